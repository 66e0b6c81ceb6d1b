"""Profile a chain of layers: measured on a real sample micro-batch, or from its structure when that is impossible.

The work is split by job: :mod:`.timing` (the one timer), :mod:`.measure` (running and timing the layers),
:mod:`.aggregate` (identical layers pooled, noise removed, ranks combined: the rule that identical layers get
identical numbers is stated there) and :mod:`.structural` (the fallback). :func:`profile_chain` is the entry point
the strategy's setup uses; the names below stay importable from here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from uniap_lightning.planner.profile import ModelProfile
from uniap_lightning.profiling.aggregate import median_over_ranks, structure_key
from uniap_lightning.profiling.estimate import default_micro_batches
from uniap_lightning.profiling.measure import ProfilingUnavailable, profile_layers, training_state_kept
from uniap_lightning.profiling.structural import NOMINAL_FLOPS, structural_profile
from uniap_lightning.runtime.experts import expert_profile_fields
from uniap_lightning.runtime.payload import flatten, is_payload
from uniap_lightning.runtime.sequence import sequence_info


def profile_chain(layers: Sequence[nn.Module], names: Sequence[str], sample_input: torch.Tensor | None, *,
                  why_no_input: str = "", **options: Any) -> ModelProfile:
    """Measure the chain with :func:`profile_layers` (``options`` are its keyword arguments); when that is
    impossible, warn and return the structural profile instead (no crash).

    A broken chain contract (a layer returning a tuple) raises :class:`~uniap_lightning.errors.UniAPError`.
    """
    reason = why_no_input or "no sample batch"
    if sample_input is not None:
        try:
            measured = profile_layers(layers, names, sample_input, **options)
            return with_expert_fields(with_sequence_fields(measured, layers, sample_input, options.get("loss_fn")),
                                      layers)
        except ProfilingUnavailable as err:
            reason = str(err)
    warnings.warn(
        f"UniAP could not measure the model ({reason}); planning with a structural profile instead (parameter "
        "counts and output sizes from the modules, times from a nominal FLOP rate). The plan fits memory as far "
        "as the structure tells, but its predicted times are rough; pass profile=<file> for a measured one.",
        stacklevel=2,
    )
    kept = {k: options[k] for k in ("tp_degrees", "tp_allreduces", "model", "device") if k in options}

    device_type = flatten(sample_input)[0].device.type if is_payload(sample_input) else "cpu"
    return with_expert_fields(with_sequence_fields(
        structural_profile(layers, names, sample_input, device_type=device_type, reason=reason, **kept),
        layers, sample_input, options.get("loss_fn")), layers)


def sample_sequence_length(sample_input: Any) -> int | None:
    """The sample's tokens per sequence: dim 1 of its first tensor with two or more dimensions (``None``: none)."""
    if sample_input is None or not is_payload(sample_input):
        return None
    for t in flatten(sample_input):
        if t.dim() >= 2:
            return int(t.shape[1])
    return None


def with_sequence_fields(profile: ModelProfile, layers: Sequence[nn.Module], sample_input: Any,
                         loss_fn: Any = None) -> ModelProfile:
    """The profile's sequence fields (``sequence_length``, ``attention_heads``, ``kv_heads``,
    ``sequence_parallel``; :mod:`uniap_lightning.planner.profile`) from each layer's ``uniap_sequence()``
    declaration (:func:`uniap_lightning.runtime.sequence.sequence_info`) and the sample's sequence length, so the
    planner may split the sequence (cp) or run sequence parallelism (sp) on the layers that declare them. Layers
    that declare nothing, or a sample without a sequence dimension, leave the fields out. A ``loss_fn`` that
    declares its sequence form (``uniap_sequence_loss``: "token" or "next_token", the runtime's ``piece_loss``)
    marks the last layer ``loss_on_pieces`` when that layer may split the sequence."""
    length = sample_sequence_length(sample_input)
    if length is None:
        return profile
    out = []
    for lp, layer in zip(profile.layers, layers, strict=True):
        info = sequence_info(layer)
        if info is not None:
            lp = replace(lp, sequence_length=length, attention_heads=info["attention_heads"],
                         kv_heads=info["kv_heads"], sequence_parallel=info["sequence_parallel"])
        out.append(lp)
    if out and out[-1].sequence_length is not None and \
            getattr(loss_fn, "uniap_sequence_loss", None) in ("token", "next_token"):
        out[-1] = replace(out[-1], loss_on_pieces=True)
    return replace(profile, layers=out)


def with_expert_fields(profile: ModelProfile, layers: Sequence[nn.Module]) -> ModelProfile:
    """The profile's expert fields (``experts``, ``top_k``, ``expert_params``, ``capacity_factor``;
    :mod:`uniap_lightning.planner.profile`) from each layer's mixture-of-experts modules
    (:func:`uniap_lightning.runtime.experts.expert_profile_fields`: the project's own MoE and Hugging Face's stacked
    experts), so the planner may split their experts (``ep``). Dense layers keep none."""
    out = []
    for lp, layer in zip(profile.layers, layers, strict=True):
        fields = expert_profile_fields(layer)
        out.append(replace(lp, **fields) if fields else lp)
    return replace(profile, layers=out)


__all__ = [
    "NOMINAL_FLOPS", "ProfilingUnavailable", "default_micro_batches", "median_over_ranks", "profile_chain",
    "profile_layers", "structural_profile", "structure_key", "training_state_kept", "with_expert_fields",
    "with_sequence_fields",
]
