"""Which per-layer strategies each pipeline schedule runs correctly (torch-free, for the planner and the runtime).

The zero-bubble schedules (``zb_h1``, ``interleaved_zb``, ``zb_v``, ``dualpipe_v``) split each stage's backward
into an input-gradient and a weight-gradient part (``stage_backward_input`` / ``stage_backward_weight``). The rules
below were found by real runs against one process (``tests/runtime/test_schedules_run.py``); a combination listed
here fails or gives wrong gradients under the split, so the solver skips it and the runtime refuses it.
"""

from __future__ import annotations

from typing import Any

#: schedules whose backward is split into input- and weight-gradient parts
SPLIT_BACKWARD = ("zb_h1", "interleaved_zb", "zb_v", "dualpipe_v")

#: feature -> why it is refused under the split backward (feature names as :func:`_features` gives them)
_REFUSED: dict[str, str] = {
    # FSDP2's post-backward hook runs at the input-gradient part, before the weight gradient exists: the
    # reduce-scatter never sees it (torch 2.13, found on gloo)
    "zero2": "FSDP2 reduce-scatters before the weight-gradient part of the split backward computes the gradient",
    "zero3": "FSDP2 reduce-scatters before the weight-gradient part of the split backward: gradients are wrong",
    # stage_backward_input fails on DTensor parameters (torch 2.13)
    "tensor parallelism": "torch's stage_backward_input fails on the DTensor shards of tensor parallelism",
}


def _features(strategy: Any) -> list[str]:
    """The features of a per-layer Strategy record that the rules name."""
    out = []
    if strategy.dp > 1:
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


def unsupported_ties(schedule: str) -> str | None:
    """Why ``schedule`` cannot run a chain with tied weights across device groups, or ``None``."""
    return None
