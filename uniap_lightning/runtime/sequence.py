"""The sequence dimension: Ulysses context parallelism, split causal-LM batches and their loss.

**Ulysses** (Jacobs et al., 2023). The sequence is split into ``c`` contiguous equal pieces over the ranks of a
context-parallel (cp) process group: cp rank ``r`` holds positions ``[r s/c, (r+1) s/c)`` of every sample. Per
attention, q, k and v (``[b, heads, s/c, d]``) go through an all-to-all that gives each rank ``heads/c`` whole
heads over the whole sequence (``[b, heads/c, s, d]``); attention runs there (SDPA, causal and/or a key padding
mask gathered over the group) and a second all-to-all turns the output back into sequence pieces. Each
all-to-all keeps ``1/c`` of its input on the rank, so one attention forward sends ``4 s b h (c-1)/c^2`` elements
per rank (``h`` = heads x head size on the rank); its backward sends the same again. Needs the heads (per
tensor-parallel rank) divisible by ``c``.

**Batches and losses.** :func:`shard_causal_lm_batch` shifts causal-LM labels over the whole sequence *before*
splitting (so no (token, next token) pair straddles two ranks) and gives a cp rank its slice of every
sequence-shaped tensor; :func:`shard_token_batch` splits an encoder's batch (masked LM, token classification:
labels stay with their tokens). :func:`sequence_loss` returns this rank's share of the one-process mean: the
local sum of the token losses over the global count of counted tokens (all-reduced over the cp group), so the cp
ranks' losses *sum* to the one-process loss, and so do their gradients.

**Gradient reduction.** A weight replicated over data (dp) and context (cp) ranks gets the gradient
``(1/dp) x sum over the dp x cp ranks`` of the local gradients: the cp ranks see different tokens of the same
samples (sum), the dp ranks different samples (average, as today). :func:`reduce_gradients` does exactly that over
one group holding the dp x cp ranks of the layer. A runtime that keeps averaging over a group (divide by its
size, as :class:`~uniap_lightning.runtime.data_parallel.ReplicatedGrads` does) gets the same result by averaging
over the dp x cp group and multiplying the loss by ``c`` (:func:`sequence_loss` with ``scale=c``). Both reductions
are tested against one process. (The strategy needs neither: its loss sees whole sequences, see below.)

**Positions.** Absolute positions are global: a layer in cp mode adds ``cp_rank x s/c`` to its local positions
(:func:`position_offset`); :func:`shard_causal_lm_batch` slices ``position_ids`` for rotary models.

Layers opt in with ``uniap_cp_methods() -> list[str]`` and ``uniap_enable_cp(group, method, counter=None)``
(:func:`enable_context_parallel` calls it on every layer that has it). Sequence parallelism with TP is in
:mod:`uniap_lightning.runtime.sequence_tp`.

**What the strategy runs** (``Trainer(strategy="uniap")`` with a plan whose layers have ``cp > 1`` and/or ``sp``).
Each layer's ranks form a ``dp x cp x tp`` grid of its stage (tp innermost, :mod:`.mesh`). Setup, per layer: TP
(``apply_tp``, or ``sequence_tp.apply_sp`` where ``sp``) -> :func:`enable_context_parallel` over the layer's cp group
-> data parallelism over its ``dp x cp`` replicas. Activations move between layouts with :mod:`.reshard`: a stage
starts and ends with whole sequences (the micro-batch split over its ``n`` lanes, or into ``gcd(b, n)`` chunks
when smaller, :func:`~.mesh.boundary_layout`), a cp layer gets its sequence piece
(``[b, s/c, h]``). The loss runs where the last stage ends, on whole sequences, so the model's own loss (a causal LM
shifting its labels inside) sees exactly what one process sees, padding (``-100`` labels) included; the logged loss
is the one process's. Gradients follow the convention of :mod:`.reshard`, so averaging over the ``dp x cp``
replicas (replicated or ZeRO) is exact without scaling the loss. One exception saves the all-gather of the logits:
a loss that declares a per-token form runs on the sequence pieces a cp last layer leaves (:func:`piece_loss`; the
last stage keeps its last layout): Hugging Face masked LM and token classification (labels stay with their tokens),
and a ``CausalLMModule`` whose ``uniap_loss`` declares ``uniap_sequence_loss = "next_token"`` (labels shifted over
whole sequences first; opt-in: the planner still prices the gather before the loss for every cp last layer, so the
shipped module keeps it and predicted memory stays measured memory). Hugging Face causal LMs still gather.
:func:`sequence_loss` with :func:`shard_causal_lm_batch` / :func:`shard_token_batch` are the same building blocks
outside the strategy, tested against one process for GPT, Llama and BERT. :func:`check_sequence_strategy` refuses,
before any process group work, what cannot run: a layer that declares no sequence behaviour, Ulysses heads that
``cp`` does not divide, ring attention with attention dropout.

**Ring attention** (``cp_method="ring"``, :mod:`.ring`): the same contiguous pieces and contract as Ulysses
(:func:`~.ring.ring_attention`), k / v passed round the cp group instead of heads exchanged, so no heads
condition; causal load balance moves only q (``s`` must be a multiple of ``2 cp``, :func:`sequence_multiple`).
Our own implementation (any device: torch's CPU flash kernel per block on CPU, plain matmuls elsewhere); torch's
CUDA-only ``context_parallel`` is not used.

Layers declare their sequence behaviour with ``uniap_sequence() -> {"attention_heads": a, "kv_heads": k,
"sequence_parallel": bool}`` (``a`` 0: token-wise; ``None``: nothing); profiles take these fields from it
(:func:`sequence_info`).

The batch and loss are :mod:`.sequence_batch`, the checks :mod:`.sequence_checks` (their names are importable from
here too).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.sequence_batch import (
    IGNORE_INDEX,
    SEQUENCE_KEYS,
    global_loss,
    piece_loss,
    reduce_gradients,
    sequence_loss,
    shard_causal_lm_batch,
    shard_token_batch,
    shift_labels,
    split_sequence,
)
from uniap_lightning.runtime.sequence_checks import (
    ATTENTION_DROPOUT_KEYS,
    CP_METHODS,
    attention_dropout,
    check_sequence_length,
    check_sequence_strategy,
    check_ulysses,
    sequence_info,
    sequence_multiple,
)

__all__ = [
    "ATTENTION_DROPOUT_KEYS", "CP_METHODS", "IGNORE_INDEX", "SEQUENCE_KEYS", "AllToAllCounter", "attention",
    "attention_dropout", "check_sequence_length", "check_sequence_strategy", "check_ulysses",
    "enable_context_parallel", "gather_sequence", "global_loss", "heads_to_seq", "padding_mask", "piece_loss",
    "position_offset", "reduce_gradients", "seq_to_heads", "sequence_info", "sequence_loss", "sequence_multiple",
    "shard_causal_lm_batch", "shard_token_batch", "shift_labels", "split_sequence", "ulysses_attention",
    "ulysses_elements",
]


@dataclass
class AllToAllCounter:
    """Elements this rank's Ulysses all-to-alls send to *other* ranks (the ``1/c`` a rank keeps is not sent)."""

    forward_elements: int = 0
    backward_elements: int = 0
    calls: int = 0
    by_call: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.forward_elements = self.backward_elements = self.calls = 0
        self.by_call.clear()

    def add(self, n: int, *, backward: bool) -> None:
        """Count ``n`` elements sent by one exchange (a forward one also as a call)."""
        if backward:
            self.backward_elements += n
        else:
            self.forward_elements += n
            self.calls += 1
            self.by_call.append(n)


def ulysses_elements(*, seq_len: int, batch: int, hidden: int, cp: int) -> float:
    """Elements one Ulysses attention forward sends per rank: ``4 s b h (c-1)/c^2`` (q, k, v in, output back)."""
    return 4 * seq_len * batch * hidden * (cp - 1) / cp**2


# ---------------------------------------------------------------------------------------------- all-to-all
class _AllToAll(torch.autograd.Function):
    """All-to-all of ``c`` equal chunks along dim 0 (chunk ``j`` goes to rank ``j``, chunk ``i`` comes from rank
    ``i``). The exchange is its own adjoint, so the backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, counter: AllToAllCounter | None) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return _exchange(x, group, counter, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _exchange(grad, ctx.group, ctx.counter, backward=True), None, None


def _exchange(x: torch.Tensor, group: Any, counter: AllToAllCounter | None, *, backward: bool) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    if counter is not None:
        c = dist.get_world_size(group)
        counter.add(x.numel() * (c - 1) // c, backward=backward)
    return out


def seq_to_heads(x: torch.Tensor, group: Any, counter: AllToAllCounter | None = None) -> torch.Tensor:
    """``[b, heads, s/c, d]`` (this rank's sequence piece) -> ``[b, heads/c, s, d]`` (this rank's heads)."""
    c = dist.get_world_size(group)
    b, h, s_local, d = x.shape
    chunks = x.reshape(b, c, h // c, s_local, d).transpose(0, 1)  # [c (head chunk -> rank), b, h/c, s/c, d]
    got = _AllToAll.apply(chunks, group, counter)  # [c (sequence piece of rank i), b, h/c, s/c, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s_local, d)


def heads_to_seq(x: torch.Tensor, group: Any, counter: AllToAllCounter | None = None) -> torch.Tensor:
    """``[b, heads/c, s, d]`` -> ``[b, heads, s/c, d]`` (the inverse of :func:`seq_to_heads`)."""
    c = dist.get_world_size(group)
    b, h_local, s, d = x.shape
    chunks = x.reshape(b, h_local, c, s // c, d).permute(2, 0, 1, 3, 4)  # [c (sequence piece -> rank), ...]
    got = _AllToAll.apply(chunks, group, counter)  # [c (head chunk of rank j), b, h/c, s/c, d]
    return got.transpose(0, 1).reshape(b, c * h_local, s // c, d)


def gather_sequence(t: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather a non-differentiable ``[b, s/c, ...]`` tensor (a mask) into ``[b, s, ...]`` in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


# ---------------------------------------------------------------------------------------------- attention
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              key_valid: torch.Tensor | None = None, dropout_p: float = 0.0,
              scale: float | None = None) -> torch.Tensor:
    """SDPA over whole sequences (``[b, heads, s, d]``; k and v may have fewer heads, grouped-query attention),
    causal (a decoder) or bidirectional (an encoder, ``causal=False``), with a key padding mask ``key_valid``
    (``[b, s]``, true for real tokens): every query sees the real keys it may see, as Hugging Face's masks do,
    padding queries included. A query that may see no key (a padding position before the first real token, a row
    of padding) sees itself, so no row is empty (its output is unused: its label is ignored)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if key_valid is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p, scale=scale)
    s = q.shape[-2]
    allowed = key_valid.to(torch.bool)[:, None, None, :].expand(-1, 1, s, -1)
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    allowed = allowed | (torch.eye(s, dtype=torch.bool, device=q.device) & ~allowed.any(-1, keepdim=True))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *, causal: bool = True,
                      key_valid: torch.Tensor | None = None, dropout_p: float = 0.0, scale: float | None = None,
                      counter: AllToAllCounter | None = None) -> torch.Tensor:
    """:func:`attention` over the whole sequence for q/k/v given as this rank's sequence piece
    (``[b, heads, s/c, d]``); ``key_valid`` is this rank's piece of the padding mask (``[b, s/c]``). Returns this
    rank's piece of the output (``[b, heads, s/c, d]``). Grouped-query k/v whose heads ``c`` does not divide are
    repeated to the query heads first (more bytes; with ``kv_heads % c == 0`` they travel as they are)."""
    c = dist.get_world_size(group)
    check_ulysses(heads=q.shape[1], cp=c, name="Ulysses attention")
    if c == 1:
        return attention(q, k, v, causal=causal, key_valid=key_valid, dropout_p=dropout_p, scale=scale)
    if k.shape[1] % c:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    q, k, v = (seq_to_heads(t, group, counter) for t in (q, k, v))
    full_mask = None if key_valid is None else gather_sequence(key_valid.to(torch.bool), group)
    out = attention(q, k, v, causal=causal, key_valid=full_mask, dropout_p=dropout_p, scale=scale)
    return heads_to_seq(out, group, counter)


# ---------------------------------------------------------------------------------------------- layers
def enable_context_parallel(layers: Iterable[nn.Module], group: Any, *, method: str = "ulysses",
                            counter: AllToAllCounter | None = None) -> int:
    """Switch every layer that supports it to context parallelism over ``group``; returns how many switched.

    Layers without ``uniap_enable_cp`` (a head, an MLP) are position-wise and need nothing."""
    if method not in CP_METHODS:
        raise UniAPError(f"context-parallel method {method!r} is not executable here; supported: {list(CP_METHODS)}")
    n = 0
    for layer in layers:
        for m in layer.modules():
            if hasattr(m, "uniap_enable_cp"):
                if method not in m.uniap_cp_methods():
                    raise UniAPError(f"{type(m).__name__} supports context parallelism {m.uniap_cp_methods()}, "
                                     f"not {method!r}")
                m.uniap_enable_cp(group, method=method, counter=counter)
                n += 1
    return n


def position_offset(group: Any | None, local_len: int) -> int:
    """The global position of this rank's first token: ``cp_rank x s/c`` (0 without a cp group)."""
    return 0 if group is None else dist.get_rank(group) * local_len


@contextmanager
def padding_mask(layers: Iterable[nn.Module], key_valid: torch.Tensor | None) -> Iterator[None]:
    """Within the block, layers with a ``uniap_key_valid`` attribute attend only to keys where ``key_valid``
    (this rank's ``[b, s/c]`` piece of the attention mask) is true; outside it they are unmasked again."""
    mods = [m for layer in layers for m in layer.modules() if hasattr(m, "uniap_key_valid")]
    for m in mods:
        m.uniap_key_valid = key_valid
    try:
        yield
    finally:
        for m in mods:
            m.uniap_key_valid = None
