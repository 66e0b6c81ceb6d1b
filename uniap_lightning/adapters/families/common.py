"""Pieces every family uses: tensor-parallel styles (re-exported from :mod:`uniap_lightning.adapters.tp_styles`),
the causal-LM loss with a whole-batch item count."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from uniap_lightning.adapters.family import HFTarget
from uniap_lightning.adapters.tp_styles import colwise, divisors_of_all, replicate, rowwise
from uniap_lightning.errors import UniAPError

__all__ = ["View", "causal_lm_loss", "classification_loss", "colwise", "count_labels", "count_per_column",
           "divisors_of_all", "local_heads", "question_answering_labels", "question_answering_loss", "rowwise",
           "replicate", "sequence_classification_loss", "tensor_parallel_heads", "token_loss"]


class View(nn.Module):
    """A chain layer made of modules of the user's model (registered here too, so ``parameters()``, FSDP and tensor
    parallelism see them; their names in the LightningModule stay the model's own)."""

    def __init__(self, **modules: nn.Module) -> None:
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """Cross-entropy summed over the labelled tokens (label != -100), scaled so that the micro-batches' mean is the
    whole batch's mean over its labelled tokens (what Hugging Face's loss computes on one device)."""
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                        ignore_index=-100, reduction="sum")
    return total * target.per_item_sum_scale()


def causal_lm_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """The causal LM loss (labels shifted inside, as ``ForCausalLMLoss``), whole-batch normalized."""
    labels = nn.functional.pad(target.labels, (0, 1), value=-100)[..., 1:]
    return token_loss(logits, labels, target)


def classification_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """The model's own sequence / image classification loss (a mean over samples, so a micro-batch's mean is
    already the right share)."""
    return model.loss_function(target.labels, logits, model.config)


def count_labels(labels: torch.Tensor) -> torch.Tensor:
    """Sequence classification: class ids count where not -100; float labels (regression, multi-label) count every
    element (their losses, MSE and BCE, average over all of them)."""
    if labels.is_floating_point():
        return torch.tensor(labels.numel())
    return (labels != -100).sum()


def count_per_column(labels: torch.Tensor) -> torch.Tensor:
    """Question answering: the start and end columns each average over their own labelled rows."""
    return (labels != -100).sum(0)


def sequence_classification_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """Hugging Face's sequence classification loss (``ForSequenceClassificationLoss``: the problem type settled
    on the model's config as it does, then MSE, cross-entropy ignoring -100, or BCE), summed and whole-batch
    normalized (see :func:`count_labels`)."""
    config, labels = model.config, target.labels
    num_labels = config.num_labels
    if config.problem_type is None:
        if num_labels == 1:
            config.problem_type = "regression"
        elif num_labels > 1 and labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    f = nn.functional
    if config.problem_type == "regression":
        if num_labels == 1:
            total = f.mse_loss(logits.reshape(-1), labels.reshape(-1).to(logits.dtype), reduction="sum")
        else:
            total = f.mse_loss(logits, labels.to(logits.dtype), reduction="sum")
    elif config.problem_type == "single_label_classification":
        total = f.cross_entropy(logits.reshape(-1, num_labels), labels.reshape(-1), ignore_index=-100,
                                reduction="sum")
    elif config.problem_type == "multi_label_classification":
        total = f.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="sum")
    else:
        raise ValueError(f"Invalid problem type: {config.problem_type}")
    return total * target.per_item_sum_scale()


def question_answering_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """``start_positions`` and ``end_positions`` as one ``[batch, 2]`` target, clamped to ``[0, seq]`` as Hugging
    Face does, the positions it ignores (those at ``seq``: outside the input) set to -100."""
    given = [k for k in ("start_positions", "end_positions") if k in batch]
    if len(given) == 1:
        raise UniAPError(f"a question answering batch needs both 'start_positions' and 'end_positions' (its loss); "
                         f"this one has only {given[0]!r}")
    if not given:
        return None
    seq = batch["input_ids"].shape[-1]
    columns = []
    for key in ("start_positions", "end_positions"):
        p = batch[key]
        p = p.reshape(p.shape[0]) if p.dim() > 1 else p
        p = p.clamp(0, seq)
        columns.append(p.masked_fill(p == seq, -100))
    return torch.stack(columns, -1)


def question_answering_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """Hugging Face's question answering loss: the mean of the start and end cross-entropies, each over its own
    labelled rows of the whole batch. ``logits``: ``[batch, seq, 2]`` (start, end)."""
    scale = target.per_item_sum_scale()
    total = logits.new_zeros((), dtype=torch.float32)
    for i in range(2):
        ce = nn.functional.cross_entropy(logits[..., i].float(), target.labels[:, i], ignore_index=-100,
                                         reduction="sum")
        total = total + ce * scale[i]
    return total / 2


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward, the gradients of the ranks' head slices summed over the tensor-parallel group
    (Megatron's "copy to the tensor-parallel region")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def tensor_parallel_heads(weight: torch.Tensor) -> tuple[int, int, Any]:
    """(tensor-parallel degree, this rank's index, group) of an attention whose query projection ``weight`` is
    column-parallel (a DTensor on a 1-D mesh); ``(1, 0, None)`` otherwise."""
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or weight.device_mesh.size() == 1:
        return 1, 0, None
    mesh = weight.device_mesh
    return mesh.size(), mesh.get_local_rank(), mesh.get_group()


def local_heads(query_weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """This rank's heads of a ``[1, heads, q, k]`` attention bias computed for all heads (all of it without tensor
    parallelism); the heads' gradients are summed over the group on the way back, so whatever computed the bias (a
    position table) gets its whole gradient on every rank."""
    tp, r, group = tensor_parallel_heads(query_weight)
    if tp == 1:
        return bias
    heads = bias.shape[1] // tp
    return _CopyToTensorParallel.apply(bias, group)[:, r * heads:(r + 1) * heads]
