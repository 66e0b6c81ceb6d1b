"""ViT and Swin image classifiers (``ViTForImageClassification``, ``SwinForImageClassification``) as chains.

Batches are dicts ``{"pixel_values", "labels"}``. ViT: patch embedding, one layer per encoder block, final norm +
classifier on the first token. Swin: patch embedding, one layer per block of every stage, one layer per patch
merging between stages, final norm + average pool + classifier; a block's patch-grid size is a constant of its
stage (from the config), not sent. Both shard attention heads and MLP under tensor parallelism (from transformers
5.9: before, their attentions reshape with a fixed head count). Swin's blocks differ between stages (width, heads,
grid) and within a stage (shifted windows or not): each answers ``uniap_structure_key()``, so profiling pools only
truly identical blocks.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import Family, count_rows, register
from uniap_lightning.adapters.families import compat
from uniap_lightning.adapters.families.common import (
    View,
    classification_loss,
    colwise,
    divisors_of_all,
    local_heads,
    rowwise,
)

Payload = dict[str, torch.Tensor]


def _mlp_plan(prefix: str) -> dict[str, Any]:
    return {f"{prefix}.mlp.fc1": colwise(), f"{prefix}.mlp.fc2": rowwise()}


# ------------------------------------------------------------------------------------------------------ ViT
class PatchEmbed(View):
    def forward(self, d: Payload) -> dict[str, Any]:
        out = self.embeddings(d["pixel_values"])
        return {"hidden": out[0] if isinstance(out, tuple) else out, "pixel_values": None}


class ViTBlock(View):
    """One ViT layer. Tensor parallel: q/k/v and fc1 column-parallel, o and fc2 row-parallel (whole heads)."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__(layer=layer)
        self.config = config

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        out = self.layer(d["hidden"])
        return {"hidden": out[0] if isinstance(out, tuple) else out}

    def uniap_tp_degrees(self) -> list[int]:
        if not compat.at_least(compat.VISION_PROJECTIONS):  # before 5.9: a fixed number of heads per rank
            return [1]
        return divisors_of_all(self.config.num_attention_heads, self.config.intermediate_size)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        attn = {f"layer.attention.{p}": colwise() for p in ("q_proj", "k_proj", "v_proj")}
        return {**attn, "layer.attention.o_proj": rowwise(), **_mlp_plan("layer")}

    def uniap_tp_allreduces(self) -> int:
        return 2


class ViTHead(View):
    def forward(self, d: Payload) -> torch.Tensor:
        return self.classifier(self.layernorm(d["hidden"])[:, 0, :])


def vit_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    compat.check_supported()
    vit = model.vit
    path, blocks = compat.vit_blocks(vit)
    return [
        (PatchEmbed(embeddings=vit.embeddings), ["vit.embeddings"]),
        *[(ViTBlock(layer, vit.config), [f"vit.{path}.{i}"]) for i, layer in enumerate(blocks)],
        (ViTHead(layernorm=vit.layernorm, classifier=model.classifier), ["vit.layernorm", "classifier"]),
    ]


# ------------------------------------------------------------------------------------------------------ Swin
def _heads_of_this_rank(attention: nn.Module, module: nn.Module, args: Any, bias: torch.Tensor) -> torch.Tensor:
    """Forward hook of a Swin attention's relative-position bias: this rank's heads under tensor parallelism."""
    return local_heads(attention.q_proj.weight, bias)


class SwinBlock(View):
    """One Swin block on its stage's patch grid ``dims``. Tensor parallel in the Megatron pattern (q/k/v and fc1
    column-, o and fc2 row-parallel); the block's relative-position bias, computed for all heads from its table,
    is cut to this rank's heads by a forward hook (no-op without tensor parallelism; parameter names unchanged)."""

    def __init__(self, block: nn.Module, dims: tuple[int, int]) -> None:
        super().__init__(block=block)
        self.dims = dims
        attention = block.attention
        if compat.at_least(compat.VISION_PROJECTIONS) and not getattr(attention, "_uniap_heads_hook", False):
            attention.relative_position_bias.register_forward_hook(partial(_heads_of_this_rank, attention))
            attention._uniap_heads_hook = True

    def uniap_structure_key(self) -> tuple[Any, ...]:
        return (self.dims, self.block.shift_size, self.block.window_size)

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        out = self.block(d["hidden"], self.dims)
        return {"hidden": out[0] if isinstance(out, tuple) else out}

    def uniap_tp_degrees(self) -> list[int]:
        if not compat.at_least(compat.VISION_PROJECTIONS):  # before 5.9: a fixed number of heads per rank
            return [1]
        return divisors_of_all(self.block.mlp.fc1.out_features, self.block.attention.num_attention_heads)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        attn = {f"block.attention.{p}": colwise() for p in ("q_proj", "k_proj", "v_proj")}
        return {**attn, "block.attention.o_proj": rowwise(), **_mlp_plan("block")}

    def uniap_tp_allreduces(self) -> int:
        return 2


class SwinMerge(View):
    def __init__(self, downsample: nn.Module, dims: tuple[int, int]) -> None:
        super().__init__(downsample=downsample)
        self.dims = dims

    def uniap_structure_key(self) -> tuple[int, int]:
        return self.dims

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        return {"hidden": self.downsample(d["hidden"], self.dims)}


class SwinHead(View):
    def forward(self, d: Payload) -> torch.Tensor:
        pooled = torch.flatten(self.pooler(self.layernorm(d["hidden"]).transpose(1, 2)), 1)
        return self.classifier(pooled)


def swin_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    compat.check_supported()
    swin, cfg = model.swin, model.config
    image = cfg.image_size if isinstance(cfg.image_size, (tuple, list)) else (cfg.image_size, cfg.image_size)
    patch = cfg.patch_size if isinstance(cfg.patch_size, (tuple, list)) else (cfg.patch_size, cfg.patch_size)
    dims = (math.ceil(image[0] / patch[0]), math.ceil(image[1] / patch[1]))
    out: list[tuple[nn.Module, list[str]]] = [(PatchEmbed(embeddings=swin.embeddings), ["swin.embeddings"])]
    for s, stage in enumerate(swin.encoder.layers):
        out += [(SwinBlock(b, dims), [f"swin.encoder.layers.{s}.blocks.{i}"]) for i, b in enumerate(stage.blocks)]
        if stage.downsample is not None:
            out.append((SwinMerge(stage.downsample, dims), [f"swin.encoder.layers.{s}.downsample"]))
            dims = ((dims[0] + 1) // 2, (dims[1] + 1) // 2)
    out.append((SwinHead(layernorm=swin.layernorm, pooler=swin.pooler, classifier=model.classifier),
                ["swin.layernorm", "classifier"]))
    return out


register("vit", Family(layers=vit_layers, loss=classification_loss, inputs=("pixel_values",), count=count_rows))
register("swin", Family(layers=swin_layers, loss=classification_loss, inputs=("pixel_values",), count=count_rows))
