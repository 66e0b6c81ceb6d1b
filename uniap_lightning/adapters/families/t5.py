"""T5 (``T5ForConditionalGeneration``) as one chain: embedding, encoder blocks, the encoder's final norm, decoder
blocks, the decoder's final norm + LM head.

The layers pass a dict. Through the encoder: ``hidden``, the batch's ``attention_mask`` and the decoder's embedded
inputs ``decoder`` (embedded on the first stage with the shared embedding, so the embedding lives on one stage),
and ``enc_rel``, the relative-position table of the encoder's first block (a parameter of that block only: the
later blocks compute their position bias from it, so the gradient reaches it from every block; it is sent with the
batch on dim 0, a few hundred numbers per sample). At the encoder's end ``encoder`` (its output) travels with the
decoder's ``hidden`` states and ``dec_rel`` through the decoder. Masks (padding, causal) are rebuilt in each block.

Tensor parallelism in the Megatron pattern: q/k/v (self- and cross-attention) and ``wi`` column-parallel, ``o``
and ``wo`` row-parallel. The position bias is computed for all heads from the stack's shared table and each rank
takes its heads' slice; the slicing sums the heads' gradients over the tensor-parallel group on the way back
(Megatron's "copy to the tensor-parallel region"), so the table gets its whole gradient on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import Family, count_tokens, register
from uniap_lightning.adapters.families import compat
from uniap_lightning.adapters.families.common import (
    View,
    colwise,
    divisors_of_all,
    local_heads,
    rowwise,
    tensor_parallel_heads,
    token_loss,
)
from uniap_lightning.adapters.families.seq2seq_inputs import prepare_decoder_inputs
from uniap_lightning.errors import UniAPError

Payload = dict[str, torch.Tensor]


class T5Embed(View):
    """input_ids -> hidden and decoder_input_ids -> decoder, both with the shared embedding."""

    def forward(self, d: Payload) -> dict[str, Any]:
        return {"hidden": self.dropout(self.shared(d["input_ids"])), "decoder": self.shared(d["decoder_input_ids"]),
                "input_ids": None, "decoder_input_ids": None}


def _bias(attention: nn.Module, table: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """``T5Attention.compute_bias`` with the table given (the first block's ``relative_attention_bias.weight``)."""
    device = table.device
    context = torch.arange(q_len, dtype=torch.long, device=device)[:, None]
    memory = torch.arange(k_len, dtype=torch.long, device=device)[None, :]
    buckets = attention._relative_position_bucket(
        memory - context, bidirectional=not attention.is_decoder, num_buckets=attention.relative_attention_num_buckets,
        max_distance=attention.relative_attention_max_distance)
    return nn.functional.embedding(buckets, table).permute([2, 0, 1]).unsqueeze(0)


def _with_mask(bias: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """An attention mask added to a ``[1, heads, q, k]`` position bias (as T5 did before 5.15); a boolean one
    (True: attended) becomes 0 or the dtype's minimum first."""
    if mask is None:
        return bias
    mask = mask[..., : bias.shape[-1]]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=bias.dtype, device=bias.device).masked_fill(
            ~mask, torch.finfo(bias.dtype).min)
    return bias + mask


class T5Block(View):
    """One block of either stack. The first block of a stack owns the relative-position table and passes it on."""

    def __init__(self, block: nn.Module, config: Any, *, first: bool) -> None:
        super().__init__(block=block)
        self.config, self.first, self.decoder = config, first, bool(config.is_decoder)

    def uniap_structure_key(self) -> tuple[bool, bool]:
        return (self.decoder, self.first)

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        hidden = d["hidden"]
        attention = self.block.layer[0].SelfAttention
        key = "dec_rel" if self.decoder else "enc_rel"
        rel = attention.relative_attention_bias.weight.unsqueeze(0).expand(hidden.shape[0], -1, -1) if self.first \
            else d[key]
        bias = local_heads(attention.q.weight, _bias(attention, rel[0], hidden.shape[1], hidden.shape[1]))
        if self.decoder:
            mask = compat.causal_mask(self.config, hidden, d.get("decoder_attention_mask"))
        else:
            mask = compat.bidirectional_mask(self.config, hidden, d.get("attention_mask"))
        cross = None
        if self.decoder:
            cross = compat.bidirectional_mask(self.config, hidden, d.get("attention_mask"), d["encoder"])
            # T5 builds a zero cross-attention bias for all heads when given none: give this rank's heads'
            cross_attention = self.block.layer[1].EncDecAttention
            heads = cross_attention.n_heads // tensor_parallel_heads(cross_attention.q.weight)[0]
            zeros = torch.zeros(1, heads, hidden.shape[1], d["encoder"].shape[1], dtype=hidden.dtype,
                                device=hidden.device)
        if not compat.at_least(compat.T5_MASK_IN_POSITION_BIAS):
            # before 5.15 an attention given a position bias ignores its mask: the mask goes inside the bias
            bias, mask = _with_mask(bias, mask), None
            if self.decoder:
                zeros, cross = _with_mask(zeros, cross), None
        if self.decoder:
            out = self.block(hidden, mask, bias, d["encoder"], cross, zeros, **compat.t5_block_kwargs(hidden))
        else:
            out = self.block(hidden, mask, bias, **compat.t5_block_kwargs(hidden))
        return {"hidden": out[0], key: rel}

    def uniap_tp_degrees(self) -> list[int]:
        if not compat.at_least(compat.T5_HEADS_FROM_SHAPE):  # before 5.5: a fixed number of heads per rank
            return [1]
        ff = self.block.layer[-1].DenseReluDense
        return divisors_of_all(ff.wo.in_features, self.block.layer[0].SelfAttention.n_heads)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        ff = self.block.layer[-1].DenseReluDense
        prefix = f"block.layer.{len(self.block.layer) - 1}.DenseReluDense"
        wis = ["wi_0", "wi_1"] if hasattr(ff, "wi_0") else ["wi"]
        plan = {**{f"{prefix}.{w}": colwise() for w in wis}, f"{prefix}.wo": rowwise()}
        attentions = ["layer.0.SelfAttention"] + (["layer.1.EncDecAttention"] if self.decoder else [])
        for a in attentions:
            plan.update({f"block.{a}.{p}": colwise() for p in ("q", "k", "v")})
            plan[f"block.{a}.o"] = rowwise()
        return plan

    def uniap_tp_allreduces(self) -> int:
        return 3 if self.decoder else 2


class T5EncoderEnd(View):
    """The encoder's final norm: its output becomes ``encoder``; the decoder's embedded inputs become ``hidden``."""

    def forward(self, d: Payload) -> dict[str, Any]:
        encoder = self.dropout(self.final_layer_norm(d["hidden"]))
        return {"encoder": encoder, "hidden": self.decoder_dropout(d["decoder"]), "decoder": None, "enc_rel": None}


class T5Head(View):
    def __init__(self, *, scale: float | None, **modules: nn.Module) -> None:
        super().__init__(**modules)
        self.scale = scale

    def forward(self, d: Payload) -> torch.Tensor:
        out = self.dropout(self.final_layer_norm(d["hidden"]))
        if self.scale is not None:
            out = out * self.scale
        return self.lm_head(out)


def t5_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    compat.check_supported()
    if not hasattr(model, "lm_head") or not hasattr(model, "decoder"):
        raise UniAPError(f"{type(model).__name__}: the strategy splits T5ForConditionalGeneration; for other heads "
                         "define uniap_layers() (and uniap_loss) on your LightningModule")
    enc, dec = model.encoder, model.decoder
    scale = model.model_dim**-0.5 if compat.t5_scales_decoder_outputs(model.config) else None
    return [
        (T5Embed(shared=model.shared, dropout=enc.dropout), ["shared", "encoder.embed_tokens", "decoder.embed_tokens"]),
        *[(T5Block(b, enc.config, first=i == 0), [f"encoder.block.{i}"]) for i, b in enumerate(enc.block)],
        (T5EncoderEnd(final_layer_norm=enc.final_layer_norm, dropout=enc.dropout, decoder_dropout=dec.dropout),
         ["encoder.final_layer_norm"]),
        *[(T5Block(b, dec.config, first=i == 0), [f"decoder.block.{i}"]) for i, b in enumerate(dec.block)],
        (T5Head(final_layer_norm=dec.final_layer_norm, dropout=dec.dropout, lm_head=model.lm_head, scale=scale),
         ["decoder.final_layer_norm", "lm_head"]),
    ]


def t5_prepare(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's inputs: given, or the labels shifted right (as T5 does when only labels are given); the one
    preparation of every encoder-decoder family (:func:`.seq2seq_inputs.prepare_decoder_inputs`)."""
    return prepare_decoder_inputs(model, batch, lambda labels: model._shift_right(labels), "a T5 batch")


def t5_loss(model: Any, logits: torch.Tensor, target: Any) -> torch.Tensor:
    return token_loss(logits, target.labels, target)


register("t5", Family(layers=t5_layers, loss=t5_loss, count=count_tokens, prepare=t5_prepare, attention=None,
                      ties=(("shared", "lm_head"),),
                      inputs=("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")))
