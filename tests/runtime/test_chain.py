"""The model contract: what the strategy finds in a LightningModule without glue code."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from uniap_lightning.runtime import UniAPModule, extract_chain


class _Sequential(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.loss_fn = nn.CrossEntropyLoss()


class _Explicit(pl.LightningModule):
    """Layers spread over several attributes, exposed in order through uniap_layers()."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 10)

    def uniap_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def uniap_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())

    def uniap_split_batch(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["ids"], batch["ids"]


def test_sequential_attribute_and_loss_fn() -> None:
    module = _Sequential()
    chain = extract_chain(module)
    assert chain.names == ["net.0", "net.1", "net.2"]
    assert chain.loss_fn is module.loss_fn
    x, y = chain.split_batch((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)))
    assert x.shape == (2, 4) and y.shape == (2,)


def test_uniap_layers_loss_and_batch_split() -> None:
    module = _Explicit()
    assert isinstance(module, UniAPModule)
    chain = extract_chain(module)
    assert chain.names == ["embed", "blocks.0", "blocks.1", "head"]
    ids = torch.randint(0, 10, (2, 3))
    x, y = chain.split_batch({"ids": ids})
    out = x
    for layer in chain.layers:
        out = layer(out)
    assert chain.loss_fn(out, y).ndim == 0


def test_replacing_a_layer_keeps_other_names() -> None:
    module = _Explicit()
    chain = extract_chain(module)
    chain.replace(1, nn.Identity())
    names = [n for n, _ in module.named_parameters()]
    assert "blocks.0.weight" not in names and {"embed.weight", "blocks.1.weight", "head.weight"} <= set(names)
