"""Hugging Face GPT-2 and Llama causal LMs as tensor chains: embedding, one layer per decoder block, final norm +
LM head, for :class:`~uniap_lightning.adapters.CausalLMModule`.

The layers are the GPT-2 and Llama family's own (:mod:`.families.text_decoders`, with their tensor-parallel plans
and sequence hooks), called with tensors: ids in, logits out. Blocks are called without attention masks: the
adapter switches the model to SDPA attention, which is causal when no mask is given (no padding support: pack
sequences to equal length). Tied input/output embeddings cannot live on two pipeline stages of such a chain (it
has no tie bookkeeping; the strategy's own route for a Hugging Face model does); build the model with
``tie_word_embeddings=False``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from uniap_lightning.adapters.families import compat
from uniap_lightning.adapters.families.text_decoders import (
    GPT2SequenceBlock,
    GPT2SequenceEmbed,
    LlamaSequenceBlock,
    LlamaSequenceEmbed,
    NormLMHead,
)
from uniap_lightning.errors import UniAPError


def gpt2_layers(model: Any) -> list[nn.Module]:
    t = model.transformer
    return [GPT2SequenceEmbed(wte=t.wte, wpe=t.wpe, drop=t.drop), *[GPT2SequenceBlock(b, t.config) for b in t.h],
            NormLMHead(t.ln_f, model.lm_head)]


def llama_layers(model: Any) -> list[nn.Module]:
    m = model.model
    blocks = [LlamaSequenceBlock(layer, m.config) for layer in m.layers]
    return [LlamaSequenceEmbed(embed_tokens=m.embed_tokens), *blocks, NormLMHead(m.norm, model.lm_head)]


_BUILDERS = {"gpt2": gpt2_layers, "llama": llama_layers}


def hf_layers(model: Any) -> list[nn.Module]:
    """The chain of ``model`` (``GPT2LMHeadModel`` or ``LlamaForCausalLM``); switches it to SDPA attention."""
    compat.check_supported()
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
