"""Chain layers the plain GPT (:mod:`.gpt`), the MoE GPT (:mod:`.moe`) and the Hugging Face decoders
(:mod:`.families.text_decoders`, which :func:`uniap_lightning.adapters.hf_layers` uses too) share: a token +
learned position embedding, the token-wise declarations of a layer with absolute positions, and the final norm +
LM head. Each wraps the model's own modules under the model's own attribute names (``wte``, ``wpe``, ``drop``,
``norm``, ``lm_head``), so checkpoints and state dicts keep them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.tp_styles import colwise, divisors_of_all, replicate, rowwise
from uniap_lightning.runtime.sequence import position_offset

__all__ = ["GlobalPositions", "NormHead", "TokenPositionEmbedding"]


class GlobalPositions:
    """Mixin of a token-wise layer with absolute positions: it declares itself token-wise (``uniap_sequence``) and,
    under context parallelism, keeps the group so its ``forward`` can number positions globally
    (:func:`uniap_lightning.runtime.sequence.position_offset`)."""

    _cp_group: Any = None

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": 0}

    def uniap_cp_methods(self) -> list[str]:
        return ["ulysses", "ring"]  # token-wise: either method's contiguous pieces

    def uniap_enable_cp(self, group: Any, *, method: str = "ulysses", counter: Any = None) -> None:
        self._cp_group = group


class TokenPositionEmbedding(nn.Module):
    """Token + learned position embedding (``wte``, ``wpe``, ``drop``); tensor parallel over the vocabulary.

    Positions are global under context parallelism (``_cp_group``, set by :class:`GlobalPositions`): the input is
    then a contiguous piece of each sequence, numbered from ``cp_rank x s/c``."""

    _cp_group: Any = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        start = position_offset(self._cp_group, ids.shape[1])
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(pos))

    def forward(self, ids: torch.Tensor) -> Any:
        return self.embed(ids)

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.wte.num_embeddings)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"wte": rowwise(input_layouts=replicate(), output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


class NormHead(nn.Module):
    """Final norm + LM head; tensor parallel over the vocabulary (logits gathered). Token-wise: under context
    parallelism it may run on sequence pieces."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> Any:
        return self.lm_head(self.norm(hidden))

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": 0}  # token-wise

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.lm_head.out_features)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"lm_head": colwise(output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1
