"""Data parallelism: ``dp`` copies of the layer (its degree, derived from the stage: ``n / (tp x cp)``) and how
the ``dp x cp`` replicas hold their state (``dp_mode``: replicate, ZeRO-1, ZeRO-2, ZeRO-3 / FSDP)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner import fields as F
from uniap_lightning.planner.dimensions.base import REQUIRED, Column, Dimension, Field, Slot, one_of

DP_MODES = ("replicate", "zero1", "zero2", "zero3")
# modes whose gradients are all-reduced whole, so a compressor can stand in for the all-reduce
COMPRESSIBLE_DP_MODES = ("replicate", "zero1")
DP_LABELS = {"replicate": "dp", "zero1": "z1dp", "zero2": "z2dp", "zero3": "fsdp"}
ZERO_LABELS = {"zero1": "z1", "zero2": "z2", "zero3": "fsdp"}
#: the report's words for each mode
DP_MODE_LABELS = {
    "replicate": "replicated (DDP)",
    "zero1": "ZeRO-1 (optimizer sharded)",
    "zero2": "ZeRO-2 (+ gradients)",
    "zero3": "ZeRO-3 / FSDP (+ parameters)",
}


def no_copies(where: str, s: Any) -> UniAPError:
    """The error of a record whose state rules need copies it does not have (``dp x cp = 1``)."""
    return UniAPError(
        f"{where}: dp=1 has no data-parallel copies, so dp_mode must be 'replicate' and compression 'none' "
        f"(got {s.dp_mode!r}, {s.compression!r})"
    )


def _dp_options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[int, ...]:
    # the stage's devices left after tensor and context parallelism; each copy takes a share of the micro-batch
    d = slot.n // (chosen["tp"] * chosen["cp"])
    return () if slot.micro_batch % d else (d,)


def _dp_mode_options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[str, ...]:
    return DP_MODES if chosen["dp"] * chosen["cp"] > 1 else ("replicate",)


def _shard(x: dict, where: str, values: Mapping[str, Any]) -> str:
    # format 1: shard (a real boolean: "false" would be truthy, ZeRO-3) instead of dp_mode
    return "zero3" if F.boolean(F.required(x, "shard", where), f"{where}: shard") and values["dp"] > 1 \
        else "replicate"


def _canonical(v: Mapping[str, Any]) -> dict[str, Any]:
    return {"dp_mode": "replicate"} if v["dp"] * v["cp"] == 1 else {}


def _grid(s: Any) -> str:
    if s.dp > 1:
        return f"{DP_LABELS.get(s.dp_mode, s.dp_mode)}{s.dp}"
    if s.cp > 1 and s.dp_mode != "replicate":  # the mode over the context-parallel ranks alone
        return ZERO_LABELS[s.dp_mode]
    return ""


def _rules(s: Any, where: str, experts: int | None) -> None:
    if s.replicas == 1 and s.dp_mode != "replicate":
        raise no_copies(where, s)


DATA = Dimension(
    name="data",
    fields=(
        Field("dp", int, REQUIRED, _dp_options),
        Field("dp_mode", str, "replicate", _dp_mode_options, check=one_of("dp_mode", DP_MODES), since=2,
              legacy=_shard, required_in_plan=True),
    ),
    canonical=_canonical,
    grid=_grid,
    rules=_rules,
    columns=(
        Column("dp", lambda s: str(s.dp)),
        Column("dp mode", lambda s: "-" if s.replicas == 1 else DP_MODE_LABELS[s.dp_mode],
               explain=lambda s: s.dp_mode if s.dp > 1 else "-", explain_left=True),
    ),
)
