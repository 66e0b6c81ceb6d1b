"""Runtime benchmarks: what executing a plan costs, measured on 4 CPU processes (gloo on loopback).

    python benchmarks/runtime.py [--quick] [--runs 5] [--warmup 4] [--steps 16] [--parts 0,1,2,3,4]
                                 [--markdown BENCHMARKS_runtime.md] [--json results.json]

0. **Fixed cost per step** (one process, run before the others): a model so small that a step is mostly loop
   (1-layer GPT, 16 wide, batch 4) trained by a bare PyTorch loop, by ``Trainer()`` and by
   ``Trainer(strategy=UniAPStrategy(plan=<one device>))``: what each loop adds per step, in milliseconds,
   whatever the model (on 4 ranks sharing 2 cores it costs about twice that in wall time).

Three comparisons, each measured side by side in one job (the 4 ranks are spawned once; the variants of a
comparison alternate run after run, in rotating order, so machine noise hits them alike):

1. **Strategy vs hand-written.** ``Trainer(strategy=UniAPStrategy(plan=<pinned layout>))`` against the same
   layout written by hand with plain PyTorch (no Lightning): ``DistributedDataParallel`` for pure data
   parallelism, ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``) over a DDP-wrapped
   stage for pipeline x data parallelism. Same model, initial weights, batches, micro-batches and optimizer
   (AdamW). Target: overhead at most 3%.
2. **uniap vs Lightning's ddp.** ``Trainer(strategy=UniAPStrategy(plan=<pure data parallel>))`` against
   ``Trainer(strategy="ddp")`` with the same global batch (``ddp``: batch / 4 per rank through Lightning's
   DistributedSampler; ``uniap``: every rank loads the global batch and takes its share). The data-parallel plan
   is *pinned*: on this machine the planner does not reliably choose pure data parallelism for this model (part 3
   shows what it chooses). Target: at least 0.97x the throughput.
3. **Chosen vs rejected plans.** The strategy profiles the model and solves; from its search trace (one record
   per (pp, micro-batches) candidate) each candidate's best plan is rebuilt by solving with that candidate alone
   (same profile, same cluster description), and the chosen plan and several rejected ones are run for real.

4. **Replicated gradients: flat after backward vs bucketed and overlapped** (opt-in: ``--parts 4``). The strategy
   as it is (replicated gradients all-reduced in buckets while the step's last backward runs) against the same
   strategy with the path it had before (one flat all-reduce per group after the whole backward; kept here only,
   as :func:`uniap_with_flat_sync`), paired, for dp2 (a second job of 2 ranks), dp4 and pp2 x dp2.

Timing: a callback (or the hand-written loop) stamps ``time.perf_counter()`` at the end of every optimizer
step (dataloader, Lightning loop, logging and optimizer included); a variant's figure is the median over
``--runs`` runs.
Per run the figure is the median of the per-step times after ``--warmup`` steps on each rank, the slowest rank
counting; "paired" ratios are medians over runs of the ratio between the two variants' back-to-back runs.

CPU time: the same stamps also read ``time.process_time()`` (all threads of the process); a run's CPU figure is
the per-rank median CPU seconds per step, summed over the ranks. The 4 ranks share 2 cores, so wall time per
step is about total CPU time / 2, and CPU time is what a framework's per-step work adds. It is not immune to the
host: on a VM whose host is busy, stolen time and cache misses are charged to the running process, so CPU time
rises with the wall time (compare variants only within one run, side by side).
"""

from __future__ import annotations

from uniap_lightning.planner.decision import Strategy
import argparse
import gc
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: ranks of a job (part 4 also runs one job of 2 ranks: the parent sets this for the ranks it spawns)
WORLD = int(os.environ.get("UNIAP_BENCH_WORLD", "4"))
LR = 3e-4
#: the model of every comparison: the project's plain GPT (embedding, 4 blocks, head: a 6-layer chain)
MODEL = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
#: the planning run (part 3) measures as the strategy does by default (UniAPStrategy measure_cluster=True:
#: collectives, every rank profiling at once, TP / FSDP overheads); --no-measure-cluster plans from constants
MEASURE_CLUSTER = os.environ.get("UNIAP_BENCH_MEASURE_CLUSTER", "1") == "1"
#: the strategy as users get it (its default UniAPMonitor included; --no-monitor turns it off)
STRATEGY_KW: dict[str, Any] = {} if os.environ.get("UNIAP_BENCH_MONITOR", "1") == "1" else {"monitor": False}
BATCH = 32  # global batch (samples of MODEL["block_size"] tokens)


# ---------------------------------------------------------------------------------------------- model and data
def make_layers() -> list[nn.Module]:
    from uniap_lightning.adapters.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL)).layers()


def make_module() -> Any:
    from uniap_lightning.adapters import CausalLMModule

    return CausalLMModule(make_layers(), lr=LR)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Same as ``CausalLMModule.uniap_loss``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def make_loader(steps: int, batch: int = BATCH, per_rank_batch: int | None = None) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (batch * steps, MODEL["block_size"]), generator=g)
    return DataLoader(TensorDataset(ids, ids), batch_size=per_rank_batch or batch, shuffle=False, drop_last=True)


def my_share(t: torch.Tensor, c: int, n: int, lane: int) -> torch.Tensor:
    """Rank ``lane`` of ``n`` takes slice ``lane`` of each of the ``c`` micro-batches (the strategy's split)."""
    b = t.shape[0]
    return t.reshape(c, n, b // (c * n), *t.shape[1:])[:, lane].reshape(b // n, *t.shape[1:])


def layout_plan(pp: int, c: int, stage_of_layer: list[int], dp: int, names: list[str]) -> Any:
    from uniap_lightning.planner.plan import Plan

    return Plan.from_assignment(
        stage_of_layer=stage_of_layer, strategies=[Strategy(dp, 1)] * len(names), layer_names=names, pp=pp,
        microbatches=c, schedule="1f1b", global_batch_size=BATCH, num_devices=WORLD,
    )


def label(plan: Any) -> str:
    """``pp2 c4 d2t1`` style: pipeline degree, micro-batches, per-stage strategies (``f``: sharded dp)."""
    parts = []
    for i in range(plan.pp):
        kinds = []
        for u in plan.layers_of_stage(i):
            lp = plan.layers[u]
            k = f"{'f' if lp.strategy.shard else 'd'}{lp.strategy.dp}t{lp.strategy.tp}"
            if k not in kinds:
                kinds.append(k)
        parts.append("/".join(kinds))
    split = "|".join(str(len(plan.layers_of_stage(i))) for i in range(plan.pp))
    return f"pp{plan.pp} c{plan.microbatches} {' : '.join(parts)}" + (f" (layers {split})" if plan.pp > 1 else "")


# ---------------------------------------------------------------------------------------------- timing
class Timing(float):
    """Seconds per step (wall, slowest rank) that also carries ``cpu``: CPU seconds per step summed over ranks."""

    cpu: float

    def __new__(cls, wall: float, cpu: float) -> Timing:
        t = super().__new__(cls, wall)
        t.cpu = cpu
        return t


class Stamps:
    def __init__(self) -> None:
        self.t: list[float] = []
        self.cpu: list[float] = []

    def stamp(self) -> None:
        self.t.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def cpu_window(self, warmup: int) -> float:
        """Median CPU seconds per step of this process after the warm-up (as :meth:`window`)."""
        c = self.cpu
        return statistics.median(b - a for a, b in zip(c[warmup - 1:], c[warmup:]))

    def window(self, warmup: int) -> float:
        """Median seconds per step over the steps after the first ``warmup`` (steady state).

        The median rather than the mean: on a shared machine another job occasionally stalls a step; the median
        keeps such stalls out while any cost paid on every step (the thing compared here) stays in.
        """
        t = self.t
        if len(t) <= warmup:
            raise RuntimeError(f"only {len(t)} steps recorded, warm-up is {warmup}")
        return statistics.median(b - a for a, b in zip(t[warmup - 1:], t[warmup:]))


def step_timer(stamps: Stamps) -> Any:
    import lightning.pytorch as pl

    class _Timer(pl.Callback):
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            stamps.stamp()

    return _Timer()


def measured(stamps: Stamps, warmup: int) -> Timing:
    """The slowest rank's median step time and the ranks' summed median CPU time per step (all ranks call it)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, (stamps.window(warmup), stamps.cpu_window(warmup)))
    return Timing(max(w for w, _ in out), sum(c for _, c in out))


def trainer_common(steps: int) -> dict[str, Any]:
    return dict(
        accelerator="cpu", devices=WORLD, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )


# ---------------------------------------------------------------------------------------------- variants
def run_uniap(plan: Any, warmup: int, steps: int, strategy: Any = None) -> tuple[float, Any]:
    """The strategy executing ``plan`` (pinned) or planning itself (``plan=None``, ``strategy`` given)."""
    import lightning.pytorch as pl

    from uniap_lightning.strategy import UniAPStrategy

    stamps = Stamps()
    strategy = strategy if strategy is not None else UniAPStrategy(plan=plan, **STRATEGY_KW)
    trainer = pl.Trainer(strategy=strategy, callbacks=[step_timer(stamps)], use_distributed_sampler=False,
                         **trainer_common(warmup + steps))
    trainer.fit(make_module(), make_loader(warmup + steps))
    plan = strategy.plan if isinstance(strategy, UniAPStrategy) else None
    return measured(stamps, warmup), plan


def run_lightning_ddp(warmup: int, steps: int) -> float:
    import lightning.pytorch as pl

    stamps = Stamps()
    trainer = pl.Trainer(strategy="ddp", callbacks=[step_timer(stamps)], **trainer_common(warmup + steps))
    trainer.fit(make_module(), make_loader(warmup + steps, per_rank_batch=BATCH // WORLD))
    return measured(stamps, warmup)


_GROUPS: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}


def _groups(pp: int, n: int) -> tuple[list[Any], list[Any]]:
    """Pipeline-lane groups and stage groups (created once, in the same order on every rank)."""
    import torch.distributed as dist

    if (pp, n) not in _GROUPS:
        lanes = [dist.new_group([s * n + lane for s in range(pp)]) for lane in range(n)]
        stages = [dist.new_group(list(range(s * n, (s + 1) * n))) for s in range(pp)]
        _GROUPS[(pp, n)] = (lanes, stages)
    return _GROUPS[(pp, n)]


def flat_all_reduce(params: list[nn.Parameter], group: Any, size: int) -> None:
    """Average gradients over ``group`` with one flat all-reduce."""
    import torch.distributed as dist

    from uniap_lightning.runtime.data_parallel import local_tensor

    with torch.no_grad():
        grads = [local_tensor(p.grad) for p in params]  # the local shard of a tensor-parallel (DTensor) gradient
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def run_by_hand(pp: int, c: int, stage_of_layer: list[int], warmup: int, steps: int, sync: str = "ddp") -> float:
    """The same layout in a plain training loop, no Lightning.

    ``sync="ddp"``: DistributedDataParallel (pp=1) or pipelining over DDP-wrapped stages (pp>1), i.e. bucketed
    all-reduces overlapped with backward. ``sync="flat"``: no wrapper, one flat all-reduce of the gradients after
    the last backward (what the strategy does for replicated layers).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    n = WORLD // pp
    stage, lane = rank // n, rank % n
    layers = make_layers()
    mine = nn.Sequential(*[m for m, s in zip(layers, stage_of_layer) if s == stage])
    stamps = Stamps()
    loader = make_loader(warmup + steps)
    group = None if pp == 1 else _groups(pp, n)[1][stage]
    params = list(mine.parameters())
    if pp == 1:
        model = DDP(mine) if sync == "ddp" else mine
        opt = torch.optim.AdamW(mine.parameters(), lr=LR)
        for x, y in loader:
            xs, ys = my_share(x, c, n, lane), my_share(y, c, n, lane)
            for i, (xm, ym) in enumerate(zip(xs.chunk(c), ys.chunk(c))):
                with model.no_sync() if sync == "ddp" and i < c - 1 else nullcontext():
                    (lm_loss(model(xm), ym) / c).backward()
            if sync == "flat":
                flat_all_reduce(params, group, n)
            opt.step()
            opt.zero_grad(set_to_none=True)
            stamps.stamp()
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        lanes, stages = _groups(pp, n)
        model = DDP(mine, process_group=stages[stage]) if n > 1 and sync == "ddp" else mine
        pstage = PipelineStage(model, stage, pp, torch.device("cpu"), group=lanes[lane])
        sched = Schedule1F1B(pstage, n_microbatches=c, loss_fn=lm_loss, scale_grads=True)
        opt = torch.optim.AdamW(mine.parameters(), lr=LR)
        for x, y in loader:
            xs, ys = my_share(x, c, n, lane), my_share(y, c, n, lane)
            if stage == 0:
                sched.step(xs)
            elif stage == pp - 1:
                sched.step(target=ys, losses=[])
            else:
                sched.step()
            if sync == "flat" and n > 1:
                flat_all_reduce(params, group, n)
            opt.step()
            opt.zero_grad(set_to_none=True)
            stamps.stamp()
    return measured(stamps, warmup)


def interleaved(variants: dict[str, Any], runs: int, say: Any) -> tuple[dict[str, list[float]],
                                                                        dict[str, list[float]]]:
    """Run every variant ``runs`` times, alternating (rotating order); seconds/step and CPU seconds/step per run."""
    import torch.distributed as dist

    names = list(variants)
    out: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(runs):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            gc.collect()
            t = variants[name]()
            out[name].append(float(t))
            cpu[name].append(t.cpu)
            say(f"    run {r + 1}/{runs} {name}: {t * 1e3:.1f} ms/step, {t.cpu * 1e3:.1f} CPU ms/step")
    return out, cpu


# ---------------------------------------------------------------------------------------------- the parts
TINY = dict(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)  # part 0: a step that is mostly loop
TINY_BATCH = 4


def part0(args: Any, say: Any) -> dict[str, Any]:
    """One process (this one): seconds per step of a bare loop, Lightning's loop and the strategy's, tiny model."""
    import lightning.pytorch as pl

    from uniap_lightning.adapters import CausalLMModule
    from uniap_lightning.adapters.gpt import GPT, GPTConfig
    from uniap_lightning.planner.plan import Plan
    from uniap_lightning.strategy import UniAPStrategy

    torch.set_num_threads(1)
    steps, warm = (60, 10) if args.quick else (300, 30)

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        return GPT(GPTConfig(**TINY)).layers()

    def loader() -> Any:
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, TINY["vocab_size"], (TINY_BATCH * steps, TINY["block_size"]), generator=g)
        return DataLoader(TensorDataset(ids, ids), batch_size=TINY_BATCH, drop_last=True)

    def by_hand() -> float:
        model = nn.Sequential(*layers())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        stamps = Stamps()
        for x, y in loader():
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stamps.stamp()
        return stamps.window(warm)

    def lightning(strategy: Any) -> float:
        stamps = Stamps()
        trainer = pl.Trainer(strategy=strategy, callbacks=[step_timer(stamps)], use_distributed_sampler=False,
                             **{**trainer_common(steps), "devices": 1})
        trainer.fit(CausalLMModule(layers(), lr=LR), loader())
        return stamps.window(warm)

    def uniap() -> float:
        names = [f"chain.{i}" for i in range(TINY["n_layer"] + 2)]
        plan = Plan.from_assignment(stage_of_layer=[0] * len(names), strategies=[Strategy(1, 1)] * len(names),
                                    layer_names=names, pp=1, microbatches=1, schedule="1f1b",
                                    global_batch_size=TINY_BATCH, num_devices=1)
        return lightning(UniAPStrategy(plan=plan, **STRATEGY_KW))

    variants = {"by hand": by_hand, "Lightning Trainer()": lambda: lightning("auto"), "uniap": uniap}
    out: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.runs):
        for name in list(variants)[r % 3:] + list(variants)[: r % 3]:
            gc.collect()
            out[name].append(variants[name]())
            say(f"    run {r + 1}/{args.runs} {name}: {out[name][-1] * 1e3:.2f} ms/step")
    return {"steps": steps, "warmup": warm, "hand_s": out["by hand"], "lightning_s": out["Lightning Trainer()"],
            "uniap_s": out["uniap"]}


def part1(args: Any, say: Any) -> dict[str, Any]:
    names = [f"chain.{i}" for i in range(MODEL["n_layer"] + 2)]
    half = len(names) // 2
    layouts = {
        "dp4 (replicate), 1 micro-batch": (1, 1, [0] * len(names)),
        "pp2 x dp2, 1F1B, 4 micro-batches": (2, 4, [0] * half + [1] * (len(names) - half)),
    }
    rows = []
    for title, (pp, c, stages) in layouts.items():
        say(f"  part 1: {title}")
        plan = layout_plan(pp, c, stages, WORLD // pp, names)
        res, cpu = interleaved({
            "uniap": lambda plan=plan: run_uniap(plan, args.warmup, args.steps)[0],
            "by hand (DDP)": lambda pp=pp, c=c, stages=stages: run_by_hand(pp, c, stages, args.warmup, args.steps),
            "by hand (flat)": lambda pp=pp, c=c, stages=stages: run_by_hand(pp, c, stages, args.warmup, args.steps,
                                                                            sync="flat"),
        }, args.runs, say)
        rows.append({"layout": title, "plan": label(plan), "uniap_s": res["uniap"], "hand_s": res["by hand (DDP)"],
                     "flat_s": res["by hand (flat)"], "uniap_cpu_s": cpu["uniap"], "hand_cpu_s": cpu["by hand (DDP)"],
                     "flat_cpu_s": cpu["by hand (flat)"]})
    return {"rows": rows}


def part2(args: Any, say: Any, cache_dir: str) -> dict[str, Any]:
    from uniap_lightning.strategy import UniAPStrategy

    say("  part 2: strategy='uniap' vs strategy='ddp'")
    names = [f"chain.{i}" for i in range(MODEL["n_layer"] + 2)]
    # The planner does not pick pure data parallelism for this model on its own (see part 3), so the data-parallel
    # plan is pinned: every layer replicated over the 4 ranks, one micro-batch (DDP's layout exactly).
    dp_plan = layout_plan(1, 1, [0] * len(names), WORLD, names)
    seen: list[str] = []

    def uniap() -> float:
        strategy = UniAPStrategy(plan=dp_plan, **STRATEGY_KW)
        s, plan = run_uniap(None, args.warmup, args.steps, strategy=strategy)
        pure = plan.pp == 1 and all(lp.strategy.dp == WORLD and lp.strategy.tp == 1 and not lp.strategy.shard for lp in plan.layers)
        seen.append(f"{label(plan)} [{strategy.plan_origin.split()[0]}{', pure data parallel' if pure else ''}]")
        return s

    res, cpu = interleaved({"uniap": uniap, "ddp": lambda: run_lightning_ddp(args.warmup, args.steps)}, args.runs,
                           say)
    return {"uniap_s": res["uniap"], "ddp_s": res["ddp"], "uniap_cpu_s": cpu["uniap"], "ddp_cpu_s": cpu["ddp"],
            "plans": seen}


def part3(args: Any, say: Any, cache_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from uniap_lightning.planner.plan import Plan

    say("  part 3: the strategy plans; chosen vs rejected candidates")
    from uniap_lightning.strategy import UniAPStrategy

    strategy = UniAPStrategy(cache_dir=cache_dir, measure_cluster=MEASURE_CLUSTER, **STRATEGY_KW)
    _, chosen = run_uniap(None, 1, 1, strategy=strategy)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        cluster = getattr(strategy, "planning_cluster", None)
        box = [_candidates(chosen, strategy.setup_result.profile, cluster, args.rejected, say)]
    dist.broadcast_object_list(box, src=0)
    cands = [(Plan.from_dict(d), info) for d, info in box[0]]
    variants = {label(p): (lambda p=p: run_uniap(p, args.warmup, args.steps)[0]) for p, _ in cands}
    res, cpu = interleaved(variants, args.runs, say)
    rows = [{"plan": label(p), **info, "measured_s": res[label(p)], "cpu_s": cpu[label(p)]} for p, info in cands]
    trace = [{k: r.get(k) for k in ("pp", "microbatches", "outcome", "tpi_s", "bound_s")} for r in chosen.search]
    return {"rows": rows, "chosen": label(chosen), "trace": trace, "solver": str(chosen.solver)}


def _candidates(chosen: Any, profile: Any, cluster: Any, k: int,
                say: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The chosen plan and the ``k`` best-predicted rejected (pp, c) candidates (each pp degree represented)."""
    from uniap_lightning.planner.problem import Problem, TrainingConfig
    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.planner.solver import solve

    cluster = cluster or local_cluster(nodes=1, devices_per_node=WORLD, device_type="cpu")
    rebuilt = []
    for rec in chosen.search:
        p, c = rec["pp"], rec["microbatches"]
        if rec["outcome"] == "does not fit" or (p, c) == (chosen.pp, chosen.microbatches):
            continue
        problem = Problem(model=profile, cluster=cluster,
                          training=TrainingConfig(global_batch_size=BATCH, microbatches=(c,), schedule="1f1b"))
        try:
            plan = solve(problem, pp=[p], baselines=False, time_limit_s=20)
        except Exception as err:  # noqa: BLE001 - a candidate that cannot be rebuilt is reported and skipped
            say(f"    candidate pp={p} c={c}: {err}")
            continue
        rebuilt.append((plan, rec["outcome"]))
    rebuilt.sort(key=lambda pr: pr[0].estimate.tpi_s)
    picked: list[tuple[Any, str]] = []
    for p in sorted({pl.pp for pl, _ in rebuilt}):  # the best of every pipeline degree ...
        picked.append(next(pr for pr in rebuilt if pr[0].pp == p))
    for pr in rebuilt:  # ... then the next best overall
        if len(picked) >= k:
            break
        if pr not in picked:
            picked.append(pr)
    picked = sorted(picked, key=lambda pr: pr[0].estimate.tpi_s)
    out = [(chosen.to_dict(), {"role": "chosen", "outcome": "chosen", "predicted_s": chosen.estimate.tpi_s})]
    for plan, outcome in picked:
        out.append((plan.to_dict(), {"role": "rejected", "outcome": outcome, "predicted_s": plan.estimate.tpi_s}))
    return out


def uniap_with_flat_sync(plan: Any, *, flat: bool = True, waited_s: list[float] | None = None,
                         one_bucket: bool = False) -> Any:
    """The strategy with the replicated-gradient path it had before bucketing (part 4's baseline): each group's
    gradients concatenated into one flat buffer and all-reduced after the whole backward of the step.

    ``flat=False`` keeps the strategy's own path (``one_bucket``: with all of a group's gradients in one bucket,
    i.e. the bucketing machinery without overlap, started when the last gradient is final). ``waited_s`` collects, per batch, the seconds the strategy's
    ``backward`` spends in the gradient sync after the backward (all of the flat all-reduce; only the wait for the
    buckets still in flight, and the copy back, with buckets): the part of the sync that overlapping hides."""
    from uniap_lightning.runtime.data_parallel import ReplicatedGrads
    from uniap_lightning.strategy import UniAPStrategy

    class FlatAfterBackward(ReplicatedGrads):
        pending = False

        def arm(self, *, backward_passes: int, previous: dict[Any, Any]) -> None:
            self.pending = bool(self.groups)  # no hooks: nothing happens during the backward

        def flush(self) -> None:
            pass

        @torch.no_grad()
        def finish(self) -> None:  # called by the strategy's backward, after the whole backward
            if not self.pending:
                return
            self.pending = False
            for group, size, params in self.groups:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                flat_all_reduce(params, group, size)

    class FlatSync(UniAPStrategy):
        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            if flat:
                self.runtime.replicated = FlatAfterBackward(self.runtime.replicated.groups)
            elif one_bucket:
                self.runtime.replicated.first_bucket_cap_bytes = self.runtime.replicated.bucket_cap_bytes
            if waited_s is not None:
                finish = self.runtime.replicated.finish

                def timed() -> None:
                    t0 = time.perf_counter()
                    finish()
                    waited_s.append(time.perf_counter() - t0)

                self.runtime.replicated.finish = timed  # type: ignore[method-assign]

    return FlatSync(plan=plan, **STRATEGY_KW)


def _waited(waited_s: list[float], warmup: int) -> float:
    """Median seconds waited per step after the warm-up, the slowest rank counting (collective)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, statistics.median(waited_s[warmup:]))
    waited_s.clear()
    return max(out)


def part4(args: Any, say: Any) -> dict[str, Any]:
    names = [f"chain.{i}" for i in range(MODEL["n_layer"] + 2)]
    half = len(names) // 2
    layouts = {f"dp{WORLD} (replicate), 1 micro-batch": (1, 1, [0] * len(names))}
    if WORLD == 4:
        layouts["pp2 x dp2, 1F1B, 4 micro-batches"] = (2, 4, [0] * half + [1] * (len(names) - half))
    rows = []
    for title, (pp, c, stages) in layouts.items():
        say(f"  part 4: {title}")
        plan = layout_plan(pp, c, stages, WORLD // pp, names)
        waited: dict[str, list[float]] = {"flat": [], "buckets": [], "one": []}

        def run(name: str, plan: Any = plan) -> Any:
            sink: list[float] = []
            strategy = uniap_with_flat_sync(plan, flat=name == "flat", one_bucket=name == "one", waited_s=sink)
            t = run_uniap(None, args.warmup, args.steps, strategy=strategy)[0]
            waited[name].append(_waited(sink, args.warmup))
            return t

        res, cpu = interleaved({name: lambda name=name: run(name) for name in waited}, args.runs, say)
        rows.append({"layout": title, "world": WORLD, **{f"{k}_s": res[k] for k in waited},
                     **{f"{k}_cpu_s": cpu[k] for k in waited}, **{f"{k}_waited_s": v for k, v in waited.items()}})
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------- processes
def worker(rank: int, port: int, args: Any, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo", RANK=str(rank))
    progress = os.fdopen(os.dup(2), "w", buffering=1)
    log = open(Path(out_dir) / f"rank{rank}.log", "w", buffering=1)  # Lightning's and the plan's chatter
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)

    def say(msg: str) -> None:
        if rank == 0:
            progress.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")

    results: dict[str, Any] = {"args": vars(args), "model": MODEL, "batch": BATCH, "world": WORLD}
    cache_dir = tempfile.mkdtemp(prefix="uniap-bench-plans-") if rank == 0 else ""
    box = [cache_dir]
    dist.broadcast_object_list(box, src=0)
    cache_dir = box[0]
    for part in args.parts:
        t0 = time.perf_counter()
        if part == 1:
            results["part1"] = part1(args, say)
        elif part == 2:
            results["part2"] = part2(args, say, cache_dir)
        elif part == 3:
            results["part3"] = part3(args, say, cache_dir)
        elif part == 4:
            results["part4"] = part4(args, say)
        results[f"part{part}"]["wall_s"] = time.perf_counter() - t0
    if rank == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


def spawn_job(args: Any, world: int, parts: list[int]) -> dict[str, Any]:
    """Run ``parts`` on ``world`` freshly spawned ranks; their results (from rank 0)."""
    import torch.multiprocessing as mp

    job_args = argparse.Namespace(**{**vars(args), "parts": parts})
    saved = os.environ.get("UNIAP_BENCH_WORLD")
    os.environ["UNIAP_BENCH_WORLD"] = str(world)  # read by the ranks when they import this module
    try:
        with tempfile.TemporaryDirectory(prefix="uniap-bench-") as out_dir:
            try:
                mp.start_processes(worker, args=(free_port(), job_args, out_dir), nprocs=world, start_method="spawn")
            except Exception:
                for r in range(world):
                    log = Path(out_dir) / f"rank{r}.log"
                    if log.exists():
                        print(f"----- rank {r} log (tail)\n" + "".join(log.read_text().splitlines(True)[-40:]))
                raise
            return json.loads((Path(out_dir) / "results.json").read_text())
    finally:
        if saved is None:
            os.environ.pop("UNIAP_BENCH_WORLD", None)
        else:
            os.environ["UNIAP_BENCH_WORLD"] = saved


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- report
def med(xs: list[float]) -> float:
    return statistics.median(xs)


def paired(a: list[float], b: list[float]) -> float:
    """Median over runs of a_i / b_i (run i of both variants was measured back to back)."""
    return med([x / y for x, y in zip(a, b)])


def spread(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}"


def tables(res: dict[str, Any]) -> list[Any]:
    from rich.table import Table

    out = []
    runs = res["args"]["runs"]
    if "part0" in res:
        p = res["part0"]
        t = Table(title=f"(0) Fixed cost per step: one process, 1-layer GPT {TINY['n_embd']} wide, batch {TINY_BATCH} "
                        f"(ms/step, median of {runs} runs of {p['steps']} steps)")
        for col in ("loop", "ms/step", "over the bare loop", "over Lightning", "paired over the bare loop", "runs"):
            t.add_column(col)
        h, lt = med(p["hand_s"]), med(p["lightning_s"])
        for name, key in (("bare PyTorch loop", "hand_s"), ("Lightning Trainer()", "lightning_s"),
                          ("Trainer(strategy=UniAPStrategy)", "uniap_s")):
            v = med(p[key])
            diff = [a - b for a, b in zip(p[key], p["hand_s"])]
            t.add_row(name, f"{v * 1e3:.2f}", f"{(v - h) * 1e3:+.2f} ms", f"{(v - lt) * 1e3:+.2f} ms",
                      f"{med(diff) * 1e3:+.2f} ms", f"{min(p[key]) * 1e3:.2f}-{max(p[key]) * 1e3:.2f}")
        out.append(t)
    if "part1" in res:
        t = Table(title=f"(1) Strategy executing a plan vs the same layout by hand (ms/step, median of {runs}; "
                        "target: uniap / hand <= 1.03)")
        for col in ("layout", "plan", "hand DDP", "hand flat", "uniap", "uniap / DDP", "uniap / flat",
                    "paired / DDP", "paired / flat", "runs hand DDP", "runs hand flat", "runs uniap"):
            t.add_column(col)
        for row in res["part1"]["rows"]:
            h, f, u = med(row["hand_s"]), med(row["flat_s"]), med(row["uniap_s"])
            t.add_row(row["layout"], row["plan"], f"{h * 1e3:.1f}", f"{f * 1e3:.1f}", f"{u * 1e3:.1f}",
                      f"{u / h:.3f}", f"{u / f:.3f}", f"{paired(row['uniap_s'], row['hand_s']):.3f}",
                      f"{paired(row['uniap_s'], row['flat_s']):.3f}", spread(row["hand_s"]), spread(row["flat_s"]),
                      spread(row["uniap_s"]))
        out.append(t)
        t = Table(title=f"(1, CPU) the same runs in CPU ms per step, summed over the {res['world']} ranks (median of "
                        f"{runs}; what each loop costs; compare within one run)")
        for col in ("layout", "hand DDP", "hand flat", "uniap", "uniap / DDP", "uniap / flat", "paired / DDP",
                    "paired / flat"):
            t.add_column(col)
        for row in res["part1"]["rows"]:
            h, f, u = med(row["hand_cpu_s"]), med(row["flat_cpu_s"]), med(row["uniap_cpu_s"])
            t.add_row(row["layout"], f"{h * 1e3:.1f}", f"{f * 1e3:.1f}", f"{u * 1e3:.1f}", f"{u / h:.3f}",
                      f"{u / f:.3f}", f"{paired(row['uniap_cpu_s'], row['hand_cpu_s']):.3f}",
                      f"{paired(row['uniap_cpu_s'], row['flat_cpu_s']):.3f}")
        out.append(t)
    if "part2" in res:
        p = res["part2"]
        t = Table(title=f"(2) strategy='uniap' vs strategy='ddp' (global batch {res['batch']}, samples/s, median of "
                        f"{runs}; target >= 0.97x)")
        for col in ("strategy", "plan", "ms/step", "samples/s", "vs ddp", "paired vs ddp", "runs ms/step",
                    "CPU ms/step", "CPU vs ddp (paired)"):
            t.add_column(col)
        d, u = med(p["ddp_s"]), med(p["uniap_s"])
        dc, uc = med(p["ddp_cpu_s"]), med(p["uniap_cpu_s"])
        plans = sorted(set(p["plans"]))
        t.add_row("ddp", "DDP over 4 ranks", f"{d * 1e3:.1f}", f"{res['batch'] / d:.1f}", "1.000x", "1.000x",
                  spread(p["ddp_s"]), f"{dc * 1e3:.1f}", "1.000")
        t.add_row("uniap", ", ".join(plans), f"{u * 1e3:.1f}", f"{res['batch'] / u:.1f}", f"{d / u:.3f}x",
                  f"{paired(p['ddp_s'], p['uniap_s']):.3f}x", spread(p["uniap_s"]), f"{uc * 1e3:.1f}",
                  f"{paired(p['uniap_cpu_s'], p['ddp_cpu_s']):.3f}")
        out.append(t)
    if "part3" in res:
        p = res["part3"]
        rows = p["rows"]
        by_meas = sorted(rows, key=lambda r: med(r["measured_s"]))
        by_pred = sorted(rows, key=lambda r: r["predicted_s"])
        chosen = next(r for r in rows if r["role"] == "chosen")
        t = Table(title=f"(3) The chosen plan vs rejected candidates, run for real (ms/step, median of {runs})")
        for col in ("plan", "role", "search outcome", "predicted", "measured", "measured / chosen", "rank predicted",
                    "rank measured", "runs"):
            t.add_column(col)
        for r in by_pred:
            m = med(r["measured_s"])
            t.add_row(r["plan"], r["role"], r["outcome"], f"{r['predicted_s'] * 1e3:.1f}", f"{m * 1e3:.1f}",
                      f"{m / med(chosen['measured_s']):.2f}x", str(by_pred.index(r) + 1), str(by_meas.index(r) + 1),
                      spread(r["measured_s"]))
        out.append(t)
    if "part4" in res:
        t = Table(title=f"(4) Replicated gradients: one flat all-reduce after backward (before) vs buckets overlapped "
                        f"with backward (after); ms/step, CPU ms/step summed over ranks, ms per step waited for the "
                        f"sync after the backward (slowest rank); medians of {runs}")
        for col in ("layout", "ranks", "before", "after", "after / before", "paired", "CPU before", "CPU after",
                    "CPU paired", "waited before", "waited after", "runs before", "runs after"):
            t.add_column(col)
        for row in res["part4"]["rows"]:
            f, b = med(row["flat_s"]), med(row["buckets_s"])
            t.add_row(row["layout"], str(row["world"]), f"{f * 1e3:.1f}", f"{b * 1e3:.1f}", f"{b / f:.3f}",
                      f"{paired(row['buckets_s'], row['flat_s']):.3f}", f"{med(row['flat_cpu_s']) * 1e3:.1f}",
                      f"{med(row['buckets_cpu_s']) * 1e3:.1f}",
                      f"{paired(row['buckets_cpu_s'], row['flat_cpu_s']):.3f}",
                      f"{med(row['flat_waited_s']) * 1e3:.2f}", f"{med(row['buckets_waited_s']) * 1e3:.2f}",
                      spread(row["flat_s"]), spread(row["buckets_s"]))
        out.append(t)
        t = Table(title="(4, control) the bucketed path with all of a group's gradients in ONE bucket (no overlap: "
                        "it starts when the last gradient is final), paired against before and after")
        for col in ("layout", "one bucket ms/step", "paired / before", "paired / after", "CPU paired / before",
                    "CPU paired / after", "waited"):
            t.add_column(col)
        for row in res["part4"]["rows"]:
            t.add_row(row["layout"], f"{med(row['one_s']) * 1e3:.1f}", f"{paired(row['one_s'], row['flat_s']):.3f}",
                      f"{paired(row['one_s'], row['buckets_s']):.3f}",
                      f"{paired(row['one_cpu_s'], row['flat_cpu_s']):.3f}",
                      f"{paired(row['one_cpu_s'], row['buckets_cpu_s']):.3f}", f"{med(row['one_waited_s']) * 1e3:.2f}")
        out.append(t)
    return out


def verdicts(res: dict[str, Any]) -> list[str]:
    lines = []
    if "part0" in res:
        p = res["part0"]
        h, lt, u = med(p["hand_s"]), med(p["lightning_s"]), med(p["uniap_s"])
        lines.append(f"(0) per step, one process: Lightning's loop adds {(lt - h) * 1e3:.2f} ms to a bare loop, the "
                     f"strategy {(u - lt) * 1e3:+.2f} ms more (callbacks, loss logging, gradient hand-over, monitor)")
    if "part1" in res:
        for row in res["part1"]["rows"]:
            h, f, u = med(row["hand_s"]), med(row["flat_s"]), med(row["uniap_s"])
            best = min(h, f)
            cheaper = min(("hand_cpu_s", "flat_cpu_s"), key=lambda k: med(row[k]))
            lines.append(f"(1) {row['layout']}: uniap {u * 1e3:.1f} ms vs by hand {h * 1e3:.1f} ms (DDP) / "
                         f"{f * 1e3:.1f} ms (flat all-reduce): overhead vs the faster hand-written loop "
                         f"{(u / best - 1) * 100:+.1f}% ({'meets' if u / best <= 1.03 else 'MISSES'} the 3% target); "
                         f"CPU time per step vs the cheaper hand-written loop ({'DDP' if cheaper == 'hand_cpu_s' else 'flat'}, paired) "
                         f"{(paired(row['uniap_cpu_s'], row[cheaper]) - 1) * 100:+.1f}%")
    if "part2" in res:
        p = res["part2"]
        d, u = med(p["ddp_s"]), med(p["uniap_s"])
        pure_dp = all("pure data parallel" in pl for pl in p["plans"])
        lines.append(f"(2) uniap {BATCH / u:.1f} samples/s vs ddp {BATCH / d:.1f}: {d / u:.3f}x "
                     f"({'meets' if d / u >= 0.97 else 'MISSES'} the 0.97x target); plans used: "
                     f"{sorted(set(p['plans']))} ({'pure data parallel' if pure_dp else 'NOT pure data parallel'}); "
                     f"CPU time per step uniap / ddp (paired) {paired(p['uniap_cpu_s'], p['ddp_cpu_s']):.3f}")
    if "part3" in res:
        rows = res["part3"]["rows"]
        chosen = next(r for r in rows if r["role"] == "chosen")
        best = min(rows, key=lambda r: med(r["measured_s"]))
        others = [r for r in rows if r is not chosen]
        runner_up = min(others, key=lambda r: med(r["measured_s"])) if others else None
        if best is chosen and runner_up:
            lines.append(f"(3) the chosen plan {chosen['plan']} is the fastest measured; the next best "
                         f"({runner_up['plan']}) is {med(runner_up['measured_s']) / med(chosen['measured_s']):.2f}x "
                         "slower")
        else:
            lines.append(f"(3) the chosen plan {chosen['plan']} is NOT the fastest measured: {best['plan']} is "
                         f"{med(chosen['measured_s']) / med(best['measured_s']):.2f}x faster")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run: 2 runs of 6 steps, 2 rejected candidates")
    ap.add_argument("--runs", type=int, default=None, help="runs per variant (default 7; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="steps excluded from timing (default 3; --quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run (default 12; --quick 6)")
    ap.add_argument("--rejected", type=int, default=None, help="rejected candidates to run (default 4; --quick 2)")
    ap.add_argument("--parts", default="0,1,2,3", help="comma list of parts to run: 0,1,2,3,4")
    ap.add_argument("--no-monitor", action="store_true", help="UniAPStrategy(monitor=False) in every uniap run")
    ap.add_argument("--no-measure-cluster", action="store_true",
                    help="plan from the constant local cluster and a rank-0 profile (UniAPStrategy measure_cluster=False)")
    ap.add_argument("--markdown", default=None, help="also write the tables as a markdown fragment")
    ap.add_argument("--json", default=None, help="also write the raw measurements (JSON)")
    args = ap.parse_args()
    q = args.quick
    args.runs = args.runs or (2 if q else 7)
    args.warmup = args.warmup or (2 if q else 3)
    args.steps = args.steps or (6 if q else 12)
    args.rejected = args.rejected if args.rejected is not None else (2 if q else 4)
    args.parts = [int(p) for p in args.parts.split(",") if p]
    os.environ["UNIAP_BENCH_MEASURE_CLUSTER"] = "0" if args.no_measure_cluster else "1"  # inherited by the ranks
    os.environ["UNIAP_BENCH_MONITOR"] = "0" if args.no_monitor else "1"

    from rich.console import Console

    console = Console(width=170, record=True)
    t0 = time.perf_counter()
    part0_res = None
    if 0 in args.parts:
        progress = os.fdopen(os.dup(2), "w", buffering=1)
        progress.write(f"[{time.strftime('%H:%M:%S')}]   part 0: fixed cost per step, one process\n")
        saved = os.dup(1), os.dup(2)
        with open(os.devnull, "w") as quiet:  # Lightning's and the plan's chatter, as the ranks' logs below
            os.dup2(quiet.fileno(), 1)
            os.dup2(quiet.fileno(), 2)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    part0_res = part0(args, lambda msg: progress.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n"))
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    args.parts = [p for p in args.parts if p != 0]
    res: dict[str, Any] = {"args": vars(args), "model": MODEL, "batch": BATCH, "world": WORLD}
    if 4 in args.parts:  # dp2 first, in a job of its own (2 ranks), then the 4-rank job does dp4 and pp2 x dp2
        dp2 = spawn_job(args, 2, [4])["part4"]
    if args.parts:
        res = spawn_job(args, WORLD, args.parts)
    if 4 in args.parts:
        res["part4"]["rows"] = dp2["rows"] + res["part4"]["rows"]
    if part0_res is not None:
        res["part0"] = part0_res
    wall = time.perf_counter() - t0
    console.print(f"model: GPT {MODEL}, global batch {BATCH}, {WORLD} CPU processes (gloo), AdamW; "
                  f"{args.runs} runs x ({args.warmup} warm-up + {args.steps} timed steps) per variant; "
                  f"wall {wall:.0f} s")
    for t in tables(res):
        console.print(t)
    for line in verdicts(res):
        console.print(line)
    if "part3" in res:
        steps = [f"pp{r['pp']} c{r['microbatches']}: {r['outcome']}"
                 + (f" ({r['bound_s'] * 1e3:.1f} ms bound)" if r.get("bound_s") else "") for r in res["part3"]["trace"]]
        console.print("planner's search, in visiting order: " + "; ".join(steps))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.markdown:
        text = console.export_text()
        cmd = "python benchmarks/runtime.py " + " ".join(sys.argv[1:])
        Path(args.markdown).write_text(f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d')}, wall {wall:.0f} s)\n\n"
                                       f"```\n{text}```\n")


if __name__ == "__main__":
    main()
