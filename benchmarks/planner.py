"""Planner benchmarks: wall time of `uniap plan`, plan quality vs baselines, CBC vs HiGHS, before vs after.

    python benchmarks/planner.py [--repeats 3] [--quick] [--skip wall,quality,solvers]
    python benchmarks/planner.py --skip wall,quality,solvers --big 60         # every model on h100_32x8
    python benchmarks/planner.py --skip wall,quality,solvers --huge 300       # LLaMA-70B / 7B on h100_128x8
    python benchmarks/planner.py --skip wall,quality,solvers --giant 60 [--models llama_7b]  # 8,192 devices
    python benchmarks/planner.py --skip wall,quality,solvers --quality-json after.json [--time-limit 60]
        [--models bert_huge,llama_13b --clusters h100_128x8]                  # a subset, with wall and CPU s
    python benchmarks/planner.py --compare before.json after.json

Prints tables (medians of --repeats runs). Batch size: max(32, 2 x devices) unless stated. ``--quality-json``
records samples/s (or, where nothing fits, the least memory any plan needs) for every shipped model x cluster;
``--compare`` puts two such files side by side (e.g. the planner before and after a change, each file written
by its own checkout).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from uniap_lightning.planner.config import available
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.solver import solve
from uniap_lightning.planner.solver.baselines import BASELINES


#: issue 24's clusters (8,192 devices; three device types): --giant and benchmarks/heterogeneous.py measure them,
#: the all-pairs sections leave them out
SCALE = ("h100_1024x8", "h100_a100_3type_24x8")


def batch_for(cluster: str) -> int:
    from uniap_lightning.planner.config import cluster_from

    return max(32, 2 * cluster_from(cluster).num_devices)


def wall_time(model: str, cluster: str, batch: int, repeats: int, solver: str = "auto",
              time_limit: float | None = None) -> tuple[float, str]:
    times, status = [], ""
    extra = [f"time_limit={time_limit:g}"] if time_limit is not None else []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run(
            ["uniap", "plan", f"model={model}", f"cluster={cluster}", f"batch_size={batch}", f"solver={solver}",
             *extra],
            capture_output=True, text=True, check=False,
        )
        times.append(time.perf_counter() - t0)
        status = next((ln for ln in out.stdout.splitlines() if ln.startswith("solver:")), out.stderr.strip()[-80:])
    return statistics.median(times), status


def cpu_s() -> float:
    """CPU seconds of this process and its finished children (the solver's worker processes)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def quality_json(path: str, time_limit: float, models: list[str] | None = None,
                 clusters: list[str] | None = None) -> None:
    """samples/s, status and peak memory of the plan for every shipped model x cluster (or those named), or the
    least memory per device any plan needs where nothing fits; wall and CPU seconds; written to ``path`` as it
    goes."""
    import json
    import re

    from uniap_lightning.errors import InfeasibleError

    out: dict[str, dict] = {}
    for model in models or available("model"):
        for cluster in clusters or [c for c in available("cluster") if c not in SCALE]:
            prob = build_problem(model=model, cluster=cluster, global_batch_size=batch_for(cluster))
            t0, c0 = time.perf_counter(), cpu_s()
            try:
                plan = solve(prob, time_limit_s=time_limit)
                rec = {"samples_per_s": plan.estimate.samples_per_s, "status": plan.solver.status,
                       "gap": plan.solver.gap, "tpi_ms": plan.estimate.tpi_s * 1e3,
                       "plan": f"pp{plan.pp} c{plan.microbatches}", "peak_gib": max(plan.estimate.stage_memory_bytes) / 2**30,
                       "recomputed": sum(lp.strategy.recompute for lp in plan.layers),
                       "modes": sorted({lp.strategy.dp_mode for lp in plan.layers if lp.strategy.dp > 1})}
            except InfeasibleError as err:
                m = re.search(r"needs is ([0-9.]+) GiB", str(err))
                rec = {"infeasible": True, "least_gib": float(m.group(1)) if m else None}
            except UniAPError as err:
                rec = {"error": str(err)[:200]}
            rec["wall_s"] = time.perf_counter() - t0
            rec["cpu_s"] = cpu_s() - c0
            out[f"{model}@{cluster}"] = rec
            print(model, cluster, rec, flush=True)
            with open(path, "w") as f:
                json.dump(out, f, indent=1)


def compare(before_path: str, after_path: str, console: Console) -> None:
    import json

    before, after = (json.load(open(p)) for p in (before_path, after_path))
    table = Table(title="Plan quality before vs after (samples/s; where nothing fits: least memory per device)")
    for col in ("model", "cluster", "before", "after", "change", "after: recomputed layers, modes"):
        table.add_column(col)

    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        if r.get("infeasible"):
            return f"does not fit (needs >= {r['least_gib']:.1f} GiB)" if r.get("least_gib") else "does not fit"
        if "error" in r:
            return "error"
        return f"{r['samples_per_s']:,.1f}" + ("" if r["status"] == "optimal" else f" (gap {r['gap']:.1%})")

    for key in sorted(after):
        model, cluster = key.split("@")
        b, a = before.get(key), after[key]
        change = "-"
        if b and a and "samples_per_s" in a and "samples_per_s" in b:
            change = f"{a['samples_per_s'] / b['samples_per_s'] - 1:+.1%}"
        elif b and b.get("infeasible") and "samples_per_s" in (a or {}):
            change = f"now fits ({a['peak_gib']:.1f} GiB peak)"
        extra = f"{a.get('recomputed', 0)}, {'/'.join(a.get('modes', []))}" if "samples_per_s" in a else ""
        table.add_row(model, cluster, cell(b), cell(a), change, extra)
    console.print(table)


def scale(clusters: list[str], models: list[str], limit: float, console: Console,
          batch: int | None = None) -> None:
    """Whole `uniap plan` per model on the big clusters, one run each: wall and CPU seconds (the command and its
    solver workers), the solver's status and gap, and the plan's shape (read back from the plan file it wrote)."""
    import tempfile
    from pathlib import Path

    table = Table(title=f"`uniap plan` on the big clusters (time_limit={limit:g} s, one run each)")
    for col in ("model", "cluster", "devices", "batch", "wall s", "CPU s", "status", "gap", "plan"):
        table.add_column(col)
    for cluster in clusters:
        for model in models:
            b = batch or batch_for(cluster)
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "plan.json"
                c0, t0 = cpu_s(), time.perf_counter()
                proc = subprocess.run(["uniap", "plan", f"model={model}", f"cluster={cluster}", f"batch_size={b}",
                                       f"time_limit={limit:g}", f"out={out}"],
                                      capture_output=True, text=True, check=False)
                wall, cpu = time.perf_counter() - t0, cpu_s() - c0
                status, gap, shape = "error", "-", proc.stderr.strip()[-60:]
                if out.exists():
                    plan = Plan.from_json(out)
                    status, gap = plan.solver.status, f"{plan.solver.gap:.2%}"
                    labels = sorted({lp.strategy.label() for lp in plan.layers})
                    shape = (f"pp{plan.pp} c{plan.microbatches} {plan.schedule}"
                             + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
                             + f" {'/'.join(labels)}")
                elif "no plan fits" in proc.stderr or "InfeasibleError" in proc.stderr:
                    status, shape = "does not fit", "-"
            table.add_row(model, cluster, str(cluster_devices(cluster)), str(b), f"{wall:.1f}", f"{cpu:.1f}",
                          status, gap, shape)
            console.print(f"  {model} on {cluster}: {wall:.1f} s wall, {cpu:.1f} s CPU, {status} {gap} {shape}",
                          style="dim")
    console.print(table)


def cluster_devices(cluster: str) -> int:
    from uniap_lightning.planner.config import cluster_from

    return cluster_from(cluster).num_devices


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="skip the 1024-device run and the full quality matrix")
    ap.add_argument("--time-limit", type=float, default=30.0, help="solver time limit for the quality matrix")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: wall,quality,solvers")
    ap.add_argument("--big", type=float, default=None, help="every shipped model on h100_32x8 at this time limit")
    ap.add_argument("--huge", type=float, default=None, help="LLaMA-70B and LLaMA-7B on h100_128x8 at this limit")
    ap.add_argument("--giant", type=float, default=None,
                    help="every shipped model (or --models) on h100_1024x8, batch 16,384, at this time limit")
    ap.add_argument("--quality-json", default=None, help="write samples/s of every model x cluster to this file")
    ap.add_argument("--models", default=None, help="comma list: only these models in --quality-json")
    ap.add_argument("--clusters", default=None, help="comma list: only these clusters in --quality-json")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    console = Console(width=160)
    if args.compare:
        compare(*args.compare, console)
        return
    if args.quality_json:
        quality_json(args.quality_json, args.time_limit, args.models and args.models.split(","),
                     args.clusters and args.clusters.split(","))
    if args.big is not None:
        scale(["h100_32x8"], available("model"), args.big, console)
    if args.huge is not None:
        scale(["h100_128x8"], ["llama_70b", "llama_7b"], args.huge, console)
    if args.giant is not None:
        scale(["h100_1024x8"], args.models.split(",") if args.models else available("model"), args.giant, console)

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
        clusters = [c for c in available("cluster")
                    if c not in SCALE and not (args.quick and c == "h100_128x8")]
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

                desc = f"pp{plan.pp} c{plan.microbatches} " + "/".join(
                    sorted({lp.strategy.label() for lp in plan.layers}))
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
