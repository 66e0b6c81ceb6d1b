"""Which per-layer strategies each pipeline schedule runs correctly (torch-free, for the planner and the runtime).

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
