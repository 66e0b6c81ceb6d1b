"""Plan format 3: schedules, virtual stages and the layout every module asks the plan for."""

from __future__ import annotations

import json

import pytest

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan import PLAN_FORMAT_VERSION, SCHEDULE_LAYOUTS, SCHEDULES, Plan, check_schedule

NAMES = [f"l{u}" for u in range(8)]


def _plan(schedule: str, v: int, pp: int = 2, world: int = 4, stage_of=None) -> Plan:
    S = pp * v
    stage_of = stage_of or [u * S // len(NAMES) for u in range(len(NAMES))]
    return Plan.from_assignment(stage_of_layer=stage_of, strategies=[Strategy(world // pp, 1)] * len(NAMES),
                                layer_names=NAMES, pp=pp, microbatches=4, schedule=schedule, global_batch_size=16,
                                num_devices=world, virtual_stages=v)


def test_loop_placement_interleaves_stages_over_device_groups():
    plan = _plan("interleaved_1f1b", 2)
    assert plan.num_stages == 4
    assert [plan.group_of_stage(k) for k in range(4)] == [0, 1, 0, 1]
    assert plan.stages_of_group(0) == [0, 2] and plan.stages_of_rank(3) == [1, 3]
    assert [list(st.ranks) for st in plan.stages] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert plan.layers_of_rank(0) == [0, 1, 4, 5] and plan.layers_of_rank(2) == [2, 3, 6, 7]
    assert list(plan.ranks_of_stage(2)) == [0, 1] and plan.group_of_rank(2) == 1


def test_v_placement_puts_the_first_and_last_stage_on_group_zero():
    plan = _plan("zb_v", 2)
    assert [plan.group_of_stage(k) for k in range(4)] == [0, 1, 1, 0]
    assert plan.stages_of_rank(0) == [0, 3] and plan.layers_of_rank(0) == [0, 1, 6, 7]
    assert [list(st.ranks) for st in plan.stages] == [[0, 1], [2, 3], [2, 3], [0, 1]]


def test_format_3_round_trips_and_versions_1_and_2_still_load():
    plan = _plan("interleaved_zb", 2)
    doc = json.loads(plan.to_json())
    assert doc["format_version"] == PLAN_FORMAT_VERSION and doc["virtual_stages"] == 2 and doc["schedule"] == "interleaved_zb"
    again = Plan.from_dict(doc)
    assert again == plan and again.stages_of_group(1) == [1, 3]
    old = json.loads(_plan("1f1b", 1).to_json())
    for version in (1, 2):
        d = dict(old, format_version=version)
        d.pop("virtual_stages")
        if version == 1:
            d["layers"] = [{k: x[k] for k in ("name", "stage", "dp", "tp", "shard")} for x in d["layers"]]
        loaded = Plan.from_dict(d)
        assert loaded.virtual_stages == 1 and loaded.format_version == PLAN_FORMAT_VERSION and loaded.num_stages == 2


@pytest.mark.parametrize("schedule, v, message", [
    ("zb_v", 3, r"schedule='zb_v' runs with virtual_stages 2, got 3"),
    ("interleaved_1f1b", 1, r"schedule='interleaved_1f1b' runs with virtual_stages >=2, got 1"),
    ("1f1b", 2, r"schedule='1f1b' runs with virtual_stages 1, got 2"),
    ("looped", 1, r"schedule='looped' must be one of"),
])
def test_a_schedule_with_the_wrong_virtual_stages_is_one_clear_error(schedule, v, message):
    doc = json.loads(_plan("interleaved_1f1b", 2).to_json())
    doc.update(schedule=schedule, virtual_stages=v)
    with pytest.raises(UniAPError, match=message):
        Plan.from_dict(doc)


def test_stages_must_sit_on_the_schedules_device_groups():
    doc = json.loads(_plan("interleaved_1f1b", 2).to_json())
    doc["stages"][2]["ranks"] = [2, 3]  # stage 2 belongs to group 0 under the loop placement
    with pytest.raises(UniAPError, match=r"plan stage 2 ranks must be 0..1 \(device group 0\)"):
        Plan.from_dict(doc)
    doc = json.loads(_plan("interleaved_1f1b", 2).to_json())
    doc["stages"] = doc["stages"][:2]
    with pytest.raises(UniAPError, match=r"plan has 2 stages but pp=2 x virtual_stages=2 = 4"):
        Plan.from_dict(doc)


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if SCHEDULE_LAYOUTS[s][1] != "1"])
def test_a_pinned_schedule_plans_with_its_own_virtual_stages(schedule):
    """``uniap plan schedule=interleaved_1f1b`` (or any pinned schedule with virtual stages) plans with that
    schedule; the baselines, built with one stage per group, fall back to 1F1B instead of refusing v=1."""
    from uniap_lightning.profiling.pricing import build_problem
    from uniap_lightning.planner.solver import solve

    problem = build_problem(model="bert_huge", cluster="titanxp_2x4", global_batch_size=32, schedule=schedule)
    plan = solve(problem, pp=[2])
    assert plan.schedule == schedule and plan.pp == 2
    check_schedule(plan.schedule, plan.virtual_stages)
    assert len(plan.stages) == plan.pp * plan.virtual_stages > plan.pp
    assert plan.baselines and any(v is not None for v in plan.baselines.values())
