"""Pictures: the PNG is written, and the pipeline timeline respects dependencies and shows the bubble."""

from __future__ import annotations

import pytest

from uniap_lightning.planner.config import build_problem
from uniap_lightning.planner.solver import solve
from uniap_lightning.planner.viz import draw_plan, pipeline_timeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_timeline_and_picture(tmp_path, schedule):
    problem = build_problem(model="bert_huge", cluster="titanxp_2x4", global_batch_size=32, schedule=schedule)
    plan = solve(problem, pp=[4])
    blocks = pipeline_timeline(plan)
    assert len(blocks) == 2 * plan.pp * plan.microbatches
    end = {(i, k, m): s + d for i, s, d, k, m in blocks}
    start = {(i, k, m): s for i, s, d, k, m in blocks}
    for (i, k, m), s in start.items():
        if k == "F" and i > 0:
            assert s >= end[(i - 1, "F", m)] - 1e-12
        if k == "B" and i < plan.pp - 1:
            assert s >= end[(i + 1, "B", m)] - 1e-12
    makespan = max(end.values())
    busy = sum(d for i, s, d, k, m in blocks if i == 0)
    assert makespan > busy  # stage 0 idles: the bubble
    path = draw_plan(plan, problem, tmp_path / "plan.png")
    assert path.stat().st_size > 20_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_picture_of_a_plan_that_recomputes_and_compresses(tmp_path):
    """Activations large, memory tight: the plan recomputes (hatched in the picture) and mixes ZeRO modes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from planner_factories import forced_problem

    problem = forced_problem(0, memory_gib=1.0, activation_scale=5, param_scale=0.05)
    plan = solve(problem, time_limit_s=60, compression="bf16")
    assert any(lp.strategy.recompute for lp in plan.layers)
    path = draw_plan(plan, problem, tmp_path / "plan.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
