"""Measured step time of every pipeline schedule on 4 CPU processes, against the planner's prediction (issue 25).

    python benchmarks/schedules_run.py [--layers 16] [--width 512] [--batch 256] [--microbatches 8]
                                       [--steps 12] [--warmup 4] [--reps 3]

An MLP chain of ``--layers`` equal ``Linear + Tanh`` blocks trains with ``Trainer(strategy=UniAPStrategy(plan=...))``
on 4 CPU processes (gloo, one thread each) under a pinned plan per schedule: pp=4 (one process per device group),
``pp * v`` stages of equal layers (v=1 for gpipe / 1f1b / zb_h1, v=2 for the others), the same micro-batch count for
all, every layer replicated. A first fit lets the strategy solve, only for the profile and cluster it measures; every
pinned plan is scored with them (``evaluate``). Per schedule (medians over the steps after warm-up, then the median
over ``--reps`` repetitions, schedules interleaved within a repetition):

* measured step: batch start to batch end, the slowest rank;
* predicted: the plan's time per iteration;
* measured m x compute: ``m`` x the busiest rank's own forward + backward (input gradients too; for the
  zero-bubble schedules split as they run it: input gradients, then weight gradients) of its stage modules on one
  micro-batch, timed outside the schedule right after the fit on every rank at once (the same core sharing);
  predicted m x stage: ``m`` x the plan's largest stage time per micro-batch;
* measured bubble: step minus measured m x compute; predicted bubble:
  :func:`uniap_lightning.planner.solver.search.bubble_s` (which also takes off the end-of-step sync);
* rank of the planner's choice: where the lowest-predicted schedule lands among the measured times (1: fastest).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from uniap_lightning.planner.schedule_rules import SPLIT_BACKWARD

WORLD, PP = 4, 4
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "interleaved_zb": 2, "zb_v": 2,
             "dualpipe_v": 2}  # schedule -> stages per device group


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module(layers: int, width: int) -> Any:
    import lightning.pytorch as pl
    from torch import nn

    class Chain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
            self.loss_fn = nn.MSELoss()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.loss_fn(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    return Chain()


def _data(args: argparse.Namespace, steps: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    n = args.batch * steps
    return DataLoader(TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, args.width, generator=g)),
                      batch_size=args.batch, drop_last=True)


def _plan(schedule: str, args: argparse.Namespace) -> Any:
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.plan import Plan

    v = SCHEDULES[schedule]
    stages = PP * v
    per = args.layers // stages
    return Plan.from_assignment(
        stage_of_layer=[u // per for u in range(args.layers)], strategies=[Strategy.of(1, 1)] * args.layers,
        layer_names=[f"net.{u}" for u in range(args.layers)], pp=PP, microbatches=args.microbatches,
        schedule=schedule, global_batch_size=args.batch, num_devices=WORLD, virtual_stages=v)


def _env(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      NODE_RANK="0")


def _trainer(strategy: Any, steps: int, callbacks: list[Any]) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=callbacks)


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    if args.profile_flush_bytes is not None:
        from uniap_lightning.profiling import timing

        timing.CPU_FLUSH_BYTES = args.profile_flush_bytes
    import lightning.pytorch as pl

    from uniap_lightning.strategy import UniAPStrategy

    pl.seed_everything(0, verbose=False)
    _env(rank, port)
    solved = UniAPStrategy(monitor=False, cache_dir=os.path.join(out, "cache"), pp=PP)  # for its profile, cluster
    _trainer(solved, 1, []).fit(_module(args.layers, args.width), _data(args, 1))
    problem = None
    if rank == 0:
        from uniap_lightning.planner.problem import Problem, TrainingConfig

        setup = solved.setup_result
        problem = Problem(model=setup.profile, cluster=setup.planning_cluster,
                          training=TrainingConfig(global_batch_size=args.batch))
    port += 1
    for rep in range(args.reps):
        for schedule in SCHEDULES:
            port += 1
            _env(rank, port)
            row = _run(rank, schedule, args, problem)
            Path(out, f"{schedule}.{rep}.{rank}.json").write_text(json.dumps(row))


def _run(rank: int, schedule: str, args: argparse.Namespace, problem: Any) -> dict[str, float]:
    import lightning.pytorch as pl

    from uniap_lightning.strategy import UniAPStrategy

    plan = _plan(schedule, args)
    steps: list[float] = []

    class Steps(pl.Callback):
        start = 0.0

        def on_train_batch_start(self, *a: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            steps.append(time.perf_counter() - self.start)

    module = _module(args.layers, args.width)
    mine = [u for st in plan.stages if rank in st.ranks for u in range(st.layers[0], st.layers[1] + 1)]
    layers = [copy.deepcopy(module.net[u]) for u in mine]  # this rank's stage modules, before the fit moves them
    total = args.warmup + args.steps
    _trainer(UniAPStrategy(monitor=False, plan=plan), total, [Steps()]).fit(module, _data(args, total))
    row = {"step_s": statistics.median(steps[args.warmup:]),
           "compute_s": _compute(layers, args, schedule in SPLIT_BACKWARD)}
    if problem is not None:
        from uniap_lightning.planner.cost import evaluate
        from uniap_lightning.planner.solver.search import bubble_s

        scored = plan.with_report(estimate=evaluate(problem, plan))
        row.update(predicted_s=scored.estimate.tpi_s, predicted_bubble_s=bubble_s(scored),
                   predicted_work_s=plan.microbatches * max(scored.estimate.stage_time_s))
    return row


def _compute(layers: list[Any], args: argparse.Namespace, split: bool) -> float:
    """This rank's stage modules: forward + backward of one micro-batch, median seconds; ``split``: the backward as
    the zero-bubble schedules run it, input gradients first (graph kept), then weight gradients."""
    x = torch.randn(args.batch // args.microbatches, args.width, generator=torch.Generator().manual_seed(1))
    params = [p for layer in layers for p in layer.parameters()]
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        h = x.requires_grad_(True)
        for layer in layers:
            h = layer(h)
        if split:
            torch.autograd.grad(h, [x], torch.ones_like(h), retain_graph=True)
            torch.autograd.grad(h, params, torch.ones_like(h))
        else:
            h.backward(torch.ones_like(h))
        times.append(time.perf_counter() - t0)
        x = x.detach()
        for layer in layers:
            layer.zero_grad(set_to_none=True)
    return statistics.median(times[args.warmup:])


def _table(out: str, args: argparse.Namespace) -> str:
    rows = {}
    for schedule in SCHEDULES:
        reps = []
        for rep in range(args.reps):
            ranks = [json.loads(Path(out, f"{schedule}.{rep}.{r}.json").read_text()) for r in range(WORLD)]
            step = max(r["step_s"] for r in ranks)
            work = args.microbatches * max(r["compute_s"] for r in ranks)
            reps.append((step, work, ranks[0]))
        rows[schedule] = {"step": statistics.median(s for s, _, _ in reps),
                          "spread": (min(s for s, _, _ in reps), max(s for s, _, _ in reps)),
                          "bubble": statistics.median(s - w for s, w, _ in reps),
                          "work": statistics.median(w for _, w, _ in reps),
                          "pred_work": reps[0][2]["predicted_work_s"],
                          "pred": reps[0][2]["predicted_s"], "pred_bubble": reps[0][2]["predicted_bubble_s"]}
    by_measured = sorted(rows, key=lambda s: rows[s]["step"])
    # what schedule="auto" picks among these: the lowest predicted; it never prices GPipe (1F1B holds fewer
    # activations for the same time, TrainingConfig.schedule_candidates), so GPipe is out of the choice
    preferred = min((s for s in rows if s != "gpipe"), key=lambda s: rows[s]["pred"])
    flush = "" if args.profile_flush_bytes is None else f", profile flush {args.profile_flush_bytes} bytes"
    lines = [f"pp={PP}, {args.layers} x Linear({args.width}) + Tanh, global batch {args.batch}{flush}, "
             f"m={args.microbatches}, replicate; medians of {args.steps} steps after {args.warmup} warm-up, "
             f"median of {args.reps} repetitions (min-max in brackets)",
             "",
             "| schedule | v | measured step ms | predicted ms | measured / predicted | measured m x compute ms | "
             "predicted m x stage ms | measured bubble ms | predicted bubble ms | measured rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in rows.items():
        lo, hi = r["spread"]
        lines.append(f"| {s} | {SCHEDULES[s]} | {r['step'] * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | "
                     f"{r['pred'] * 1e3:.1f} | {r['step'] / r['pred']:.2f} | {r['work'] * 1e3:.1f} | "
                     f"{r['pred_work'] * 1e3:.1f} | {r['bubble'] * 1e3:.1f} | "
                     f"{r['pred_bubble'] * 1e3:.1f} | {by_measured.index(s) + 1} |")
    lines += ["", f"planner's choice (schedule=auto: lowest predicted, GPipe not priced): {preferred}, measured rank "
                  f"{by_measured.index(preferred) + 1} of {len(rows)} (fastest measured: {by_measured[0]})"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile-flush-bytes", type=int, default=None,
                    help="bytes the profiler writes before each timed layer run on a CPU (default: the library's, "
                         "64 MiB; 0: hot caches, as the schedules run here)")
    args = ap.parse_args()
    if args.layers % (2 * PP) or args.batch % args.microbatches or args.microbatches < 2 * PP:
        raise SystemExit(f"--layers must be a multiple of {2 * PP}, --batch of --microbatches, and --microbatches "
                         f">= {2 * PP} (DualPipeV)")
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(_port(), args, out), nprocs=WORLD, start_method="spawn")
        print(_table(out, args))


if __name__ == "__main__":
    main()
