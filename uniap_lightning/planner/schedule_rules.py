"""What each pipeline schedule runs: its placement and torch's rules for its shape (:data:`SCHEDULES`,
:func:`unusable`), and which per-layer strategies it runs correctly (:func:`unsupported`). Torch-free, for the
planner and the runtime; below the cost model, so that ``TrainingConfig.schedule_candidates`` (planner.problem) asks
it without loading :mod:`uniap_lightning.planner.cost` (which needs the problem).

The zero-bubble schedules (``zb_h1``, ``interleaved_zb``, ``zb_v``, ``dualpipe_v``) split each stage's backward
into an input-gradient and a weight-gradient part (``stage_backward_input`` / ``stage_backward_weight``). The rules
below were found by real runs against one process (``tests/runtime/test_schedules_run.py``); a combination listed
here fails or gives wrong gradients under the split, so the solver skips it and the runtime refuses it.

Measured (torch 2.13, gloo, 5 steps against one process within 1e-5): replicate, zero1, recomputation, gradient
compression (PowerSGD: equal to the same plan without the split) and tied weights (copies on one device group or
two) run under every split schedule; zero2 (a "no gradient in the last micro-batch" error), zero3 (wrong
gradients) and tensor parallelism (stage_backward_input fails on DTensor) do not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: schedules whose backward is split into input- and weight-gradient parts
SPLIT_BACKWARD = ("zb_h1", "interleaved_zb", "zb_v", "dualpipe_v")

#: feature -> why it is refused under the split backward (feature names as :func:`_features` gives them)
_REFUSED: dict[str, str] = {
    # observed with torch 2.13 on gloo; the cause inside FSDP2's backward hooks was not tracked down
    "zero2": "FSDP2 finds no gradient to reduce-scatter after the last micro-batch's split backward",
    "zero3": "FSDP2's sharded gradients come out wrong under the split backward",
    "tensor parallelism": "torch's stage_backward_input fails on the DTensor shards of tensor parallelism",
}


def _features(strategy: Any) -> list[str]:
    """The features of a per-layer Strategy record that the rules name."""
    out = []
    if strategy.replicas > 1:  # data and context-parallel ranks holding the same weights
        out.append(strategy.dp_mode)
    if strategy.tp > 1:
        out.append("tensor parallelism")
    if strategy.recompute:
        out.append("recomputation")
    if strategy.compression != "none":
        out.append("gradient compression")
    return out


def unsupported(schedule: str, strategy: Any) -> str | None:
    """Why ``schedule`` cannot run a layer with ``strategy`` (one line), or ``None`` when it can."""
    if schedule not in SPLIT_BACKWARD:
        return None
    for feature in _features(strategy):
        if feature in _REFUSED:
            return f"schedule={schedule!r} does not support {feature} ({_REFUSED[feature]})"
    return None


def _check_single(name: str) -> Callable[[int, int, int], str | None]:
    def check(p: int, v: int, m: int) -> str | None:
        if v != 1:
            return f"{name} runs one stage per group (v=1), got v={v}"
        if name == "1f1b" and m < p:
            return f"Schedule1F1B needs m >= p ({m} < {p}); the runtime uses GPipe below it"
        return None

    return check


def _check_rounds(name: str, allowed: Callable[[int], bool]) -> Callable[[int, int, int], str | None]:
    def check(p: int, v: int, m: int) -> str | None:
        if not allowed(v):
            return f"{name} does not take v={v}"
        rounds = max(1, m // p)
        if m % rounds:
            return f"torch needs m a multiple of the rounds max(1, m // p) = {rounds}, got m={m}"
        return None

    return check


def _check_v(name: str, dual: bool) -> Callable[[int, int, int], str | None]:
    def check(p: int, v: int, m: int) -> str | None:
        if v != 2:
            return f"{name} needs exactly 2 stages per group (v=2), got v={v}"
        if dual and m < 2 * p:
            return f"ScheduleDualPipeV needs m >= 2p stages ({m} < {2 * p})"
        return None

    return check


@dataclass(frozen=True)
class ScheduleInfo:
    """What a schedule name means: placement, the v it takes, whether B is split into I and W, torch's class."""

    name: str
    placement: str  # "loop" or "v"
    allowed_v: str  # "1", ">=2", "2"
    split_backward: bool
    torch_class: str
    check: Callable[[int, int, int], str | None]  # None when torch builds and runs it, else a one-line reason


SCHEDULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo("gpipe", "loop", "1", False, "ScheduleGPipe", _check_single("gpipe")),
    "1f1b": ScheduleInfo("1f1b", "loop", "1", False, "Schedule1F1B", _check_single("1f1b")),
    "interleaved_1f1b": ScheduleInfo(
        "interleaved_1f1b", "loop", ">=2", False, "ScheduleInterleaved1F1B",
        _check_rounds("interleaved_1f1b", lambda v: v >= 2),
    ),
    "zb_h1": ScheduleInfo(
        "zb_h1", "loop", "1", True, "ScheduleInterleavedZeroBubble", _check_rounds("zb_h1", lambda v: v == 1)
    ),
    "interleaved_zb": ScheduleInfo(
        "interleaved_zb", "loop", ">=2", True, "ScheduleInterleavedZeroBubble",
        _check_rounds("interleaved_zb", lambda v: v >= 2),
    ),
    "zb_v": ScheduleInfo("zb_v", "v", "2", True, "ScheduleZBVZeroBubble", _check_v("zb_v", False)),
    "dualpipe_v": ScheduleInfo("dualpipe_v", "v", "2", True, "ScheduleDualPipeV", _check_v("dualpipe_v", True)),
}


def unusable(schedule: str, pp: int, v: int, m: int) -> str | None:
    """Why ``schedule`` is not run with ``pp`` device groups, ``v`` stages each and ``m`` micro-batches (one line),
    or None. GPipe and 1F1B run any shape (1F1B with ``m < pp`` runs as GPipe). Beyond them the planner uses
    ``m >= pp`` (where the time forms of :mod:`~uniap_lightning.planner.cost.pipeline` were checked) and ``m >= 2 pp`` for ZB-V (fewer leave warm-up bubbles, 7-10% more than its
    form); torch's own checks follow (interleaved: ``m`` a multiple of its rounds ``max(1, m // pp)``; DualPipeV:
    ``m >= 2 pp``)."""
    if schedule in ("gpipe", "1f1b"):
        return None
    if pp < 2:
        return f"{schedule} needs 2 or more device groups"
    if m < pp:
        return f"{schedule} with {m} micro-batches < {pp} device groups (no steady state)"
    torch_says = SCHEDULES[schedule].check(pp, v, m)  # torch's own rules (rounds, DualPipeV's m >= 2 pp, v)
    if torch_says is not None:
        return torch_says
    if schedule == "zb_v" and m < 2 * pp:  # torch runs it, but its warm-up leaves bubbles the form does not price
        return f"zb_v is priced from 2 pp = {2 * pp} micro-batches, got {m}"
    return None
