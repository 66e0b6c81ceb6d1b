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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from uniap_lightning.errors import UniAPError

#: Context-parallel methods this runtime executes (ring: :mod:`uniap_lightning.runtime.ring`, any device).
CP_METHODS = ("ulysses", "ring")
IGNORE_INDEX = -100
#: batch keys that are sequence-shaped (``[b, s, ...]``) and split along dim 1
SEQUENCE_KEYS = ("input_ids", "labels", "targets", "attention_mask", "position_ids", "token_type_ids")


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


def check_ulysses(*, heads: int, cp: int, tp: int = 1, seq_len: int | None = None, name: str = "layer") -> None:
    """Refuse a Ulysses degree the layer cannot run, in one line naming the numbers."""
    if cp < 1 or tp < 1:
        raise UniAPError(f"{name}: context-parallel degree cp={cp} and tensor-parallel degree tp={tp} must be >= 1")
    if heads % tp:
        raise UniAPError(f"{name}: {heads} attention heads are not divisible by tp={tp}")
    if (heads // tp) % cp:
        raise UniAPError(
            f"{name}: Ulysses needs the attention heads per tensor-parallel rank ({heads} heads / tp={tp} = "
            f"{heads // tp}) divisible by cp={cp}; choose cp in {_divisors(heads // tp)}"
        )
    if seq_len is not None and seq_len % cp:
        raise UniAPError(f"{name}: sequence length {seq_len} is not divisible by cp={cp}; pad it to a multiple of {cp}")


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


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


# ---------------------------------------------------------------------------------------------- batch and loss
def shift_labels(labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets over the whole sequence: ``targets[:, t] = labels[:, t+1]``, the last one ignored."""
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)


def split_sequence(t: torch.Tensor, rank: int, cp: int, *, name: str = "tensor") -> torch.Tensor:
    """Rank ``rank``'s contiguous ``1/cp`` piece of ``t`` along dim 1."""
    s = t.shape[1]
    if s % cp:
        raise UniAPError(f"{name}: sequence length {s} is not divisible by cp={cp}; pad it to a multiple of {cp}")
    n = s // cp
    return t[:, rank * n:(rank + 1) * n]


def shard_causal_lm_batch(batch: Mapping[str, torch.Tensor], rank: int, cp: int, *,
                          ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """A cp rank's piece of a causal-LM batch: ``input_ids`` (``labels`` default to them) and optional
    ``attention_mask`` / ``position_ids``.

    Returns ``input_ids``, ``targets`` (labels shifted over the whole sequence, then split; positions whose
    label or next label is masked out by ``attention_mask`` are ``ignore_index``), ``position_ids`` (global;
    ``arange`` if not given) and ``attention_mask`` when given. Other sequence-shaped keys are split too."""
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    if "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"] == 0, ignore_index)
    full = {**batch, "targets": shift_labels(labels, ignore_index=ignore_index)}
    full.pop("labels", None)
    if "position_ids" not in full:
        full["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    return {k: split_sequence(v, rank, cp, name=k) if k in SEQUENCE_KEYS else v for k, v in full.items()}


def shard_token_batch(batch: Mapping[str, torch.Tensor], rank: int, cp: int) -> dict[str, torch.Tensor]:
    """A cp rank's piece of an encoder batch whose loss is per token (masked LM, token classification): every
    sequence-shaped entry (``input_ids``, ``attention_mask``, ``token_type_ids``, ``labels``, ...) is split along
    the sequence as it is. A token's label stays with the token (nothing is shifted), so :func:`sequence_loss` on
    the pieces is exactly the one-process loss. (A loss on a pooled token, sequence classification, needs whole
    sequences: it has no per-piece form.)"""
    return {k: split_sequence(v, rank, cp, name=k) if k in SEQUENCE_KEYS else v for k, v in batch.items()}


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor, group: Any | None, *, scale: float = 1.0,
                  ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """This rank's share of the one-process token-mean cross-entropy: the local sum over the number of counted
    tokens of the whole sequence (all-reduced over ``group``), times ``scale``. Summed over the cp ranks (with
    ``scale=1``) it is the one-process loss (:func:`global_loss` reports that sum)."""
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum().to(torch.float64)
    if group is not None:
        dist.all_reduce(count, group=group)
    return total * scale / count.clamp_min(1).to(total.dtype)


def global_loss(local: torch.Tensor, group: Any | None, *, scale: float = 1.0) -> torch.Tensor:
    """The one-process loss from the cp ranks' :func:`sequence_loss` values (detached, summed, ``/ scale``)."""
    out = local.detach().clone()
    if group is not None:
        dist.all_reduce(out, group=group)
    return out / scale


def piece_loss(plan: Any, loss_fn: Any, y: Any, lane: int) -> tuple[Any, list[Any]] | None:
    """The loss on the sequence pieces the chain's last layer leaves, where that is exact: ``(loss, targets per
    micro-batch)`` for this lane of the last stage, or ``None`` (the output is gathered into whole sequences first).

    The loss declares its form (``loss_fn.uniap_sequence_loss``), and the last layer must split the sequence
    (``cp > 1``). Lane ``r`` of layout ``(d, c, t)`` holds batch chunk ``r // (c t)`` of ``d`` and sequence piece
    ``(r // t) % c`` of every micro-batch; its targets come from the whole batch (every rank loads it):

    * ``"token"``: labels that stay with their tokens, a loss that sums the labelled tokens' losses times the whole
      batch's scale (Hugging Face masked LM and token classification, :class:`~uniap_lightning.adapters.auto.HFTarget`):
      the loss itself on the piece of the labels, times ``c``.
    * ``"next_token"``: a causal LM's mean next-token cross-entropy over the lane's samples (``-100`` ignored; a
      ``CausalLMModule.uniap_loss`` that declares it): labels shifted over the whole sequence *before* the split (no
      (token, next token) pair straddles two pieces), the piece's summed cross-entropy over the chunk's count of
      targets, times ``c``.

    With the factor ``c`` the lanes' losses average to the global loss (each piece's share counts ``c x`` in a mean
    over ``c`` pieces), and the gradient a lane holds for its piece is ``d c`` times the global loss's, the
    convention of :mod:`.reshard`. What this saves: the all-gather of the logits (``b s V`` per micro-batch) into
    whole sequences."""
    from uniap_lightning.runtime.mesh import layout_of
    from uniap_lightning.runtime.payload import chunk

    mode = getattr(loss_fn, "uniap_sequence_loss", None)
    if y is None or mode not in ("token", "next_token"):
        return None
    d, c, t = layout_of(plan, len(plan.layers) - 1)
    if c == 1:
        return None
    pd, pc = lane // (c * t), (lane // t) % c
    parts = [chunk(ym, d)[pd] for ym in chunk(y, plan.microbatches)]
    if mode == "next_token":
        if not isinstance(y, torch.Tensor):
            raise UniAPError(f"a next-token loss on sequence pieces needs a tensor of labels, got {type(y).__name__}")
        shifted = [shift_labels(part) for part in parts]
        targets = [(split_sequence(sh, pc, c, name="labels"), (sh != IGNORE_INDEX).sum()) for sh in shifted]

        def next_token(output: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            labels, count = target
            total = F.cross_entropy(output.reshape(-1, output.shape[-1]), labels.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
            return total * c / count

        return next_token, targets

    def piece(part: Any) -> Any:
        if isinstance(part, torch.Tensor):
            return split_sequence(part, pc, c, name="labels")
        if isinstance(part, dict) and "labels" in part:
            return {**part, "labels": split_sequence(part["labels"], pc, c, name="labels")}
        raise UniAPError(f"a per-token loss on sequence pieces needs tensor or dict targets with 'labels', got "
                         f"{type(part).__name__}")

    def token(output: Any, target: Any) -> torch.Tensor:
        return loss_fn(output, target) * c

    return token, [piece(part) for part in parts]


@torch.no_grad()
def reduce_gradients(params: Iterable[nn.Parameter], group: Any, *, dp: int) -> None:
    """Replicated weights' gradients over a group of the dp x cp ranks that hold them: sum, then ``/ dp`` (the
    cp ranks' losses add up to one sample's loss; dp ranks average as the data-parallel runtime does)."""
    from uniap_lightning.runtime.data_parallel import local_tensor
    from uniap_lightning.runtime.grads import all_reduce_flat

    # a TP shard: its local piece
    all_reduce_flat([local_tensor(p.grad) for p in params if p.grad is not None], group, dp)


# ---------------------------------------------------------------------------------------------- plan checks
def sequence_info(layer: nn.Module) -> dict[str, Any] | None:
    """What ``layer`` declares about the sequence (``uniap_sequence()``): ``attention_heads`` (0: token-wise),
    ``kv_heads``, ``sequence_parallel``; ``None`` when it declares nothing, no hook or a hook returning ``None``
    (it is then never split along it)."""
    hook = getattr(layer, "uniap_sequence", None)
    declared = None if hook is None else hook()
    if declared is None:
        return None
    info = dict(declared)
    heads = int(info.get("attention_heads", 0))
    return {"attention_heads": heads, "kv_heads": int(info.get("kv_heads") or heads) if heads else None,
            "sequence_parallel": bool(info.get("sequence_parallel", hasattr(layer, "uniap_sp_plan")))}


def check_sequence_strategy(layer: nn.Module, name: str, *, cp: int, cp_method: str, tp: int, sp: bool) -> None:
    """Refuse, in one line, a layer strategy with context or sequence parallelism this runtime cannot execute
    (needs only the plan and the layer: every rank fails alike, before any collective)."""
    where = f"plan layer {name!r} ({type(layer).__name__})"
    if sp and tp > 1 and not hasattr(layer, "uniap_sp_plan"):
        raise UniAPError(f"{where}: sp=true needs a sequence-parallel tensor-parallel plan (uniap_sp_plan), which "
                         "the layer does not have; use sp=false")
    if cp == 1:
        return
    if cp_method not in CP_METHODS:
        raise UniAPError(f"{where}: cp_method={cp_method!r} is not executable; supported: {list(CP_METHODS)}")
    info = sequence_info(layer)
    cp_modules = [m for m in layer.modules() if hasattr(m, "uniap_enable_cp")]
    if info is None and not cp_modules:
        raise UniAPError(f"{where}: cp={cp} splits the sequence, but the layer declares no sequence behaviour "
                         "(uniap_sequence() / uniap_enable_cp); use cp=1 for it")
    heads = info["attention_heads"] if info is not None else 0
    if heads == 0 and cp_modules and info is None:
        raise UniAPError(f"{where}: cp={cp} needs the layer's attention heads (uniap_sequence()); use cp=1 for it")
    if heads and not cp_modules:
        raise UniAPError(f"{where}: cp={cp} needs its attention to run over the split sequence, which the layer "
                         "does not support (no uniap_enable_cp); use cp=1 for it")
    for m in cp_modules:
        if cp_method not in m.uniap_cp_methods():
            raise UniAPError(f"{where}: {type(m).__name__} supports context parallelism {m.uniap_cp_methods()}, "
                             f"not {cp_method!r}")
    if cp_method == "ring":
        dropout = attention_dropout(layer)
        if dropout > 0:
            raise UniAPError(f"{where}: ring attention does not run attention dropout (p={dropout}); set the "
                             "model's attention dropout to 0 or use cp_method='ulysses'")
    elif heads:
        check_ulysses(heads=heads, cp=cp, tp=tp, name=where)


#: config fields that hold a Hugging Face attention's dropout probability (Llama, GPT-2, BERT)
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def attention_dropout(layer: nn.Module) -> float:
    """The largest attention-dropout probability a layer's modules declare: ``uniap_attention_dropout()``, or a
    Hugging Face attention's config (:data:`ATTENTION_DROPOUT_KEYS`) on modules switched with ``uniap_enable_cp``."""
    found = [0.0]
    for m in layer.modules():
        hook = getattr(m, "uniap_attention_dropout", None)
        if callable(hook):
            found.append(float(hook()))
        config = getattr(m, "config", None)
        if config is not None and type(m).__name__.endswith("Attention"):
            found += [float(v) for key in ATTENTION_DROPOUT_KEYS
                      if isinstance(v := getattr(config, key, None), (int, float))]
    return max(found)


def sequence_multiple(plan: Any) -> int:
    """What every sequence's length must be a multiple of under ``plan``: the lcm over its layers of ``cp``
    (``cp x tp`` where sequence parallelism splits each cp piece again; ``2 cp`` for ring attention's halves)."""
    import math

    out = 1
    for lp in plan.layers:
        st = lp.strategy
        ring = 2 if st.cp > 1 and getattr(st, "cp_method", "ulysses") == "ring" else 1
        out = math.lcm(out, st.cp * ring * (st.tp if st.sp else 1))
    return out


def check_sequence_length(plan: Any, x: Any) -> None:
    """Refuse, in one line and on every rank alike (all load the same batch), a batch whose sequences the plan's
    context / sequence parallelism cannot split evenly."""
    from uniap_lightning.runtime.payload import flatten, is_payload

    multiple = sequence_multiple(plan)
    if multiple == 1 or not is_payload(x):
        return
    seq = next((t for t in flatten(x) if t.dim() >= 2), None)
    if seq is not None and seq.shape[1] % multiple:
        raise UniAPError(
            f"the batch's sequence length {seq.shape[1]} is not divisible by {multiple}, the pieces the plan's "
            f"context / sequence parallelism splits each sequence into; pad sequences to a multiple of {multiple}")
