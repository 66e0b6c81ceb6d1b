"""Schedule math (planner/cost/schedules.py) against torch 2.13's own action lists, and the planner's time formula
(planner/cost/pipeline.py, through ``CandidateCosts.tpi_s``) against those lists played out (``pipeline_sim``) at
larger hand-offs, 8 device groups and lopsided stages."""

from __future__ import annotations

import random

import pytest
from pipeline_sim import planner_tpi, simulate

from uniap_lightning.planner.cost.schedules import (
    SCHEDULES,
    group_of_stage,
    in_flight,
    in_flight_of_order,
    stages_of_group,
)
from uniap_lightning.planner.cost.torch_orders import torch_pipeline_order

pytest.importorskip("torch.distributed.pipelining")

V_OF = {"1": (1,), ">=2": (2, 3), "2": (2,)}
RATIOS = ((1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (1.0, 1.0, 0.5), (1.0, 1.5, 1.5))

# Relative gap (formula - simulated) / simulated of the planner's formula, measured on the grids below: (lowest,
# highest) allowed. Negative = the formula underestimates torch's order; those are reported, not hidden: 1F1B falls
# up to 7% under it with equal stages and hand-offs of 0.3 t (pipeline.py's docstring: the round-trip row that
# would lift it is not in the program), ZB-V up to 18% with w > f or hand-offs (torch's greedy V order).
EQUAL_GAP = {
    "gpipe": (0.0, 0.0),
    "1f1b": (-0.071, 0.0),
    "interleaved_1f1b": (0.0, 0.053),
    "zb_h1": (-0.083, 0.0),
    "interleaved_zb": (-0.057, 0.037),
    "zb_v": (-0.181, 0.041),
    "dualpipe_v": (-0.080, 0.0),
}
# gpipe underestimates unequal stages: (m - 1) max(f + b) < (m - 1)(max f + max b) when the maxima differ.
RANDOM_GAP = {
    "gpipe": (-0.044, 0.0),
    "1f1b": (-0.002, 0.175),
    "interleaved_1f1b": (-0.036, 0.445),
    "zb_h1": (-0.025, 0.085),
    "interleaved_zb": (0.025, 0.402),
    "zb_v": (-0.034, 0.342),
    "dualpipe_v": (0.007, 0.319),
}
# With several stages per group the forms price every chunk as long as its group's longest (T >= v p_k): torch's
# orders assume equal chunks, and without that row the forms fell up to 20% under the simulation here and 30-44%
# under it on the lopsided stages a search finds (a 133 ms chunk beside 9 ms ones); now they stay above it, by
# as much as 45% on random stages, which the search avoids (its chosen plans: 0-3.5% over the simulation).


def _grid(ps=(2, 3, 4, 8)):
    for name, info in SCHEDULES.items():
        for p in ps:
            for v in V_OF[info.allowed_v]:
                if p == 8 and v == 3:
                    continue
                for m in sorted({p - 1, p, p + 1, 2 * p, 2 * p + 1, 3 * p}):
                    yield name, p, v, m


def _orders():
    out = {}
    for name, p, v, m in _grid():
        if SCHEDULES[name].check(p, v, m) is None:
            out[(name, p, v, m)] = torch_pipeline_order(name, p, v, m)
    return out


@pytest.fixture(scope="module")
def orders():
    return _orders()


def test_placement_round_trip():
    for placement in ("loop", "v"):
        for p in (2, 3, 4):
            v = 2
            seen = sorted(k for g in range(p) for k in stages_of_group(g, p, v, placement))
            assert seen == list(range(p * v))
            for g in range(p):
                assert all(group_of_stage(k, p, v, placement) == g for k in stages_of_group(g, p, v, placement))
    assert stages_of_group(0, 4, 2, "v") == [0, 7] and stages_of_group(0, 4, 2, "loop") == [0, 4]


def test_check_matches_what_torch_builds():
    refused = []
    for name, p, v, m in _grid():
        if name in ("gpipe", "1f1b"):
            continue  # built here, not by torch's multi-stage constructors
        reason = SCHEDULES[name].check(p, v, m)
        try:
            torch_pipeline_order(name, p, v, m)
            built = True
        except ValueError:
            built = False
        assert built == (reason is None), (name, p, v, m, reason)
        if reason:
            refused.append((name, p, v, m))
    print("torch refuses:", refused)
    assert ("dualpipe_v", 4, 2, 5) in refused and ("interleaved_1f1b", 4, 2, 9) in refused


def test_in_flight_equals_torch_order(orders):
    for (name, p, v, m), order in orders.items():
        info = SCHEDULES[name]
        got = in_flight_of_order(order, p * v, info.split_backward)
        assert in_flight(name, p, v, m) == got, (name, p, v, m)


def _gap(name, p, v, m, order, f, b, w, o):
    sim, busy = simulate(order, f, b, w, o)
    assert sim >= max(busy.values()) - 1e-9
    return planner_tpi(name, p, v, m, f, b, w, o) / sim - 1


def test_planner_formula_on_equal_stages(orders):
    worst = {}
    for (name, p, v, m), order in orders.items():
        if m < p:
            continue  # the formulas assume m >= p (torch's single short round is not modelled)
        n = p * v
        for fr, br, wr in RATIOS:
            if not SCHEDULES[name].split_backward:
                br, wr = br + wr, 0.0  # full-backward schedules see only b + w
            for o in (0.0, 0.3):
                gap = _gap(name, p, v, m, order, [fr] * n, [br] * n, [wr] * n, [o] * (n - 1))
                loop = ("1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb")
                exact = name == "gpipe" or (o == 0 and wr <= fr and name in loop)
                if exact:
                    assert abs(gap) < 1e-9, (name, p, v, m, fr, br, wr, o, gap)
                lo, hi = EQUAL_GAP[name]
                assert lo - 1e-9 <= gap <= hi + 1e-9, (name, p, v, m, fr, br, wr, o, gap)
                w_lo, w_hi = worst.get(name, (float("inf"), float("-inf")))
                worst[name] = (min(w_lo, gap), max(w_hi, gap))
    print("equal stages, (min, max) relative gap:", {k: (round(a, 4), round(b, 4)) for k, (a, b) in worst.items()})


def _random_stages(rng, name, n, low, high):
    """Forward times in [low, high], backward 1-2x, weight gradients 0.3-1x (split schedules), hand-offs 0 or up to
    0.3: (f, b, w, o) for ``n`` stages, drawn in this order."""
    f = [rng.uniform(low, high) for _ in range(n)]
    b = [x * rng.uniform(1.0, 2.0) for x in f]
    w = [x * rng.uniform(0.3, 1.0) for x in f] if SCHEDULES[name].split_backward else [0.0] * n
    o = [rng.choice((0.0, rng.uniform(0.0, 0.3))) for _ in range(n - 1)]
    return f, b, w, o


def test_planner_formula_on_random_stages(orders):
    rng = random.Random(25)
    worst = {}
    for (name, p, v, m), order in orders.items():
        if m < p or p == 8:
            continue
        n = p * v
        for _ in range(3):
            gap = _gap(name, p, v, m, order, *_random_stages(rng, name, n, 0.5, 1.5))
            lo, hi = RANDOM_GAP[name]
            assert lo - 1e-9 <= gap <= hi + 1e-9, (name, p, v, m, gap)
            w_lo, w_hi = worst.get(name, (float("inf"), float("-inf")))
            worst[name] = (min(w_lo, gap), max(w_hi, gap))
    print("random stages, (min, max) relative gap:", {k: (round(a, 4), round(b, 4)) for k, (a, b) in worst.items()})


def test_simulate_rejects_a_deadlock():
    order = {0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 0, 1), ("B", 0, 1)]}
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(order, [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0])


def test_multi_chunk_forms_do_not_undercut_lopsided_stages(orders):
    """Stages from 0.1 to 3.0 (a 30x spread, what an unconstrained search would pick to exploit a form): every
    multi-chunk form stays at or above torch's order, but for -3.6% on the interleaved 1F1B's short rounds."""
    rng = random.Random(7)
    for (name, p, v, m), order in orders.items():
        if v == 1 or m < p or p == 8:
            continue
        n = p * v
        for _ in range(3):
            gap = _gap(name, p, v, m, order, *_random_stages(rng, name, n, 0.1, 3.0))
            assert gap >= -0.036 - 1e-9, (name, p, v, m)
