"""The per-operation analytic model: a layer's forward and backward traced as operations, each priced by a roofline
on the catalogue's device (:mod:`uniap_lightning.planner.devices`).

How a layer is priced, for layers nobody has profiled on the device (``uniap plan cluster=...`` for a cluster you
don't own):

1. **Trace.** A reference implementation of the layer (:func:`block_forward` and friends: the transformer block
   the model config describes, at the tensor-parallel slice one rank runs) runs forward and backward on the
   ``meta`` device under a dispatch mode that records every aten operation with its tensors' shapes and dtypes.
   Nothing is computed and no memory is taken; the operations are the ones eager PyTorch launches. FLOPs come
   from torch's own formulas (:data:`torch.utils.flop_counter.flop_registry`); bytes from the tensors each
   operation reads and writes. The tensors autograd saves for backward (``saved_tensors_hooks``, counted once per
   storage, parameters left out) are the layer's activation memory, by dtype and attention implementation.
2. **Price.** A matmul takes ``max(FLOPs / (peak(dtype) x efficiency), bytes / bandwidth)``, with the efficiency of
   its shape: the output's 128 x 128 tiles run in waves over the device's SMs (a last, partly filled wave wastes
   the rest: ``tiles / (waves x SMs)``), a short reduction dimension ``K`` pays its pipeline's fill
   (``K / (K + 128)``), and even a large matmul reaches :data:`MATMUL_EFFICIENCY` of the datasheet peak. Every other
   operation (norms, softmax, dropout, element-wise, the loss) is memory bound: ``bytes / (bandwidth x``
   :data:`MEMORY_EFFICIENCY` ``)``; a softmax over rows of 1025 to 4096 runs torch's block kernels,
   latency bound, at :data:`SOFTMAX_LONG_ROW_EFFICIENCY` of the bandwidth (a materialized 2048-key attention's largest
   term: ~1 TB/s on a GH200). Fused flash attention is one operation of its FLOPs at
   :data:`ATTENTION_EFFICIENCY`. Every kernel takes at least :data:`KERNEL_FLOOR_S`: eager PyTorch spends that
   on the host per operation (dispatch, autograd bookkeeping, the launch), so a small micro-batch is bound by the
   number of operations, not by their size: a micro-batch of 8 is not 8 times a micro-batch of 1.
3. **Hand over.** :func:`layer_costs` returns per-sample times at several micro-batch sizes (the profile's
   ``timings``, interpolated by the cost model), the tensor-parallel slices' times (the profile's ``tp``
   overheads, which also carry the activation all-reduces priced by the cluster's links) and the activation bytes.

The tracer is :mod:`uniap_lightning.profiling.trace_ops`, the reference layers
:mod:`uniap_lightning.profiling.reference_layers`; this module prices their operations.

Where this model stands against measured runs: ``benchmarks/measured.py`` and BENCHMARKS.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import torch

from uniap_lightning.planner.devices import (ATTENTION_EFFICIENCY, KERNEL_FLOOR_S, MATMUL_EFFICIENCY,
                                              MEMORY_EFFICIENCY, SOFTMAX_LATENCY_ROW, SOFTMAX_LONG_ROW_EFFICIENCY,
                                              SOFTMAX_WARP_ROW, DeviceSpec)
from uniap_lightning.profiling.reference_layers import (BlockShape, block_forward, classifier_forward,
                                                        embed_forward, lm_head_forward, patch_embed_forward)
from uniap_lightning.profiling.trace_ops import Op, Trace, trace
from uniap_lightning.planner.cost.comm import all_reduce_s
from uniap_lightning.planner.profile import Overhead, Timing

__all__ = ["BlockShape", "LayerCosts", "MICRO_BATCHES", "Op", "TILE", "Trace", "block_forward", "cached_trace",
           "layer_costs", "matmul_dtype", "matmul_efficiency", "op_seconds", "roofline_profile", "trace",
           "trace_seconds", "KERNEL_FLOOR_S", "MATMUL_EFFICIENCY"]

#: a matmul's output tile (rows x columns per thread block of a tensor-core kernel)
TILE = 128
#: micro-batch sizes the timings are traced at (the cost model interpolates between them, linearly beyond)
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)


# ---------------------------------------------------------------------------------------------- pricing
def matmul_efficiency(shape: tuple[int, int, int, int], device: DeviceSpec) -> float:
    """The share of the peak a matmul of ``(batch, M, N, K)`` reaches: :data:`MATMUL_EFFICIENCY`, times the
    filled share of its last wave of output tiles over the SMs, times ``K / (K + TILE)`` (the pipeline's fill)."""
    batch, m, n, k = shape
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / device.sms)
    return MATMUL_EFFICIENCY * tiles / (waves * device.sms) * k / (k + TILE)


def op_seconds(op: Op, device: DeviceSpec, matmul_dtype: str, floor_s: float = KERNEL_FLOOR_S) -> float:
    """One operation's time on ``device`` (the roofline of the module docstring, never below ``floor_s``: the
    host's cost of one eager operation)."""
    latency_bound = SOFTMAX_WARP_ROW < op.row <= SOFTMAX_LATENCY_ROW  # torch's block softmax kernels
    efficiency = SOFTMAX_LONG_ROW_EFFICIENCY if latency_bound else MEMORY_EFFICIENCY
    memory_s = op.bytes / (device.hbm_bytes_per_s * efficiency)
    if op.flops > 0:
        peak = device.peak(matmul_dtype) or device.peak("fp32") or 1e12
        if op.fused_attention:
            compute_s = op.flops / (peak * ATTENTION_EFFICIENCY)
        elif op.shape is not None:
            compute_s = op.flops / (peak * matmul_efficiency(op.shape, device))
        else:  # a FLOP-counted operation that is not a plain matmul (convolution): at the large-matmul efficiency
            compute_s = op.flops / (peak * MATMUL_EFFICIENCY)
        return max(compute_s, memory_s, floor_s)
    return max(memory_s, floor_s)


def trace_seconds(tr: Trace, device: DeviceSpec, matmul_dtype: str,
                  floor_s: float = KERNEL_FLOOR_S) -> tuple[float, float]:
    """``(forward, backward)`` seconds of a traced layer."""
    return (sum(op_seconds(op, device, matmul_dtype, floor_s) for op in tr.forward),
            sum(op_seconds(op, device, matmul_dtype, floor_s) for op in tr.backward))


def cached_trace(kind: str, key: tuple, micro_batch: int, tp: int) -> Trace:
    """The trace of one layer kind (``block``, ``embed``, ``lm_head``, ``classifier``, ``patch_embed``) at
    ``micro_batch``: traced at 1 and 2 samples, every operation's FLOPs, bytes and matmul dimensions extended
    linearly in the micro-batch (exact for these layers: each term is a constant, from the weights, plus one
    proportional to the samples), so a micro-batch of 64 costs two small traces."""
    if micro_batch in (1, 2):
        return _traced(kind, key, micro_batch, tp)
    one, two = _traced(kind, key, 1, tp), _traced(kind, key, 2, tp)
    if len(one.forward) != len(two.forward) or len(one.backward) != len(two.backward):
        return _traced(kind, key, micro_batch, tp)  # (another operation sequence at 2 samples: trace it)
    k = micro_batch - 1

    def extend(a: Op, b: Op) -> Op:
        shape = None
        if a.shape is not None and b.shape is not None:
            shape = tuple(x + (y - x) * k for x, y in zip(a.shape, b.shape))
        return Op(a.name, a.flops + (b.flops - a.flops) * k, a.bytes + (b.bytes - a.bytes) * k, shape,
                  a.fused_attention, a.row)

    return Trace(tuple(map(extend, one.forward, two.forward)), tuple(map(extend, one.backward, two.backward)),
                 one.saved_bytes + (two.saved_bytes - one.saved_bytes) * k)


@lru_cache(maxsize=512)  # bounded: traces of the shapes planned recently (a model has a few distinct layers)
def _traced(kind: str, key: tuple, micro_batch: int, tp: int) -> Trace:
    with torch.device("meta"):
        if kind == "block":
            return trace(block_forward(key[0], micro_batch, tp))
        if kind == "embed":
            return trace(embed_forward(*key, micro_batch=micro_batch, tp=tp))
        if kind == "lm_head":
            return trace(lm_head_forward(*key, micro_batch=micro_batch, tp=tp))
        if kind == "classifier":
            return trace(classifier_forward(*key, micro_batch=micro_batch))
        if kind == "patch_embed":
            return trace(patch_embed_forward(*key, micro_batch=micro_batch))
    raise ValueError(f"unknown layer kind {kind!r}")


@dataclass(frozen=True)
class LayerCosts:
    """What :func:`layer_costs` hands to the analytic profile (seconds, bytes; per call of ``micro_batch``)."""

    timings: tuple[tuple[int, float, float], ...]  # (micro_batch, forward_s, backward_s) at tp = 1
    tp_timings: dict[int, tuple[tuple[int, float], ...]]  # tp -> ((micro_batch, forward + backward s), ...)
    activation_bytes: float  # per sample, tp = 1
    activation_tp_fraction: float


def layer_costs(kind: str, key: tuple, device: DeviceSpec, matmul_dtype: str, tp_degrees: Sequence[int],
                *, micro_batches: Sequence[int] = MICRO_BATCHES, floor_s: float = KERNEL_FLOOR_S) -> LayerCosts:
    """Times at each micro-batch size (tp 1 and each degree of ``tp_degrees``) and activation bytes per sample."""
    timings = []
    for mb in micro_batches:
        f, b = trace_seconds(cached_trace(kind, key, mb, 1), device, matmul_dtype, floor_s)
        timings.append((mb, f, b))
    tp_timings: dict[int, tuple[tuple[int, float], ...]] = {}
    for t in tp_degrees:
        if t > 1:
            tp_timings[t] = tuple((mb, sum(trace_seconds(cached_trace(kind, key, mb, t), device, matmul_dtype,
                                                             floor_s)))
                                  for mb in micro_batches)
    act1 = cached_trace(kind, key, 1, 1).saved_bytes
    fraction = 1.0
    split = [t for t in tp_degrees if t > 1]
    if split and act1 > 0:
        t = min(split)
        act_t = cached_trace(kind, key, 1, t).saved_bytes
        fraction = max(0.0, min(1.0, (1 - act_t / act1) / (1 - 1 / t)))
    return LayerCosts(tuple(timings), tp_timings, act1, fraction)


# ---------------------------------------------------------------------------------------------- the profile
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def matmul_dtype(dtype: str, tf32: bool, device: DeviceSpec) -> str:
    """The tensor-core unit a model of ``dtype`` runs its matmuls on (``tf32`` for fp32 when allowed and present;
    a 16-bit dtype the device lacks runs at its fp32 rate)."""
    key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    if key == "fp32":
        return "tf32" if tf32 and device.has("tf32") else "fp32"
    return key if device.has(key) else "fp32"


def roofline_profile(spec: Any, cluster: Any, flat: Any) -> Any:
    """``flat`` (the analytic profile of ``spec`` on ``cluster``: parameters, shapes, tensor-parallel degrees) with
    each layer's times, tensor-parallel times and activation bytes from the traced operations on the catalogue
    device the cluster names."""
    device = cluster.device_spec
    mm = matmul_dtype(spec.dtype, spec.tf32, device)
    dtype = _DTYPES[spec.dtype]
    blocks = [seg for seg in spec.blocks() for _ in range(seg.layers)]
    first, last = spec.blocks()[0], spec.blocks()[-1]
    layers = []
    for u, lp in enumerate(flat.layers):
        if u == 0:
            if spec.embedding == "token":
                key: tuple = (first.seq_len, first.hidden, spec.vocab, spec.family in ("gpt2", "bert", "t5"),
                              spec.dropout, dtype)
                kind = "embed"
            else:
                key, kind = (first.seq_len, first.hidden, spec.channels * spec.patch_size**2, dtype), "patch_embed"
        elif u == len(flat.layers) - 1:
            if spec.head == "lm":
                key, kind = (last.seq_len, last.hidden, spec.vocab, not spec.gated_mlp, dtype), "lm_head"
            else:
                key, kind = (last.seq_len, last.hidden, spec.num_classes, dtype), "classifier"
        else:
            seg = blocks[u - 1]
            key = (BlockShape(
                seq_len=seg.seq_len, hidden=seg.hidden, heads=seg.heads, kv_heads=seg.kv_heads or seg.heads,
                ffn=(spec.expert_ffn or seg.ffn) if spec.experts else seg.ffn,
                attended=min(seg.window or seg.seq_len, seg.seq_len), cross_attention=seg.cross_attention,
                gated_mlp=spec.gated_mlp, bias=spec.bias, flash_attention=spec.flash_attention,
                dropout=spec.dropout, dtype=dtype,
                attention_dropout=spec.dropout if spec.attention_dropout is None else spec.attention_dropout,
                experts=spec.experts, top_k=spec.top_k if spec.experts else 1,
                shared_ffn=spec.shared_expert_ffn),)
            kind = "block"
        tps = [t for t in lp.tp_degrees if t <= cluster.devices_per_node]
        costs = layer_costs(kind, key, device, mm, tps, floor_s=cluster.kernel_floor_us * 1e-6)
        overheads = []
        for t, rows in costs.tp_timings.items():
            for (mb, seconds), (_, f1, b1) in zip(rows, costs.timings):
                # what the cost model adds to the divided single-device compute: the slice's own time beyond it
                # (thin matmuls, unsplit norms, per-operation floors) and the activation all-reduces
                comm = 2 * lp.tp_allreduces * all_reduce_s(cluster, lp.output_bytes * mb, t, False)
                if kind == "lm_head":  # its input's gradient (a column-parallel linear's backward) and the
                    # vocabulary-parallel loss's three per-token fp32 all-reduces (reference_layers._VocabParallelLoss)
                    comm = (all_reduce_s(cluster, mb * last.seq_len * last.hidden * dtype.itemsize, t, False)
                            + 3 * all_reduce_s(cluster, mb * last.seq_len * 4.0, t, False))
                overheads.append(Overhead("tp", t, mb, seconds - (f1 + b1) / t + comm))
        f1, b1 = costs.timings[0][1], costs.timings[0][2]
        layers.append(replace(
            lp, forward_s=f1, backward_s=b1,
            timings=tuple(Timing(mb, f, b) for mb, f, b in costs.timings),
            overheads=tuple(overheads),
            activation_bytes=costs.activation_bytes,
            activation_tp_fraction=costs.activation_tp_fraction if kind == "block" else lp.activation_tp_fraction,
        ))
    return replace(flat, layers=layers, source="analytic", meta={**flat.meta, "compute_model": "roofline",
                                                                 "matmul_dtype": mm})
