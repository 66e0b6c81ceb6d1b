"""Predicted vs measured memory per rank for context-parallel (cp, Ulysses) and sequence-parallel (sp) plans (CPU,
gloo; issue 22).

    python benchmarks/memory_sequence.py [--world 2] [--layers 4] [--width 128] [--seq 256] [--batch 4]
                                         [--plans dp2,cp2,...] [--markdown out.md] [--json out.json]

The shipped GPT (``adapters.gpt``, 4 heads, AdamW) trained 2 steps by ``Trainer(strategy=UniAPStrategy(plan=...))``
on ``--world`` gloo processes with every layer pinned to one strategy, one micro-batch per step (``--batch``
samples): ``dp2`` (the baseline: the batch over the ranks), ``cp2`` (each sample's sequence over the ranks, Ulysses),
``tp2`` (tensor parallelism without sequence parallelism), ``tp2_sp`` (the blocks with sequence parallelism; the
embedding and head tp 2 without), ``cp2_rc`` (cp 2, every layer recomputed); with ``--world 4`` data parallelism
over the other 2 (``dp2`` then means dp 4). Each rank and plan measures, in the
second step:

- **static**: parameters, gradients, AdamW state and the all-reduce buckets, from the live tensors
  (:func:`uniap_lightning.runtime.zero.held_bytes`, as ``memory_modes.py`` part 1);
- **kept**: bytes of the storages ops create from the stage's first layer's forward to the stage's output (after
  its re-layout to the stage's edge, where the loss runs on whole sequences) that are still alive then (what the
  forward keeps for backward; :class:`~uniap_lightning.profiling.memory.LiveBytes`, as ``memory_modes.py`` part 2),
  without the output tensor's own bytes (the loss's input: a plan on whole sequences holds it too and no layer's
  figure counts it; what more a cp-split last layer keeps, e.g. the whole sequences its output views, counts);
- **peak**: the most such bytes from the stage's output until the embedding's weight gradient is accumulated
  (the backward's end), without the output tensor; gradients are allocated (zeros) before the forward, as after a
  micro-batch before, so the backward accumulates into them in place (they are ``static``). The loss's forward
  and backward (log-softmax over the vocabulary) fall inside it; no layer's figure holds them. The readings of kept
  follow a barrier (:func:`_settle`); the peak cannot, so a collective's buffers that gloo's thread releases late
  now and then raise it (measured: 1 rank in 20, by 256 KiB on the test's small case).

Predicted: the planner's terms for the same plan (``planner.cost.tables.CandidateCosts.terms``, i.e.
:func:`uniap_lightning.planner.cost.layer.layer_cost` plus the whole-sequence output a cp-split last layer keeps
for the loss: ``static_bytes``, ``activation_bytes`` summed over the layers; peak = kept + the largest
``transient_bytes``) from the project's own profile of these layers, measured as the strategy measures it: ``profiling.profile_layers`` on
the full sequence, then ``measure_overheads`` / ``attach_overheads`` on the ranks for the share of activations
tensor parallelism splits (``activation_tp_fraction``).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_modes import _free_port, _mb, gpt_layers  # noqa: E402  (the same model and helpers)

PLANS = ("dp2", "cp2", "tp2", "tp2_sp", "cp2_rc", "cp2_ring")


def plan_strategies(name: str, world: int, n: int) -> list[Any]:
    """Per-layer strategies of plan ``name`` on ``world`` ranks for a chain of ``n`` layers (embedding, blocks,
    head): the degree 2 part uses 2 ranks, data parallelism the rest."""
    from uniap_lightning.planner.decision import Strategy

    d = world // 2
    if name == "dp2":
        return [Strategy.of(world, 1)] * n
    if name in ("cp2", "cp2_rc"):
        return [Strategy.of(d, 1, recompute=name == "cp2_rc", cp=2, cp_method="ulysses")] * n
    if name == "cp2_ring":  # ring attention (runtime/ring.py)
        return [Strategy.of(d, 1, cp=2, cp_method="ring")] * n
    if name == "tp2":
        return [Strategy.of(d, 2)] * n
    if name == "tp2_sp":  # sequence parallelism in the blocks (the embedding and head have no sp plan)
        return [Strategy.of(d, 2)] + [Strategy.of(d, 2, sp=True)] * (n - 2) + [Strategy.of(d, 2)]
    raise SystemExit(f"unknown plan {name!r}: one of {', '.join(PLANS)}")


def _profile(args: Any, ids: torch.Tensor) -> Any:
    """The layers' profile at the full sequence (per sample), with the measured share TP splits (collective)."""
    from uniap_lightning.profiling.measure import profile_layers
    from uniap_lightning.profiling.module import with_sequence_fields
    from uniap_lightning.profiling.strategies import attach_overheads, measure_overheads
    from uniap_lightning.runtime.tensor_parallel import tp_allreduces, tp_degrees

    layers = gpt_layers(args)
    names = [f"chain.{i}" for i in range(len(layers))]
    profile = profile_layers(layers, names, ids, micro_batches=[args.batch], repeats=1,
                             tp_degrees=[tp_degrees(m) for m in layers],
                             tp_allreduces=[tp_allreduces(m) for m in layers])
    profile = with_sequence_fields(profile, layers, ids)
    split: dict[int, float] = {}
    overheads = measure_overheads(layers, names, ids, micro_batches=[args.batch], repeats=1, warmup=0,
                                  tp_split=split)
    return attach_overheads(profile, overheads, split)


def _settle() -> None:
    """Before reading live bytes: a finished collective's tensors are released by gloo's worker thread, racing this
    one (a reading then holds them at random, measured: 1 run in 10 kept 384 KiB more); a barrier (it waits for every
    earlier collective, then a round trip) lets that thread finish first."""
    import torch.distributed as dist

    dist.barrier()


def _rank_run(rank: int, world: int, port: int, args: Any, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    os.chdir(out_dir)
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from uniap_lightning.adapters import CausalLMModule
    from uniap_lightning.planner.plan import Plan
    from uniap_lightning.profiling.memory import LiveBytes
    from uniap_lightning.runtime.zero import held_bytes
    from uniap_lightning.strategy import UniAPStrategy

    dist.init_process_group("gloo", rank=rank, world_size=world)  # Lightning keeps an initialized group
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (4 * args.batch, args.seq), generator=g)
    profile = _profile(args, ids[: args.batch])
    results: dict[str, Any] = {}
    for name in args.plans:
        module = CausalLMModule(gpt_layers(args))
        n = args.layers + 2
        plan = Plan.from_assignment(stage_of_layer=[0] * n, strategies=plan_strategies(name, world, n),
                                    layer_names=[f"chain.{i}" for i in range(n)], pp=1, microbatches=1,
                                    schedule="1f1b", global_batch_size=args.batch, num_devices=world)
        strategy = UniAPStrategy(plan=plan, monitor=False)
        probe: dict[str, Any] = {}
        state: dict[str, Any] = {}

        class Probe(pl.Callback):
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                self.layers = [layer for m in strategy.runtime.stage_modules for layer in m.layers]
                self.opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
                self.params = [p for m in self.layers for p in m.parameters()]
                self.layers[0].register_forward_pre_hook(self._start)
                for layer in self.layers:
                    layer.register_forward_hook(self._layer_end)
                strategy.runtime.stage_modules[-1].register_forward_hook(self._stage_end)
                wte = next(p for p in self.layers[0].parameters() if p.requires_grad)
                wte.register_post_accumulate_grad_hook(self._backward_end)

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
                state["armed"] = idx == 1

            def _start(self, *_: Any) -> None:
                if state.get("armed") and torch.is_grad_enabled() and "live" not in state:
                    for p in self.params:  # as after a micro-batch before: the backward accumulates in place
                        if p.requires_grad and p.grad is None:
                            p.grad = torch.zeros_like(p)
                    state["live"] = LiveBytes()
                    state["live"].__enter__()

            def _layer_end(self, *_: Any) -> None:
                live = state.get("live")
                if live is not None and "kept" not in probe:
                    _settle()
                    gc.collect()
                    probe.setdefault("by_layer", []).append(live.live)  # cumulative, outputs included

            def _stage_end(self, _m: Any, _i: Any, out: Any) -> None:
                live = state.get("live")
                if live is None or "kept" in probe:
                    return
                # after the re-layout to the stage's edge layout; its output is the loss's input, which a plan
                # on whole sequences holds too and no layer's figure counts: its own bytes left out (not the
                # storage it may view, e.g. a cp layer's all-gathered whole sequences)
                outs = out if isinstance(out, tuple) else (out,)
                state["out"] = sum(o.numel() * o.element_size() for o in outs)
                # garbage in reference cycles (freed whenever Python's collector runs, which other threads' work
                # moves) would make the figure vary from run to run: collected first, and its bytes recorded
                _settle()
                probe["uncollected"] = live.live
                gc.collect()
                probe["uncollected"] -= live.live
                probe["kept"] = live.live - state["out"]
                live.reset_peak()

            def _backward_end(self, *_: Any) -> None:
                live = state.get("live")
                if live is not None and "peak_raw" not in probe:
                    probe["peak_raw"] = live.peak

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                if idx != 1:
                    return
                live = state.pop("live")
                live.__exit__(None, None, None)
                probe["in_step"] = [held_bytes(m, self.opts) for m in self.layers]
                probe["bucket"] = strategy.runtime.replicated.buffer_bytes()

        data = DataLoader(TensorDataset(ids, ids), batch_size=args.batch, drop_last=True)
        trainer = pl.Trainer(devices=world, accelerator="cpu", strategy=strategy, callbacks=[Probe()], max_steps=2,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(module, data)
        probe["out"] = state["out"]
        probe["predicted"] = predict(profile, plan_strategies(name, world, n), args.batch, world)
        results[name] = probe
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def predict(profile: Any, strategies: list[Any], batch: int, world: int) -> dict[str, float]:
    """The planner's per-rank terms for the plan (one stage of ``world`` devices, one micro-batch of ``batch``):
    static bytes, activations kept (with the whole-sequence output a cp-split last layer keeps for the loss) and
    kept + the largest transient, from the candidate's own per-layer terms (``CandidateCosts.terms``)."""
    from dataclasses import replace

    from uniap_lightning.planner.config import cluster_from
    from uniap_lightning.planner.cost.tables import CandidateCosts
    from uniap_lightning.planner.problem import Problem, TrainingConfig

    cluster = replace(cluster_from("local_cpu"), devices_per_node=world)
    problem = Problem(model=profile, cluster=cluster, training=TrainingConfig(global_batch_size=batch))
    costs = CandidateCosts(problem, 1, 1)
    terms = [costs.terms(u, s) for u, s in enumerate(strategies)]
    kept = sum(c.activation_bytes for c in terms)
    return {"by_layer": [c.activation_bytes for c in terms],"static": sum(c.static_bytes for c in terms), "kept": kept,
            "peak": kept + max(c.transient_bytes for c in terms)}


def run(args: Any) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="uniap_memseq_")
    mp.start_processes(_rank_run, args=(args.world, _free_port(), args, out), nprocs=args.world,
                       start_method="spawn")
    ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(args.world)]
    shutil.rmtree(out, ignore_errors=True)
    return rows_of(ranks, args.plans)


def rows_of(ranks: list[dict[str, Any]], plans: list[str]) -> list[dict[str, Any]]:
    """One row per plan and rank from the ranks' probe results (``memory_experts.py`` reads them too)."""
    rows = []
    for name in plans:
        for rank, res in enumerate(ranks):
            r = res[name]
            grads = sum(a["grads"] + a["unsharded_grads"] for a in r["in_step"])
            static = sum(a["params"] + a["gathered"] + a["optimizer"] for a in r["in_step"]) + grads + r["bucket"]
            peak = r["peak_raw"] - r["out"]  # without the chain's output (the loss's input)
            rows.append({"plan": name, "rank": rank, "static": static, "kept": r["kept"], "peak": peak,
                         "out": r["out"], "uncollected": r["uncollected"],
                         "kept_by_layer": [b - a for a, b in zip([0] + r["by_layer"][:-1], r["by_layer"])],
                         "predicted_by_layer": r["predicted"].pop("by_layer"),
                         "predicted": r["predicted"]})
    return rows


def _ratio(m: float, p: float) -> str:
    return "n/a" if not p else f"{m / p:.3f}"


def table(rows: list[dict[str, Any]], args: Any) -> str:
    lines = [f"GPT {args.layers} blocks, width {args.width}, 4 heads, seq {args.seq}, micro-batch {args.batch}, "
             f"{args.world} ranks, AdamW; per rank (MiB): measured / predicted (ratio)", "",
             "| plan | rank | static (params, grads, AdamW, buckets) | activations kept after forward | "
             "backward peak (kept + transient) |", "|---|---|---|---|---|"]
    for r in rows:
        p = r["predicted"]
        cells = [f"{_mb(r[k])} / {_mb(p[k])} ({_ratio(r[k], p[k])})" for k in ("static", "kept", "peak")]
        lines.append(f"| {r['plan']} | {r['rank']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks (plus embedding and head)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="samples per micro-batch (one per step)")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.plans = [p for p in args.plans.split(",") if p]
    if args.world % 2 or args.batch % args.world:
        sys.exit("--world must be even and divide --batch")
    report(run(args), args, table)


def report(rows: list[dict[str, Any]], args: Any, tabulate: Any) -> None:
    """Print the table of ``rows`` and write it (``--markdown``) and the rows (``--json``) atomically."""
    from uniap_lightning.files import write_json_atomic, write_text_atomic

    text = tabulate(rows, args)
    print(text)
    if args.markdown:
        write_text_atomic(args.markdown, text + "\n")
    if args.json:
        write_json_atomic(args.json, {"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
