"""The structural fallback: a profile from the modules alone, when the layers cannot be run on a real batch.

Used when measuring is impossible (meta-device parameters or input, a batch the model rejects, an empty
dataloader). Such a profile has ``source="structural"``: enough to plan, not to trust the predicted times.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from uniap_lightning.planner.profile import LayerProfile, ModelProfile
from uniap_lightning.runtime.payload import call_layer, flatten, map_tensors, nbytes

#: nominal FLOP/s used by the structural fallback (per device), only to rank layers by cost
NOMINAL_FLOPS = {"cpu": 5e10, "cuda": 1e14}


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def structural_profile(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    sample_input: torch.Tensor | None,
    *,
    tp_degrees: Sequence[Sequence[int]] | None = None,
    tp_allreduces: Sequence[int] | None = None,
    model: str = "model",
    device: str = "",
    device_type: str = "cpu",
    reason: str = "",
) -> ModelProfile:
    """A profile from the modules' structure alone (no timing).

    Output bytes come from running the layers on meta tensors shaped like ``sample_input`` (0 where a layer
    cannot run on meta tensors or no input is known); activations are taken as 4x the output (a typical block
    saves a few tensors of its output's size); forward time is ``2 * params * tokens / NOMINAL_FLOPS`` with
    ``tokens`` the output's elements per sample over its last dimension; backward is twice the forward.
    """
    flops = NOMINAL_FLOPS.get(device_type, NOMINAL_FLOPS["cpu"])

    x: Any = None
    if sample_input is not None:
        x = map_tensors(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), sample_input)
    out: list[LayerProfile] = []
    for i, (layer, name) in enumerate(zip(layers, names, strict=True)):
        params = sum(p.numel() for p in layer.parameters())
        out_bytes, tokens = 0.0, 1.0
        if x is not None:
            try:
                with torch.no_grad():
                    y = call_layer(_meta_copy(layer), x)
                first = flatten(y)[0]
                rows = max(int(first.shape[0]), 1)
                out_bytes = nbytes(y) / rows
                tokens = first.numel() / rows / max(int(first.shape[-1]), 1) if first.dim() > 1 else 1.0
                x = y
            except Exception:  # noqa: BLE001 - any failure only loses the size estimate
                x = None
        fwd = 2.0 * params * tokens / flops
        out.append(
            LayerProfile(
                name=name, forward_s=fwd, backward_s=2 * fwd, params=params, activation_bytes=4 * out_bytes,
                output_bytes=out_bytes, tp_degrees=tuple(tp_degrees[i]) if tp_degrees else (1,),
                tp_allreduces=int(tp_allreduces[i]) if tp_allreduces else 0,
                param_tensors=sum(1 for p in layer.parameters() if p.requires_grad),
                backward_peak_bytes=2 * out_bytes,  # at least the gradient received and the one handed back
                **powersgd_dims(layer),
            )
        )
    return ModelProfile(model=model, layers=out, source="structural", device=device,
                        meta={"fallback_reason": reason, "nominal_flops": flops})


def powersgd_dims(layer: nn.Module) -> dict[str, Any]:
    """The profile's PowerSGD pricing fields of ``layer``'s trainable parameters: ``matrix_dims``, the sum over
    parameters with ``ndim >= 2`` of ``shape[0] + numel / shape[0]`` (PowerSGD sends ``rank x`` that many numbers),
    and ``vector_params``, the elements of the others (sent uncompressed). Shapes are the full parameters'; meta
    tensors work."""
    matrix, vector = 0, 0
    for p in layer.parameters():
        if not p.requires_grad:
            continue
        if p.dim() >= 2 and p.numel():
            matrix += p.shape[0] + p.numel() // p.shape[0]
        else:
            vector += p.numel()
    return {"matrix_dims": float(matrix), "vector_params": vector}


def _meta_copy(layer: nn.Module) -> nn.Module:
    if all(p.is_meta for p in layer.parameters()) and all(b.is_meta for b in layer.buffers()):
        return layer
    return copy.deepcopy(layer).to("meta")
