"""Tensor parallelism: ``tp`` ranks (innermost in the stage's grid, inside a node) split the layer's weights;
``sp`` (sequence parallelism): the parts tensor parallelism does not split run on sequence shards."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.base import REQUIRED, Column, Dimension, Field, Slot, flag
from uniap_lightning.planner.dimensions.context import splits_sequence


def _tp_options(slot: Slot, chosen: Mapping[str, Any]) -> list[int]:
    # a degree the layer supports that divides the stage and stays inside a node (aligned)
    n, dpn = slot.n, slot.cluster.devices_per_node
    return [t for t in slot.layer.tp_degrees if not (n % t or t > dpn or dpn % t)]


def _sp_options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[bool, ...]:
    # a layer with a sequence-parallel TP plan, tp > 1 and a sequence that cp x tp divides
    t, L = chosen["tp"], slot.layer.sequence_length
    if slot.sequence and t > 1 and slot.layer.sequence_parallel and L and L % (chosen["cp"] * t) == 0:
        return (False, True)
    return (False,)


def _canonical(v: Mapping[str, Any]) -> dict[str, Any]:
    return {"sp": False} if v["tp"] == 1 else {}


def _rules(s: Any, where: str, experts: int | None) -> None:
    if s.sp and s.tp == 1:
        raise UniAPError(f"{where}: sp (sequence parallelism) needs tp > 1, got tp=1")


TENSOR = Dimension(
    name="tensor",
    fields=(
        Field("tp", int, REQUIRED, _tp_options),
        Field("sp", bool, False, _sp_options, check=flag("sp"), since=4),
    ),
    canonical=_canonical,
    grid=lambda s: f"tp{s.tp}" if s.tp > 1 else "",
    suffix=lambda s: "+sp" if s.sp else "",
    rules=_rules,
    columns=(
        Column("tp", lambda s: str(s.tp)),
        Column("sp", lambda s: "yes" if s.sp else "-", shown=splits_sequence),
    ),
)
