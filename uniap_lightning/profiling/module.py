"""Profile a chain of layers: measured on a real sample micro-batch, or from its structure when that is impossible.

The work is split by job: :mod:`.timing` (the one timer), :mod:`.measure` (running and timing the layers),
:mod:`.aggregate` (identical layers pooled, noise removed, ranks combined: the rule that identical layers get
identical numbers is stated there) and :mod:`.structural` (the fallback). :func:`profile_chain` is the entry point
the strategy's setup uses; the names below stay importable from here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from uniap_lightning.planner.profile import ModelProfile
from uniap_lightning.profiling.aggregate import median_over_ranks, structure_key
from uniap_lightning.profiling.measure import (
    Context,
    ProfilingUnavailable,
    default_micro_batches,
    profile_layers,
    training_state_kept,
)
from uniap_lightning.profiling.structural import NOMINAL_FLOPS, structural_profile


def profile_chain(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    sample_input: torch.Tensor | None,
    *,
    tp_degrees: Sequence[Sequence[int]] | None = None,
    tp_allreduces: Sequence[int] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    micro_batches: Sequence[int] | None = None,
    model: str = "model",
    device: str = "",
    progress: Callable[[str], None] | None = None,
    why_no_input: str = "",
    sync: Callable[[], Any] | None = None,
    context: Context = nullcontext,
) -> ModelProfile:
    """Measure the chain; when that is impossible, warn and return the structural profile instead (no crash).

    A broken chain contract (a layer returning a tuple) raises :class:`~uniap_lightning.errors.UniAPError`.
    """
    kw: dict[str, Any] = dict(tp_degrees=tp_degrees, tp_allreduces=tp_allreduces, model=model, device=device)
    device_type = sample_input.device.type if isinstance(sample_input, torch.Tensor) else "cpu"
    reason = why_no_input or "no sample batch"
    if sample_input is not None:
        try:
            return profile_layers(layers, names, sample_input, repeats=repeats, warmup=warmup,
                                  micro_batches=micro_batches, progress=progress, sync=sync, context=context, **kw)
        except ProfilingUnavailable as err:
            reason = str(err)
    warnings.warn(
        f"UniAP could not measure the model ({reason}); planning with a structural profile instead (parameter "
        "counts and output sizes from the modules, times from a nominal FLOP rate). The plan fits memory as far "
        "as the structure tells, but its predicted times are rough; pass profile=<file> for a measured one.",
        stacklevel=2,
    )
    return structural_profile(layers, names, sample_input, device_type=device_type, reason=reason, **kw)


__all__ = [
    "NOMINAL_FLOPS", "ProfilingUnavailable", "default_micro_batches", "median_over_ranks", "profile_chain",
    "profile_layers", "structural_profile", "structure_key", "training_state_kept",
]
