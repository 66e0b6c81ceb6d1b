"""A Hugging Face family as a record (:class:`Family`), the registry of the hand-written ones (:data:`FAMILIES`, by
``config.model_type``) and what every family's loss shares (:class:`HFTarget`, the ``count_*`` functions).

The leaf of the adapters' family route: the families (:mod:`uniap_lightning.adapters.families`) import it to
declare and register themselves, and :mod:`uniap_lightning.adapters.auto` imports the families (which fills the
registry) and builds a model's chain from its entry; each name is also importable from ``adapters.auto``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class HFTarget:
    """What the loss of one micro-batch needs: its ``labels`` and the scale that makes the mean over micro-batches
    equal the model's own mean over the *whole* batch.

    Hugging Face losses average over the labelled items (tokens whose label is not -100, or rows). A micro-batch
    holding ``r`` of the batch's ``R`` rows computes ``sum of its item losses * R / (r * N)`` with ``N`` the
    labelled items of the whole batch; the strategy averages its micro-batches' losses (``R / r`` of them), which
    gives ``sum over the batch / N``: the one-device loss, however the padding falls (``global_scale`` is
    ``R / N`` on every row, so it splits with the batch)."""

    labels: torch.Tensor
    global_scale: torch.Tensor

    def per_item_sum_scale(self) -> torch.Tensor:
        """The factor for the micro-batch's *sum* of item losses."""
        return self.global_scale[0] / self.labels.shape[0]


@dataclass
class Family:
    """How to turn a model of one family into a chain."""

    #: ``model -> [(layer, [FQN of each module of the model it wraps, relative to the model])]``
    layers: Callable[[Any], list[tuple[nn.Module, list[str]]]]
    #: ``(model, output, target) -> mean loss`` (the model's own loss, see :class:`HFTarget`)
    loss: Callable[[Any, Any, HFTarget], torch.Tensor]
    #: the keys of the batch dict the chain's first layer takes
    inputs: tuple[str, ...]
    #: how many items of ``labels`` the model's loss averages over (e.g. tokens whose label is not -100)
    count: Callable[[torch.Tensor], torch.Tensor]
    #: ``(model, batch) -> extra inputs`` derived from the batch (e.g. T5's decoder ids from its labels)
    prepare: Callable[[Any, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    #: the attention implementation the layers run with (``None``: the model's own)
    attention: str | None = "sdpa"
    #: weights the model ties (``(module holding the original, module given an equal copy)``, relative to the
    #: model, e.g. T5's ``("shared", "lm_head")``): kept as two copies with summed gradients (runtime/ties.py)
    ties: tuple[tuple[str, str], ...] = ()
    #: ``batch -> the target`` (``None`` for a batch without one); default ``batch["labels"]``. Its first dimension
    #: is the batch's; ``count`` may count per column (question answering: start and end positions), each column
    #: then getting its own whole-batch scale
    labels: Callable[[dict[str, torch.Tensor]], torch.Tensor | None] | None = None
    #: a family whose models differ by head (masked LM, sequence classification, ...): ``model -> the Family of
    #: this model``
    head: Callable[[Any], Family] | None = None


def count_rows(labels: torch.Tensor) -> torch.Tensor:
    """Losses that average over samples (classification): every row counts once."""
    return torch.tensor(labels.shape[0])


def count_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Losses that average over labelled tokens (label != -100)."""
    return (labels != -100).sum()


def count_next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Causal LM losses: the labels are shifted by one inside the loss, so the first position never counts."""
    return (labels[..., 1:] != -100).sum()


#: model_type -> Family (filled by the family modules on import: :mod:`uniap_lightning.adapters.families`)
FAMILIES: dict[str, Family] = {}


def register(model_type: str, family: Family) -> None:
    FAMILIES[model_type] = family
