"""Models and data for the multi-tensor tests: a chain whose layers pass dicts and tuples of tensors (an integer
padding mask among them), loaded as dict batches. Built in the test processes through ``make_module(factory=...)``
and ``case["data"]`` of :mod:`uniap_rt_helpers`."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from uniap_lightning.runtime.payload import call_layer

IN, HID, OUT = 8, 16, 4


class DictEmbed(nn.Module):
    """{x, mask} -> {h}: drops ``x`` (returned as None), keeps the integer ``mask`` flowing on."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, HID)

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"h": self.proj(d["x"] * d["mask"]), "x": None}


class MaskedBlock(nn.Module):
    """{h, mask} -> {h}: uses the mask (rows with more valid entries are scaled up), returns only ``h``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HID, 2 * HID), nn.Linear(2 * HID, HID)

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weight = d["mask"].sum(dim=1, keepdim=True).to(d["h"].dtype) / IN
        return {"h": d["h"] + self.fc2(torch.tanh(self.fc1(d["h"]))) * weight}

    def uniap_tp_degrees(self) -> list[int]:
        return [1, 2]

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}

    def uniap_tp_allreduces(self) -> int:
        return 1


class ToTuple(nn.Module):
    """dict -> (h, gate): a float gate per sample, computed once and carried to the head."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HID, 1)

    def forward(self, d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return d["h"], torch.sigmoid(self.gate(d["h"]))


class TupleBlock(nn.Module):
    """(h, gate) -> (h, gate): the gate passes through unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HID, HID)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + torch.relu(self.fc(h)), gate


class TupleHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(HID, OUT)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.out(h) * gate


class MultiTensorChain(pl.LightningModule):
    """Six layers: dict -> dict -> dict -> tuple -> tuple -> tensor. Batches are dicts {x, mask, labels}; the
    strategy's default split takes ``labels`` as the target and the rest as the chain's input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = DictEmbed()
        self.blocks = nn.ModuleList([MaskedBlock(), MaskedBlock()])
        self.to_tuple = ToTuple()
        self.tblock = TupleBlock()
        self.head = TupleHead()

    def uniap_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.to_tuple, self.tblock, self.head]

    def uniap_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x: Any = {k: v for k, v in batch.items() if k != "labels"}
        for layer in self.uniap_layers():
            x = call_layer(layer, x)
        return x

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.uniap_loss(self(batch), batch["labels"])

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.uniap_loss(self(batch), batch["labels"])
        self.log("val_loss", loss)
        return loss

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


LAYER_NAMES = ["embed", "blocks.0", "blocks.1", "to_tuple", "tblock", "head"]


def multi_tensor_module() -> MultiTensorChain:
    return MultiTensorChain()


def dict_batches(batch_size: int, n: int = 64, seed: int = 1) -> Any:
    """Dict batches {x, mask (int64, some rows mostly padding), labels}."""
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    valid = torch.randint(1, IN + 1, (n, 1), generator=g)
    mask = (torch.arange(IN).unsqueeze(0) < valid).long()
    labels = torch.randn(n, OUT, generator=g)
    rows = [{"x": x[i], "mask": mask[i], "labels": labels[i]} for i in range(n)]
    return DataLoader(rows, batch_size=batch_size, shuffle=False, drop_last=True)
