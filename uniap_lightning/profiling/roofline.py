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

Where this model stands against measured runs: ``benchmarks/measured.py`` and BENCHMARKS.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from uniap_lightning.planner.devices import (ATTENTION_EFFICIENCY, KERNEL_FLOOR_S, MATMUL_EFFICIENCY,
                                              MEMORY_EFFICIENCY, SOFTMAX_LATENCY_ROW, SOFTMAX_LONG_ROW_EFFICIENCY,
                                              SOFTMAX_WARP_ROW, DeviceSpec)

#: a matmul's output tile (rows x columns per thread block of a tensor-core kernel)
TILE = 128
#: micro-batch sizes the timings are traced at (the cost model interpolates between them, linearly beyond)
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}
#: softmax kernels (forward and backward): priced by the length of the row they reduce. The loss's log-softmax is
#: left out: the measurement behind SOFTMAX_LONG_ROW_EFFICIENCY is an attention's softmax, and a vocabulary-parallel
#: loss (Megatron's) runs no torch log-softmax at all
_SOFTMAXES = {torch.ops.aten._softmax, torch.ops.aten._softmax_backward_data}
#: operations that launch no kernel: allocations, and ``_unsafe_view`` (a view its schema does not mark as one)
_CREATION = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty, torch.ops.aten.empty_strided,
             torch.ops.aten.lift_fresh, torch.ops.aten._unsafe_view}
_ACTIVE: list[_Recorder] = []  # the recorder of the trace running now (fused attention records itself into it)


@dataclass(frozen=True)
class Op:
    """One traced operation: its FLOPs, the bytes it moves, and for a matmul its shape ``(batch, M, N, K)``."""

    name: str
    flops: float
    bytes: float
    shape: tuple[int, int, int, int] | None = None  # a matmul's (batch, M, N, K); None: not a matmul
    fused_attention: bool = False
    row: int = 0  # a softmax's (forward or backward) reduced length; 0: not a softmax


@dataclass(frozen=True)
class Trace:
    """A layer's forward and backward operations and the bytes autograd saves between them."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    saved_bytes: float


# ---------------------------------------------------------------------------------------------- tracing
def _nbytes(x: Any) -> float:
    return float(x.numel() * x.element_size()) if isinstance(x, torch.Tensor) else 0.0


def _tensors(xs: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [xs]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def _is_view(func: Any) -> bool:
    """An operation that returns an alias of its input without writing (view, transpose, expand, detach...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _matmul_shape(func: Any, args: Sequence[Any]) -> tuple[int, int, int, int]:
    packet = func._overloadpacket
    a, b = (args[1], args[2]) if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm) else (args[0], args[1])
    if a.dim() == 3:
        return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
    return 1, a.shape[0], b.shape[1], a.shape[1]


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if _is_view(func) or packet in _CREATION:
            return out
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        moved = sum(map(_nbytes, ins)) + sum(_nbytes(o) for o in outs if not any(o is i for i in ins))
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            shape = _matmul_shape(func, args) if packet in _MATMULS else None
            self.ops.append(Op(str(packet), flops, moved, shape))
        elif packet in _SOFTMAXES:
            x = outs[0]
            dim = args[1] if packet is torch.ops.aten._softmax else args[2]
            self.ops.append(Op(str(packet), 0.0, moved, row=int(x.shape[dim])))
        else:
            self.ops.append(Op(str(packet), 0.0, moved))
        return out


def trace(forward: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]) -> Trace:
    """Record ``forward()`` (meta tensors; returns the output and the parameters) and its backward."""
    saved: dict[int, float] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage()) if t.device.type != "meta" else id(t._base if t._base is not None else t)
        saved.setdefault(key, _nbytes(t._base if t._base is not None else t))
        return t

    rec = _Recorder()
    _ACTIVE.append(rec)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec:
            out, weights = forward()
        params = {id(w) for w in weights}
        forward_ops = tuple(rec.ops)
        rec.ops = []
        with rec:
            out.backward(torch.empty_like(out))
    finally:
        _ACTIVE.pop()
    # parameters saved for backward (a linear keeps its weight) are not activations
    activation = sum(b for k, b in saved.items() if k not in params)
    return Trace(forward_ops, tuple(rec.ops), float(activation))


# ---------------------------------------------------------------------------------------------- reference layers
@dataclass(frozen=True)
class BlockShape:
    """What the reference implementation needs of one block (hashable: traces are cached by it)."""

    seq_len: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    attended: int  # keys each query sees (the window, else the sequence)
    cross_attention: bool
    gated_mlp: bool
    bias: bool
    flash_attention: bool
    dropout: float
    dtype: torch.dtype
    attention_dropout: float = 0.0
    experts: int = 0
    top_k: int = 1
    shared_ffn: int = 0


def _param(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=True)


def _norm(x: torch.Tensor, shape: BlockShape, weights: list[torch.Tensor]) -> torch.Tensor:
    w = _param(shape.hidden, dtype=shape.dtype)
    weights.append(w)
    if shape.gated_mlp:  # Llama-style blocks: RMSNorm
        return F.rms_norm(x, (shape.hidden,), w)
    b = _param(shape.hidden, dtype=shape.dtype)
    weights.append(b)
    return F.layer_norm(x, (shape.hidden,), w, b)


def _linear(x: torch.Tensor, n_in: int, n_out: int, bias: bool, weights: list[torch.Tensor],
            dtype: torch.dtype) -> torch.Tensor:
    w = _param(n_out, n_in, dtype=dtype)
    weights.append(w)
    b = None
    if bias:
        b = _param(n_out, dtype=dtype)
        weights.append(b)
    return F.linear(x, w, b)


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout as CUDA runs it: one fused kernel each way (``F.dropout`` on meta decomposes into three)."""
    return torch.native_dropout(x, p, True)[0] if p > 0 else x


def _attention(x: torch.Tensor, kv_source: torch.Tensor, shape: BlockShape, tp: int, causal: bool,
               weights: list[torch.Tensor]) -> torch.Tensor:
    b, s, h = x.shape
    d = h // shape.heads
    heads, kv = shape.heads // tp, max(shape.kv_heads // tp, 1)
    q = _linear(x, h, heads * d, shape.bias, weights, shape.dtype).view(b, s, heads, d).transpose(1, 2)
    kvp = _linear(kv_source, h, 2 * kv * d, shape.bias, weights, shape.dtype).view(b, -1, 2, kv, d)
    k, v = (t.transpose(1, 2) for t in kvp.unbind(2))
    if kv != heads:  # grouped-query attention: each key/value head serves heads / kv query heads
        k = k.repeat_interleave(heads // kv, dim=1)
        v = v.repeat_interleave(heads // kv, dim=1)
    s_att = min(shape.attended, k.shape[2])
    k, v = k[:, :, :s_att], v[:, :, :s_att]  # a window: each query's s_att keys (same cost as the band)
    if shape.flash_attention:
        ctx = _FlashAttention.apply(q, k, v, causal)
    else:  # materialized scores (Megatron's unfused path, eager attention): scores, mask, softmax, dropout, context
        scores = torch.baddbmm(torch.empty(b * heads, s, s_att, device="meta", dtype=q.dtype),
                               q.reshape(b * heads, s, d), k.reshape(b * heads, s_att, d).transpose(1, 2),
                               beta=0.0, alpha=1.0 / math.sqrt(d)).view(b, heads, s, s_att)
        if causal:
            mask = torch.empty(1, 1, s, s_att, device="meta", dtype=torch.bool)
            scores = scores.masked_fill(mask, float("-inf"))
        probs = _dropout(torch.softmax(scores, dim=-1), shape.attention_dropout)
        ctx = torch.bmm(probs.view(b * heads, s, s_att), v.reshape(b * heads, s_att, d)).view(b, heads, s, d)
    out = ctx.transpose(1, 2).reshape(b, s, heads * d)
    return _linear(out, heads * d, h, False, weights, shape.dtype)  # row-parallel: its bias after the all-reduce


class _FlashAttention(torch.autograd.Function):
    """Fused attention as one operation each way (what FlashAttention launches): recorded by the trace with the
    FLOPs of its two (four in backward, plus the recomputed scores) matmuls; saves q, k, v, the output and the
    softmax statistics."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        ctx.ops = _flash_ops(tuple(q.shape), k.shape[2], causal, q.element_size())
        if _ACTIVE:
            _ACTIVE[-1].ops.append(ctx.ops[0])
        out = torch.empty_like(q)
        stats = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        if _ACTIVE:
            _ACTIVE[-1].ops.append(ctx.ops[1])
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _flash_ops(q: tuple[int, ...], s_att: int, causal: bool, itemsize: int) -> tuple[Op, Op]:
    b, heads, s, d = q
    share = 0.5 if causal and s_att == s else 1.0  # a causal kernel skips the masked half of the blocks
    fwd = 4.0 * b * heads * s * s_att * d * share
    io = float(b * heads * (3 * s + s_att) * d * itemsize)
    return (Op("flash_attention_forward", fwd, io, fused_attention=True),
            Op("flash_attention_backward", 2.5 * fwd, 2 * io, fused_attention=True))


def _mlp(x: torch.Tensor, shape: BlockShape, ffn: int, tp: int, weights: list[torch.Tensor]) -> torch.Tensor:
    h, f = shape.hidden, max(ffn // tp, 1)
    if shape.gated_mlp:
        gate = _linear(x, h, f, shape.bias, weights, shape.dtype)
        up = _linear(x, h, f, shape.bias, weights, shape.dtype)
        mid = F.silu(gate) * up
    else:
        mid = F.gelu(_linear(x, h, f, shape.bias, weights, shape.dtype))
    return _linear(mid, f, h, False, weights, shape.dtype)


def block_forward(shape: BlockShape, micro_batch: int, tp: int) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    """A pre-norm transformer block (attention, optional cross attention, MLP or mixture of experts) on one
    tensor-parallel rank's slice: heads, key/value heads and the FFN split ``tp`` ways."""

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        weights: list[torch.Tensor] = []
        x = torch.empty(micro_batch, shape.seq_len, shape.hidden, device="meta", dtype=shape.dtype,
                        requires_grad=True)
        a = _norm(x, shape, weights)
        y = x + _dropout(_attention(a, a, shape, tp, True, weights), shape.dropout)
        if shape.cross_attention:
            enc = torch.empty_like(x, requires_grad=True)
            c = _norm(y, shape, weights)
            y = y + _dropout(_attention(c, enc, shape, tp, False, weights), shape.dropout)
        m = _norm(y, shape, weights)
        if shape.experts:
            b, s, h = m.shape
            router = _linear(m, h, shape.experts, False, weights, shape.dtype)
            probs = torch.softmax(router.float(), dim=-1)
            top, _ = torch.topk(probs, shape.top_k, dim=-1)
            routed = m.repeat_interleave(shape.top_k, dim=1)  # balanced routing: top_k expert rows per token
            expert_out = _mlp(routed, shape, shape.ffn, tp, weights).view(b, s, shape.top_k, h)
            out = (expert_out * top.to(m.dtype).unsqueeze(-1)).sum(2)
            if shape.shared_ffn:
                out = out + _mlp(m, shape, shape.shared_ffn, tp, weights)
        else:
            out = _mlp(m, shape, shape.ffn, tp, weights)
        return y + _dropout(out, shape.dropout), weights

    return run


def embed_forward(seq_len: int, hidden: int, vocab: int, positions: bool, dropout: float, dtype: torch.dtype,
                  micro_batch: int, tp: int) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    """Token (+ learned position) embedding, the vocabulary split ``tp`` ways (Megatron's vocab-parallel lookup:
    ids outside the rank's range masked, looked up, zeroed; the all-reduce is priced by the cost model)."""

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        table = _param(max(vocab // tp, 1), hidden, dtype=dtype)
        ids = torch.empty(micro_batch, seq_len, device="meta", dtype=torch.long)
        weights = [table]
        if tp > 1:
            outside = (ids < 0) | (ids >= vocab // tp)
            x = F.embedding(ids.masked_fill(outside, 0), table).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            x = F.embedding(ids, table)
        if positions:
            pos = _param(seq_len, hidden, dtype=dtype)
            weights.append(pos)
            x = x + F.embedding(torch.empty(seq_len, device="meta", dtype=torch.long), pos)
        return _dropout(x, dropout), weights

    return run


def lm_head_forward(seq_len: int, hidden: int, vocab: int, layer_norm: bool, dtype: torch.dtype, micro_batch: int,
                    tp: int) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    """The final norm, the output projection (vocabulary split ``tp`` ways) and the cross-entropy in fp32."""

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = torch.empty(micro_batch, seq_len, hidden, device="meta", dtype=dtype, requires_grad=True)
        w = _param(hidden, dtype=dtype)
        weights = [w]
        if layer_norm:
            bias = _param(hidden, dtype=dtype)
            weights.append(bias)
            x = F.layer_norm(x, (hidden,), w, bias)
        else:
            x = F.rms_norm(x, (hidden,), w)
        logits = _linear(x, hidden, max(vocab // tp, 1), False, weights, dtype)
        target = torch.empty(micro_batch * seq_len, device="meta", dtype=torch.long)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target)
        return loss, weights

    return run


def classifier_forward(seq_len: int, hidden: int, classes: int, dtype: torch.dtype, micro_batch: int
                       ) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = torch.empty(micro_batch, seq_len, hidden, device="meta", dtype=dtype, requires_grad=True)
        w, b = _param(hidden, dtype=dtype), _param(hidden, dtype=dtype)
        pooled = F.layer_norm(x, (hidden,), w, b).mean(1)
        weights = [w, b]
        logits = _linear(pooled, hidden, classes, True, weights, dtype)
        target = torch.empty(micro_batch, device="meta", dtype=torch.long)
        return F.cross_entropy(logits.float(), target), weights

    return run


def patch_embed_forward(seq_len: int, hidden: int, patch_dim: int, dtype: torch.dtype, micro_batch: int
                        ) -> Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]:
    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        patches = torch.empty(micro_batch, seq_len, patch_dim, device="meta", dtype=dtype)
        weights: list[torch.Tensor] = []
        x = _linear(patches, patch_dim, hidden, True, weights, dtype)
        pos = _param(seq_len, hidden, dtype=dtype)
        weights.append(pos)
        return x + pos, weights

    return run


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
    from dataclasses import replace

    from uniap_lightning.planner.cost.comm import all_reduce_s
    from uniap_lightning.planner.profile import Overhead, Timing

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
