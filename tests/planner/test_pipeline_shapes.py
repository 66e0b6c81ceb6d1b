"""Each schedule's time formula against a discrete-event simulation of torch's own action list, and the
activations in flight against the counts read off that list (``uniap_lightning.planner.cost.pipeline``)."""

from __future__ import annotations

import random

import pytest

from uniap_lightning.planner.cost.pipeline import in_flight_from_torch, pipeline_shape, torch_actions, unusable
from uniap_lightning.planner.plan import group_of_stage

SCHEDULES = [("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zb_h1", 1), ("interleaved_zb", 2),
             ("zb_v", 2), ("dualpipe_v", 2)]


def simulate(order, f, b, w, o, group):
    """Makespan of the action lists: each group runs its actions in order; a forward waits for the previous
    stage's forward (plus the hand-off across groups), a backward (full B or input half I) for the next stage's
    (the last stage's for its own forward), a weight half W for its input half."""
    S = len(f)
    done: dict = {}
    pos = {r: 0 for r in order}
    clock = {r: 0.0 for r in order}

    def hand(k1, k2, j):
        return o[j] if group[k1] != group[k2] else 0.0

    def ready(kind, mb, k):
        if kind == "F":
            if k == 0:
                return 0.0
            t = done.get(("F", mb, k - 1))
            return None if t is None else t + hand(k - 1, k, k - 1)
        if kind in ("B", "I"):
            own = done.get(("F", mb, k))
            if k == S - 1 or own is None:
                return own
            t = done.get(("BI", mb, k + 1))
            return None if t is None else max(t + hand(k, k + 1, k), own)
        return done.get(("BI", mb, k))  # W

    moved = True
    while moved:
        moved = False
        for r, actions in order.items():
            while pos[r] < len(actions):
                kind, mb, k = actions[pos[r]]
                t = ready(kind, mb, k)
                if t is None:
                    break
                clock[r] = max(clock[r], t) + {"F": f[k], "I": b[k], "W": w[k], "B": b[k] + w[k]}[kind]
                done[("BI", mb, k) if kind in ("B", "I") else (kind, mb, k)] = clock[r]
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(a) for r, a in order.items()), "the action lists deadlock"
    return max(clock.values())


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
            got = simulate(order, [f] * S, [b] * S, [w] * S, [0.0] * (S - 1), group)
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
            got = simulate(order, f, b, w, o, group)
            errors.append((want - got) / got)
    assert errors and -0.13 <= min(errors) and max(errors) <= 0.13, (min(errors), max(errors))


def test_in_flight_counts_follow_torchs_order():
    # interleaved: the first stages hold more than 1F1B would (Megatron's warm-up), never more than m
    il = in_flight_from_torch("interleaved_1f1b", 4, 2, 8)
    assert il == (8, 8, 7, 5, 4, 4, 3, 1)
    assert in_flight_from_torch("zb_v", 4, 2, 8) == (8, 7, 6, 5, 4, 3, 2, 1)
    assert in_flight_from_torch("zb_h1", 4, 1, 8) == (4, 4, 4, 4)
    assert all(1 <= x <= 16 for x in in_flight_from_torch("interleaved_zb", 4, 2, 16))


def test_shapes_torch_cannot_run_are_refused_with_the_reason():
    assert "rounds" in unusable("interleaved_1f1b", 4, 2, 9) and unusable("interleaved_1f1b", 4, 2, 10) is None
    assert "2 pp = 8" in unusable("dualpipe_v", 4, 2, 6)
    assert "no steady state" in unusable("zb_v", 4, 2, 2) and "priced from" in unusable("zb_v", 4, 2, 6)
    assert unusable("1f1b", 4, 1, 2) is None  # runs as GPipe
