"""Where the new pipeline schedules win, by the planner's own cost model: ``schedule=1f1b`` against
``schedule=auto`` on shipped models and clusters, with the planner's wall time.

    python benchmarks/schedules.py [--time-limit 60] [--cases gpt2_small:a100_1x8:32,llama_70b:h100_32x8:512]

Prints one row per case: the 1F1B-only plan (as before issue 25), the plan ``auto`` chooses (schedule, stages per
device, pipeline degree, micro-batches), the predicted speed-up, the bubble each leaves on its busiest device
group, each search's wall time and whether it was proven optimal (else the MIP gap left at the time limit).
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.solver.search import bubble_s, search

CASES = "gpt2_small:a100_1x8:32,llama_7b:a100_1x8:32,bert_huge:titanxp_2x4:32,llama_7b:h100_4x8:64,llama_7b:h100_32x8:512,llama_70b:h100_32x8:512"


def _run(model: str, cluster: str, batch: int, schedule: str, limit: float):
    problem = build_problem(model=model, cluster=cluster, global_batch_size=batch, schedule=schedule,
                            max_virtual_stages=2 if schedule == "auto" else 4)
    t0 = time.perf_counter()
    plan = search(problem, time_limit_s=limit)
    return plan, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--cases", default=CASES, help="model:cluster:batch,...")
    args = ap.parse_args()
    table = Table(title="1F1B only vs schedule=auto (same cost model)")
    for col in ("model", "cluster", "batch", "1f1b plan", "ms", "bubble ms", "search s", "auto plan", "ms",
                "bubble ms", "search s", "speed-up"):
        table.add_column(col, justify="right" if col in ("batch", "ms", "bubble ms", "search s", "speed-up") else "left")
    for case in args.cases.split(","):
        model, cluster, batch = case.split(":")
        rows = []
        for schedule in ("1f1b", "auto"):
            plan, wall = _run(model, cluster, int(batch), schedule, args.time_limit)
            status = "" if plan.solver.status == "optimal" else f" (gap {plan.solver.gap:.1%})"
            label = f"{plan.schedule} v={plan.virtual_stages} pp={plan.pp} c={plan.microbatches}"
            rows.append((plan, label, f"{wall:.1f}{status}"))
        (p1, l1, w1), (pa, la, wa) = rows
        table.add_row(model, cluster, batch, l1, f"{p1.estimate.tpi_s * 1e3:,.1f}", f"{bubble_s(p1) * 1e3:,.1f}", w1,
                      la, f"{pa.estimate.tpi_s * 1e3:,.1f}", f"{bubble_s(pa) * 1e3:,.1f}", wa,
                      f"{p1.estimate.tpi_s / pa.estimate.tpi_s:.3f}x")
    Console(width=240).print(table)


if __name__ == "__main__":
    main()
