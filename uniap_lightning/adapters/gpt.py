"""A plain-PyTorch GPT (nanoGPT-style, pre-norm) written as a chain, with tensor-parallel plans per layer.

``GPT(GPTConfig(...)).layers()`` gives ``[Embedding, Block x n_layer, Head]``; wrap it with
:class:`~uniap_lightning.adapters.CausalLMModule`. Attention projections are separate q/k/v ``nn.Linear`` and
heads are reshaped with ``-1``, so column-parallel q/k/v give each tensor-parallel rank ``n_head / tp`` whole
heads (a fused QKV weight would split across q, k and v instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from uniap_lightning.adapters.hf import NormHead, TokenPositionEmbedding, _colwise, _divisors_of_all, _replicate, _rowwise


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class Embedding(TokenPositionEmbedding):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        c = cfg.n_embd
        self.head_dim = c // cfg.n_head
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.q, self.k, self.v, self.proj = (nn.Linear(c, c) for _ in range(4))
        self.fc, self.fc_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))

    def uniap_tp_degrees(self) -> list[int]:
        return _divisors_of_all(self.n_head, self.fc.out_features)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"q": _colwise(), "k": _colwise(), "v": _colwise(), "proj": _rowwise(),
                "fc": _colwise(), "fc_proj": _rowwise()}

    def uniap_tp_allreduces(self) -> int:
        return 2


class GPT(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = NormHead(nn.LayerNorm(cfg.n_embd), nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False))

    def layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        for layer in self.layers():
            ids = layer(ids)
        return ids
