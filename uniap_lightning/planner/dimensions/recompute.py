"""Activation recomputation: the layer keeps its input instead of its activations and runs its forward again
in backward."""

from __future__ import annotations

from uniap_lightning.planner.dimensions.base import Column, Dimension, Field, flag


def _cell(s) -> str:
    return "yes" if s.recompute else "-"


RECOMPUTE = Dimension(
    name="recompute",
    fields=(Field("recompute", bool, False, lambda slot, chosen: (False, True), check=flag("recompute"), since=2),),
    suffix=lambda s: "+rc" if s.recompute else "",
    columns=(Column("recompute", _cell, explain=_cell),),
)
