"""The layers of the encoder-decoder split (:mod:`.seq2seq`): the encoder prologue (with the decoder's inputs
embedded), the bridge from the encoder's output to the decoder's first block, one layer per encoder or decoder block
(tensor parallel where its attentions and MLP have BART's shape) and the epilogue (plus BART's
``final_logits_bias``).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.families.common import colwise, divisors_of_all, rowwise
from uniap_lightning.adapters.families.generic_layers import GenericBlock, GenericEpilogue, _Layer, _settled
from uniap_lightning.adapters.families.generic_trace import _PREFIX, _capture, _Plan, _templates
from uniap_lightning.adapters.families.seq2seq_inputs import _flags
from uniap_lightning.errors import UniAPError

class EncoderPrologue(_Layer):
    """The encoder's forward up to its first block (hidden states + what the blocks take), and the decoder's inputs
    embedded with the decoder's token embedding."""

    def __init__(self, modules: list[nn.Module], encoder: nn.Module, blocks: nn.ModuleList, plan: _Plan,
                 inputs: tuple[str, ...], embedding: nn.Module) -> None:
        super().__init__(modules)
        self.__dict__["_encoder"], self.__dict__["_blocks"] = encoder, blocks  # (owned by the model, not here)
        self.plan, self.inputs, self.extra = plan, inputs, _flags(encoder)
        self.embedding = next(i for i, m in enumerate(modules) if m is embedding)

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, Any]:
        batch = {k: d[k] for k in self.inputs if k in d}
        hidden, calls = _capture(self._encoder, self._blocks, {**batch, **self.extra})
        templates, tensors = _templates(calls)
        if templates != self.plan.templates:
            raise UniAPError("the encoder passed its blocks other arguments than on the setup probe; the generic "
                             "split needs the same structure for every batch")
        keep = {"attention_mask"}  # the decoder's cross-attention mask
        return {**{k: None for k in self.inputs if k not in keep}, "decoder_input_ids": None,
                "decoder_embeds": self.units[self.embedding](d["decoder_input_ids"]), "hidden": _settled(hidden),
                **self.plan.encode(tensors, hidden.shape[0])}


class DecoderPrologue(_Layer):
    """The encoder's last modules (its output), then the decoder's forward up to its first block."""

    def __init__(self, ends: list[nn.Module], modules: list[nn.Module], decoder: nn.Module,
                 blocks: nn.ModuleList, plan: _Plan, encoder_plan: _Plan) -> None:
        super().__init__(ends + modules)
        self.__dict__["_decoder"], self.__dict__["_blocks"] = decoder, blocks
        self.steps, self.plan, self.extra = len(ends), plan, _flags(decoder)
        self.drop = [f"{_PREFIX}{j}" for j in range(len(encoder_plan.modes))]
        self.cross_mask = "encoder_attention_mask" in inspect.signature(decoder.forward).parameters

    def encoder_output(self, hidden: torch.Tensor) -> torch.Tensor:
        for m in list(self.units)[: self.steps]:
            hidden = m(hidden)
        return hidden

    def decoder_kwargs(self, d: dict[str, torch.Tensor], encoder_output: torch.Tensor) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"inputs_embeds": d["decoder_embeds"], "encoder_hidden_states": encoder_output,
                                  **self.extra}
        if "decoder_attention_mask" in d:
            kwargs["attention_mask"] = d["decoder_attention_mask"]
        if self.cross_mask and "attention_mask" in d:
            kwargs["encoder_attention_mask"] = d["attention_mask"]
        return kwargs

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, Any]:
        kwargs = self.decoder_kwargs(d, self.encoder_output(d["hidden"]))
        hidden, calls = _capture(self._decoder, self._blocks, kwargs)
        templates, tensors = _templates(calls)
        if templates != self.plan.templates:
            raise UniAPError("the decoder passed its blocks other arguments than on the setup probe; the generic "
                             "split needs the same structure for every batch")
        return {**dict.fromkeys(self.drop), "decoder_embeds": None, "attention_mask": None,
                "decoder_attention_mask": None, "hidden": _settled(hidden), **self.plan.encode(tensors,
                                                                                               hidden.shape[0])}


def _tensor_parallel(block: nn.Module) -> tuple[dict[str, str], list[int]] | None:
    """Megatron-style tensor parallelism of an encoder or decoder block: every attention (self, cross) with
    ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj`` whose forward reshapes by ``-1`` heads and never by its full
    head count, and ``fc1`` / ``fc2`` on the block itself; ``None`` when the block is not of that shape."""
    projections = ("q_proj", "k_proj", "v_proj", "out_proj")
    attentions = [(n, m) for n, m in block.named_modules()
                  if all(isinstance(getattr(m, p, None), nn.Linear) for p in projections)]
    if not attentions or not all(isinstance(getattr(block, p, None), nn.Linear) for p in ("fc1", "fc2")):
        return None
    plan, heads = {}, []
    for name, attn in attentions:
        try:
            source = "".join(inspect.getsource(type(attn).forward).split())
        except (OSError, TypeError):
            return None
        if ",-1,self.head_dim)" not in source or "reshape(*input_shape,-1)" not in source or "self.num_heads" in source:
            return None  # e.g. Whisper's keys reshaped with the full head count
        if {id(p) for p in attn.parameters()} != {id(w) for p in projections for w in getattr(attn, p).parameters()}:
            return None  # parameters besides the projections would see only this rank's heads
        n_heads = int(getattr(attn, "num_heads", 0) or 0)
        if not n_heads:
            return None
        heads.append(n_heads)
        plan.update({f"{name}.{p}": "col" for p in ("q_proj", "k_proj", "v_proj")})
        plan[f"{name}.out_proj"] = "row"
    plan.update({"fc1": "col", "fc2": "row"})
    return plan, divisors_of_all(*heads, block.fc1.out_features)


class Seq2SeqBlock(GenericBlock):
    """One encoder or decoder block, called as its stack calls it; tensor parallel where :func:`_tensor_parallel`
    recognizes it."""

    def __init__(self, block: nn.Module, plan: _Plan, index: int, config: Any = None) -> None:
        super().__init__(block, plan, index, config)
        self.tp = _tensor_parallel(block)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        assert self.tp is not None
        return {f"units.0.{path}": (colwise() if kind == "col" else rowwise()) for path, kind in self.tp[0].items()}

    def uniap_tp_allreduces(self) -> int:
        return sum(kind == "row" for kind in self.tp[0].values()) if self.tp is not None else 0


class Seq2SeqEpilogue(GenericEpilogue):
    """The decoder's last modules and the LM head, plus the model's ``final_logits_bias`` (BART's buffer) if any."""

    def __init__(self, sequence: list[nn.Module], unused: list[nn.Module], bias: torch.Tensor | None) -> None:
        super().__init__(sequence, unused)
        self.__dict__["_bias"] = bias  # the model's buffer (not registered here: it stays the model's)

    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = super().forward(d)
        return logits if self._bias is None else logits + self._bias.to(logits.device)
