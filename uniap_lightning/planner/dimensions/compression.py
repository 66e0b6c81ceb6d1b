"""Gradient compression: how a layer's gradients travel between its replicas (bf16, PowerSGD, top-k instead of
the all-reduce; replicate / ZeRO-1 only, whose gradients are all-reduced whole).

Opt-in (it changes numerics): the methods the planner may choose come from the user's ``compression`` option,
which ``UniAPStrategy(compression=...)``, ``uniap plan compression=...`` (and ``uniap train
strategy.compression=...``) and ``Problem`` / ``build_problem`` all read through :func:`compression_methods`: the
same values, the same one-line refusal. (It predates :class:`~.base.OptIn` and still threads its own
``compression`` field and keyword: the problem, the slot, ``strategies_for``, the setup and the plan cache key.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.base import Column, Dimension, Field, Slot, one_of
from uniap_lightning.planner.dimensions.data import COMPRESSIBLE_DP_MODES, no_copies
from uniap_lightning.values import short

COMPRESSIONS = ("none", "bf16", "powersgd", "topk")


def compression_methods(value: Any, where: str = "compression") -> tuple[str, ...]:
    """The gradient compression methods the planner may choose per layer, from the user's ``compression`` option:
    ``None`` or ``"none"`` (off), a method (it or none, per layer), ``"auto"`` (any), or a list (or tuple) of
    methods (any of them; ``"none"`` may be among them, an empty list is off). Returned as a tuple in
    :data:`COMPRESSIONS` order that always holds ``"none"``. Anything else is refused in one line naming ``where``
    and the value as given (what the strategy, the command line and the problem all say)."""
    methods = COMPRESSIONS[1:]
    if value is None:
        return ("none",)
    named = (list(COMPRESSIONS) if value == "auto" else [value]) if isinstance(value, str) else value
    if isinstance(named, (list, tuple)) and all(isinstance(v, str) and v in COMPRESSIONS for v in named):
        return tuple(m for m in COMPRESSIONS if m == "none" or m in named)
    unknown = [v for v in named if v not in COMPRESSIONS] if isinstance(named, (list, tuple)) else []
    raise UniAPError(f"{where}={short(value)} must be one of None, {', '.join(map(repr, methods))}, 'auto' or a list "
                     f"of methods{f' (unknown: {short(unknown)})' if unknown and len(named) > 1 else ''}: None or "
                     "'none': off; a method: the planner may use it per layer; 'auto': any; a list: any of those "
                     "(it changes numerics, so it is opt-in)")


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
