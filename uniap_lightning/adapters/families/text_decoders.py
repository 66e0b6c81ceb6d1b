"""GPT-2 and Llama as chains (:mod:`.text`): the token (and GPT-2's position) embedding, one layer per decoder block
(the causal + padding mask, and Llama's rotary table, rebuilt in the block) and the head (causal LM, sequence
classification at each row's last non-padding token, token classification, question answering). Llama is tensor
parallel (GPT-2's fused ``Conv1D`` QKV is not); on transformers 5.x both take Ulysses or ring context parallelism,
Llama sequence parallelism too.

Every layer here also takes a plain tensor (ids, then hidden states) and returns one: that is the chain
:func:`uniap_lightning.adapters.hf_layers` builds of a causal LM from these same classes (no attention mask: causal
SDPA, a padding mask only through :func:`~uniap_lightning.runtime.sequence.padding_mask` once the attention is
switched, :func:`~.sequence_hf.enable_hf_ulysses`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import Family
from uniap_lightning.adapters.families import compat
from uniap_lightning.adapters.chain_layers import GlobalPositions, NormHead, TokenPositionEmbedding
from uniap_lightning.adapters.families.common import View, colwise, divisors_of_all, replicate, rowwise
from uniap_lightning.adapters.families.sequence_hf import DecoderSequence, llama_sp_plan
from uniap_lightning.adapters.families.text_heads import (
    DECODER_INPUTS,
    LastTokenScore,
    Payload,
    TokenHead,
    _family,
    _first,
    _has,
    _pool_index,
    _pooled,
    _unsupported_head,
    head_kind,
)
from uniap_lightning.runtime.sequence import padding_mask, position_offset


class GPT2Embed(TokenPositionEmbedding, View):
    """Token + learned position embedding, tensor parallel over the vocabulary; under context parallelism
    (:class:`GPT2SequenceEmbed`) its input is a contiguous piece of each sequence and the positions are global
    (``cp_rank x s/c`` onwards)."""

    def forward(self, d: Payload) -> Any:
        if isinstance(d, torch.Tensor):
            return self.embed(d)
        ids = d["input_ids"]
        return {"hidden": self.embed(ids), "input_ids": None, **_pool_index(self, ids)}


class GPT2Block(View):
    """A GPT-2 block with its causal + padding mask rebuilt. No tensor-parallel plan: GPT-2's ``Conv1D`` projections
    (fused QKV) are not ``nn.Linear``, which DTensor's styles shard."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__(block=block)
        self.config = config

    _cp_group: Any = None

    def forward(self, d: Payload) -> Any:
        if isinstance(d, torch.Tensor):  # the tensor chain: no mask
            return _first(self.block(d))
        with _attention_masks(self, self.block, d) as mask:
            return {"hidden": _first(self.block(d["hidden"], attention_mask=mask))}


@contextmanager
def _attention_masks(block: Any, module: nn.Module, d: Payload) -> Iterator[Any]:
    """The ``attention_mask`` a decoder block passes ``module``: the causal + padding mask of whole sequences, or
    under context parallelism (``block._cp_group``) none, the switched attention being causal over the whole
    sequence with this piece's key padding mask (gathered over the cp group inside attention,
    :func:`uniap_lightning.runtime.sequence.padding_mask`) set for the call."""
    if block._cp_group is None:
        yield _causal_mask(block.config, d)
        return
    mask = d.get("attention_mask")
    with padding_mask([module], None if mask is None else mask.bool()):
        yield None


class GPT2SequenceEmbed(GlobalPositions, GPT2Embed):
    """:class:`GPT2Embed` that may run on pieces of the sequence (token-wise; global positions under cp)."""


class GPT2SequenceBlock(DecoderSequence, GPT2Block):
    """:class:`GPT2Block` with the sequence dimension: Ulysses or ring context parallelism (no sequence
    parallelism: GPT-2 has no tensor-parallel plan here)."""

    def _attention(self) -> nn.Module:
        return self.block.attn

    def _heads(self) -> tuple[int, int]:
        return self.config.n_head, self.config.n_head

    def uniap_sequence(self) -> dict[str, Any]:
        heads = self.config.n_head
        return {"attention_heads": heads, "kv_heads": heads, "sequence_parallel": False}


def _causal_mask(config: Any, d: Payload) -> Any:
    hidden = d["hidden"]
    pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return compat.causal_mask(config, hidden, d.get("attention_mask"), pos)


class NormLMHead(NormHead):
    """Final norm + LM head (:class:`~uniap_lightning.adapters.chain_layers.NormHead`) on the payload's hidden
    states. Token-wise: under context parallelism it may run on sequence pieces (the model's own causal loss then
    sees the gathered logits)."""

    def forward(self, d: Payload) -> torch.Tensor:
        return super().forward(d if isinstance(d, torch.Tensor) else d["hidden"])


def _decoder_head(model: Any, kind: str | None, norm: nn.Module, prefix: str, norm_name: str, supported: str,
                  classifier: str) -> tuple[nn.Module, list[str]]:
    """The head layer of a decoder (GPT-2, Llama) whose body is ``model.<prefix>`` with final norm ``norm``."""
    fqn = f"{prefix}.{norm_name}"
    if kind == "causal_lm" and _has(model, "lm_head"):
        return NormLMHead(norm=norm, lm_head=model.lm_head), [fqn, "lm_head"]
    if kind == "sequence_classification" and _has(model, "score"):
        return LastTokenScore(norm=norm, score=model.score), [fqn, "score"]
    if kind == "token_classification" and _has(model, "dropout", classifier):
        return TokenHead(out=getattr(model, classifier), norm=norm, dropout=model.dropout), [fqn, classifier]
    if kind == "question_answering" and _has(model, "qa_outputs"):
        return TokenHead(out=model.qa_outputs, norm=norm), [fqn, "qa_outputs"]
    raise _unsupported_head(model, supported)


GPT2_HEADS = ("GPT2LMHeadModel, GPT2ForSequenceClassification, GPT2ForTokenClassification and "
              "GPT2ForQuestionAnswering")
GPT2_TIES = (("transformer.wte", "lm_head"),)


def gpt2_head(model: Any) -> Family:
    """The Family of this GPT-2 model's head."""
    compat.check_supported()
    kind, t = head_kind(model), getattr(model, "transformer", None)
    if not isinstance(t, nn.Module):
        raise _unsupported_head(model, GPT2_HEADS)
    head = _decoder_head(model, kind, t.ln_f, "transformer", "ln_f", GPT2_HEADS, "classifier")
    embed_cls, block_cls = (GPT2SequenceEmbed, GPT2SequenceBlock) if _decoder_sequence(kind) else (GPT2Embed, GPT2Block)
    embed = embed_cls(wte=t.wte, wpe=t.wpe, drop=t.drop)
    if kind == "sequence_classification":
        embed = _pooled(embed, model.config)

    def layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
        return [
            (embed, ["transformer.wte", "transformer.wpe"]),
            *[(block_cls(b, t.config), [f"transformer.h.{i}"]) for i, b in enumerate(t.h)],
            head,
        ]

    return _family(kind, DECODER_INPUTS, layers, ties=GPT2_TIES)


def gpt2_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    return gpt2_head(model).layers(model)


# ------------------------------------------------------------------------------------------------------ Llama
class LlamaEmbed(View):
    """Token embedding; tensor parallel over the vocabulary (partial sums all-reduced)."""

    def forward(self, d: Payload) -> Any:
        if isinstance(d, torch.Tensor):
            return self.embed_tokens(d)
        ids = d["input_ids"]
        return {"hidden": self.embed_tokens(ids), "input_ids": None, **_pool_index(self, ids)}

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.embed_tokens.num_embeddings)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"embed_tokens": rowwise(input_layouts=replicate(), output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


class LlamaBlock(View):
    """A Llama decoder layer; the rotary table (no parameters) and the causal + padding mask are rebuilt here.
    Tensor parallel: q/k/v and gate/up column-parallel, o and down row-parallel."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        super().__init__(layer=layer)
        self.config = config
        self.rotary = LlamaRotaryEmbedding(config=config)

    _cp_group: Any = None

    def forward(self, d: Payload) -> Any:
        if isinstance(d, torch.Tensor):  # the tensor chain: no mask
            return self._run(d, None)
        with _attention_masks(self, self.layer, d) as mask:
            return {"hidden": self._run(d["hidden"], mask)}

    def _run(self, hidden: torch.Tensor, mask: Any) -> torch.Tensor:
        start = position_offset(self._cp_group, hidden.shape[1])  # global rotary positions under cp
        pos = torch.arange(start, start + hidden.shape[1], device=hidden.device).unsqueeze(0)
        return _first(self.layer(hidden, attention_mask=mask, position_ids=pos,
                                 position_embeddings=self.rotary(hidden, pos)))

    def uniap_tp_degrees(self) -> list[int]:
        c = self.config
        return divisors_of_all(c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        attn = {f"layer.self_attn.{p}": colwise() for p in ("q_proj", "k_proj", "v_proj")}
        mlp = {f"layer.mlp.{p}": colwise() for p in ("gate_proj", "up_proj")}
        return {**attn, **mlp, "layer.self_attn.o_proj": rowwise(), "layer.mlp.down_proj": rowwise()}

    def uniap_tp_allreduces(self) -> int:
        return 2


class LlamaSequenceEmbed(GlobalPositions, LlamaEmbed):
    """:class:`LlamaEmbed` that may run on pieces of the sequence (token-wise; the rotary positions are the
    blocks')."""


class LlamaSequenceBlock(DecoderSequence, LlamaBlock):
    """:class:`LlamaBlock` with the sequence dimension: Ulysses or ring context parallelism (grouped-query k/v),
    global rotary positions under cp, and sequence parallelism with tensor parallelism
    (:func:`~.sequence_hf.llama_sp_plan`: the decoder layer is the boundary)."""

    def _attention(self) -> nn.Module:
        return self.layer.self_attn

    def _heads(self) -> tuple[int, int]:
        return self.config.num_attention_heads, self.config.num_key_value_heads

    def uniap_sequence(self) -> dict[str, Any]:
        heads, kv = self._heads()
        return {"attention_heads": heads, "kv_heads": kv, "sequence_parallel": True}

    def uniap_sp_plan(self, tp: int) -> dict[str, Any]:
        return llama_sp_plan(tp)


def _decoder_sequence(kind: str | None) -> bool:
    """Whether a decoder's zero-glue chain declares the sequence dimension: its causal LM, token classification and
    question answering heads (not the sequence classifier: its embedding finds each row's last real token on whole
    sequences), on transformers 5.x (where cp and sp are tested)."""
    return kind in ("causal_lm", "token_classification", "question_answering") and compat.at_least(
        compat.BERT_HEADS_FROM_SHAPE)


LLAMA_HEADS = ("LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification and "
               "LlamaForQuestionAnswering")


def llama_head(model: Any) -> Family:
    """The Family of this Llama model's head."""
    compat.check_supported()
    kind = head_kind(model)
    prefix = getattr(model, "base_model_prefix", "model")  # LlamaForQuestionAnswering: "transformer"
    m = getattr(model, prefix, None)
    if not isinstance(m, nn.Module) or not _has(m, "embed_tokens", "norm"):
        raise _unsupported_head(model, LLAMA_HEADS)
    head = _decoder_head(model, kind, m.norm, prefix, "norm", LLAMA_HEADS, "score")
    sequence = _decoder_sequence(kind)
    embed = (LlamaSequenceEmbed if sequence else LlamaEmbed)(embed_tokens=m.embed_tokens)
    block_cls = LlamaSequenceBlock if sequence else LlamaBlock
    if kind == "sequence_classification":
        embed = _pooled(embed, model.config)

    def layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
        return [
            (embed, [f"{prefix}.embed_tokens"]),
            *[(block_cls(layer, m.config), [f"{prefix}.layers.{i}"]) for i, layer in enumerate(m.layers)],
            head,
        ]

    return _family(kind, DECODER_INPUTS, layers, ties=((f"{prefix}.embed_tokens", "lm_head"),))


def llama_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    return llama_head(model).layers(model)
