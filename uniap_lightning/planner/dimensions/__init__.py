"""The dimensions of the per-layer decision, one module each, and their one ordered registry.

Each module declares one :class:`~.base.Dimension`: its fields in the decision record
(:class:`~uniap_lightning.planner.decision.Strategy`) with their types and defaults, its canonicalization rule
(``Strategy.of``), its label fragment, its checks, its plan-JSON reading (the format version that added each field
and how older files read), its report columns, each field's candidate options and its cost terms (hooks on the
layer's pricing). The record, the candidate enumeration (:func:`candidates`), the plan JSON reader and its format
version, the layer's pricing (:func:`price`) and the report loop over :data:`DIMENSIONS` and name no dimension. Torch-free. See ``docs/architecture.md`` ("Dimensions") for the orders and how to add a dimension.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.base import (COST_PHASES, REQUIRED, Column, Dimension, Field, LayerTerms,
                                                     OptIn, Slot)
from uniap_lightning.planner.dimensions.compression import COMPRESSION
from uniap_lightning.planner.dimensions.context import CONTEXT
from uniap_lightning.planner.dimensions.data import DATA
from uniap_lightning.planner.dimensions.experts import EXPERTS
from uniap_lightning.planner.dimensions.offload import OFFLOAD
from uniap_lightning.planner.dimensions.precision import PRECISION
from uniap_lightning.planner.dimensions.recompute import RECOMPUTE
from uniap_lightning.planner.dimensions.state_offload import STATE_OFFLOAD
from uniap_lightning.planner.dimensions.tensor import TENSOR

#: THE registry. Its order: the stage's device grid ``dp x cp x tp`` outer to inner, then what modifies a layer
#: without taking devices (experts over the replicas, gradient compression, recomputation, activation offload,
#: matmul precision, state offload). The label's grid fragments and ``+...`` suffixes, the relational checks and
#: the report's grid columns follow it.
DIMENSIONS: tuple[Dimension, ...] = (DATA, CONTEXT, TENSOR, EXPERTS, COMPRESSION, RECOMPUTE, OFFLOAD, PRECISION,
                                     STATE_OFFLOAD)

#: Three orders of the same fields that are fixed by history, each a permutation the registry checks on import:
#: the decision record's fields (public: positional construction, pickles, the plan JSON's key order; a new field
#: goes at the end, with a default)
RECORD: tuple[str, ...] = ("dp", "tp", "dp_mode", "recompute", "compression", "cp", "cp_method", "sp", "ep",
                           "offload", "precision", "state_offload")
#: the order the candidate enumeration chooses fields in, outer first (a field's options read the choices before
#: it; the order of the candidates, which the solver's tie-breaking sees, follows it)
CHOICES: tuple[str, ...] = ("tp", "cp", "dp", "cp_method", "dp_mode", "compression", "ep", "sp", "recompute",
                            "offload", "precision", "state_offload")
#: the report's per-layer columns: the degrees in the registry's order, then the state and gradient modes
COLUMNS: tuple[str, ...] = ("dp", "cp", "cp method", "tp", "sp", "ep", "dp mode", "recompute", "compression",
                            "offload", "precision", "state")

_BY_NAME: dict[str, Field] = {f.name: f for d in DIMENSIONS for f in d.fields}
_COLUMNS: dict[str, Column] = {c.header: c for d in DIMENSIONS for c in d.columns}
for _order, _names in (("RECORD", _BY_NAME), ("CHOICES", _BY_NAME), ("COLUMNS", _COLUMNS)):
    if sorted(globals()[_order]) != sorted(_names):  # pragma: no cover - a registry edit out of step
        raise AssertionError(f"dimensions.{_order} must order exactly {sorted(_names)}")

#: the record's fields, in its order
FIELDS: tuple[Field, ...] = tuple(_BY_NAME[name] for name in RECORD)
_CHOICE_FIELDS: tuple[Field, ...] = tuple(_BY_NAME[name] for name in CHOICES)
_record_of = operator.itemgetter(*RECORD)  # the chosen values (by field) as a tuple in record order
#: the report's per-layer columns, in :data:`COLUMNS` order
REPORT_COLUMNS: tuple[Column, ...] = tuple(_COLUMNS[h] for h in COLUMNS)
#: each pricing phase's hooks, in registry order (the dimensions that declare one)
_PRICES = {phase: tuple(getattr(d, phase) for d in DIMENSIONS if getattr(d, phase) is not None)
           for phase in COST_PHASES}
#: the per-job permissions the dimensions ask for (:class:`~.base.OptIn`), by option name, in registry order
OPT_INS: dict[str, OptIn] = {d.opt_in.option: d.opt_in for d in DIMENSIONS if d.opt_in is not None}


def opt_ins(given: Mapping[str, Any] | None = None) -> dict[str, tuple[str, ...]]:
    """Every opt-in's allowed per-layer values from the user's ``given`` values by option name (absent: off);
    refuses an unknown option or a bad value in one line."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(OPT_INS))
    if unknown:
        raise UniAPError(f"unknown opt-in option(s) {unknown}; known: {list(OPT_INS)}")
    return {name: o.allowed(given.get(name), name) for name, o in OPT_INS.items()}


#: the newest per-layer field's plan format version (the plan's format version is at least this)
NEWEST_FIELD_SINCE: int = max(f.since for f in FIELDS)


def price(phase: str, x: LayerTerms) -> None:
    """Every dimension's cost hook of ``phase`` (one of :data:`~.base.COST_PHASES`) on ``x``, in registry order."""
    for hook in _PRICES[phase]:
        hook(x)


def defaults() -> dict[str, Any]:
    """The record's defaults by field (the fields without one are left out)."""
    return {f.name: f.default for f in FIELDS if f.default is not REQUIRED}


def canonical(values: Mapping[str, Any]) -> tuple:
    """``values`` (every field) with each dimension's canonicalization applied, cast to the fields' types, in
    record order. Every rule reads the record as given (no rule reads a field another one resets)."""
    out = dict(values)
    for d in DIMENSIONS:
        out.update(d.canonical(values))
    return tuple(f.type(out[f.name]) for f in FIELDS)


def label(s: Any) -> str:
    """The strategy's label: the grid fragments joined by ``x`` (``single`` without any), then the suffixes."""
    return ("x".join(g for g in (d.grid(s) for d in DIMENSIONS) if g) or "single") + \
        "".join(d.suffix(s) for d in DIMENSIONS)


def check(s: Any, where: str, experts: int | None = None) -> None:
    """Every field's own check (record order), then every dimension's rules (registry order)."""
    for f in FIELDS:
        f.validate(getattr(s, f.name), where)
    for d in DIMENSIONS:
        d.rules(s, where, experts)


def read(x: dict, where: str, version: int) -> tuple:
    """A plan layer's record fields from its JSON object ``x`` written in format ``version``, in record order."""
    values: dict[str, Any] = {}
    for f in FIELDS:
        values[f.name] = f.read(x, where, version, values)
    return tuple(values[f.name] for f in FIELDS)


def candidates(slot: Slot) -> list[tuple]:
    """Every candidate record (as a tuple in record order) the layer allows in ``slot``: the fields chosen in
    :data:`CHOICES` order, each over its options given the choices before it (a nested loop, outer first)."""
    out: list[tuple] = []
    chosen: dict[str, Any] = {}
    last = len(_CHOICE_FIELDS) - 1

    def walk(i: int) -> None:
        f = _CHOICE_FIELDS[i]
        name = f.name
        if i == last:  # the innermost loop, flat
            for v in f.options(slot, chosen):
                chosen[name] = v
                out.append(_record_of(chosen))
            return
        for v in f.options(slot, chosen):
            chosen[name] = v
            walk(i + 1)

    walk(0)
    return out


def report_columns(strategies: list[Any]) -> tuple[Column, ...]:
    """The per-layer columns a report of ``strategies`` shows (a conditional column where some strategy needs
    it)."""
    return tuple(c for c in REPORT_COLUMNS if c.shown is None or any(c.shown(s) for s in strategies))


def explain_columns() -> tuple[Column, ...]:
    """The columns of ``explain``'s per-layer table, in :data:`COLUMNS` order."""
    return tuple(c for c in REPORT_COLUMNS if c.explain is not None)


__all__ = ["CHOICES", "COLUMNS", "COST_PHASES", "DIMENSIONS", "FIELDS", "NEWEST_FIELD_SINCE", "OPT_INS", "RECORD",
           "REPORT_COLUMNS", "REQUIRED", "Column", "Dimension", "Field", "LayerTerms", "OptIn", "Slot", "canonical",
           "candidates", "check", "defaults", "explain_columns", "label", "opt_ins", "price", "read",
           "report_columns"]
