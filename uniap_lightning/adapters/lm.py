"""A LightningModule for causal language models given as a chain of layers (see :mod:`uniap_lightning.adapters`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class CausalLMModule(pl.LightningModule):
    """Next-token prediction over a chain ``ids -> ... -> logits``.

    Follows the UniAP model contract: the chain is the ``chain`` ``nn.Sequential``, the loss is
    :meth:`uniap_loss`, and a batch is ``(input_ids, labels)`` (labels are shifted inside the loss, so pass the
    ids themselves) or a dict with ``input_ids`` (and optional ``labels``). It also trains without UniAP.

    ``layers``: a list (the chain's children are ``chain.0``, ``chain.1``, ...) or a mapping of names to layers
    (``chain.<name>``): ``GPT.named_layers()`` names them as the analytic model does, so a plan from `uniap plan`
    for the same model config pins (``UniAPStrategy(plan=...)``).
    """

    def __init__(self, layers: Sequence[nn.Module] | Mapping[str, nn.Module], *, lr: float = 3e-4,
                 weight_decay: float = 0.0) -> None:
        super().__init__()
        self.chain = nn.Sequential(OrderedDict(layers)) if isinstance(layers, Mapping) else nn.Sequential(*layers)
        self.lr = lr
        self.weight_decay = weight_decay

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.chain(input_ids)

    def uniap_split_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, dict):
            return batch["input_ids"], batch.get("labels", batch["input_ids"])
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        return batch, batch

    def uniap_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of each position's logits against the next token."""
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = self.uniap_split_batch(batch)
        loss = self.uniap_loss(self(ids), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = self.uniap_split_batch(batch)
        loss = self.uniap_loss(self(ids), labels)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
