"""Re-planning at scale (issue 24): the re-solve a running job does when its devices' speeds change, on 1,024
devices, cold vs warm-started from the running plan.

    python benchmarks/replan.py [--cluster h100_128x8] [--models llama_7b,llama_70b,gpt2_xl,bert_huge]
                                [--slow-node 5] [--speed 0.6] [--time-limit 60]

Per model: the plan is solved with every device equal (the running plan); then one node (``--slow-node``) runs at
``--speed`` (what :mod:`uniap_lightning.rebalance` measures and hands to ``Cluster.with_rank_speed``) and the plan is
solved again, twice:

- cold: ``solve`` as at setup (baselines first, then the search);
- warm: what the rebalance callback does, ``solve(warm_start=running plan, baselines=False)``: the running plan,
  re-scored at the new speeds, is the first incumbent.

Prints wall and CPU seconds (this process, single-threaded solver workers included), status and gap of each, and
whether both found the same time per iteration (they must: the warm start prunes, it does not approximate).
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import replace

from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.solver import solve


def cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn):
    t0, c0 = time.perf_counter(), cpu_s()
    out = fn()
    return out, time.perf_counter() - t0, cpu_s() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="h100_128x8")
    ap.add_argument("--models", default="llama_7b,llama_70b,gpt2_xl,bert_huge")
    ap.add_argument("--slow-node", type=int, default=5)
    ap.add_argument("--speed", type=float, default=0.6)
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    print(f"cluster {args.cluster}; node {args.slow_node} at speed {args.speed}; time_limit {args.time_limit:g} s")
    print("| model | devices | running plan | its time at the new speeds | cold re-solve: wall / CPU s, status "
          "| warm re-solve: wall / CPU s, status | new plan | same optimum |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        base = build_problem(model=model, cluster=args.cluster)
        base = replace(base, training=replace(base.training,
                                              global_batch_size=max(32, 2 * base.cluster.num_devices)))
        running = solve(base, time_limit_s=args.time_limit)
        per_node, n = base.cluster.devices_per_node, base.cluster.num_devices
        speeds = tuple(args.speed if r // per_node == args.slow_node else 1.0 for r in range(n))
        slowed = replace(base, cluster=base.cluster.with_rank_speed(speeds))
        before = evaluate(slowed, running)
        cold, cw, cc = timed(lambda: solve(slowed, time_limit_s=args.time_limit))
        warm, ww, wc = timed(lambda: solve(slowed, time_limit_s=args.time_limit, warm_start=running,
                                           baselines=False))
        same = abs(cold.estimate.tpi_s - warm.estimate.tpi_s) <= 1e-6 * cold.estimate.tpi_s
        st = lambda p: p.solver.status + ("" if p.solver.status == "optimal" else f" ({p.solver.gap:.1%})")  # noqa: E731
        shape = f"pp{warm.pp} c{warm.microbatches} {warm.schedule}" + (
            f" v{warm.virtual_stages}" if warm.virtual_stages > 1 else "")
        print(f"| {model} | {n} | pp{running.pp} c{running.microbatches} {running.schedule} "
              f"| {before.tpi_s * 1e3:,.1f} ms | {cw:.1f} / {cc:.1f}, {st(cold)} | {ww:.1f} / {wc:.1f}, {st(warm)} "
              f"| {shape}: {warm.estimate.tpi_s * 1e3:,.1f} ms | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
