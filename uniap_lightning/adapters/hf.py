"""Hugging Face GPT-2 and Llama as chains: embedding, one layer per decoder block, final norm + LM head.

Blocks are called without attention masks: the adapter switches the model to SDPA attention, which is causal when
no mask is given (no padding support: pack sequences to equal length). Tied input/output embeddings cannot live on
two pipeline stages; build the model with ``tie_word_embeddings=False``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uniap_lightning.errors import UniAPError


def _divisors_of_all(*values: int) -> list[int]:
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]


def _colwise(**kw: Any) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(**kw)


def _rowwise(**kw: Any) -> Any:
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(**kw)


def _replicate() -> Any:
    from torch.distributed.tensor import Replicate

    return Replicate()


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


class TokenPositionEmbedding(GlobalPositions, nn.Module):
    """Token + learned position embedding (``wte``, ``wpe``, ``drop``); tensor parallel over the vocabulary.

    Under context parallelism (``uniap_enable_cp(group)``) its input is a contiguous piece of each sequence and
    positions are global (``cp_rank x s/c`` onwards, :func:`uniap_lightning.runtime.sequence.position_offset`)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from uniap_lightning.runtime.sequence import position_offset

        start = position_offset(self._cp_group, ids.shape[1])
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(pos))

    def uniap_tp_degrees(self) -> list[int]:
        return _divisors_of_all(self.wte.num_embeddings)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"wte": _rowwise(input_layouts=_replicate(), output_layouts=_replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


# ---------------------------------------------------------------------------------------------- GPT-2
class GPT2Embedding(TokenPositionEmbedding):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop



class GPT2BlockLayer(nn.Module):
    """A GPT-2 block. No tensor-parallel plan: the fused QKV ``Conv1D`` does not shard by heads."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out

    def uniap_sequence(self) -> dict[str, Any]:
        heads = self.block.attn.num_heads
        return {"attention_heads": heads, "kv_heads": heads, "sequence_parallel": False}

    def uniap_cp_methods(self) -> list[str]:
        return ["ulysses", "ring"]

    def uniap_enable_cp(self, group: Any, *, method: str = "ulysses", counter: Any = None) -> None:
        """Ulysses or ring attention over ``group`` (transformers' attention interface, :mod:`.families.sequence_hf`)."""
        from uniap_lightning.adapters.families.sequence_hf import switch_attention

        switch_attention(self.block.attn, group, counter=counter, method=method, heads=self.block.attn.num_heads,
                         name="GPT2BlockLayer")


class NormHead(nn.Module):
    """Final norm + LM head; tensor parallel over the vocabulary (logits gathered)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": 0}  # token-wise

    def uniap_tp_degrees(self) -> list[int]:
        return _divisors_of_all(self.lm_head.out_features)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"lm_head": _colwise(output_layouts=_replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


def gpt2_layers(model: Any) -> list[nn.Module]:
    t = model.transformer
    return [GPT2Embedding(t.wte, t.wpe, t.drop), *[GPT2BlockLayer(b) for b in t.h], NormHead(t.ln_f, model.lm_head)]


# ---------------------------------------------------------------------------------------------- Llama
class LlamaEmbedding(nn.Module):
    """Token embedding; tensor parallel over the vocabulary (partial sums all-reduced)."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": 0}  # token-wise (rotary positions are the blocks')

    def uniap_tp_degrees(self) -> list[int]:
        return _divisors_of_all(self.embed_tokens.num_embeddings)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"embed_tokens": _rowwise(input_layouts=_replicate(), output_layouts=_replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


class LlamaBlockLayer(nn.Module):
    """A Llama decoder layer with its own rotary embedding (no parameters, so nothing is shared across stages).

    Tensor parallel in the Megatron pattern: q/k/v and gate/up column-parallel, o and down row-parallel; the
    attention reshapes with ``-1`` heads, so each rank simply runs its ``heads / tp`` heads.
    """

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self._heads = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos_sin = self.rotary(hidden, pos)
        out = self.layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def uniap_tp_degrees(self) -> list[int]:
        return _divisors_of_all(*self._heads)

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": self._heads[0], "kv_heads": self._heads[1], "sequence_parallel": True}

    def uniap_sp_plan(self, tp: int) -> dict[str, Any]:
        from uniap_lightning.adapters.families.sequence_hf import llama_sp_plan

        return llama_sp_plan(tp)

    def uniap_cp_methods(self) -> list[str]:
        return ["ulysses", "ring"]

    def uniap_enable_cp(self, group: Any, *, method: str = "ulysses", counter: Any = None) -> None:
        """Ulysses or ring attention over ``group`` (transformers' attention interface, :mod:`.families.sequence_hf`)."""
        from uniap_lightning.adapters.families.sequence_hf import enable_hf_ulysses

        enable_hf_ulysses([self], group, counter=counter, method=method)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {
            "layer.self_attn.q_proj": _colwise(),
            "layer.self_attn.k_proj": _colwise(),
            "layer.self_attn.v_proj": _colwise(),
            "layer.self_attn.o_proj": _rowwise(),
            "layer.mlp.gate_proj": _colwise(),
            "layer.mlp.up_proj": _colwise(),
            "layer.mlp.down_proj": _rowwise(),
        }

    def uniap_tp_allreduces(self) -> int:
        return 2


def llama_layers(model: Any) -> list[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    m, config = model.model, model.config
    blocks = [LlamaBlockLayer(layer, LlamaRotaryEmbedding(config=config), config) for layer in m.layers]
    return [LlamaEmbedding(m.embed_tokens), *blocks, NormHead(m.norm, model.lm_head)]


# ---------------------------------------------------------------------------------------------- dispatch
_BUILDERS = {"gpt2": gpt2_layers, "llama": llama_layers}


def hf_layers(model: Any) -> list[nn.Module]:
    """The chain of ``model`` (``GPT2LMHeadModel`` or ``LlamaForCausalLM``); switches it to SDPA attention."""
    from uniap_lightning.adapters.families.compat import check_supported

    check_supported()
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _BUILDERS:
        raise UniAPError(
            f"no UniAP adapter for Hugging Face model_type={kind!r}; supported: {sorted(_BUILDERS)}. Other models "
            "can define uniap_layers() on their LightningModule (see uniap_lightning.runtime.chain)."
        )
    if getattr(config, "tie_word_embeddings", False):
        raise UniAPError(
            f"{type(model).__name__} ties its input and output embeddings, which cannot sit on different pipeline "
            "stages; build it with tie_word_embeddings=False"
        )
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    else:
        config._attn_implementation = "sdpa"
    return _BUILDERS[kind](model)
