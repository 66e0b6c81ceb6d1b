"""The transformers releases the hand-written families support (4.57 through 5.x), in one place: every call or module
layout that differs between releases is decided here, by the installed version, and nowhere else.

Each gate names the first release with the newer behaviour and why it matters; ``tests/runtime/test_compat.py``
checks the branch the installed release takes, and ``tests/ecosystem/test_transformers_oldest.py`` runs the parity
tests against the oldest supported release, which takes the other branches.

* :data:`INPUTS_EMBEDS` (5.2): ``create_causal_mask`` / ``create_bidirectional_mask`` renamed ``input_embeds`` to
  ``inputs_embeds``.
* :data:`NO_CACHE_POSITION` (5.9) and :data:`CACHE_ARGUMENT` (5.24): ``create_causal_mask`` dropped its required
  ``cache_position`` (5.9) and renamed ``past_key_values`` to ``cache`` (5.24).
* :data:`BIDIRECTIONAL_MASK` (5.0): ``create_bidirectional_mask`` is new in 5.0; 4.x encoders add the padding mask
  (0 where attended, the dtype's minimum elsewhere) to their attention scores, which :func:`bidirectional_mask`
  builds the same way.
* :data:`VISION_PROJECTIONS` (5.9): ViT's blocks moved from ``vit.encoder.layer`` to ``vit.layers`` and ViT's and
  Swin's attentions got ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and, for Swin, a ``relative_position_bias``
  module. Before, both reshape with a fixed number of heads: no tensor parallelism.
* :data:`T5_MASK_IN_POSITION_BIAS` (5.15): T5's attention adds the mask to the position bias it computes, and
  ignores the mask when given a bias (so a block handed the bias gets the mask inside it); from 5.15 it adds both.
* :data:`T5_BLOCK_CACHE_POSITION` (5.4): before, a T5 decoder block reads the query length from its
  ``cache_position`` argument (required, though no cache is used): :func:`t5_block_kwargs` passes it.
* :data:`T5_SCALE_CONFIG` (5.0): T5 scales the decoder's output by ``d_model ** -0.5`` when
  ``config.scale_decoder_outputs``; before, when ``config.tie_word_embeddings`` (:func:`t5_scales_decoder_outputs`).
* :data:`BERT_HEADS_FROM_SHAPE` (5.0) and :data:`T5_HEADS_FROM_SHAPE` (5.5): BERT's and T5's attentions reshape
  with ``-1`` heads (the local heads under tensor parallelism); before, with the configured number: no tensor
  parallelism on those releases.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from packaging.version import Version

from uniap_lightning.errors import UniAPError

__all__ = ["BERT_HEADS_FROM_SHAPE", "BIDIRECTIONAL_MASK", "CACHE_ARGUMENT", "INPUTS_EMBEDS", "NO_CACHE_POSITION",
           "OLDEST", "T5_BLOCK_CACHE_POSITION", "T5_HEADS_FROM_SHAPE", "T5_MASK_IN_POSITION_BIAS", "T5_SCALE_CONFIG",
           "VISION_PROJECTIONS", "at_least", "bidirectional_mask", "causal_mask", "check_supported", "installed",
           "t5_block_kwargs", "t5_scales_decoder_outputs", "vit_blocks"]

#: the oldest transformers release the families support (the lower bound pyproject declares)
OLDEST = "4.57"

INPUTS_EMBEDS = "5.2"
NO_CACHE_POSITION = "5.9"
CACHE_ARGUMENT = "5.24"
BIDIRECTIONAL_MASK = "5.0"
VISION_PROJECTIONS = "5.9"
T5_MASK_IN_POSITION_BIAS = "5.15"  # the first release that no longer does
T5_BLOCK_CACHE_POSITION = "5.4"  # the first release whose T5 block no longer needs it
T5_SCALE_CONFIG = "5.0"
BERT_HEADS_FROM_SHAPE = "5.0"
T5_HEADS_FROM_SHAPE = "5.5"


@cache
def installed() -> Version:
    """The imported transformers' release (``4.57.6``; a dev or local suffix dropped)."""
    import transformers

    return Version(Version(transformers.__version__).base_version)


def at_least(gate: str, version: Version | None = None) -> bool:
    """Whether ``version`` (the installed transformers by default) is ``gate`` or newer."""
    return (installed() if version is None else version) >= Version(gate)


def check_supported(version: Version | None = None) -> None:
    """One clear error for a transformers older than :data:`OLDEST` (installed past the declared range): its
    masking and rotary APIs are missing or different, and the families would fail deep inside the model."""
    version = installed() if version is None else version
    if version < Version(OLDEST):
        raise UniAPError(f"transformers {version} is older than the oldest release the Hugging Face adapters support "
                         f"({OLDEST}); install 'transformers>={OLDEST},<6' (pip install 'uniap-lightning[hf]')")


def _embeds_key(version: Version | None) -> str:
    return "inputs_embeds" if at_least(INPUTS_EMBEDS, version) else "input_embeds"


def causal_mask(config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None, *, version: Version | None = None) -> Any:
    """``transformers.masking_utils.create_causal_mask`` without a cache, called as the installed release takes it:
    the causal + padding mask of ``hidden`` ``[batch, seq, ...]`` in the form the config's attention uses."""
    from transformers.masking_utils import create_causal_mask

    kwargs: dict[str, Any] = {"config": config, _embeds_key(version): hidden, "attention_mask": attention_mask,
                              "position_ids": position_ids}
    if at_least(CACHE_ARGUMENT, version):
        kwargs["cache"] = None
    else:
        kwargs["past_key_values"] = None
        if not at_least(NO_CACHE_POSITION, version):
            kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return create_causal_mask(**kwargs)


def bidirectional_mask(config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                       encoder_hidden_states: torch.Tensor | None = None, *, version: Version | None = None) -> Any:
    """The padding mask of an encoder's attention (self-attention over ``hidden``, or cross-attention from
    ``hidden`` to ``encoder_hidden_states``). 5.x: ``create_bidirectional_mask``; 4.x: the additive mask its
    encoders build (``[batch, 1, 1, keys]``: 0 where attended, the dtype's minimum elsewhere; ``None`` without a
    mask)."""
    if at_least(BIDIRECTIONAL_MASK, version):
        from transformers.masking_utils import create_bidirectional_mask

        return create_bidirectional_mask(config=config, attention_mask=attention_mask,
                                         encoder_hidden_states=encoder_hidden_states,
                                         **{_embeds_key(version): hidden})
    if attention_mask is None:
        return None
    keep = attention_mask[:, None, None, :].to(hidden.dtype)
    return (1.0 - keep) * torch.finfo(hidden.dtype).min


def vit_blocks(vit: Any, version: Version | None = None) -> tuple[str, Any]:
    """(path under the ``ViTModel``, the ``nn.ModuleList``) of ViT's blocks: ``layers`` from 5.9, before
    ``encoder.layer``."""
    if at_least(VISION_PROJECTIONS, version):
        return "layers", vit.layers
    return "encoder.layer", vit.encoder.layer


def t5_block_kwargs(hidden: torch.Tensor, version: Version | None = None) -> dict[str, Any]:
    """The keyword arguments a T5 block needs besides its inputs: ``cache_position`` (the positions of ``hidden``)
    before 5.4, whose decoder blocks take the query length from it; none from 5.4."""
    if at_least(T5_BLOCK_CACHE_POSITION, version):
        return {}
    return {"cache_position": torch.arange(hidden.shape[1], device=hidden.device)}


def t5_scales_decoder_outputs(config: Any, version: Version | None = None) -> bool:
    """Whether T5 scales its decoder's output by ``d_model ** -0.5`` before the LM head: the config's
    ``scale_decoder_outputs`` from 5.0; before, ``tie_word_embeddings`` (T5's default)."""
    if at_least(T5_SCALE_CONFIG, version):
        return bool(getattr(config, "scale_decoder_outputs", False))
    return bool(getattr(config, "tie_word_embeddings", False))
