"""Gradient compression: how a layer's gradients travel between its replicas (bf16, PowerSGD, top-k instead of
the all-reduce; replicate / ZeRO-1 only, whose gradients are all-reduced whole)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.base import Column, Dimension, Field, Slot, one_of
from uniap_lightning.planner.dimensions.data import COMPRESSIBLE_DP_MODES, no_copies

COMPRESSIONS = ("none", "bf16", "powersgd", "topk")


def _options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[str, ...]:
    # the methods the solver may choose besides "none", for replicas whose mode all-reduces gradients whole
    if chosen["dp"] * chosen["cp"] > 1 and chosen["dp_mode"] in COMPRESSIBLE_DP_MODES:
        return ("none", *[m for m in slot.compression if m != "none"])
    return ("none",)


def _canonical(v: Mapping[str, Any]) -> dict[str, Any]:
    return {"compression": "none"} if v["dp"] * v["cp"] == 1 else {}


def _rules(s: Any, where: str, experts: int | None) -> None:
    if s.compression == "none":
        return
    if s.replicas == 1:
        raise no_copies(where, s)
    if s.dp_mode not in COMPRESSIBLE_DP_MODES:
        raise UniAPError(
            f"{where}: compression={s.compression!r} needs dp_mode in {COMPRESSIBLE_DP_MODES} "
            f"(gradients all-reduced whole), got {s.dp_mode!r}"
        )


def _cell(s: Any) -> str:
    return s.compression if s.compression != "none" else "-"


COMPRESSION = Dimension(
    name="compression",
    fields=(Field("compression", str, "none", _options, check=one_of("compression", COMPRESSIONS), since=2),),
    canonical=_canonical,
    suffix=lambda s: f"+{s.compression}" if s.compression != "none" else "",
    rules=_rules,
    columns=(Column("compression", _cell, explain=_cell, explain_left=True),),
)
