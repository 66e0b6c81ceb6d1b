"""Planning for a heterogeneous pool: the plan, the same planner told every device is the reference device (its
plan scored on the real pool), and the baselines.

    python benchmarks/heterogeneous.py                                   # a100_v100_4x8 (issue 14)
    python benchmarks/heterogeneous.py --cluster h100_a100_3type_24x8 --time-limit 60 \\
        [--models llama_7b,gpt2_xl] [--batch 384]                        # three device types (issue 24)

Prints a markdown table: per model the plan's layers per stage with each stage's device type, its time per
iteration, the solver's status, wall and CPU seconds of the whole solve (baselines included), the "told all equal"
plan scored on the real pool, and the baselines on the real pool.
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import replace

from uniap_lightning.errors import InfeasibleError
from uniap_lightning.planner.config import available, cluster_from
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.solver import solve

DEFAULT = {"a100_v100_4x8": [("gpt2_xl", 64), ("llama_7b", 64), ("llama_13b", 64), ("bert_huge", 128)]}


def cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def short(device: str) -> str:
    """H100-SXM5-80GB -> H100-80; A100-SXM4-40GB -> A100-40; a catalogue name (``a100_40gb``) stays; a mixed stage:
    H100-80+A100-80+A100-40."""
    if "+" in device:
        return "+".join(short(d) for d in device.split("+"))
    parts = device.split("-")
    mem = next((p[:-2] for p in parts if p.endswith("GB")), "")
    return parts[0] + (f"-{mem}" if mem else "")


def per_type(plan) -> str:
    """Layers and stages per device type, in rank order: ``H100-80 18 layers / 8 stages, A100-80 8 / 8, ...``."""
    out: dict[str, list[int]] = {}
    for i in range(plan.num_stages):
        kind = short(plan.estimate.stage_device[plan.group_of_stage(i)])
        acc = out.setdefault(kind, [0, 0])
        acc[0] += len(plan.layers_of_stage(i))
        acc[1] += 1
    return ", ".join(f"{k} {n} layers / {s} stages" for k, (n, s) in out.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default="a100_v100_4x8")
    ap.add_argument("--models", default=None, help="comma list (default: the issue-14 set on a100_v100_4x8, else "
                                                   "every shipped model)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: 2 x devices, at least 64)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    devices = cluster_from(args.cluster).num_devices
    batch = args.batch or max(64, 2 * devices)
    if args.models:
        cases = [(m, batch) for m in args.models.split(",")]
    else:
        cases = DEFAULT.get(args.cluster) or [(m, batch) for m in available("model")]
    print(f"cluster {args.cluster} ({devices} devices), time_limit {args.time_limit:g} s")
    print("| model | batch | plan (layers and stages per device type) | plan ms/iter | status (gap) | wall s | CPU s "
          "| told all equal: its plan on the real pool | baselines on the real pool (ms; - = does not fit) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, b in cases:
        pr = build_problem(model=model, cluster=args.cluster, global_batch_size=b)
        t0, c0 = time.perf_counter(), cpu_s()
        try:
            plan = solve(pr, time_limit_s=args.time_limit)
        except InfeasibleError:
            print(f"| {model} | {b} | does not fit | - | - | {time.perf_counter() - t0:.1f} | {cpu_s() - c0:.1f} | - | - |")
            continue
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        eq = replace(pr, cluster=replace(pr.cluster, rank_speed=None, rank_memory_gib=None, rank_device=None))
        try:
            naive = solve(eq, time_limit_s=args.time_limit)
            ne = evaluate(pr, naive)
            nt = f"{ne.tpi_s * 1e3:,.0f} ms" + ("" if ne.feasible else " (does not fit)")
        except InfeasibleError:
            nt = "nothing fits"
        bl = ", ".join(f"{k} {v * 1e3:,.0f}" if v is not None else f"{k} -" for k, v in plan.baselines.items())
        split = per_type(plan)
        s = plan.solver
        status = s.status + ("" if s.status == "optimal" else f" ({s.gap:.1%})")
        print(f"| {model} | {b} | pp={plan.pp} {plan.schedule}"
              + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
              + f": {split} | {plan.estimate.tpi_s * 1e3:,.0f} | {status} | {wall:.1f} | {cpu:.1f} | {nt} | {bl} |",
              flush=True)


if __name__ == "__main__":
    main()
