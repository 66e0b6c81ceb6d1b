"""Where the demo's training step goes, against the plan's prediction (the README's `uniap train` model and data).

    python benchmarks/step_breakdown.py [--devices 2] [--steps 40] [--pp 2 --microbatches 8]
                                        [--profile-flush-bytes 0]

Runs the shipped tiny GPT on the shipped corpus with ``Trainer(strategy=UniAPStrategy(...))`` on ``--devices`` CPU
processes (the cores shared out, as `uniap train` does), with the plan the strategy solves (as the demo), and times, on rank 0, per step (medians after 5
warm-up steps): the whole step (batch start to batch end), the strategy's ``training_step`` (the schedule's forward
and backward), its ``backward`` (handing gradients back and waiting for the replicated-gradient all-reduce), the
remainder (optimizer step, zero_grad, Lightning's loop and callbacks), and the gap between batches (data loading).
For a one-stage plan it also times the chain's forward + backward and an AdamW step outside Lightning in the same
process (what profiling and the optimizer term assume). The table puts each next to the plan's predicted terms.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from uniap_lightning.planner.decision import Strategy


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


strategy_of_solved_run: list[Any] = []  # the solved run's SetupResult (profile and cluster), in this process


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, cache: str) -> None:
    _fit(rank, world, port, argparse.Namespace(**{**vars(args), "pp": 0}), cache)  # the demo: solve
    if args.pp:
        _fit(rank, world, port + 1, args, cache)  # then the pinned plan, scored by the same profile


def _fit(rank: int, world: int, port: int, args: argparse.Namespace, cache: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.profile_flush_bytes is not None:
        from uniap_lightning.profiling import timing

        timing.CPU_FLUSH_BYTES = args.profile_flush_bytes
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_dir

    from uniap_lightning.cli.train import build_module
    from uniap_lightning.planner.config import CONF_DIR
    from uniap_lightning.strategy import UniAPStrategy

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="fit")
    pl.seed_everything(0, verbose=False)
    module, data, _ = build_module(cfg)
    strategy = UniAPStrategy(monitor=False, cache_dir=cache, plan=_pinned(args, world, module, cfg))
    times: dict[str, list[float]] = {k: [] for k in ("step", "training_step", "backward", "gap")}

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            times[name].append(time.perf_counter() - t0)
            return out
        return run

    strategy.training_step = timed("training_step", strategy.training_step)  # type: ignore[method-assign]
    strategy.backward = timed("backward", strategy.backward)  # type: ignore[method-assign]

    class Steps(pl.Callback):
        start = end = None

        def on_train_batch_start(self, *a: Any) -> None:
            self.start = time.perf_counter()
            if self.end is not None:
                times["gap"].append(self.start - self.end)

        def on_train_batch_end(self, *a: Any) -> None:
            self.end = time.perf_counter()
            times["step"].append(self.end - self.start)

    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[Steps()])
    trainer.fit(module, data)
    if args.pp and strategy.plan.estimate is None:  # pinned: score it with the solved run's profile and cluster
        from dataclasses import replace

        from uniap_lightning.planner.cost import evaluate
        from uniap_lightning.planner.problem import Problem, TrainingConfig

        solved = strategy_of_solved_run[0]
        problem = Problem(model=solved.profile, cluster=solved.planning_cluster,
                          training=TrainingConfig(global_batch_size=strategy.plan.global_batch_size))
        strategy_plan = strategy.plan.with_report(estimate=evaluate(problem, strategy.plan))
    else:
        strategy_plan = strategy.plan
        strategy_of_solved_run[:] = [strategy.setup_result]
    med = {k: statistics.median(v[5:]) * 1e3 for k, v in times.items()}
    if strategy_plan.pp == 1:
        med.update(_outside_lightning(strategy, data))
    if rank == 0:
        _print(med, strategy_plan)


def _pinned(args: argparse.Namespace, world: int, module: Any, cfg: Any) -> Any:
    """With ``--pp``: a pinned plan, the chain's layers split evenly over ``pp`` stages, one device per stage's
    rank doing plain data parallelism over the rest (the plan's estimate is filled in by the strategy)."""
    if not args.pp:
        return None
    from uniap_lightning.planner.plan import Plan
    from uniap_lightning.adapters import extract_chain

    names = extract_chain(module).names
    per = -(-len(names) // args.pp)
    n = world // args.pp
    return Plan.from_assignment(
        stage_of_layer=[min(u // per, args.pp - 1) for u in range(len(names))], strategies=[Strategy(n, 1)] * len(names),
        layer_names=names, pp=args.pp, microbatches=args.microbatches, schedule="1f1b",
        global_batch_size=int(cfg.data.batch_size), num_devices=world)


def _outside_lightning(strategy: Any, data: Any) -> dict[str, float]:
    """The chain's forward + backward of this rank's share and an AdamW step, without Lightning or hooks."""
    import copy

    layers = copy.deepcopy(strategy.runtime.chain.layers)
    x = next(iter(data.train_dataloader()))[0][: strategy.plan.micro_batch_size // strategy.plan.devices_per_stage]
    opt = torch.optim.AdamW([p for layer in layers for p in layer.parameters()], lr=1e-3)
    fwd_bwd, step = [], []
    for _ in range(25):
        t0 = time.perf_counter()
        h = x
        for layer in layers:
            h = layer(h)
        h.float().sum().backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        fwd_bwd.append(t1 - t0)
        step.append(time.perf_counter() - t1)
    return {"bare_fwd_bwd": statistics.median(fwd_bwd[5:]) * 1e3, "bare_adamw": statistics.median(step[5:]) * 1e3}


def _print(med: dict[str, float], plan: Any) -> None:
    est = plan.estimate
    rest = med["step"] - med["training_step"] - med["backward"]
    print(f"plan: pp={plan.pp} x {plan.devices_per_stage} per stage, {plan.microbatches} micro-batches")
    print("| term | measured ms (rank 0, median) | predicted ms |")
    print("|---|---|---|")
    print(f"| whole step | {med['step']:.2f} | {est.tpi_s * 1e3:.2f} (time per iteration) |")
    print(f"| training_step (schedule: forward + backward) | {med['training_step']:.2f} | "
          f"{(est.tpi_s - max(est.stage_sync_s)) * 1e3:.2f} (iteration - sync) |")
    print(f"| backward (gradients back + all-reduce wait) | {med['backward']:.2f} | "
          f"{max(est.stage_sync_s) * 1e3:.2f} (sync + optimizer) |")
    print(f"| remainder (optimizer, zero_grad, loop, callbacks) | {rest:.2f} | (in the line above) |")
    print(f"| gap between batches (data) | {med['gap']:.2f} | - |")
    if "bare_fwd_bwd" in med:
        print(f"| chain forward + backward outside Lightning | {med['bare_fwd_bwd']:.2f} | "
              f"{est.stage_time_s[0] * 1e3:.2f} (stage time per micro-batch) |")
        print(f"| AdamW step outside Lightning | {med['bare_adamw']:.2f} | - |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pp", type=int, default=0, help="pin a plan with this many stages (0: solve, as the demo)")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches of the pinned plan")
    parser.add_argument("--profile-flush-bytes", type=int, default=None,
                        help="bytes the profiler writes before each timed layer run on a CPU (default: the "
                             "library's, 64 MiB; 0: hot caches, as profiles were timed before)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        mp.start_processes(_worker, args=(args.devices, _port(), args, cache), nprocs=args.devices,
                           start_method="spawn")


if __name__ == "__main__":
    main()
