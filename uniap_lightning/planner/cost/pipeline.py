"""Pipeline schedules as numbers: each schedule's time per iteration as linear terms, and its activations in flight.

Notation: ``pp`` device groups, ``v`` stages per group (``S = pp v`` pipeline stages in chain order), ``m``
micro-batches; per stage ``k`` and micro-batch its time ``p_k`` (forward ``f``, input-gradient ``b`` and
weight-gradient ``w`` backward), per boundary ``j`` the hand-off ``o_j``; ``T`` the largest device group's summed
stage times (or hand-off). Times per iteration, before the end-of-step sync:

===================  ==================================================================  ===========================
schedule             time per iteration                                                  with equal stages ``t``
===================  ==================================================================  ===========================
gpipe, 1f1b          ``sum p + sum o + (m - 1) T``  (UniAP's)                            ``(m + pp - 1) t``
interleaved_1f1b     ``(sum p + sum o) / v + (m - 1/v) T``                               ``(m v + pp - 1) t``
zb_h1, interleaved   ``(sum p - 2 sum w + sum o) / v + 2 sum w / S + (m - 1/v) T``       ``m v t + (pp - 1)(f + b
_zb, zb_v,                                                                               - w)``  (ZB paper's)
dualpipe_v
===================  ==================================================================  ===========================

Each form equals a discrete-event simulation of torch's own action list (``pipeline_order`` of the schedule
class) with equal stages, exactly for interleaved 1F1B, ZB-H1 and interleaved ZB at every ratio ``f : b : w``
tried, within 4% for ZB-V and DualPipeV (equal ``f``, ``b``, ``w``: exact); with unequal stages (each stage's
time drawn in +-30%, hand-offs up to 10% of a stage, 2-4 groups, micro-batch counts that are and are not
multiples of ``pp``) within -13% .. +12% (``tests/planner/test_pipeline_shapes.py`` holds them to that). The zero-bubble forms put the weight-gradient time of the one stage whose ``W`` the
schedule cannot hide at the stages' mean ``sum w / S`` instead of a maximum: exact for balanced stages, and it
keeps the program as easy to solve as 1F1B's (a maximum made HiGHS take more than 60 s where 1F1B took 4 s).

Activations in flight: GPipe holds all ``m`` micro-batches; 1F1B ``min(m, pp - k)`` (with ``m < pp`` torch runs
GPipe); every other schedule's counts are read off torch's action list for the exact ``(pp, v, m)`` -- per stage,
the most micro-batches whose forward ran and whose backward (for split schedules: weight-gradient half) has
not -- and where torch cannot build that list here, ``m`` (never too few).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple

from uniap_lightning.planner.schedule_rules import SPLIT_BACKWARD

#: torch.distributed.pipelining class per schedule
TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb_h1": "ScheduleInterleavedZeroBubble",
    "interleaved_1f1b": "ScheduleInterleaved1F1B", "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zb_v": "ScheduleZBVZeroBubble", "dualpipe_v": "ScheduleDualPipeV",
}


class PipelineShape(NamedTuple):
    """A schedule's time per iteration as coefficients of linear terms (see
    :meth:`~uniap_lightning.planner.cost.tables.CandidateCosts.tpi_s`):
    ``a_p sum p + a_w sum w + a_o sum o + b_T T + b_W max w + Y`` with ``T >= boundary_weight * o_j``."""

    a_p: float
    a_w: float
    a_o: float
    b_T: float
    b_W: float = 0.0
    boundary_weight: float = 1.0


def pipeline_shape(schedule: str, pp: int, v: int, m: int) -> tuple[PipelineShape, list[int]]:
    """The schedule's time coefficients and, per pipeline stage, the micro-batches whose activations it holds at
    its peak (see the module docstring)."""
    S = pp * v
    if schedule in ("gpipe", "1f1b"):
        flight = [m if schedule == "gpipe" or m < pp else min(m, pp - k) for k in range(pp)]
        return PipelineShape(1.0, 0.0, 1.0, m - 1.0), flight
    flight = list(in_flight_from_torch(schedule, pp, v, m))
    if schedule == "interleaved_1f1b":
        return PipelineShape(1 / v, 0.0, 1 / v, m - 1 / v), flight
    return PipelineShape(1 / v, -2 / v + 2 / S, 1 / v, m - 1 / v), flight


def unusable(schedule: str, pp: int, v: int, m: int) -> str | None:
    """Why this shape is not run (one line), or None. Beyond GPipe and 1F1B the planner uses ``m >= pp`` (where
    the forms above were checked) and ``m >= 2 pp`` for ZB-V (fewer leave warm-up bubbles, 7-10% more than its
    form); torch's own checks follow (interleaved: ``m`` a multiple of its rounds ``max(1, m // pp)``; DualPipeV:
    ``m >= 2 pp``)."""
    if schedule in ("gpipe", "1f1b"):
        return None
    if pp < 2:
        return f"{schedule} needs 2 or more device groups"
    if m < pp:
        return f"{schedule} with {m} micro-batches < {pp} device groups (no steady state)"
    if schedule in ("interleaved_1f1b", "interleaved_zb") and m % max(1, m // pp):
        return f"{schedule}: {m} micro-batches is not a multiple of torch's rounds max(1, m // pp) = {m // pp}"
    if schedule == "dualpipe_v" and m < 2 * pp:
        return f"dualpipe_v needs at least 2 pp = {2 * pp} micro-batches, got {m}"
    if schedule == "zb_v" and m < 2 * pp:  # torch runs it, but its warm-up leaves bubbles the form does not price
        return f"zb_v is priced from 2 pp = {2 * pp} micro-batches, got {m}"
    return None


@lru_cache(maxsize=512)
def in_flight_from_torch(schedule: str, pp: int, v: int, m: int) -> tuple[int, ...]:
    """Per pipeline stage, the most micro-batches in flight in torch's action list for this shape (``m`` each when
    torch cannot build the list)."""
    try:
        order = torch_actions(schedule, pp, v, m)
    except Exception:  # noqa: BLE001 - another torch: the safe count
        return (m,) * (pp * v)
    held = [0] * (pp * v)
    peak = [0] * (pp * v)
    split = schedule in SPLIT_BACKWARD
    for actions in order.values():
        for kind, _mb, k in actions:
            if kind == "F":
                held[k] += 1
            elif kind == "B" or (split and kind == "W"):
                held[k] -= 1
            peak[k] = max(peak[k], held[k])
    return tuple(max(1, min(p, m)) for p in peak)


_ACTION = re.compile(r"(\d+)([A-Z_]+?)(\d+)")


def torch_actions(schedule: str, pp: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """Every device group's computation actions ``(kind, micro-batch, stage)`` in torch's order (kind F, B, I, W;
    an overlapped forward-backward counts as its two parts), built from torch's schedule class without processes."""
    from types import SimpleNamespace

    import torch.distributed.pipelining.schedules as torch_schedules

    cls = getattr(torch_schedules, TORCH_CLASSES[schedule])
    v_shape = schedule in ("zb_v", "dualpipe_v")
    S = pp * v
    local = [0, S - 1] if v_shape else [j * pp for j in range(v)]
    stages = [SimpleNamespace(num_stages=S, group_size=pp, group_rank=0, stage_index=k, is_first=k == 0,
                              is_last=k == S - 1, submod=None, stage_index_to_group_rank=None) for k in local]
    sched = cls(stages, m)
    out = {}
    for rank, actions in sched.pipeline_order.items():
        parsed = []
        for action in actions:
            if action is None:
                continue
            for stage, kind, mb in _ACTION.findall(str(action)):
                if kind in ("F", "B", "I", "W"):
                    parsed.append((kind, int(mb), int(stage)))
        out[rank] = parsed
    return out
