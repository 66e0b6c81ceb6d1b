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
