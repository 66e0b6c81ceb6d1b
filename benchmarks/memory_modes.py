"""Predicted vs measured memory per rank for each data-parallel mode and for recomputation (CPU, gloo).

    python benchmarks/memory_modes.py [--world 4] [--layers 4] [--width 128] [--batch 16]
                                      [--markdown out.md] [--json out.json]

1. **dp modes** (``--world`` processes, gloo on loopback). The shipped GPT (``adapters.gpt``, AdamW: 4 + 4 + 8
   bytes per parameter) trained 2 steps by ``Trainer(strategy=UniAPStrategy(plan=...))`` with every layer
   ``dp = world`` in one mode (replicate, zero1, zero2, zero3), 2 micro-batches. Each rank's bytes are read from the
   live tensors (:func:`uniap_lightning.runtime.zero.held_bytes`): parameters with FSDP2's gathered copy (at the
   last layer's forward in the step's last micro-batch), the unsharded gradient at that point plus the sharded
   one after the step, optimizer state after the step, and the all-reduce buckets. Predicted: the agreed formula
   (issue 12 interfaces: ``P(b+g+o)``, ``P(b+g) + Po/d``, ``Pb + P(g+o)/d (+ Pg with accumulation)``,
   ``P(b+g+o)/d``) and, when the planner exposes it, its ``static_bytes`` (``planner.cost.layer.layer_cost``).
2. **recomputation** (one process). The same layers, one micro-batch forward and backward (gradients already
   allocated, as from the micro-batch before), without and with every layer recomputed (non-reentrant
   checkpoint, as ``StageModule.forward`` does). Measured: bytes of the storages ops create that are alive after
   the forward (what the forward keeps for backward) and their peak during the backward, both without the chain's
   output (the loss's input, which no layer's figure includes). Predicted from the
   project's own profile of these layers (``profiling.profile_layers``: saved storages, backward peaks): kept =
   sum of the layers' activations, or with recomputation sum of their inputs; peak = kept + the largest
   transient (the planner's term: a layer's backward peak, plus its activations when it recomputes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

MODES = ("replicate", "zero1", "zero2", "zero3")
B, G, O = 4, 4, 8  # fp32 weights and gradients, AdamW's two fp32 moments
MB = 2**20


def gpt_layers(args: Any) -> list[torch.nn.Module]:
    from uniap_lightning.adapters.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width)
    return GPT(cfg).layers()


# ---------------------------------------------------------------------- part 1: dp modes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_run(rank: int, world: int, port: int, args: Any, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    os.chdir(out_dir)
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from uniap_lightning.adapters import CausalLMModule
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.plan import Plan
    from uniap_lightning.runtime.zero import held_bytes
    from uniap_lightning.strategy import UniAPStrategy

    results = {}
    for mode in MODES:
        module = CausalLMModule(gpt_layers(args))
        n = args.layers + 2  # embedding, blocks, head
        names = [f"chain.{i}" for i in range(n)]  # CausalLMModule keeps them in an nn.Sequential `chain`
        plan = Plan.from_assignment(stage_of_layer=[0] * n, strategies=[Strategy(world, 1, mode, False, "none")] * n,
                                    layer_names=names, pp=1, microbatches=2, schedule="1f1b",
                                    global_batch_size=args.batch, num_devices=world)
        strategy = UniAPStrategy(plan=plan, monitor=False)
        probe: dict[str, Any] = {}

        class Probe(pl.Callback):
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                rt = strategy.runtime
                self.layers = [layer for m in rt.stage_modules for layer in m.layers]
                self.opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
                self.layers[-1].register_forward_hook(self._forward)

            def _forward(self, *_: Any) -> None:
                if torch.is_grad_enabled():
                    probe["in_step"] = [held_bytes(m, self.opts) for m in self.layers]

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                if idx == 1:
                    probe["after"] = [held_bytes(m, self.opts) for m in self.layers]
                    probe["bucket"] = strategy.runtime.replicated.buffer_bytes()

        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 256, (4 * args.batch, args.seq), generator=g)
        data = DataLoader(TensorDataset(ids, ids), batch_size=args.batch, drop_last=True)
        trainer = pl.Trainer(devices=world, accelerator="cpu", strategy=strategy, callbacks=[Probe()], max_steps=2,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(module, data)
        layers = [layer for s in strategy.runtime.stage_modules for layer in s.layers]
        numel = [sum(p.numel() for p in m.parameters()) for m in layers]
        results[mode] = {**probe, "numel": numel, "names": list(strategy.runtime.chain.names),
                         "param_tensors": [len(list(m.parameters())) for m in layers]}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def formula(mode: str, P: int, d: int, m: int) -> int:
    """The agreed per-layer formula (interfaces), bytes on one rank, without the replicated bucket."""
    return {"replicate": P * (B + G + O), "zero1": P * (B + G) + P * O // d,
            "zero2": P * B + P * (G + O) // d + (P * G if m > 1 else 0), "zero3": P * (B + G + O) // d}[mode]


def planner_static(mode: str, P: int, tensors: int, d: int, m: int, batch: int) -> float | None:
    """The planner's ``static_bytes`` for the layer, if its per-mode cost function is available."""
    try:
        from uniap_lightning.planner.config import cluster_from
        from uniap_lightning.planner.cost.layer import Pricing, Strategy, layer_cost
        from uniap_lightning.planner.problem import TrainingConfig
        from uniap_lightning.planner.profile import LayerProfile
    except ImportError:
        return None
    lp = LayerProfile(name="x", forward_s=1e-3, backward_s=2e-3, params=P, activation_bytes=0.0, output_bytes=0.0,
                      param_tensors=tensors)
    cost = layer_cost(lp, Strategy(d, 1, mode), Pricing(batch // m, d, accumulate=m > 1),
                      cluster=cluster_from("local_cpu"), training=TrainingConfig(global_batch_size=batch))
    return cost.static_bytes


def part1(args: Any) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="uniap_mem_")
    mp.start_processes(_rank_run, args=(args.world, _free_port(), args, out), nprocs=args.world,
                       start_method="spawn")
    ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(args.world)]
    rows = []
    for mode in MODES:
        per_rank = []
        for res in ranks:
            r = res[mode]
            params = sum(a["params"] + a["gathered"] for a in r["in_step"])
            grads = sum(a["unsharded_grads"] for a in r["in_step"]) + sum(a["grads"] for a in r["after"])
            opt = sum(a["optimizer"] for a in r["after"])
            per_rank.append({"params": params, "grads": grads, "optimizer": opt, "bucket": r["bucket"],
                             "total": params + grads + opt + r["bucket"]})
        r0 = ranks[0][mode]
        pred = sum(formula(mode, P, args.world, 2) for P in r0["numel"])
        pred_bucket = sum(P * G for P in r0["numel"]) if mode in ("replicate", "zero1") else 0
        static = [planner_static(mode, P, k, args.world, 2, args.batch)
                  for P, k in zip(r0["numel"], r0["param_tensors"])]
        rows.append({"mode": mode, "world": args.world, "params": sum(r0["numel"]),
                     "measured_max": max(x["total"] for x in per_rank),
                     "measured_min": min(x["total"] for x in per_rank), "breakdown_rank0": per_rank[0],
                     "formula": pred + pred_bucket,
                     "planner": None if None in static else sum(static)})  # type: ignore[arg-type]
    return rows


# ---------------------------------------------------------------------- part 2: recomputation
def part2(args: Any) -> list[dict[str, Any]]:
    from torch.utils.checkpoint import checkpoint

    from uniap_lightning.profiling.measure import profile_layers
    from uniap_lightning.profiling.memory import LiveBytes

    layers = gpt_layers(args)
    names = [f"layers.{i}" for i in range(len(layers))]
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    profile = profile_layers(layers, names, ids, micro_batches=[args.batch], repeats=1)
    act = [lp.activation_bytes * args.batch for lp in profile.layers]
    bwd = [lp.backward_peak_bytes * args.batch for lp in profile.layers]
    inputs = [ids.numel() * ids.element_size()] + [lp.output_bytes * args.batch for lp in profile.layers[:-1]]

    def run(recompute: bool) -> tuple[int, int]:
        x = ids
        with torch.no_grad():
            for layer in layers:
                x = layer(x)
        grad = torch.randn_like(x)
        for p in (p for m in layers for p in m.parameters()):
            p.grad = torch.zeros_like(p)  # the gradients of the micro-batch before: accumulated into in place
        live = LiveBytes()
        with live:
            h = ids
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False) if recompute else layer(h)
            kept = live.live
            live.reset_peak()
            h.backward(grad)
            peak = live.peak
        out = h.untyped_storage().nbytes()  # the chain's output (the loss's input): no layer's activation
        del h
        return kept - out, peak - out

    rows = []
    for recompute in (False, True):
        kept, peak = run(recompute)
        pred_kept = sum(inputs) if recompute else sum(act)
        pred_peak = pred_kept + max(a * recompute + p for a, p in zip(act, bwd))
        rows.append({"recompute": recompute, "batch": args.batch, "kept": kept, "kept_predicted": pred_kept,
                     "peak": peak, "peak_predicted": pred_peak})
    return rows


# ---------------------------------------------------------------------- report
def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / MB:.2f}"


def tables(p1: list[dict[str, Any]], p2: list[dict[str, Any]]) -> str:
    lines = [f"Per rank, {p1[0]['world']} ranks, {p1[0]['params']:,} parameters, AdamW, 2 micro-batches (MiB)", "",
             "| mode | measured (max / min rank) | params + grads + optimizer + buckets (rank 0) | formula (+ bucket: replicate, zero1) | planner "
             "static_bytes |", "|---|---|---|---|---|"]
    for r in p1:
        b = r["breakdown_rank0"]
        lines.append(f"| {r['mode']} | {_mb(r['measured_max'])} / {_mb(r['measured_min'])} | {_mb(b['params'])} + "
                     f"{_mb(b['grads'])} + {_mb(b['optimizer'])} + {_mb(b['bucket'])} | {_mb(r['formula'])} | "
                     f"{_mb(r['planner'])} |")
    lines += ["", f"Recomputation, one process, micro-batch {p2[0]['batch']} (MiB)", "",
              "| recompute | kept after forward: measured / predicted | peak in backward: measured / predicted |",
              "|---|---|---|"]
    for r in p2:
        lines.append(f"| {'all layers' if r['recompute'] else 'none'} | {_mb(r['kept'])} / {_mb(r['kept_predicted'])} "
                     f"| {_mb(r['peak'])} / {_mb(r['peak_predicted'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks (plus embedding and head)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.batch % (2 * args.world):
        sys.exit(f"--batch must be a multiple of 2 x --world = {2 * args.world}")
    p1, p2 = part1(args), part2(args)
    text = tables(p1, p2)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"dp_modes": p1, "recompute": p2, "args": {k: str(v) for k, v in
                                                                                   vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
