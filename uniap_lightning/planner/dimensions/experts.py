"""Expert parallelism: the experts of a mixture-of-experts layer split over ``ep`` of the ``dp x cp`` replicas
(consecutive blocks of ``ep``, as in Megatron and DeepSpeed-MoE): not a grid dimension, it overlaps the data
ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.base import Column, Dimension, Field, Slot

if TYPE_CHECKING:
    from uniap_lightning.planner.profile import LayerProfile


def expert_degrees(layer: LayerProfile, replicas: int) -> tuple[int, ...]:
    """The ``ep`` a layer may take with ``replicas`` ranks holding the same weights: 1, and for a
    mixture-of-experts layer every divisor of ``replicas`` that divides its expert count."""
    E = layer.experts
    return (1,) + tuple(e for e in range(2, replicas + 1) if replicas % e == 0 and E % e == 0) if E else (1,)


def _ep_options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[int, ...]:
    # experts split over the replicas only with uncompressed gradients
    return expert_degrees(slot.layer, chosen["dp"] * chosen["cp"]) if chosen["compression"] == "none" else (1,)


def _check(ep: Any) -> str | None:
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return f"ep must be a positive integer, got {ep!r}"
    return None


def _canonical(v: Mapping[str, Any]) -> dict[str, Any]:
    return {"ep": 1} if v["dp"] * v["cp"] == 1 else {}


def _rules(s: Any, where: str, experts: int | None) -> None:
    ep = s.ep
    if ep == 1:
        return
    if s.replicas % ep:
        raise UniAPError(f"{where}: ep={ep} must divide the dp*cp = {s.replicas} replicas (expert parallelism "
                         "splits the experts over data ranks)")
    if s.compression != "none":
        raise UniAPError(f"{where}: ep={ep} needs compression 'none' (expert and other gradients are reduced "
                         f"over different groups), got {s.compression!r}")
    if experts is not None and experts == 0:
        raise UniAPError(f"{where}: ep={ep} on a layer without experts (only mixture-of-experts layers split "
                         "over ep)")
    if experts is not None and experts % ep:
        raise UniAPError(f"{where}: ep={ep} must divide the layer's {experts} experts")


EXPERTS = Dimension(
    name="experts",
    # format 4 also carries expert parallelism; earlier files had none (ep 1)
    fields=(Field("ep", int, 1, _ep_options, check=_check, since=4),),
    canonical=_canonical,
    suffix=lambda s: f"+ep{s.ep}" if s.ep > 1 else "",
    rules=_rules,
    columns=(Column("ep", lambda s: str(s.ep) if s.ep > 1 else "-", shown=lambda s: s.ep > 1),),
)
