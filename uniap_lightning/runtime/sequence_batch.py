"""The batch and the loss under context parallelism (:mod:`.sequence`): a cp rank's piece of every sequence-shaped
tensor (a causal LM's labels shifted over the whole sequence first), this rank's share of the one-process loss, the
loss on the sequence pieces a cp last layer leaves, and the gradient reduction over the dp x cp ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.data_parallel import local_tensor
from uniap_lightning.runtime.grads import all_reduce_flat
from uniap_lightning.runtime.mesh import layout_of
from uniap_lightning.runtime.payload import chunk

IGNORE_INDEX = -100
#: batch keys that are sequence-shaped (``[b, s, ...]``) and split along dim 1
SEQUENCE_KEYS = ("input_ids", "labels", "targets", "attention_mask", "position_ids", "token_type_ids")


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
    # a TP shard: its local piece
    all_reduce_flat([local_tensor(p.grad) for p in params if p.grad is not None], group, dp)
