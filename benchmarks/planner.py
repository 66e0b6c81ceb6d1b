"""Planner benchmarks: wall time of `uniap plan`, plan quality vs baselines, CBC vs HiGHS.

    python benchmarks/planner.py [--repeats 3] [--quick] [--markdown BENCHMARKS_planner.md]

Prints tables (medians of --repeats runs). Batch size: max(32, 2 x devices) unless stated.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from uniap_lightning.planner.config import available, build_problem
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.solver import solve
from uniap_lightning.planner.solver.baselines import BASELINES


def batch_for(cluster: str) -> int:
    from uniap_lightning.planner.config import cluster_from

    return max(32, 2 * cluster_from(cluster).num_devices)


def wall_time(model: str, cluster: str, batch: int, repeats: int, solver: str = "auto") -> tuple[float, str]:
    times, status = [], ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run(
            ["uniap", "plan", f"model={model}", f"cluster={cluster}", f"batch_size={batch}", f"solver={solver}",
             ],
            capture_output=True, text=True, check=False,
        )
        times.append(time.perf_counter() - t0)
        status = next((ln for ln in out.stdout.splitlines() if ln.startswith("solver:")), out.stderr.strip()[-80:])
    return statistics.median(times), status


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="skip the 1024-device run and the full quality matrix")
    ap.add_argument("--time-limit", type=float, default=30.0, help="solver time limit for the quality matrix")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: wall,quality,solvers")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    console = Console(width=160)

    if "wall" not in skip:
        cases = [("llama_7b", "a100_1x8"), ("bert_huge", "titanxp_2x4"), ("llama_13b", "h100_4x8"),
                 ("llama_70b", "h100_32x8")]
        if not args.quick:
            cases.append(("llama_70b", "h100_128x8"))
        table = Table(title=f"`uniap plan` wall time (whole command, all (pp, c) candidates and baselines; median of {args.repeats})")
        for col in ("model", "layers", "cluster", "devices", "batch", "wall s", "solver line"):
            table.add_column(col)
        for model, cluster in cases:
            b = batch_for(cluster)
            prob = build_problem(model=model, cluster=cluster, global_batch_size=b)
            wall, status = wall_time(model, cluster, b, args.repeats)
            table.add_row(model, str(prob.model.num_layers), cluster, str(prob.num_devices), str(b), f"{wall:.2f}", status)
            console.print(f"  {model} on {cluster}: {wall:.2f} s", style="dim")
        console.print(table)

    if "quality" not in skip:
        table = Table(title="Plan quality: samples/s of the plan and its speed-up over each baseline (same cost model)")
        for col in ("model", "cluster", "batch", "plan", "samples/s", *BASELINES, "solve s", "status"):
            table.add_column(col)
        clusters = [c for c in available("cluster") if not (args.quick and c == "h100_128x8")]
        for model in [m for m in available("model")]:
            for cluster in clusters:
                b = batch_for(cluster)
                prob = build_problem(model=model, cluster=cluster, global_batch_size=b)
                try:
                    plan = solve(prob, time_limit_s=args.time_limit)
                except UniAPError as err:
                    table.add_row(model, cluster, str(b), "does not fit", "-", *["-"] * len(BASELINES), "-",
                                  str(err).split(":")[0])
                    continue
                ratios = [
                    "OOM" if plan.baselines.get(k) is None else f"{plan.baselines[k] / plan.estimate.tpi_s:.2f}x"
                    for k in BASELINES
                ]
                tps = sorted({(lp.dp, lp.tp, lp.shard) for lp in plan.layers})
                desc = f"pp{plan.pp} c{plan.microbatches} " + "/".join(
                    f"{'f' if s else 'd'}{d}t{t}" for d, t, s in tps)
                table.add_row(model, cluster, str(b), desc, f"{plan.estimate.samples_per_s:,.1f}", *ratios,
                              f"{plan.solver.solve_s:.2f}", plan.solver.status)
        console.print(table)

    if "solvers" not in skip:
        table = Table(title="Solver time, CBC vs HiGHS (planner search only, no baselines; same optimum required)")
        for col in ("model", "cluster", "CBC s", "HiGHS s", "CBC status", "HiGHS status", "same TPI"):
            table.add_column(col)
        for model, cluster in [("gpt2_small", "a100_1x8"), ("llama_7b", "a100_1x8"), ("bert_huge", "titanxp_2x4"),
                               ("t5_large", "a100_2x8"), ("llama_13b", "h100_4x8"), ("llama_70b", "h100_32x8")]:
            prob = build_problem(model=model, cluster=cluster, global_batch_size=batch_for(cluster))
            res = {}
            for s in ("cbc", "highs"):
                t0 = time.perf_counter()
                plan = solve(prob, solver=s, baselines=False, time_limit_s=120)
                res[s] = (time.perf_counter() - t0, plan.solver.status, plan.estimate.tpi_s)
            same = abs(res["cbc"][2] - res["highs"][2]) <= 1e-6 * res["highs"][2]
            table.add_row(model, cluster, f"{res['cbc'][0]:.2f}", f"{res['highs'][0]:.2f}", res["cbc"][1],
                          res["highs"][1], "yes" if same else f"no ({res['cbc'][2]:.4f} vs {res['highs'][2]:.4f})")
        console.print(table)


if __name__ == "__main__":
    sys.exit(main())
