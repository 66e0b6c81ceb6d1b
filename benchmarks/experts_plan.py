"""What expert parallelism buys, by the planner's own cost model: the best plan of a mixture-of-experts model with
``ep`` in the search against the best plan without it (every MoE layer's experts on every replica, the planner's
``allowed`` filter keeping ``ep == 1``), on the same cluster and batch.

    python benchmarks/experts_plan.py [--time-limit 60]
        [--cases mixtral_8x7b:h100_4x8:64,mixtral_8x7b:h100_32x8:512,qwen_moe_a2.7b:h100_4x8:64]

Prints one row per case and variant: predicted time per iteration, samples/s, the largest predicted memory per
device, the plan's shape (pipeline, schedule, strategies), the ep degrees its MoE layers use, and the search's
wall time and status; then the speed-up of ep per case.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from uniap_lightning.planner.cluster import GIB
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.solver.search import search

CASES = "mixtral_8x7b:h100_4x8:64,mixtral_8x7b:h100_32x8:512,qwen_moe_a2.7b:h100_4x8:64"


def shape(plan) -> str:
    labels = []
    for lp in plan.layers:
        lab = lp.strategy.label()
        if lab not in labels:
            labels.append(lab)
    v = f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return f"pp{plan.pp} c{plan.microbatches} {plan.schedule}{v} " + "/".join(labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--cases", default=CASES)
    args = ap.parse_args()
    table = Table(title="Mixture-of-experts: the best plan with and without expert parallelism (predicted)")
    for col in ("case", "variant", "ms / iter", "samples/s", "max GiB / device", "ep used", "plan", "solve s",
                "status"):
        table.add_column(col, justify="right" if col in ("ms / iter", "samples/s", "max GiB / device", "solve s")
                         else "left")
    speedups = []
    for case in args.cases.split(","):
        model, cluster, batch = case.split(":")
        problem = build_problem(model=model, cluster=cluster, global_batch_size=int(batch))
        tpis = {}
        for name, allowed in (("with ep", None), ("without ep", lambda s: s.ep == 1)):
            t0 = time.perf_counter()
            plan = search(problem, time_limit_s=args.time_limit, allowed=allowed)
            wall = time.perf_counter() - t0
            est = plan.estimate
            tpis[name] = est.tpi_s
            eps = sorted({lp.strategy.ep for lp in plan.layers if lp.strategy.ep > 1})
            status = plan.solver.status + (f" ({plan.solver.gap:.1%})" if plan.solver.gap else "")
            table.add_row(f"{model} {cluster} B={batch}", name, f"{est.tpi_s * 1e3:,.1f}",
                          f"{est.samples_per_s:,.1f}", f"{max(est.stage_memory_bytes) / GIB:.1f}",
                          ",".join(map(str, eps)) or "-", shape(plan), f"{wall:.1f}", status)
            print(case, name, round(est.tpi_s * 1e3, 1), eps, shape(plan), round(wall, 1), status, flush=True)
        speedups.append((case, tpis["without ep"] / tpis["with ep"]))
    Console(width=220).print(table)
    for case, x in speedups:
        print(f"{case}: ep speeds the predicted iteration up {x:.2f}x")


if __name__ == "__main__":
    main()
