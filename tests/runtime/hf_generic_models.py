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
    # other heads (issue 20 item 2): token classification (_tc), question answering (_qa: start / end logits),
    # regression (_reg: 1 label, float targets), multi-label classification (_multilabel: 0 / 1 float targets)
    "roberta_tc": ("roberta.embeddings.word_embeddings", "roberta.encoder.layer", "classifier"),
    "roberta_qa": ("roberta.embeddings.word_embeddings", "roberta.encoder.layer", "qa_outputs"),
    "roberta_reg": ("roberta.embeddings.word_embeddings", "roberta.encoder.layer", "classifier"),
    "electra_tc": ("electra.embeddings.word_embeddings", "electra.encoder.layer", "classifier"),
    "electra_multilabel": ("electra.embeddings.word_embeddings", "electra.encoder.layer", "classifier"),
    "distilbert_tc": ("distilbert.embeddings.word_embeddings", "distilbert.transformer.layer", "classifier"),
    "distilbert_qa": ("distilbert.embeddings.word_embeddings", "distilbert.transformer.layer", "qa_outputs"),
    "qwen2_tc": ("model.embed_tokens", "model.layers", "model.norm"),
    "qwen2_qa": ("transformer.embed_tokens", "transformer.layers", "transformer.norm"),
    "mistral_tc": ("model.embed_tokens", "model.layers", "model.norm"),
    "mistral_qa": ("model.embed_tokens", "model.layers", "model.norm"),
    # decoders' sequence classifiers: pooled at each row's last non-padding token (found by the prologue)
    "qwen2_cls": ("model.embed_tokens", "model.layers", "model.norm"),
    "mistral_reg": ("model.embed_tokens", "model.layers", "model.norm"),
    # images (8 x 8, 3 channels) and audio: pooling in the head's forward reproduced by the epilogue
    "deit": ("deit.embeddings", "deit.layers", "deit.layernorm"),  # first token
    "convnext": ("convnext.embeddings.patch_embeddings", "convnext.encoder.stages", "convnext.layernorm"),  # stages
    "clip_cls": ("vision_model.embeddings", "vision_model.encoder.layers", "vision_model.post_layernorm"),
    "wav2vec2_ctc": ("wav2vec2.feature_extractor.conv_layers.0.conv", "wav2vec2.encoder.layers", "lm_head"),
    "whisper_cls": ("encoder.conv1", "encoder.layers", "encoder.layer_norm"),  # the encoder only, mean pooled
}
#: models the generic split cannot reproduce, trained as one layer (the model's top-level module holding its body)
ONE_LAYER = {"gemma2": "model", "distilbert_cls": "distilbert", "albert_mlm": "albert",
             "electra_mc": "electra",  # flattens the choices in its top-level forward
             "wav2vec2_cls": "wav2vec2"}  # pools over the frames the attention mask keeps
AUDIO = ("wav2vec2_cls", "wav2vec2_ctc", "whisper_cls")
#: wav2vec2's feature extractor: 80 samples -> 7 frames
SAMPLES, MELS, MEL_FRAMES = 80, 8, 16
W2V = dict(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
           num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
           feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0,
           classifier_proj_size=16)


def data_family(family: str) -> str:
    """The ``hf_models.hf_batches`` layout of ``family``: masked-LM, classification, token classification, span,
    regression, multi-label or multiple-choice labels, images, else causal."""
    if family in AUDIO:
        return family
    if family in ("deit", "convnext", "clip_cls"):
        return "vit"
    for suffix, layout in (("_mlm", "bert_mlm"), ("_cls", "bert"), ("_reg", "bert_reg"), ("_mc", "bert_mc"),
                           ("_multilabel", "llama_multilabel")):
        if family.endswith(suffix):
            return layout
    return family  # (hf_batches: *_tc and *_qa by their suffix)


def data_spec(family: str) -> dict[str, Any]:
    """The spawn cases' ``data`` entry for ``family``."""
    if family in AUDIO:
        return {"factory": "hf_generic_models:audio_batches", "family": family}
    return {"factory": "hf_models:hf_batches", "family": data_family(family)}


def batches(batch_size: int, family: str) -> Any:
    """The batches of ``family`` (text and images from ``hf_models.hf_batches``, audio from :func:`audio_batches`)."""
    from hf_models import hf_batches

    return audio_batches(batch_size, family) if family in AUDIO else hf_batches(batch_size, data_family(family))


def audio_batches(batch_size: int, family: str, n: int = 32, seed: int = 1) -> Any:
    """Raw audio (``input_values``, :data:`SAMPLES` samples) with class labels or CTC transcripts (1 to 3 tokens,
    -100 after the end); log-mel ``input_features`` (:data:`MELS` x :data:`MEL_FRAMES`) for Whisper."""
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        if family == "whisper_cls":
            rows.append({"input_features": torch.randn(MELS, MEL_FRAMES, generator=g),
                         "labels": torch.randint(0, 3, (), generator=g)})
            continue
        row = {"input_values": torch.randn(SAMPLES, generator=g)}
        if family == "wav2vec2_ctc":
            length = int(torch.randint(1, 4, (), generator=g))
            tokens = torch.randint(1, W2V["vocab_size"], (3,), generator=g)
            row["labels"] = tokens.masked_fill(torch.arange(3) >= length, -100)
        else:
            row["labels"] = torch.randint(0, 3, (), generator=g)
        rows.append(row)
    return DataLoader(rows, batch_size=batch_size, shuffle=False, drop_last=True)


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
    heads = {"tc": ("ForTokenClassification", {"num_labels": 3}), "qa": ("ForQuestionAnswering", {}),
             "reg": ("ForSequenceClassification", {"num_labels": 1}), "mc": ("ForMultipleChoice", {}),
             "multilabel": ("ForSequenceClassification", {"num_labels": 3,
                                                          "problem_type": "multi_label_classification"})}
    base, _, head = kind.rpartition("_")
    if head in heads:
        suffix, extra = heads[head]
        if base == "roberta":
            return getattr(tr, f"Roberta{suffix}")(tr.RobertaConfig(**encoder, **extra))
        if base == "electra":
            return getattr(tr, f"Electra{suffix}")(tr.ElectraConfig(**encoder, embedding_size=16,
                                                                   summary_last_dropout=0.0, **extra))
        if base == "distilbert":
            return getattr(tr, f"DistilBert{suffix}")(tr.DistilBertConfig(**distilbert, qa_dropout=0.0, **extra))
        if base in ("qwen2", "mistral"):
            cls, cfg = {"qwen2": ("Qwen2", tr.Qwen2Config), "mistral": ("Mistral", tr.MistralConfig)}[base]
            return getattr(tr, f"{cls}{suffix}")(cfg(**common, intermediate_size=64, num_key_value_heads=2,
                                                      classifier_dropout=0.0, **extra))
    vision = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64)
    if kind == "deit":
        return tr.DeiTForImageClassification(tr.DeiTConfig(**vision, num_labels=3, hidden_dropout_prob=0.0,
                                                           attention_probs_dropout_prob=0.0))
    if kind == "convnext":  # two stages of different widths (8, 16): each stage a layer
        return tr.ConvNextForImageClassification(tr.ConvNextConfig(
            num_channels=3, image_size=8, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
            num_labels=3, drop_path_rate=0.0))
    if kind == "clip_cls":
        vision.pop("num_channels")
        return tr.CLIPForImageClassification(tr.CLIPConfig(
            vision_config=vision, text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=1, num_attention_heads=4, bos_token_id=1,
                                                   eos_token_id=2, pad_token_id=0), num_labels=3))
    if kind == "wav2vec2_cls":
        return tr.Wav2Vec2ForSequenceClassification(tr.Wav2Vec2Config(**W2V, num_labels=3))
    if kind == "wav2vec2_ctc":  # ctc_loss_reduction "sum" (the default) sums over the batch
        return tr.Wav2Vec2ForCTC(tr.Wav2Vec2Config(**W2V))
    if kind == "whisper_cls":
        return tr.WhisperForAudioClassification(tr.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=MELS, encoder_layers=2, encoder_attention_heads=4, decoder_layers=1,
            decoder_attention_heads=4, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=MEL_FRAMES // 2, max_target_positions=16, num_labels=3, classifier_proj_size=16,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=1))
    if kind == "qwen2_cls":  # pools at the last real token in its top-level forward
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


def generic_module(family: str, lr: float = 0.1, optimizer_lr: float | None = None) -> HFModule:
    """``optimizer_lr``: the learning rate from a spawn case (``make_module`` keeps a case's ``lr`` to itself)."""
    torch.manual_seed(0)
    return HFModule(build_generic(family), lr=lr if optimizer_lr is None else optimizer_lr)


def generic_names(family: str) -> list[str]:
    """The chain's layer names under the LightningModule (``model.`` + the model's own module paths)."""
    if family in ONE_LAYER:
        return [f"model.{ONE_LAYER[family]}"]
    first, blocks, last = GENERIC[family.removesuffix("_tied")]
    return [f"model.{first}", f"model.{blocks}.0", f"model.{blocks}.1", f"model.{last}"]
