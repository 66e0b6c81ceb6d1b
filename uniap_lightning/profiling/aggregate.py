"""Turning raw readings into the numbers the planner uses: identical layers pooled, noise removed, ranks combined.

**Identical layers get identical cost numbers.** Layers of the same structure (:func:`structure_key`: class and
parameter shapes) with the same output and activation sizes compute the same function on the same shapes, so
:func:`pool_identical_layers` gives all of them the median of their readings (a transformer's N blocks give N
samples of one cost). The planner relies on this rule: its MILP (``uniap_lightning.planner.solver.milp``) treats a
run of consecutive layers with equal cost terms (``runs_of`` in ``uniap_lightning.planner.cost.layer``) as one
integer count, so blocks that differed only by timing noise would break the run into single layers and bring back
the symmetric per-layer search. :func:`median_over_ranks` keeps the rule (a median of equal numbers is equal),
and :mod:`.strategies` times each distinct layer once and shares its overheads with its copies.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from uniap_lightning.planner.profile import ModelProfile, Timing

#: readings per micro-batch size: ``{size: [(forward_s, backward_s) per layer]}``
Readings = dict[int, list[tuple[float, float]]]


def structure_key(layer: nn.Module) -> tuple[Any, ...]:
    """Layers with equal keys (type, parameter shapes and, where the layer defines ``uniap_structure_key()``, what
    else decides its cost - e.g. a Swin block's window shift or a T5 block's cross-attention) compute the same
    function shape: they cost the same. Layers of different classes, shapes or answers are never pooled."""
    extra = layer.uniap_structure_key() if hasattr(layer, "uniap_structure_key") else None
    return (type(layer).__qualname__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()), repr(extra))


def pool_identical_layers(layers: Sequence[nn.Module], sizes_bytes: Sequence[tuple[int, float]],
                          readings: Readings) -> None:
    """In place: every layer of a group of identical layers (same structure, same output and activation bytes in
    ``sizes_bytes``) gets the median of the group's readings at every size (the rule in the module docstring)."""
    groups: dict[Any, list[int]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault((structure_key(layer), *sizes_bytes[i]), []).append(i)
    for members in (g for g in groups.values() if len(g) > 1):
        for times in readings.values():
            f = statistics.median(times[i][0] for i in members)
            b = statistics.median(times[i][1] for i in members)
            for i in members:
                times[i] = (f, b)


def never_faster_when_larger(readings: Readings) -> None:
    """In place: a larger micro-batch never takes less time; a smaller reading at a larger size is noise (another
    process took the core), so each pass's times become a running maximum, smallest size first."""
    sizes = sorted(readings)
    if not sizes:
        return
    for i in range(len(readings[sizes[0]])):
        hi_f = hi_b = 0.0
        for m in sizes:
            f, b = readings[m][i]
            hi_f, hi_b = max(hi_f, f), max(hi_b, b)
            readings[m][i] = (hi_f, hi_b)


def median_over_ranks(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """One profile from the same chain measured on several ranks at once: every time, and the weight-gradient
    fraction, is the median over the ranks (sizes, bytes and the rest from the first). A rank that happened to run alone for a moment, or was
    descheduled, does not decide the plan."""
    first = profiles[0]
    if len(profiles) == 1:
        return first
    med = statistics.median
    layers = []
    for i, lp in enumerate(first.layers):
        peers = [p.layers[i] for p in profiles]
        timings = tuple(
            Timing(t.micro_batch, med(q.timings[j].forward_s for q in peers),
                   med(q.timings[j].backward_s for q in peers))
            for j, t in enumerate(lp.timings)
        ) if all(len(q.timings) == len(lp.timings) for q in peers) else lp.timings
        fracs = [q.weight_grad_fraction for q in peers if q.weight_grad_fraction is not None]
        overheads = [q.backward_split_overhead for q in peers if q.backward_split_overhead is not None]
        layers.append(replace(lp, forward_s=med(q.forward_s for q in peers),
                              backward_s=med(q.backward_s for q in peers), timings=timings,
                              weight_grad_fraction=med(fracs) if fracs else None,
                              backward_split_overhead=med(overheads) if overheads else None))
    meta = dict(first.meta)
    meta["ranks_combined"] = len(profiles)
    return ModelProfile(model=first.model, layers=layers, source=first.source, device=first.device, meta=meta)
