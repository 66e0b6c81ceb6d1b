"""Pieces every family uses: tensor-parallel styles, the causal-LM loss with a whole-batch item count."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.auto import HFTarget
from uniap_lightning.adapters.hf import _colwise, _divisors_of_all, _replicate, _rowwise

__all__ = ["View", "causal_lm_loss", "classification_loss", "colwise", "divisors_of_all", "rowwise", "replicate",
           "token_loss"]

colwise, rowwise, replicate, divisors_of_all = _colwise, _rowwise, _replicate, _divisors_of_all


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
