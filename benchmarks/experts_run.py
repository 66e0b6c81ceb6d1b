"""Measured step time of the tiny MoE GPT under expert-parallel plans on CPU processes: ep=1 vs ep=2 vs ep=4.

    python benchmarks/experts_run.py [--devices 4] [--repeats 3] [--steps 12] [--warmup 3] [--plans ep1 ep2 ep4]

Trains :class:`uniap_lightning.adapters.moe.MoEGPT` (``--layers`` MoE blocks, hidden ``--hidden``, ``--experts``
experts, top-2, dropless: ``capacity_factor=None``) with ``Trainer(strategy=UniAPStrategy(plan=...))`` on
``--devices`` CPU processes (gloo, one thread each), SGD, global batch ``--batch`` of ``--seq`` tokens. Every plan
is one stage, every layer data-parallel over all devices (``replicate``); the MoE blocks add ``ep`` (``ep1``: every
expert on every rank, gradients all-reduced over all ranks; ``epN``: ``E / N`` experts per rank, tokens moved by
all-to-all, expert gradients summed over the ``devices / N`` ranks holding the same experts). Also ``ep2_zero3``
(ep=2, the rest of each block ZeRO-3).

Per run: the step time is the median over the steps after ``--warmup`` of the slowest rank's wall time from
``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, gradient reduction; the optimizer step is in
between); the table gives the median over ``--repeats`` runs (runs interleave plans: repeat 1 of every plan, then
repeat 2, ...), and the spread (min-max of the runs). Also per rank: expert parameters held; the MoE blocks'
static bytes after the last step (parameters, gradients, AdamW state and gradient buckets, from the live tensors;
the largest rank) next to the planner's ``static_bytes`` for them (``planner.cost.layer.layer_cost`` on a profile
with the blocks' ``params``, ``expert_params``, ``experts``); and the all-to-all
bytes this rank sent per step (counted at runtime, ``Runtime.all_to_all``) next to the balanced-routing formula
``4 x L x b_local s k h (ep - 1) / ep x 4 bytes`` (dispatch, combine and their two backward exchanges per layer).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

PLANS = {"ep1": (1, "replicate"), "ep2": (2, "replicate"), "ep4": (4, "replicate"), "ep2_zero3": (2, "zero3")}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module(args: argparse.Namespace) -> Any:
    from uniap_lightning.adapters.moe import MoECausalLMModule, MoEGPT, MoEGPTConfig

    class AdamMoE(MoECausalLMModule):
        def configure_optimizers(self) -> Any:  # fp32 AdamW: 4 + 4 + 8 bytes per parameter, the planner's default
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    cfg = MoEGPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.hidden,
                       n_experts=args.experts, top_k=2, capacity_factor=None)
    return AdamMoE(MoEGPT(cfg).layers())


def _data(args: argparse.Namespace) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    n = args.batch * (args.steps + 1)
    ids = torch.randint(0, 256, (n, args.seq), generator=g)
    return DataLoader(TensorDataset(ids, ids), batch_size=args.batch, drop_last=True)


def _plan(name: str, names: list[str], world: int, batch: int) -> Any:
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.plan import Plan

    ep, mode = PLANS[name]
    dense = Strategy.of(world, 1)
    moe = Strategy.of(world, 1, mode, ep=ep)
    strategies = [dense] + [moe] * (len(names) - 2) + [dense]
    return Plan.from_assignment(stage_of_layer=[0] * len(names), layer_names=names, pp=1, microbatches=1,
                                strategies=strategies, schedule="1f1b", global_batch_size=batch, num_devices=world)


def _run(name: str, args: argparse.Namespace, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.strategy import UniAPStrategy

    module = _module(args)
    plan = _plan(name, extract_chain(module).names, world, args.batch)
    strategy = UniAPStrategy(plan=plan, monitor=False)
    times: list[float] = []
    sent: list[int] = []

    class Clock(pl.Callback):
        start = 0.0
        bytes_before = 0

        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            dist.barrier()  # every rank starts the step together: the slowest rank's time is the step's
            self.bytes_before = strategy.runtime.all_to_all.bytes_sent()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            elapsed = torch.tensor(time.perf_counter() - self.start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
            sent.append(strategy.runtime.all_to_all.bytes_sent() - self.bytes_before)

    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
                         callbacks=[Clock()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, _data(args))
    from uniap_lightning.runtime.experts import expert_modules

    from uniap_lightning.runtime.data_parallel import local_tensor

    expert_params = sum(local_tensor(getattr(m, p)).numel() for _, m in expert_modules(module)
                        for p in m.uniap_expert_params)
    return {"step_s": statistics.median(times[args.warmup:]), "a2a_bytes": statistics.median(sent[args.warmup:]),
            "expert_params": expert_params, "static": _static_bytes(strategy, trainer.optimizers),
            "predicted": _predicted_static(name, args, world)}


def _static_bytes(strategy: Any, optimizers: list[Any]) -> int:
    """This rank's bytes for the MoE blocks after the last step, from the live tensors: parameters, gradients,
    optimizer state and their gradient-bucket slots (:func:`~uniap_lightning.runtime.zero.state_bytes`)."""
    from uniap_lightning.adapters.moe import MoEBlock
    from uniap_lightning.runtime.zero import state_bytes

    rt = strategy.runtime
    blocks = [layer for layer in rt.chain.layers if isinstance(layer, MoEBlock)]  # (FSDP2 renames the class)
    return sum(state_bytes(layer, optimizers, rt.replicated.buckets) for layer in blocks)


def _predicted_static(name: str, args: argparse.Namespace, world: int) -> float:
    """The planner's ``static_bytes`` of the MoE blocks under the plan (``planner.cost.layer.layer_cost``)."""
    from uniap_lightning.planner.config import cluster_from
    from uniap_lightning.planner.cost.layer import Pricing, layer_cost
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.problem import TrainingConfig
    from uniap_lightning.planner.profile import LayerProfile

    block = _module(args).chain[1]
    expert = sum(getattr(block.moe, p).numel() for p in block.moe.uniap_expert_params)
    lp = LayerProfile(name="block", forward_s=1e-3, backward_s=2e-3, params=sum(p.numel() for p in block.parameters()),
                      activation_bytes=0.0, output_bytes=0.0, param_tensors=len(list(block.parameters())),
                      experts=args.experts, top_k=2, expert_params=expert)
    ep, mode = PLANS[name]
    cost = layer_cost(lp, Strategy.of(world, 1, mode, ep=ep), Pricing(args.batch, world),
                      cluster=cluster_from("local_cpu"), training=TrainingConfig(global_batch_size=args.batch))
    return cost.static_bytes * args.layers


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    os.chdir(out)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in args.plans}
    for _ in range(args.repeats):
        for name in args.plans:
            results[name].append(_run(name, args, world))
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _formula_bytes(args: argparse.Namespace, ep: int, world: int) -> float:
    tokens = args.batch // world * args.seq
    return 4 * args.layers * tokens * 2 * args.hidden * (ep - 1) / ep * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = parser.parse_args()
    world = args.devices
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, _port(), args, out), nprocs=world, start_method="spawn")
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(world)]
    print(f"tiny MoE GPT: {args.layers} MoE blocks, hidden {args.hidden}, {args.experts} experts top-2, dropless; "
          f"batch {args.batch} x {args.seq} tokens; {world} CPU processes (gloo, 1 thread each); "
          f"median of {args.repeats} runs of the median step ({args.steps} steps, {args.warmup} warm-up)")
    print("| plan | expert params / rank | MoE blocks' static MiB / rank: measured / predicted (ratio) | step ms: "
          "median (min-max of runs) | all-to-all MiB sent / rank / step (counted, rank 0) | balanced formula MiB |")
    print("|---|---|---|---|---|---|")
    for name in args.plans:
        runs = ranks[0][name]
        steps_ms = [1e3 * r["step_s"] for r in runs]
        a2a = statistics.median(r["a2a_bytes"] for r in runs) / 2**20
        ep = PLANS[name][0]
        static, predicted = max(r[name][0]["static"] for r in ranks) / 2**20, runs[0]["predicted"] / 2**20
        print(f"| {name} | {runs[0]['expert_params']:,} | {static:.2f} / {predicted:.2f} ({static / predicted:.3f}) "
              f"| {statistics.median(steps_ms):.1f} "
              f"({min(steps_ms):.1f}-{max(steps_ms):.1f}) | {a2a:.3f} | {_formula_bytes(args, ep, world) / 2**20:.3f} |")


if __name__ == "__main__":
    main()
