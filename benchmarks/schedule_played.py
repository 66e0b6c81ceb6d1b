"""Does the cost formula of a chosen multi-chunk plan match its schedule played out? The plan ``schedule=auto``
chooses, its predicted time per iteration against the same plan played through torch's own action order with the
cost model's per-stage times (``planner.viz.pipeline_timeline``: forward a third of a stage's time, the weight
gradient apart where the schedule splits the backward, hand-offs between stages; plus the end-of-step sync).

    python benchmarks/schedule_played.py [--time-limit 60] [--cases bert_huge:titanxp_2x4:32,llama_7b:h100_4x8:64]

Each case is solved twice in one run: as the planner does now (every chunk of a device group priced as long as
the group's longest, ``T >= v p_k``) and with that row removed (``--without`` only: the forms before the fix), so
the two columns are paired. A played/predicted ratio above 1 is a plan slower than promised.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

from rich.console import Console
from rich.table import Table

from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.cost import pipeline as pipeline_module
from uniap_lightning.planner.cost import tables as tables_module
from uniap_lightning.planner.solver import solve
from uniap_lightning.planner.viz import pipeline_timeline

CASES = ("bert_huge:titanxp_2x4:32,gpt2_xl:titanxp_2x4:32,llama_7b:h100_4x8:64,gpt2_xl:h100_4x8:64,"
         "bert_huge:h100_4x8:128,llama_13b:h100_4x8:64")


def _without_chunk_row():
    """``pipeline_shape`` as before the fix: no ``T >= v p_k`` row (stage_weight 0)."""
    real = pipeline_module.pipeline_shape

    def shape(schedule, pp, v, m):
        s, flight = real(schedule, pp, v, m)
        return s._replace(stage_weight=0.0), flight

    return mock.patch.object(tables_module, "pipeline_shape", shape)


def _case(model: str, cluster: str, batch: int, limit: float):
    problem = build_problem(model=model, cluster=cluster, global_batch_size=batch)
    t0 = time.perf_counter()
    plan = solve(problem, time_limit_s=limit)
    wall = time.perf_counter() - t0
    blocks = pipeline_timeline(plan, problem)
    played = max(s + d for _, s, d, *_ in blocks) + max(plan.estimate.stage_sync_s)
    return plan, played, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--without", action="store_true", help="also solve without the T >= v p_k row (paired)")
    args = ap.parse_args()
    table = Table(title="Chosen plan: predicted vs played through torch's order (schedule=auto)")
    for col in ("case", "variant", "schedule", "pp x v, m", "predicted ms", "played ms", "played / predicted",
                "solve s", "status"):
        table.add_column(col, justify="right" if col not in ("case", "variant", "schedule", "status") else "left")
    for case in args.cases.split(","):
        model, cluster, batch = case.split(":")
        variants = [("now (T >= v p_k)", None)] + ([("without the row", _without_chunk_row)] if args.without else [])
        for name, patch in variants:
            if patch is None:
                plan, played, wall = _case(model, cluster, int(batch), args.time_limit)
            else:
                with patch():
                    plan, played, wall = _case(model, cluster, int(batch), args.time_limit)
            est = plan.estimate.tpi_s
            table.add_row(f"{model} {cluster} B={batch}", name, plan.schedule,
                          f"{plan.pp} x {plan.virtual_stages}, {plan.microbatches}", f"{est * 1e3:,.1f}",
                          f"{played * 1e3:,.1f}", f"{played / est:.3f}", f"{wall:.1f}",
                          f"{plan.solver.status}" + (f" ({plan.solver.gap:.1%})" if plan.solver.gap else ""))
            print(case, name, plan.schedule, plan.pp, plan.virtual_stages, round(est * 1e3, 1),
                  round(played * 1e3, 1), round(wall, 1), flush=True)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
