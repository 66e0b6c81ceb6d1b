"""Pictures: the PNG is written for every kind of plan (virtual stages, zero-bubble, context parallelism), the
timeline plays the schedule's own order with the cost model's stage times and respects its dependencies, and the
key spells out the abbreviations a plan's labels use."""

from __future__ import annotations

import pytest
from planner_factories import forced_problem

from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.solver import solve
from uniap_lightning.planner.viz import draw_plan, label_key, pipeline_timeline


def _check_timeline(plan, problem, kinds_per_action: int):
    blocks = pipeline_timeline(plan, problem)
    assert len(blocks) == kinds_per_action * plan.num_stages * plan.microbatches
    end = {(k, kind, m): s + d for g, s, d, kind, m, k in blocks}
    start = {(k, kind, m): s for g, s, d, kind, m, k in blocks}
    for (k, kind, m), s in start.items():
        if kind == "F" and k > 0:
            assert s >= end[(k - 1, "F", m)] - 1e-12
        if kind in ("B", "I") and k < plan.num_stages - 1:
            assert s >= min(end.get((k + 1, "B", m), float("inf")), end.get((k + 1, "I", m), float("inf"))) - 1e-12
        if kind == "W":
            assert s >= end[(k, "I", m)] - 1e-12
    for g in range(plan.pp):  # a device group runs one action at a time, on its own stages only
        mine = sorted((s, s + d) for gg, s, d, kind, m, k in blocks if gg == g)
        assert all(plan.group_of_stage(k) == g for gg, s, d, kind, m, k in blocks if gg == g)
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(mine, mine[1:]))
    return blocks


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_timeline_and_picture(tmp_path, schedule):
    problem = build_problem(model="bert_huge", cluster="titanxp_2x4", global_batch_size=32, schedule=schedule)
    plan = solve(problem, pp=[4])
    blocks = _check_timeline(plan, problem, 2)
    makespan = max(s + d for g, s, d, *_ in blocks)
    busy = sum(d for g, s, d, *_ in blocks if g == 0)
    assert makespan > busy  # stage 0 idles: the bubble
    path = draw_plan(plan, problem, tmp_path / "plan.png")
    assert path.stat().st_size > 20_000 and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("schedule, kinds", [("interleaved_1f1b", 2), ("zb_v", 3)])
def test_picture_of_a_plan_with_virtual_stages(tmp_path, schedule, kinds):
    """Several stages per device group (the picture drew one row per stage and failed on these): rows are device
    groups, the timeline plays torch's own order (zero-bubble: I and W apart), and its makespan is what the cost
    formula prices, within the forms' measured gaps."""
    problem = build_problem(model="bert_huge", cluster="titanxp_2x4", global_batch_size=32, schedule=schedule)
    plan = solve(problem, pp=[2])
    assert plan.virtual_stages > 1
    blocks = _check_timeline(plan, problem, kinds)
    played = max(s + d for g, s, d, *_ in blocks) + max(plan.estimate.stage_sync_s)
    assert 0.9 * played <= plan.estimate.tpi_s <= 1.1 * played
    assert draw_plan(plan, problem, tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_picture_of_a_plan_that_recomputes_and_compresses(tmp_path):
    """Activations large, memory tight: the plan recomputes (hatched in the picture) and mixes ZeRO modes."""
    problem = forced_problem(0, memory_gib=1.0, activation_scale=5, param_scale=0.05)
    plan = solve(problem, time_limit_s=60, compression="bf16")
    assert any(lp.strategy.recompute for lp in plan.layers)
    path = draw_plan(plan, problem, tmp_path / "plan.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_picture_of_a_plan_that_splits_the_sequence(tmp_path):
    """One sample on 4 devices: the plan splits the sequence (cp); the picture draws it and its key says so."""
    from test_sequence_planning import _sequence_problem

    problem = _sequence_problem(0, 3, 4, 40.0, ring=False, batch=1)
    plan = solve(problem, solver="cbc", time_limit_s=60)
    labels = {lp.strategy.label() for lp in plan.layers}
    assert any(lp.strategy.cp > 1 for lp in plan.layers)
    assert any(line.startswith("cpNu / cpNr") for line in label_key(labels))
    assert draw_plan(plan, problem, tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_the_key_lists_what_the_labels_use_and_nothing_else():
    from uniap_lightning.planner.decision import Strategy

    labels = [Strategy(dp=2, tp=2, cp=2, cp_method="ulysses", sp=True).label(),
              Strategy(dp=8, tp=1, ep=4, compression="bf16").label(), Strategy(dp=8, tp=1, dp_mode="zero3").label()]
    assert labels == ["dp2xcp2uxtp2+sp", "dp8+ep4+bf16", "fsdp8"]
    key = label_key(labels)
    heads = [line.split(":")[0] for line in key]
    assert heads == ["dpN", "fsdpN", "cpNu / cpNr", "tpN", "+sp", "+epN", "+bf16 / +powersgd / +topk"]
    assert label_key(["single"]) == []
