"""The shipped clusters priced two ways: the catalogue roofline they use now, and the flat `peak x efficiency`
model with the figures they carried before they named catalogue devices (issue 39).

    python benchmarks/flat_vs_roofline.py [--time-limit 60] [--pairs llama_7b:h100_4x8:64,...]

`flat`: the cluster file as of commit FLAT_COMMIT (its own peak_tflops, efficiency, memory and reserve; a mixed
pool's own speeds), read with ``git show`` and labelled ``compute_model: flat``. `roofline`: the shipped file.
Prints, per model x cluster x batch, each plan (pp, micro-batches, schedule, the layers' strategies) and its
predicted ms per iteration. Needs a git checkout with that commit.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections import Counter
from pathlib import Path

import yaml

from uniap_lightning.planner.config import load_group
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.solver import solve

#: the last commit whose cluster files carry their own peak, efficiency and memory (free-text device labels)
FLAT_COMMIT = "abc1a20"
PAIRS = ("llama_7b:h100_4x8:64", "gpt2_small:a100_1x8:32", "bert_huge:titanxp_2x4:32", "llama_7b:a100_v100_4x8:64",
         "mixtral_8x7b:h100_4x8:64", "llama_70b:h100_32x8:512")


def flat_cluster(name: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{FLAT_COMMIT}:conf/cluster/{name}.yaml"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    return {**yaml.safe_load(text), "compute_model": "flat"}


def summary(plan: Plan) -> str:
    """pp, micro-batches x size, schedule (v), and the layers' strategy labels by count."""
    counts = Counter(lp.strategy.label() for lp in plan.layers)
    labels = ", ".join(f"{label or 'dp1'} x{n}" for label, n in counts.most_common(3))
    more = f", +{len(counts) - 3} more" if len(counts) > 3 else ""
    v = f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return f"pp={plan.pp}, {plan.microbatches} x {plan.micro_batch_size}, {plan.schedule}{v}; {labels}{more}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--pairs", default=",".join(PAIRS), help="model:cluster:batch,...")
    args = ap.parse_args()
    print("| model | cluster | batch | model kind | plan | ms / iteration | solve |")
    print("|---|---|---:|---|---|---:|---|")
    for pair in args.pairs.split(","):
        model, cluster, batch = pair.split(":")
        for kind, cl in (("flat", flat_cluster(cluster)), ("roofline", load_group("cluster", cluster))):
            t0 = time.perf_counter()
            problem = build_problem(model=model, cluster=cl, global_batch_size=int(batch))
            plan = solve(problem, time_limit_s=args.time_limit, baselines=False)
            wall = time.perf_counter() - t0
            status = plan.solver.status if plan.solver else "?"
            print(f"| {model} | {cluster} | {batch} | {kind} | {summary(plan)} | {plan.estimate.tpi_s * 1e3:,.2f} | "
                  f"{status}, {wall:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
