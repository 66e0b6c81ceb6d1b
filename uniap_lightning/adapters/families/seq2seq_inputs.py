"""The inputs of the encoder-decoder split (:mod:`.seq2seq`): the decoder's inputs prepared from the labels (one
preparation for every encoder-decoder family, T5's included), the seq2seq LM loss, which inputs the model and its
encoder take, and the setup probe batch built from the config.
"""
from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import HFTarget, count_tokens
from uniap_lightning.adapters.families.common import token_loss
from uniap_lightning.adapters.families.generic_heads import _Task
from uniap_lightning.adapters.families.generic_trace import _refuse
from uniap_lightning.errors import UniAPError

_FLAGS = ("use_cache", "output_attentions", "output_hidden_states")


def seq2seq_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """The seq2seq LM loss (cross-entropy over the tokens whose label is not -100, labels not shifted), whole-batch
    normalized."""
    return token_loss(logits, target.labels, target)


def _probe_labels(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["labels"]


_TASK = _Task("seq2seq LM cross-entropy", seq2seq_loss, count_tokens, _probe_labels)


# ------------------------------------------------------------------------------------------------------ inputs
def _shift(model: Any, labels: torch.Tensor) -> torch.Tensor:
    """The decoder's inputs from the labels, shifted right as the model does when given only labels."""
    if hasattr(model, "prepare_decoder_input_ids_from_labels"):
        return model.prepare_decoder_input_ids_from_labels(labels=labels)
    shift = getattr(sys.modules.get(type(model).__module__), "shift_tokens_right", None)
    if shift is None:
        raise UniAPError(f"{type(model).__name__} has no prepare_decoder_input_ids_from_labels and its module no "
                         "shift_tokens_right: give the batch 'decoder_input_ids'")
    config = model.config
    kwargs = {k: getattr(config, k) for k in ("pad_token_id", "decoder_start_token_id")
              if k in inspect.signature(shift).parameters}
    return shift(labels, **kwargs)


def prepare_decoder_inputs(model: Any, batch: dict[str, torch.Tensor],
                           shift: Callable[[torch.Tensor], torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """The decoder's inputs of an encoder-decoder batch (``what``, e.g. "a T5 batch", names it in the error): given
    (``decoder_input_ids``), or the labels shifted right by ``shift`` (what the model does with labels alone). Labels
    longer than the decoder's positions (``max_target_positions`` / ``max_position_embeddings``, where the config
    has one) are refused here, else an index error deep in the decoder."""
    if "decoder_input_ids" in batch:
        return {}
    if "labels" not in batch:
        raise UniAPError(f"{what} needs 'labels' (training) or 'decoder_input_ids' (prediction); it has "
                         f"{sorted(batch)}")
    decoder = shift(batch["labels"])
    limit = getattr(model.config, "max_target_positions", None) or getattr(model.config, "max_position_embeddings",
                                                                           None)
    if isinstance(limit, int) and decoder.shape[-1] > limit:  # (else an index error deep in the decoder)
        raise UniAPError(f"the batch's labels hold {decoder.shape[-1]} decoder tokens; {type(model).__name__} takes at "
                         f"most {limit} (config.max_target_positions / max_position_embeddings)")
    return {"decoder_input_ids": decoder}


def seq2seq_prepare(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's inputs: given, or the labels shifted right (what the model does with labels alone)."""
    return prepare_decoder_inputs(model, batch, lambda labels: _shift(model, labels), "an encoder-decoder batch")


def _stacks(model: Any) -> tuple[nn.Module, nn.Module]:
    encoder, decoder = model.get_encoder(), model.get_decoder()
    if not isinstance(encoder, nn.Module) or not isinstance(decoder, nn.Module) or encoder is decoder:
        raise _refuse(model, "it has no separate encoder and decoder modules")
    return encoder, decoder


def _encoder_inputs(model: Any, encoder: nn.Module) -> tuple[str, ...]:
    params = inspect.signature(encoder.forward).parameters
    main = next((k for k in ("input_ids", "input_features") if k in params), None)
    if main is None:
        raise _refuse(model, "its encoder takes neither input_ids nor input_features")
    return (main, *(("attention_mask",) if "attention_mask" in params else ()))


def _model_inputs(model: Any, encoder: nn.Module) -> tuple[str, ...]:
    params = inspect.signature(model.forward).parameters
    return (*_encoder_inputs(model, encoder),
            *(k for k in ("decoder_input_ids", "decoder_attention_mask") if k in params))


def _flags(module: nn.Module) -> dict[str, bool]:
    params = inspect.signature(module.forward).parameters
    return {k: False for k in _FLAGS if k in params}


def _probe(model: Any, encoder: nn.Module, main: str, rows: int, device: torch.device,
           padded: bool = True) -> dict[str, torch.Tensor]:
    """A deterministic batch from the config (no random numbers drawn): 4 input tokens (or the mel features the
    encoder requires) and 3 labels; the last sample's last input token and last label are padding (``padded``)."""
    config = model.config
    vocab = max(int(getattr(config, "vocab_size", 0) or 2) - 1, 1)
    labels = (torch.arange(rows * 3, device=device).reshape(rows, 3) * 5 + 2) % vocab + 1
    if padded:
        labels[-1, -1] = -100
    if main == "input_features":
        length = int(getattr(config, "max_source_positions", 0) or 0)
        for m in encoder.modules():
            if isinstance(m, nn.Conv1d):
                length *= m.stride[0]
        mels = int(getattr(config, "num_mel_bins", 0) or 0)
        if not length or not mels:
            raise _refuse(model, "its encoder takes input_features, but its config has no max_source_positions and "
                                 "num_mel_bins to build a probe from")
        steps = torch.arange(rows * mels * length, device=device, dtype=torch.float32).reshape(rows, mels, length)
        return {"input_features": (steps * 0.37).sin(), "labels": labels}
    ids = (torch.arange(rows * 4, device=device).reshape(rows, 4) * 7 + 3) % vocab + 1
    mask = torch.ones(rows, 4, dtype=torch.long, device=device)
    if padded:
        mask[-1, -1] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
