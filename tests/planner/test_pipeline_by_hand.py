"""The planner's time per iteration of a pipeline (``cost.pipeline.pipeline_shape`` through
``CandidateCosts.bottleneck_s`` and ``tpi_s``, the calls ``cost.evaluate`` makes) against numbers computed by hand
from the textbook forms, each written as a literal: GPipe and 1F1B ``(m + pp - 1) t`` with equal stages and
``sum p + (m - 1) max p`` with unequal ones, interleaved 1F1B ``(m v + pp - 1) t_chunk`` (Megatron) and ZB-H1
``m t + (pp - 1)(f + b - w)`` (the zero-bubble paper), plus what the planner adds on top: every hand-off ``o_j``
once and the largest device group's end-of-step sync ``Y``. The simulated order is held to the same literals where
the textbook form is exact for it."""

from __future__ import annotations

import pytest
from pipeline_sim import planner_tpi, runtime_order, simulate

pytest.importorskip("torch.distributed.pipelining")

# Equal stages: forward f = 1, backward b = 2, so t = f + b = 3 per stage and micro-batch; every boundary's
# hand-off (forward plus backward) o = 0.25; sync Y = 0.5.
# textbook = (m + pp - 1) * 3;  priced = textbook + (pp - 1) * 0.25 + 0.5
EQUAL = [
    # pp, m, textbook, priced
    (2, 1, 6.0, 6.75),  # (1 + 1) * 3 = 6;   6 + 0.25 + 0.5
    (2, 2, 9.0, 9.75),  # (2 + 1) * 3 = 9;   9 + 0.25 + 0.5
    (2, 3, 12.0, 12.75),  # (3 + 1) * 3 = 12;  12 + 0.25 + 0.5
    (2, 4, 15.0, 15.75),  # (4 + 1) * 3 = 15;  15 + 0.25 + 0.5
    (3, 1, 9.0, 10.0),  # (1 + 2) * 3 = 9;   9 + 0.5 + 0.5
    (3, 2, 12.0, 13.0),  # (2 + 2) * 3 = 12;  12 + 0.5 + 0.5
    (3, 3, 15.0, 16.0),  # (3 + 2) * 3 = 15;  15 + 0.5 + 0.5
    (3, 4, 18.0, 19.0),  # (4 + 2) * 3 = 18;  18 + 0.5 + 0.5
    (4, 1, 12.0, 13.25),  # (1 + 3) * 3 = 12;  12 + 0.75 + 0.5
    (4, 2, 15.0, 16.25),  # (2 + 3) * 3 = 15;  15 + 0.75 + 0.5
    (4, 3, 18.0, 19.25),  # (3 + 3) * 3 = 18;  18 + 0.75 + 0.5
    (4, 4, 21.0, 22.25),  # (4 + 3) * 3 = 21;  21 + 0.75 + 0.5
]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m, textbook, priced", EQUAL)
def test_equal_stages_cost_m_plus_pp_minus_one_slots(schedule, pp, m, textbook, priced):
    f, b, w = [1.0] * pp, [2.0] * pp, [0.0] * pp
    assert planner_tpi(schedule, pp, 1, m, f, b, w, [0.25] * (pp - 1), sync=0.5) == pytest.approx(priced, abs=1e-12)
    assert planner_tpi(schedule, pp, 1, m, f, b, w, [0.0] * (pp - 1)) == pytest.approx(textbook, abs=1e-12)
    order = runtime_order(schedule, pp, 1, m)
    assert simulate(order, f, b, w, [0.0] * (pp - 1))[0] == pytest.approx(textbook, abs=1e-12)
    if schedule == "gpipe":  # its fill and drain each cross every boundary once: half the hand-off each way
        assert simulate(order, f, b, w, [0.25] * (pp - 1))[0] == pytest.approx(priced - 0.5, abs=1e-12)


# Unequal stages: forwards f = 1, 2, 1.5, 0.5 (the first pp of them), backward b = 2 f, so
# p = 3, 6, 4.5, 1.5 and max p = 6; hand-offs o = 0.25, 0.5, 0.25 (the first pp - 1); sync Y = 0.5.
# sum p: pp 2 -> 9, pp 3 -> 13.5, pp 4 -> 15;  sum o: pp 2 -> 0.25, pp 3 -> 0.75, pp 4 -> 1.0
# textbook = sum p + (m - 1) * 6;  priced = textbook + sum o + 0.5
UNEQUAL = [
    # pp, m, textbook, priced
    (2, 1, 9.0, 9.75),  # 9 + 0 * 6 = 9;       9 + 0.25 + 0.5
    (2, 2, 15.0, 15.75),  # 9 + 1 * 6 = 15;      15 + 0.25 + 0.5
    (2, 3, 21.0, 21.75),  # 9 + 2 * 6 = 21;      21 + 0.25 + 0.5
    (2, 4, 27.0, 27.75),  # 9 + 3 * 6 = 27;      27 + 0.25 + 0.5
    (3, 1, 13.5, 14.75),  # 13.5 + 0 * 6 = 13.5; 13.5 + 0.75 + 0.5
    (3, 2, 19.5, 20.75),  # 13.5 + 1 * 6 = 19.5; 19.5 + 0.75 + 0.5
    (3, 3, 25.5, 26.75),  # 13.5 + 2 * 6 = 25.5; 25.5 + 0.75 + 0.5
    (3, 4, 31.5, 32.75),  # 13.5 + 3 * 6 = 31.5; 31.5 + 0.75 + 0.5
    (4, 1, 15.0, 16.5),  # 15 + 0 * 6 = 15;     15 + 1.0 + 0.5
    (4, 2, 21.0, 22.5),  # 15 + 1 * 6 = 21;     21 + 1.0 + 0.5
    (4, 3, 27.0, 28.5),  # 15 + 2 * 6 = 27;     27 + 1.0 + 0.5
    (4, 4, 33.0, 34.5),  # 15 + 3 * 6 = 33;     33 + 1.0 + 0.5
]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m, textbook, priced", UNEQUAL)
def test_unequal_stages_cost_the_sum_plus_m_minus_one_slowest(schedule, pp, m, textbook, priced):
    f = [1.0, 2.0, 1.5, 0.5][:pp]
    b, w, o = [2 * x for x in f], [0.0] * pp, [0.25, 0.5, 0.25][: pp - 1]
    assert planner_tpi(schedule, pp, 1, m, f, b, w, o, sync=0.5) == pytest.approx(priced, abs=1e-12)
    simulated = simulate(runtime_order(schedule, pp, 1, m), f, b, w, [0.0] * (pp - 1))[0]
    if schedule == "gpipe":  # all forwards, then all backwards: both wait on the slowest stage m - 1 times
        assert simulated == pytest.approx(textbook, abs=1e-12)
    else:  # 1F1B runs the slow stage's forwards while others drain, so the textbook form is an upper bound here
        assert simulated <= textbook + 1e-12  # (24 against 25.5 at pp 3, m 3; 30 against 33 at pp 4, m 4)


def test_a_hand_off_slower_than_every_stage_is_the_bottleneck():
    # pp 2, p = 3 and 3 (f 1, b 2), one hand-off o = 4 > 3: T = max(3, 3, 4) = 4, so with m = 3 and Y = 0.5:
    # sum p + o + (m - 1) T + Y = 6 + 4 + 2 * 4 + 0.5 = 18.5 (the planner treats the link as a stage of its own)
    for schedule in ("gpipe", "1f1b"):
        assert planner_tpi(schedule, 2, 1, 3, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [4.0], sync=0.5) == 18.5


# Interleaved 1F1B, pp 2, v 2 (4 chunks of f 0.5, b 1: t_chunk = 1.5, a group's load 3), no hand-offs:
# Megatron's (m v + pp - 1) t_chunk;  m 2: (4 + 1) * 1.5 = 7.5;  m 4: (8 + 1) * 1.5 = 13.5
# ZB-H1 (f = b = w = 1, t = 3), no hand-offs: m t + (pp - 1)(f + b - w);  pp 2, m 2: 6 + 1 = 7;  pp 2, m 4: 12 + 1
# = 13;  pp 4, m 4: 12 + 3 * 1 = 15
MULTI = [
    ("interleaved_1f1b", 2, 2, 2, (0.5, 1.0, 0.0), 7.5),
    ("interleaved_1f1b", 2, 2, 4, (0.5, 1.0, 0.0), 13.5),
    ("zb_h1", 2, 1, 2, (1.0, 1.0, 1.0), 7.0),
    ("zb_h1", 2, 1, 4, (1.0, 1.0, 1.0), 13.0),
    ("zb_h1", 4, 1, 4, (1.0, 1.0, 1.0), 15.0),
]


@pytest.mark.parametrize("schedule, pp, v, m, fbw, textbook", MULTI)
def test_interleaved_and_zero_bubble_match_their_papers(schedule, pp, v, m, fbw, textbook):
    S = pp * v
    f, b, w = ([x] * S for x in fbw)
    assert planner_tpi(schedule, pp, v, m, f, b, w, [0.0] * (S - 1)) == pytest.approx(textbook, abs=1e-12)
    assert simulate(runtime_order(schedule, pp, v, m), f, b, w, [0.0] * (S - 1))[0] == pytest.approx(textbook,
                                                                                                        abs=1e-12)
