"""The cost model's time formula of each schedule (``uniap_lightning.planner.cost.pipeline``, what the MILP
minimizes) against a discrete-event simulation of torch's own action list (``planner.cost.schedules.simulate``,
a hand-off ``o_j`` paid half forward, half backward), and the activations in flight it uses."""

from __future__ import annotations

import random

import pytest
from uniap_lightning.planner.cost.torch_orders import torch_pipeline_order as torch_actions

from uniap_lightning.planner.cost.pipeline import pipeline_shape, unusable
from uniap_lightning.planner.cost.schedules import in_flight, simulate
from uniap_lightning.planner.plan import group_of_stage

SCHEDULES = [("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zb_h1", 1), ("interleaved_zb", 2),
             ("zb_v", 2), ("dualpipe_v", 2)]


def formula(schedule, pp, v, m, f, b, w, o):
    shape, _ = pipeline_shape(schedule, pp, v, m)
    S = pp * v
    group = [group_of_stage(k, pp, v, schedule) for k in range(S)]
    p = [f[k] + b[k] + w[k] for k in range(S)]
    T = max([sum(p[k] for k in range(S) if group[k] == g) for g in range(pp)] + [shape.boundary_weight * x for x in o])
    return shape.a_p * sum(p) + shape.a_w * sum(w) + shape.a_o * sum(o) + shape.b_T * T + shape.b_W * max(w), group


def _shapes():
    for schedule, v in SCHEDULES:
        for pp in (2, 3, 4):
            for m in (pp, pp + 2, 2 * pp, 4 * pp):
                if unusable(schedule, pp, v, m) is None:
                    yield schedule, pp, v, m


@pytest.mark.parametrize("schedule, v", SCHEDULES)
def test_equal_stages_match_torchs_order(schedule, v):
    exact = schedule not in ("zb_v", "dualpipe_v")
    checked = 0
    for name, pp, vv, m in _shapes():
        if (name, vv) != (schedule, v):
            continue
        order = torch_actions(name, pp, vv, m)
        S = pp * vv
        for f, b, w in ((1, 1, 1), (1, 2, 1), (1, 1.2, 0.8), (1, 1.5, 0.5)):
            want, group = formula(name, pp, vv, m, [f] * S, [b] * S, [w] * S, [0.0] * (S - 1))
            got = simulate(order, [f] * S, [b] * S, [w] * S, [0.0] * (S - 1))[0]
            if exact or (f, b, w) == (1, 1, 1) and m >= 2 * pp:
                assert want == pytest.approx(got, rel=1e-12), (name, pp, m, (f, b, w))
            else:
                assert abs(want - got) <= 0.04 * got, (name, pp, m, (f, b, w), want, got)
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("schedule, v", SCHEDULES)
def test_unequal_stages_stay_within_the_documented_error(schedule, v):
    rng = random.Random(7)
    errors = []
    for name, pp, vv, m in _shapes():
        if (name, vv) != (schedule, v):
            continue
        order = torch_actions(name, pp, vv, m)
        S = pp * vv
        for _ in range(10):
            scale = [rng.uniform(0.7, 1.3) for _ in range(S)]
            f = scale
            b = [s * rng.uniform(1.0, 1.5) for s in scale]
            w = [s * rng.uniform(0.5, 1.0) for s in scale]
            o = [rng.uniform(0.0, 0.1) for _ in range(S - 1)]
            want, group = formula(name, pp, vv, m, f, b, w, o)
            got = simulate(order, f, b, w, o)[0]
            errors.append((want - got) / got)
    assert errors and -0.13 <= min(errors) and max(errors) <= 0.13, (min(errors), max(errors))


def test_in_flight_counts_are_the_schedules():
    # what the cost tables use (torch-free closed forms; tests/planner/test_schedules.py holds them to torch's
    # orders): interleaved holds more on the first stages (Megatron's warm-up), never more than m
    assert pipeline_shape("interleaved_1f1b", 4, 2, 8)[1] == in_flight("interleaved_1f1b", 4, 2, 8) == [8, 8, 7, 5, 4, 4, 3, 1]
    assert pipeline_shape("zb_v", 4, 2, 8)[1] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert pipeline_shape("zb_h1", 4, 1, 8)[1] == [4, 4, 4, 4]


def test_shapes_torch_cannot_run_are_refused_with_the_reason():
    assert "rounds" in unusable("interleaved_1f1b", 4, 2, 9) and unusable("interleaved_1f1b", 4, 2, 10) is None
    assert "m >= 2p" in unusable("dualpipe_v", 4, 2, 6)
    assert "no steady state" in unusable("zb_v", 4, 2, 2) and "priced from" in unusable("zb_v", 4, 2, 6)
    assert unusable("1f1b", 4, 1, 2) is None  # runs as GPipe
