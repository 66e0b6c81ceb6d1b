"""The reference layers the roofline traces (:mod:`uniap_lightning.profiling.roofline`): a transformer block as
the model config describes it, at the tensor-parallel slice one rank runs, and the embedding, the language-model head
(with Megatron's vocabulary-parallel loss where the vocabulary is split), a classifier and a patch embedding; each
returns a ``forward()`` for :func:`~uniap_lightning.profiling.trace_ops.trace` (meta tensors: nothing is computed).
Split from ``roofline.py`` to keep files under 400 lines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from uniap_lightning.profiling.trace_ops import _ACTIVE, Op

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
        if tp == 1:
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target), weights
        losses = _VocabParallelLoss.apply(logits.float().view(-1, logits.shape[-1]), target)
        mask = torch.empty(micro_batch * seq_len, device="meta", dtype=torch.float32)  # the loss mask
        return (losses * mask).sum() / mask.sum(), weights

    return run


class _VocabParallelLoss(torch.autograd.Function):
    """The cross-entropy over a vocabulary split ``tp`` ways, operation for operation as Megatron runs it
    (megatron/core/tensor_parallel/cross_entropy.py, ``_VocabParallelCrossEntropy``; torch's ``loss_parallel`` runs
    the same passes): the row maximum, the shifted logits, the target's logit picked out, ``exp``, the row sum, the
    log and the softmax kept for backward: eight passes over the logits forward and two backward, where torch's
    ``cross_entropy`` on a whole vocabulary makes six in all. Its three all-reduces of one fp32 number per token
    (the maximum, the target's logit, the sum) are priced by :func:`~uniap_lightning.profiling.roofline.
    roofline_profile` on the cluster's links. Megatron's in-place ``exp(out=)``, ``div_`` and ``mul_`` are traced
    out of place (the same reads and writes; the trace counts an in-place write once), its boolean-mask stores as
    ``masked_fill`` (meta tensors have no data to index by)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rows, vocab = logits.shape
        top = torch.max(logits, dim=-1)[0]  # (all-reduced: max)
        shifted = logits - top.unsqueeze(-1)
        outside = (target < 0) | (target >= vocab)
        local = (target.clone() - 0).masked_fill(outside, 0)
        picked = shifted[torch.arange(rows, device=logits.device), local].clone().masked_fill(outside, 0.0)
        exps = torch.exp(shifted)  # (picked all-reduced: sum)
        total = exps.sum(dim=-1)  # (all-reduced: sum)
        loss = torch.log(total) - picked
        softmax = exps / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, outside, local)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, outside, local = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        update = 1.0 - outside.float()
        softmax[rows, local] -= update
        return softmax * grad.unsqueeze(-1), None


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
