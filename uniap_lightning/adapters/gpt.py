"""A plain-PyTorch GPT (nanoGPT-style, pre-norm) written as a chain, with tensor-parallel plans per layer.

``GPT(GPTConfig(...)).layers()`` gives ``[Embedding, Block x n_layer, Head]``; wrap it with
:class:`~uniap_lightning.adapters.CausalLMModule`. ``named_layers()`` gives the same layers under the names the
analytic model gives them (``embed, block0 .., lm_head``): a chain built from it runs a plan `uniap plan` made. Attention projections are separate q/k/v ``nn.Linear`` and
heads are reshaped with ``-1``, so column-parallel q/k/v give each tensor-parallel rank ``n_head / tp`` whole
heads (a fused QKV weight would split across q, k and v instead).

The sequence dimension (:mod:`uniap_lightning.runtime.sequence`): ``Block.uniap_enable_cp(group, method=...)``
runs its attention with Ulysses or ring attention (:mod:`uniap_lightning.runtime.ring`) over a context-parallel
group and ``Embedding.uniap_enable_cp(group)`` gives it global positions; ``Block.uniap_sp_plan(tp)`` is the
tensor-parallel plan with sequence parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from uniap_lightning.adapters.chain_layers import GlobalPositions, NormHead, TokenPositionEmbedding
from uniap_lightning.adapters.tp_styles import colwise, divisors_of_all, rowwise
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.analytic import lm_layer_names
from uniap_lightning.runtime.ring import ring_attention
from uniap_lightning.runtime.sequence import CP_METHODS, attention, check_ulysses, ulysses_attention
from uniap_lightning.runtime.sequence_tp import replicate_sequence, sp_plan


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class Embedding(GlobalPositions, TokenPositionEmbedding):
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
        #: key padding mask (``[b, s]`` piece on this rank, true = token), set by ``sequence.padding_mask``
        self.uniap_key_valid: torch.Tensor | None = None
        self._cp_group: Any = None
        self._cp_counter: Any = None
        self._cp_method = "ulysses"

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        x = replicate_sequence(x)  # sequence parallel: q, k and v share one all-gather
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = self._attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout_p = self.dropout if self.training else 0.0
        if self._cp_group is None and self.uniap_key_valid is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)

        if self._cp_group is None:
            return attention(q, k, v, causal=True, key_valid=self.uniap_key_valid, dropout_p=dropout_p)
        if self._cp_method == "ring":
            return ring_attention(q, k, v, self._cp_group, causal=True, key_valid=self.uniap_key_valid,
                                  counter=self._cp_counter, dropout_p=dropout_p)
        return ulysses_attention(q, k, v, self._cp_group, causal=True, key_valid=self.uniap_key_valid,
                                 dropout_p=dropout_p, counter=self._cp_counter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.n_head, self.fc.out_features)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"q": colwise(), "k": colwise(), "v": colwise(), "proj": rowwise(),
                "fc": colwise(), "fc_proj": rowwise()}

    def uniap_tp_allreduces(self) -> int:
        return 2

    def uniap_sp_plan(self, tp: int) -> dict[str, Any]:
        """TP with sequence parallelism: norms on sequence pieces, q/k/v (sharing one gather) and fc gather the
        sequence, proj/fc_proj reduce-scatter it; input and output replicated over the group at the chain boundary."""
        return sp_plan(norms=["ln_1", "ln_2"], colwise=["fc"], gathered=["q", "k", "v"], rowwise=["proj", "fc_proj"])

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": self.n_head, "kv_heads": self.n_head, "sequence_parallel": True}

    def uniap_cp_methods(self) -> list[str]:
        return ["ulysses", "ring"]

    def uniap_attention_dropout(self) -> float:
        return self.dropout

    def uniap_cp_degrees(self, tp: int = 1) -> list[int]:
        """Ulysses degrees possible at tensor-parallel degree ``tp``: divisors of the heads per TP rank."""
        return divisors_of_all(self.n_head // tp) if self.n_head % tp == 0 else []

    def uniap_enable_cp(self, group: Any, *, method: str = "ulysses", counter: Any = None) -> None:
        """Run attention with Ulysses or ring attention (``method``) over ``group`` (the inputs are this rank's
        contiguous sequence pieces); ``counter`` (a ``sequence.AllToAllCounter``) counts the elements sent."""
        if method not in CP_METHODS:
            raise UniAPError(f"GPT Block: context-parallel method {method!r} is not one of {list(CP_METHODS)}")
        if method == "ulysses":
            tp = self.q.weight.device_mesh.size() if hasattr(self.q.weight, "device_mesh") else 1
            check_ulysses(heads=self.n_head, cp=dist.get_world_size(group), tp=tp, name="GPT Block (ulysses)")
        self._cp_group, self._cp_counter, self._cp_method = group, counter, method


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

    def named_layers(self) -> dict[str, nn.Module]:
        """The layers under the analytic model's names (:func:`~uniap_lightning.planner.analytic.lm_layer_names`),
        for ``CausalLMModule``: its chain's children are then ``embed, block0 .., lm_head``."""
        return dict(zip(lm_layer_names(len(self.blocks)), self.layers(), strict=True))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        for layer in self.layers():
            ids = layer(ids)
        return ids
