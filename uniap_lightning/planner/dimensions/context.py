"""Context parallelism: each sample's sequence split over ``cp`` ranks, attention by ``cp_method`` (Ulysses
all-to-alls or ring attention; "none" at ``cp = 1``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.base import Column, Dimension, Field, Slot, one_of

if TYPE_CHECKING:
    from uniap_lightning.planner.cluster import Cluster
    from uniap_lightning.planner.profile import LayerProfile

#: how a layer's attention runs over a split sequence: "none" (cp = 1), Ulysses all-to-alls (any device) or ring
#: attention (``runtime/ring.py``; any device)
CP_METHODS = ("none", "ulysses", "ring")
CP_LABELS = {"ulysses": "u", "ring": "r"}


def cp_methods(layer: LayerProfile, cp: int, t: int, cluster: Cluster) -> tuple[str, ...]:
    """How ``layer`` may run with its sequence split over ``cp`` ranks (and ``t`` tensor-parallel ranks): none
    without a ``sequence_length`` that ``cp`` divides; a token-wise layer (``attention_heads`` 0) needs no method
    and is recorded as ``ulysses`` (it moves nothing); attention takes Ulysses where ``cp`` divides its heads per
    tensor-parallel rank, ring attention where the cluster runs it and the sequence splits into ``2 cp``
    load-balanced chunks (head and tail, for causal masks)."""
    L = layer.sequence_length
    if cp == 1:
        return ("none",)
    if L is None or L % cp:
        return ()
    a = layer.attention_heads
    if a == 0:
        return ("ulysses",)
    out = []
    if a % t == 0 and (a // t) % cp == 0:
        out.append("ulysses")
    if cluster.ring_attention and L % (2 * cp) == 0:
        out.append("ring")
    return tuple(out)


def splits_sequence(s: Any) -> bool:
    """Whether a strategy splits its layer's sequence (context or sequence parallelism): the report's sequence
    columns appear where some layer does."""
    return s.cp > 1 or s.sp


def _cp_options(slot: Slot, chosen: Mapping[str, Any]) -> list[int]:
    rest = slot.n // chosen["tp"]  # every divisor of the devices tensor parallelism leaves
    return [c for c in range(1, rest + 1) if rest % c == 0] if slot.sequence else [1]


def _method_options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[str, ...]:
    return cp_methods(slot.layer, chosen["cp"], chosen["tp"], slot.cluster)


def _canonical(v: Mapping[str, Any]) -> dict[str, Any]:
    return {"cp_method": "none"} if v["cp"] == 1 else {}


def _grid(s: Any) -> str:
    return f"cp{s.cp}{CP_LABELS.get(s.cp_method, s.cp_method)}" if s.cp > 1 else ""


def _rules(s: Any, where: str, experts: int | None) -> None:
    if (s.cp > 1) != (s.cp_method != "none"):
        raise UniAPError(f"{where}: cp={s.cp} needs cp_method " + (
            f"'ulysses' or 'ring', got {s.cp_method!r}" if s.cp > 1 else f"'none', got {s.cp_method!r}"))


CONTEXT = Dimension(
    name="context",
    fields=(
        # format 4 added the sequence dimension; earlier files had none (cp 1)
        Field("cp", int, 1, _cp_options, since=4),
        Field("cp_method", str, "none", _method_options, check=one_of("cp_method", CP_METHODS), since=4),
    ),
    canonical=_canonical,
    grid=_grid,
    rules=_rules,
    columns=(
        Column("cp", lambda s: str(s.cp), shown=splits_sequence),
        Column("cp method", lambda s: s.cp_method if s.cp > 1 else "-", shown=splits_sequence),
    ),
)
