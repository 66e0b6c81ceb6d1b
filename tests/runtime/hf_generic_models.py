"""Tiny decoder-only causal LMs of the families with no hand-written builder (the generic split,
``uniap_lightning.adapters.families.generic``): hidden 32, 2 blocks, vocabulary 64, no dropout; ``<family>_tied``
ties the LM head to the token embedding."""

from __future__ import annotations

from typing import Any

import torch

from hf_models import SEQ, VOCAB, HFModule

#: families covered; their first (prologue) / last (epilogue) layer names and where the blocks are
GENERIC = {
    "opt": ("model.decoder.embed_tokens", "model.decoder.layers", "model.decoder.final_layer_norm"),
    "mistral": ("model.embed_tokens", "model.layers", "model.norm"),
    "qwen2": ("model.embed_tokens", "model.layers", "model.norm"),
    "gpt_neox": ("gpt_neox.embed_in", "gpt_neox.layers", "gpt_neox.final_layer_norm"),
    "phi": ("model.embed_tokens", "model.layers", "model.final_layernorm"),
    "gemma": ("model.embed_tokens", "model.layers", "model.norm"),
    "falcon": ("transformer.word_embeddings", "transformer.h", "transformer.ln_f"),
    "qwen3": ("model.embed_tokens", "model.layers", "model.norm"),
    "stablelm": ("model.embed_tokens", "model.layers", "model.norm"),
    "olmo": ("model.embed_tokens", "model.layers", "lm_head"),  # (its final norm has no parameters)
}


def build_generic(family: str) -> Any:
    """A tiny randomly initialized causal LM of ``family`` (``<family>_tied``: LM head tied; seeded by the caller)."""
    import transformers as tr

    tie = family.endswith("_tied")
    kind = family.removesuffix("_tied")
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  tie_word_embeddings=tie, pad_token_id=0)
    if kind == "opt":
        return tr.OPTForCausalLM(tr.OPTConfig(**common, ffn_dim=64, max_position_embeddings=2 * SEQ, dropout=0.0,
                                              attention_dropout=0.0, word_embed_proj_dim=32))
    if kind == "gpt_neox":
        return tr.GPTNeoXForCausalLM(tr.GPTNeoXConfig(**common, intermediate_size=64, hidden_dropout=0.0,
                                                      attention_dropout=0.0, max_position_embeddings=2 * SEQ))
    if kind == "falcon":
        return tr.FalconForCausalLM(tr.FalconConfig(**common, hidden_dropout=0.0, attention_dropout=0.0))
    if kind == "gemma2":  # soft-capped logits: no generic split, the one-layer fallback
        return tr.Gemma2ForCausalLM(tr.Gemma2Config(**common, intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                                    final_logit_softcapping=0.5, query_pre_attn_scalar=8))
    if kind == "phi":
        return tr.PhiForCausalLM(tr.PhiConfig(**common, intermediate_size=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                              max_position_embeddings=2 * SEQ))
    llama_like = {"mistral": (tr.MistralConfig, tr.MistralForCausalLM, {"sliding_window": 4}),  # < SEQ: it bites
                  "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM, {}),
                  "gemma": (tr.GemmaConfig, tr.GemmaForCausalLM, {"head_dim": 8}),
                  "qwen3": (tr.Qwen3Config, tr.Qwen3ForCausalLM, {"head_dim": 8}),
                  "stablelm": (tr.StableLmConfig, tr.StableLmForCausalLM, {}),
                  "olmo": (tr.OlmoConfig, tr.OlmoForCausalLM, {})}
    cfg, cls, extra = llama_like[kind]
    return cls(cfg(**common, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=2 * SEQ, **extra))


def generic_module(family: str, lr: float = 0.1) -> HFModule:
    torch.manual_seed(0)
    return HFModule(build_generic(family), lr=lr)


def generic_names(family: str) -> list[str]:
    """The chain's layer names under the LightningModule (``model.`` + the model's own module paths)."""
    first, blocks, last = GENERIC[family.removesuffix("_tied")]
    return [f"model.{first}", f"model.{blocks}.0", f"model.{blocks}.1", f"model.{last}"]
