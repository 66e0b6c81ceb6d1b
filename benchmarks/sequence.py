"""Where sequence and context parallelism take over, by the planner's own cost model: one model and cluster at
sequence lengths from 2k to 128k tokens, planned with the sequence dimension (``sp`` and ``cp`` per layer) and
without it (the same analytic profile with its sequence fields removed: dp x tp, pipelines, ZeRO and recomputation
only).

    python benchmarks/sequence.py [--model llama_7b] [--cluster h100_4x8] [--tokens 262144] [--time-limit 60]

The global batch holds ``--tokens`` tokens (at least one sequence), so every row trains on the same number of
tokens per step. Each row: the predicted step time and per-device memory of both plans, what the sequence-aware
plan chose on its blocks (cp degree and method, sp, recomputed share), and each search's wall time and status.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.config import load_group
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.solver.search import search

LENGTHS = (2048, 8192, 32768, 65536, 131072)


def _without_sequence(problem):
    layers = [replace(lp, sequence_length=None, sequence_parallel=False) for lp in problem.model.layers]
    return replace(problem, model=replace(problem.model, layers=layers))


def _solve(problem, limit):
    t0 = time.perf_counter()
    try:
        plan = search(problem, time_limit_s=limit)
    except UniAPError as err:
        return None, time.perf_counter() - t0, str(err).split(":")[0]
    return plan, time.perf_counter() - t0, None


def _blocks(plan) -> str:
    """The most common strategy of the blocks, and the recomputed share."""
    blocks = [lp.strategy for lp in plan.layers if lp.name.startswith("block")]
    common = Counter(s._replace(recompute=False) for s in blocks).most_common(1)[0][0]
    rc = sum(s.recompute for s in blocks) / max(len(blocks), 1)
    return f"{common.label()} (rc {rc:.0%})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama_7b")
    ap.add_argument("--cluster", default="h100_4x8")
    ap.add_argument("--tokens", type=int, default=262144, help="tokens per global batch")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = ap.parse_args()
    table = Table(title=f"{args.model} on {args.cluster}: without the sequence dimension, with Ulysses only, with "
                        f"Ulysses or ring ({args.tokens:,} tokens per step; same cost model)")
    for col in ("seq len", "batch", "plan space", "plan", "blocks", "ms / step", "GiB / device", "search s",
                "speed-up"):
        table.add_column(col, justify="left" if col in ("plan space", "plan", "blocks") else "right")
    for length in map(int, args.lengths.split(",")):
        spec = {**load_group("model", args.model), "seq_len": length}
        batch = max(args.tokens // length, 1)
        problem = build_problem(model=spec, cluster=args.cluster, global_batch_size=batch)
        variants = (("dp x tp, pp, ZeRO, rc", _without_sequence(problem)),
                    ("+ sp, cp (Ulysses)", replace(problem, cluster=replace(problem.cluster, ring_attention=False))),
                    ("+ sp, cp (Ulysses or ring)", replace(problem, cluster=replace(problem.cluster,
                                                                                    ring_attention=True))))
        base = None
        for name, prob in variants:
            plan, wall, why = _solve(prob, args.time_limit)
            if plan is None:
                table.add_row(f"{length:,}", str(batch), name, "does not fit" if "fit" in (why or "") else why,
                              "-", "-", "-", f"{wall:.1f}", "-")
                continue
            est = plan.estimate
            base = base or est.tpi_s
            status = "" if plan.solver.status == "optimal" else f" (gap {plan.solver.gap:.1%})"
            table.add_row(f"{length:,}", str(batch), name, f"pp={plan.pp} c={plan.microbatches} {plan.schedule}",
                          _blocks(plan), f"{est.tpi_s * 1e3:,.0f}", f"{max(est.stage_memory_bytes) / 2**30:.1f}",
                          f"{wall:.1f}{status}", f"{base / est.tpi_s:.2f}x")
        table.add_section()
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
