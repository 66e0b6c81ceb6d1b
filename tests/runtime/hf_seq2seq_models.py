"""Tiny encoder-decoder LMs with no hand-written family (the generic seq2seq split,
``uniap_lightning.adapters.families.seq2seq``): BART, mBART, Marian, Pegasus, Whisper; d_model 32, 2 + 2 blocks,
vocabulary 64, no dropout. Dict batches as Hugging Face users have them: ``input_ids`` / ``attention_mask`` (right
padding of varying length) or Whisper's ``input_features``, and ``labels`` of another length with -100 padding."""

from __future__ import annotations

from typing import Any

import torch

from hf_models import PAD, SEQ, VOCAB, HFModule

#: the decoder's sequence length (labels), unlike the encoder's
TARGET = 6
#: Whisper's mel bins and encoder positions (its input features are 2 * 8 frames long)
MELS, FRAMES = 8, 8

#: families covered: their first (encoder prologue) layer, stacks, bridge (decoder prologue) and last layer
SEQ2SEQ = {
    "bart": ("model.encoder.embed_tokens", "model.encoder.layers", "model.decoder.embed_positions",
             "model.decoder.layers", "lm_head"),
    "mbart": ("model.encoder.embed_tokens", "model.encoder.layers", "model.encoder.layer_norm",
              "model.decoder.layers", "model.decoder.layer_norm"),
    "marian": ("model.encoder.embed_tokens", "model.encoder.layers", "model.decoder.embed_positions",
               "model.decoder.layers", "lm_head"),
    "pegasus": ("model.encoder.embed_tokens", "model.encoder.layers", "model.encoder.layer_norm",
                "model.decoder.layers", "model.decoder.layer_norm"),
    "whisper": ("model.encoder.conv1", "model.encoder.layers", "model.encoder.layer_norm",
                "model.decoder.layers", "model.decoder.layer_norm"),
}
#: more families that come free (tested in the slow set)
MORE = {
    "blenderbot": SEQ2SEQ["pegasus"],
    "blenderbot_small": SEQ2SEQ["bart"],
    "plbart": SEQ2SEQ["bart"],
}
#: encoder-decoder LMs trained as one layer (the model's top-level module holding its body), and why
ONE_LAYER = {
    "bart_layerdrop": ("model", "LayerDrop"),
    # (eager attention only: its masks change with the padding, the payload with them)
    "mvp": ("model", "other arguments for batches with and without padding"),
    "led": ("led", "other arguments for batches with and without padding"),
    "mt5": ("shared", "runs decoder.dropout before and after its blocks"),  # (one dropout module, run twice)
}


def build_seq2seq(family: str) -> Any:
    """A tiny randomly initialized encoder-decoder LM of ``family`` (seeded by the caller)."""
    import transformers as tr

    common = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                  attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                  decoder_start_token_id=2, max_position_embeddings=4 * SEQ)
    if family == "bart":
        return tr.BartForConditionalGeneration(tr.BartConfig(**common, forced_eos_token_id=None))
    if family == "bart_layerdrop":  # skips blocks at random in training: one layer
        return tr.BartForConditionalGeneration(tr.BartConfig(**common, forced_eos_token_id=None,
                                                             encoder_layerdrop=0.1))
    if family == "blenderbot":
        return tr.BlenderbotForConditionalGeneration(tr.BlenderbotConfig(**common))
    if family == "blenderbot_small":
        return tr.BlenderbotSmallForConditionalGeneration(tr.BlenderbotSmallConfig(**common))
    if family == "plbart":
        return tr.PLBartForConditionalGeneration(tr.PLBartConfig(**common))
    if family == "mvp":
        return tr.MvpForConditionalGeneration(tr.MvpConfig(**common))
    if family == "led":
        common = {k: v for k, v in common.items() if k != "max_position_embeddings"}
        return tr.LEDForConditionalGeneration(tr.LEDConfig(**common, max_encoder_position_embeddings=4 * SEQ,
                                                           max_decoder_position_embeddings=4 * SEQ,
                                                           attention_window=4))
    if family == "mt5":
        return tr.MT5ForConditionalGeneration(tr.MT5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                           num_heads=4, dropout_rate=0.0, pad_token_id=PAD,
                                                           decoder_start_token_id=PAD))
    if family == "mbart":
        return tr.MBartForConditionalGeneration(tr.MBartConfig(**common))
    if family == "marian":
        return tr.MarianMTModel(tr.MarianConfig(**common))
    if family == "pegasus":
        return tr.PegasusForConditionalGeneration(tr.PegasusConfig(**common))
    if family == "whisper":
        common = {k: v for k, v in common.items() if k != "max_position_embeddings"}
        return tr.WhisperForConditionalGeneration(tr.WhisperConfig(
            **{**common, "decoder_start_token_id": 1}, num_mel_bins=MELS, max_source_positions=FRAMES,
            max_target_positions=2 * TARGET, begin_suppress_tokens=None, suppress_tokens=None))
    raise ValueError(family)


def seq2seq_module(family: str, lr: float = 0.1) -> HFModule:
    torch.manual_seed(0)
    return HFModule(build_seq2seq(family), lr=lr)


def seq2seq_names(family: str) -> list[str]:
    """The chain's layer names under the LightningModule (``model.`` + the model's own module paths)."""
    if family in ONE_LAYER:
        return [f"model.{ONE_LAYER[family][0]}"]
    first, encoder, bridge, decoder, last = {**SEQ2SEQ, **MORE}[family]
    return [f"model.{n}" for n in (first, f"{encoder}.0", f"{encoder}.1", bridge, f"{decoder}.0", f"{decoder}.1",
                                   last)]


def seq2seq_batches(batch_size: int, family: str, n: int = 32, seed: int = 1) -> Any:
    """Dict batches: text (or Whisper's mel features) in, labels of varying length (-100 past the end) out."""
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(seed)
    rows: list[dict[str, torch.Tensor]] = []
    for _ in range(n):
        length = int(torch.randint(1, TARGET + 1, (), generator=g))
        target = torch.randint(3, VOCAB, (TARGET,), generator=g)
        row = {"labels": target.masked_fill(torch.arange(TARGET) >= length, -100)}
        if family == "whisper":
            row["input_features"] = torch.randn(MELS, 2 * FRAMES, generator=g)
        else:
            real = int(torch.randint(2, SEQ + 1, (), generator=g))
            mask = (torch.arange(SEQ) < real).long()
            row.update(input_ids=torch.randint(3, VOCAB, (SEQ,), generator=g) * mask, attention_mask=mask)
        rows.append(row)
    return DataLoader(rows, batch_size=batch_size, shuffle=False, drop_last=True)
