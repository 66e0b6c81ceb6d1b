"""Measure a chain of ``nn.Module`` layers on a real sample micro-batch and return a :class:`ModelProfile`.

Per layer: parameter count, output bytes and saved-activation bytes per sample (from a real forward, counting
the tensors autograd saves for backward, parameters excluded), and forward / backward seconds per sample (median
of ``repeats`` timed runs after one warm-up, ``time.perf_counter``). Kept simple on purpose: one micro-batch size,
no memory-allocator statistics; the cost model only needs per-sample figures.

Profiling must not change training: the RNG state and every buffer (e.g. batch-norm statistics) are restored and
gradients are cleared afterwards.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from uniap_lightning.profiling.schema import LayerProfile, ModelProfile


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _measure_layer(layer: nn.Module, x: torch.Tensor, repeats: int) -> tuple[torch.Tensor, float, float, float]:
    """Run the layer: (detached output, forward s, backward s, saved activation bytes) for the whole input."""
    param_ptrs = {p.data_ptr() for p in layer.parameters()}
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in param_ptrs:
            saved[0] += _tensor_bytes(t)
        return t

    def run(count_saved: bool) -> tuple[torch.Tensor, float, float]:
        inp = x.detach().requires_grad_(x.is_floating_point())
        t0 = time.perf_counter()
        if count_saved:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(inp)
        else:
            out = layer(inp)
        t1 = time.perf_counter()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        return out.detach(), t1 - t0, t2 - t1

    out, _, _ = run(count_saved=True)  # warm-up, and the saved-tensor count
    fwd, bwd = [], []
    for _ in range(max(repeats, 1)):
        _, f, b = run(count_saved=False)
        fwd.append(f)
        bwd.append(b)
    return out, statistics.median(fwd), statistics.median(bwd), float(saved[0])


def profile_layers(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    sample_input: torch.Tensor,
    *,
    tp_degrees: Sequence[Sequence[int]] | None = None,
    tp_allreduces: Sequence[int] | None = None,
    repeats: int = 3,
    model: str = "model",
    device: str = "",
) -> ModelProfile:
    """Profile ``layers`` applied in order to ``sample_input`` (batch on dim 0)."""
    rows = sample_input.shape[0]
    rng = torch.get_rng_state()
    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    out: list[LayerProfile] = []
    x: Any = sample_input
    try:
        for i, (layer, name) in enumerate(zip(layers, names, strict=True)):
            y, fwd_s, bwd_s, act_bytes = _measure_layer(layer, x, repeats)
            out.append(
                LayerProfile(
                    name=name,
                    forward_s=fwd_s / rows,
                    backward_s=bwd_s / rows,
                    params=sum(p.numel() for p in layer.parameters()),
                    activation_bytes=act_bytes / rows,
                    output_bytes=_tensor_bytes(y) / rows,
                    tp_degrees=tuple(tp_degrees[i]) if tp_degrees else (1,),
                    tp_allreduces=int(tp_allreduces[i]) if tp_allreduces else 0,
                )
            )
            x = y
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for layer in layers:
            for p in layer.parameters():
                p.grad = None
    return ModelProfile(model=model, layers=out, source="measured", device=device, meta={"micro_batch": rows})
