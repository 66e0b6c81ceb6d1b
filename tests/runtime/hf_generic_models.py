"""Tiny models of the Hugging Face families with no hand-written builder (the generic split,
``uniap_lightning.adapters.families.generic``): decoder-only causal LMs, encoder masked LMs (``_mlm``) and sequence
classifiers (``_cls``); hidden 32, 2 blocks, vocabulary 64, no dropout; ``<family>_tied`` ties the LM head to the
token embedding."""

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
    "bloom": ("transformer.word_embeddings", "transformer.h", "transformer.ln_f"),  # ALiBi: [batch * heads, ...]
    "gemma3": ("model.embed_tokens", "model.layers", "model.norm"),  # sliding and full attention layers
    "gptj": ("transformer.wte", "transformer.h", "transformer.ln_f"),
    "gpt_bigcode": ("transformer.wte", "transformer.h", "transformer.ln_f"),
    "codegen": ("transformer.wte", "transformer.h", "transformer.ln_f"),
    "mpt": ("transformer.wte", "transformer.blocks", "transformer.norm_f"),
    "falcon_alibi": ("transformer.word_embeddings", "transformer.h", "transformer.ln_f"),
    # encoders: masked LMs (decoder tied to the word embeddings) and sequence classifiers (3 labels)
    "roberta_mlm": ("roberta.embeddings.word_embeddings", "roberta.encoder.layer", "lm_head"),
    "roberta_cls": ("roberta.embeddings.word_embeddings", "roberta.encoder.layer", "classifier"),
    "electra_mlm": ("electra.embeddings.word_embeddings", "electra.encoder.layer", "generator_predictions"),
    "electra_cls": ("electra.embeddings.word_embeddings", "electra.encoder.layer", "classifier"),
    "distilbert_mlm": ("distilbert.embeddings.word_embeddings", "distilbert.transformer.layer", "vocab_transform"),
}
#: models the generic split cannot reproduce, trained as one layer (the model's top-level module holding its body)
ONE_LAYER = {"gemma2": "model", "distilbert_cls": "distilbert", "albert_mlm": "albert", "qwen2_cls": "model"}


def data_family(family: str) -> str:
    """The ``hf_models.hf_batches`` layout of ``family``: masked-LM or classification labels, else causal."""
    return "bert_mlm" if family.endswith("_mlm") else "bert" if family.endswith("_cls") else family


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
    encoder = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=4 * SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                   pad_token_id=0)
    distilbert = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=4 * SEQ,
                      dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, pad_token_id=0)
    if kind == "roberta_mlm":
        return tr.RobertaForMaskedLM(tr.RobertaConfig(**encoder))
    if kind == "roberta_cls":
        return tr.RobertaForSequenceClassification(tr.RobertaConfig(**encoder, num_labels=3))
    if kind == "electra_mlm":
        return tr.ElectraForMaskedLM(tr.ElectraConfig(**encoder, embedding_size=16))
    if kind == "electra_cls":
        return tr.ElectraForSequenceClassification(tr.ElectraConfig(**encoder, embedding_size=16, num_labels=3))
    if kind == "distilbert_mlm":
        return tr.DistilBertForMaskedLM(tr.DistilBertConfig(**distilbert))
    if kind == "distilbert_cls":  # pools and activates in its top-level forward: one layer
        return tr.DistilBertForSequenceClassification(tr.DistilBertConfig(**distilbert, num_labels=3))
    if kind == "albert_mlm":  # one shared block run num_hidden_layers times: one layer
        return tr.AlbertForMaskedLM(tr.AlbertConfig(**encoder, embedding_size=16))
    if kind == "qwen2_cls":  # pools at the last real token in its top-level forward: one layer
        return tr.Qwen2ForSequenceClassification(tr.Qwen2Config(**common, intermediate_size=64, num_key_value_heads=2,
                                                                num_labels=3))
    gpt = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=4 * SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    if kind == "bloom":
        return tr.BloomForCausalLM(tr.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                                  hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=tie))
    if kind == "gemma3":
        return tr.Gemma3ForCausalLM(tr.Gemma3TextConfig(**common, intermediate_size=64, num_key_value_heads=2,
                                                        head_dim=8, sliding_window=4, final_logit_softcapping=None))
    if kind == "gptj":
        return tr.GPTJForCausalLM(tr.GPTJConfig(**gpt, rotary_dim=4))
    if kind == "gpt_bigcode":
        return tr.GPTBigCodeForCausalLM(tr.GPTBigCodeConfig(**gpt))
    if kind == "codegen":
        return tr.CodeGenForCausalLM(tr.CodeGenConfig(**gpt, rotary_dim=4))
    if kind == "mpt":
        return tr.MptForCausalLM(tr.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=4 * SEQ,
                                              tie_word_embeddings=tie))
    if kind == "falcon_alibi":
        return tr.FalconForCausalLM(tr.FalconConfig(**common, alibi=True, hidden_dropout=0.0, attention_dropout=0.0))
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
    if family in ONE_LAYER:
        return [f"model.{ONE_LAYER[family]}"]
    first, blocks, last = GENERIC[family.removesuffix("_tied")]
    return [f"model.{first}", f"model.{blocks}.0", f"model.{blocks}.1", f"model.{last}"]
