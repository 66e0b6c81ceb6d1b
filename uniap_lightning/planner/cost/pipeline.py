"""Pipeline schedules as numbers: each schedule's time per iteration as linear terms, and its activations in flight.

Notation: ``pp`` device groups, ``v`` stages per group (``S = pp v`` pipeline stages in chain order), ``m``
micro-batches; per stage ``k`` and micro-batch its time ``p_k`` (forward ``f``, input-gradient ``b`` and
weight-gradient ``w`` backward), per boundary ``j`` the hand-off ``o_j``; ``T`` the largest device group's summed
stage times (or hand-off). Times per iteration, before the end-of-step sync:

===================  ==================================================================  ===========================
schedule             time per iteration                                                  with equal stages ``t``
===================  ==================================================================  ===========================
gpipe, 1f1b          ``sum p + sum o + (m - 1) T``  (UniAP's)                            ``(m + pp - 1) t``
interleaved_1f1b     ``sum p / v + sum o + (m - 1/v) T``                                 ``(m v + pp - 1) t``
zb_h1, interleaved   ``(sum p - 2 sum w) / v + sum o + 2 sum w / S + (m - 1/v) T``       ``m v t + (pp - 1)(f + b
_zb                                                                                      - w)``  (ZB paper's)
zb_v, dualpipe_v     ``(sum p - 2 sum w + sum o) / v + 2 sum w / S + (m - 1/v) T``       the same
===================  ==================================================================  ===========================

Hand-offs ``sum o``: a looped placement (interleaved) pays all ``S - 1`` of them in full, since a micro-batch's
first and last chunks cross every boundary; the V placement turns on one device group and pays them ``/ v``.
Compared with the simulation (:func:`~uniap_lightning.planner.cost.schedules.simulate_blocks`) at hand-offs up to
half a stage, counting them ``/ v`` in a looped placement underestimated by up to 13%, in full by up to 9%. For 1F1B
the simulation also suggests a second floor, ``T >= (sum p + sum o) / pp`` (at most ``pp`` micro-batches circulate),
which would move its largest underestimate at such hand-offs from -4.5% to -2.3% (8 groups, 24 micro-batches,
hand-offs of 0.12 t: -7%, ``tests/planner/test_schedules.py``); it is not in the program (a row for every 1F1B
candidate for a case where hand-offs are half a stage's time).

Each form equals a discrete-event simulation of torch's own action list (``pipeline_order`` of the schedule class;
for GPipe and 1F1B the order their ``_step_microbatches`` runs) with equal stages and no hand-offs, exactly for
GPipe, 1F1B, interleaved 1F1B, and ZB-H1 and interleaved ZB with ``w <= f``, within 6% for ZB-V and DualPipeV where
the planner runs them (equal ``f``, ``b``, ``w`` from ``2 pp`` micro-batches: exact); GPipe also with unequal stages
whose backward is one multiple of their forward, at any hand-off below a stage. With unequal stages (each stage's
time drawn in +-30%, hand-offs up to 10% of a stage, 2-4 groups, 1-8 micro-batches) within -6% (GPipe) .. +35% (the
multi-chunk forms, which price every chunk as long as its group's longest);
``tests/planner/test_pipeline_shapes.py`` holds each schedule to its measured range,
``tests/planner/test_pipeline_by_hand.py`` the forms to hand-computed numbers. The zero-bubble forms put the
weight-gradient time of the one stage whose ``W`` the schedule cannot hide at the stages' mean ``sum w / S`` instead
of a maximum: exact for balanced stages, and it keeps the program as easy to solve as 1F1B's (a maximum made HiGHS
take more than 60 s where 1F1B took 4 s).

Activations in flight: GPipe holds all ``m`` micro-batches; 1F1B ``min(m, pp - k)`` (with ``m < pp`` torch runs
GPipe); every other schedule's from :func:`~uniap_lightning.planner.cost.schedules.in_flight`: per stage, the most
micro-batches whose forward ran and whose backward (for split schedules: weight-gradient half) has not, in closed
forms that equal the counts read off torch's own action lists on a grid of ``(pp, v, m)``
(``tests/planner/test_schedules.py``).
"""

from __future__ import annotations

from typing import NamedTuple

from uniap_lightning.planner.cost.schedules import SCHEDULES, in_flight
# which shapes are run (torch's rules and where the forms below hold) lives below the cost model, in the torch-free
# planner.schedule_rules, which TrainingConfig.schedule_candidates asks; its name stays importable from here
from uniap_lightning.planner.schedule_rules import unusable  # noqa: F401 - re-exported

class PipelineShape(NamedTuple):
    """A schedule's time per iteration as coefficients of linear terms (see
    :meth:`~uniap_lightning.planner.cost.tables.CandidateCosts.tpi_s`):
    ``a_p sum p + a_w sum w + a_o sum o + b_T T + b_W max w + Y`` with ``T >= boundary_weight * o_j`` and, where
    a device group runs several stages, ``T >= stage_weight * p_k`` (the orders assume a group's chunks of equal
    time: a chunk over its share holds up the stages waiting on it, so the form prices every chunk of its group
    as long as the longest one)."""

    a_p: float
    a_w: float
    a_o: float
    b_T: float
    b_W: float = 0.0
    boundary_weight: float = 1.0
    stage_weight: float = 0.0


def pipeline_shape(schedule: str, pp: int, v: int, m: int) -> tuple[PipelineShape, list[int]]:
    """The schedule's time coefficients and, per pipeline stage, the micro-batches whose activations it holds at
    its peak (see the module docstring)."""
    S = pp * v
    if schedule in ("gpipe", "1f1b"):
        flight = [m if schedule == "gpipe" or m < pp else min(m, pp - k) for k in range(pp)]
        return PipelineShape(1.0, 0.0, 1.0, m - 1.0), flight
    flight = in_flight(schedule, pp, v, m)
    # a looped placement pays every hand-off of its S - 1 boundaries on the way in and out (each chunk's round
    # trip crosses all of them); the V placement's turn stays on one device group, so it pays them once per v
    handoffs = 1.0 if SCHEDULES[schedule].placement == "loop" else 1 / v
    if schedule == "interleaved_1f1b":
        return PipelineShape(1 / v, 0.0, handoffs, m - 1 / v, stage_weight=v), flight
    return PipelineShape(1 / v, -2 / v + 2 / S, handoffs, m - 1 / v, stage_weight=v if v > 1 else 0.0), flight
