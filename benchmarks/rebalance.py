"""Re-planning a running job (issue 14): what a switch buys and what it costs, on CPU processes.

    python benchmarks/rebalance.py [--devices 4] [--runs 3] [--steps 24] [--check-every 8] [--slow-rank 3]
                                   [--delay-ms 0.4] [--width 128] [--depth 8] [--out rebalance.json]

A chain of ``--depth`` equal MLP layers (tanh(Linear(width, width))); from the first training batch on, every layer
on process ``--slow-rank`` sleeps ``--delay-ms`` per sample in its forward (a throttled device: the first plan is
solved, and profiled, with all devices equal). Each run, in the same ``--devices`` processes (setup caches warm):

1. ``rebalance=True, rebalance_check_every=--check-every``: the step time before the switch (median of the
   window's steps after the first), after it (median of the steps after the one following the switch), the
   one-off switch cost (checkpoint, rebuild, optimizers, in seconds), the re-solve time (warm-started from the
   running plan, as the callback does) and the detection: steps and seconds from the slowdown (step 1) to the
   check that switched, and one check's own cost;
   (steps right after a check, which carry its all-gather and any re-solve, are left out of "after");
2. the ideal: a plan solved from the start on the cluster with the speeds the rebalance measured
   (``Cluster.with_rank_speed``), ``rebalance=False``: its median step time (steps after the first).

The table gives the median over ``--runs`` runs of each figure. Timed on rank 0, wall clock per optimizer step.
"""

from __future__ import annotations

import argparse
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
from torch import nn


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Throttled(nn.Module):
    def __init__(self, width: int, delay_s: float) -> None:
        super().__init__()
        self.lin, self.delay_s, self.slow = nn.Linear(width, width), delay_s, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow and torch.is_grad_enabled():
            time.sleep(self.delay_s * x.shape[0])
        return torch.tanh(self.lin(x))


def _module(args: argparse.Namespace) -> Any:
    import lightning.pytorch as pl
    import torch.distributed as dist

    class Chain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            w = args.width
            self.net = nn.Sequential(nn.Linear(16, w), *[Throttled(w, args.delay_ms / 1e3) for _ in range(args.depth)],
                                     nn.Linear(w, 4))
            self.loss_fn = nn.MSELoss()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            slow = dist.get_rank() == args.slow_rank
            for m in self.net.modules():
                if isinstance(m, Throttled):
                    m.slow = slow

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # Lightning asks for it; the
            return self.loss_fn(self.net(batch[0]), batch[1])                # strategy runs the chain itself

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return Chain()


def _data(args: argparse.Namespace) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    n = args.batch * args.steps
    return DataLoader(TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)),
                      batch_size=args.batch, drop_last=True)


def _fit(args: argparse.Namespace, cache: str, cluster: Any = "local_cpu", **strategy_kw: Any) -> tuple[list[float], Any]:
    """One ``fit`` of ``--steps`` steps; returns the step times on this rank and the strategy."""
    import lightning.pytorch as pl

    from uniap_lightning.strategy import UniAPStrategy

    ends: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            ends.append(time.perf_counter())

    strategy = UniAPStrategy(cluster=cluster, cache_dir=cache, monitor=False, **strategy_kw)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         callbacks=[Clock()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(_module(args), _data(args))
    # times[i] is step i + 2's: from the end of step i + 1 to its own end (callbacks, a check, a switch included)
    return [b - a for a, b in zip(ends, ends[1:])], strategy


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    os.chdir(out)
    from uniap_lightning.planner.config import cluster_from
    from uniap_lightning.rebalance.callback import describe

    cache, rows = str(Path(out) / "cache"), []
    for _ in range(args.runs):
        times, strategy = _fit(args, cache, rebalance=True, rebalance_check_every=args.check_every)
        events = strategy.rebalances
        row: dict[str, Any] = {"first_plan": describe(strategy.setup_result.plan), "events": events}
        if events:
            e = events[0]
            s = e["step"]  # before: steps 2..s (times[0 : s-1]); after: from step s+2 (s+1 warms up the new plan)
            # a check runs after this clock's hook, so its gather (and any re-solve) lands in the next step: skipped
            after = [t for i, t in enumerate(times) if i + 2 > s + 1 and (i + 2) % args.check_every != 1]
            # detection: the slowdown starts at step 1 and the switch happens at check step s (steps after s
            # - 1 healthy-looking steps); a check step carries the check's all-gather: its cost is that step's time
            # over its neighbours' (checks before the switch, where nothing was re-solved)
            check_steps = [i for i in range(len(times)) if (i + 2) % args.check_every == 1 and i + 2 < s]
            plain = [t for i, t in enumerate(times[:s - 1]) if i not in check_steps]
            check_cost = (statistics.median([times[i] for i in check_steps]) - statistics.median(plain)
                          if check_steps and plain else None)
            row.update(before_s=statistics.median(times[:s - 1]), after_s=statistics.median(after),
                       detect_steps=s - 1, detect_s=sum(times[:s - 1]), check_s=check_cost,
                       checks=len(strategy._rebalancer.checks),
                       switch_s=e["switch_s"], solve_s=e["solve_s"], predicted_gain=e["predicted_gain"],
                       speeds=e["speeds"], new_plan=e["new_plan"])
            ideal_times, ideal = _fit(args, cache, cluster=cluster_from("local_cpu").with_rank_speed(tuple(e["speeds"])))
            row.update(ideal_s=statistics.median(ideal_times[1:]), ideal_plan=describe(ideal.plan))
        rows.append(row)
    if rank == 0:
        (Path(out) / "rows.json").write_text(json.dumps(rows, default=str))


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--check-every", type=int, default=8)
    ap.add_argument("--slow-rank", type=int, default=3)
    ap.add_argument("--delay-ms", type=float, default=0.4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=None, help="write every run's figures as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(args.devices, _port(), args, out), nprocs=args.devices, start_method="spawn")
        rows = json.loads((Path(out) / "rows.json").read_text())
    switched = [r for r in rows if r.get("events")]
    print(f"{len(switched)}/{len(rows)} runs switched; wall {time.perf_counter() - t0:.0f} s; slow rank "
          f"{args.slow_rank} sleeps {args.delay_ms} ms per sample per layer")
    if switched:
        r0 = switched[0]
        print(f"first plan: {r0['first_plan']}\nafter the switch: {r0['new_plan']} (speeds {r0['speeds']})\n"
              f"ideal (solved knowing the speeds): {r0['ideal_plan']}")
        before, after, ideal = (_median(switched, k) for k in ("before_s", "after_s", "ideal_s"))
        print("| figure (median of runs) | value |\n|---|---|")
        print(f"| step time before the switch | {before * 1e3:.1f} ms |")
        print(f"| step time after the switch | {after * 1e3:.1f} ms ({before / after - 1:+.0%} steps/s) |")
        print(f"| step time of the ideal plan | {ideal * 1e3:.1f} ms |")
        print(f"| predicted gain | {_median(switched, 'predicted_gain'):+.0%} |")
        print(f"| detection: steps (and seconds) from the slowdown to the switching check | "
              f"{_median(switched, 'detect_steps'):.0f} ({_median(switched, 'detect_s'):.2f} s) |")
        check = _median(switched, "check_s")
        print(f"| a check's own cost (its all-gather; a check step over a plain one) | "
              + (f"{check * 1e3:.1f} ms |" if check is not None else "- (no check before the switch) |"))
        print(f"| switch cost (checkpoint, rebuild, optimizers) | {_median(switched, 'switch_s'):.2f} s |")
        print(f"| re-solve (rank 0, others wait) | {_median(switched, 'solve_s'):.2f} s |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
