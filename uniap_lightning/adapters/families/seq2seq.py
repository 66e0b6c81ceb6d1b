"""Hugging Face encoder-decoder LMs with no hand-written family (BART, mBART, Marian, Pegasus, Blenderbot, PLBart,
Whisper, ...), split from the model's own structure and code with the generic split's machinery
(:mod:`uniap_lightning.adapters.families.generic`).

:func:`seq2seq_family` is what :func:`~uniap_lightning.adapters.families.generic.generic_family` hands a model with
``config.is_encoder_decoder`` (a hand-written family, e.g. T5's, always wins in dispatch). The chain is

* the *encoder prologue* (:class:`EncoderPrologue`): the encoder's own forward on the batch (``input_ids`` and
  ``attention_mask``, or Whisper's ``input_features``), stopped where it calls its first block, recorded as the
  generic prologue records a decoder-only model's; it also embeds the decoder's inputs with the decoder's own token
  embedding, so a token embedding shared by encoder and decoder lives on one stage (the LM head holds a tied copy);
* one layer per encoder block (:class:`Seq2SeqBlock`);
* the *bridge* (:class:`DecoderPrologue`): the modules the encoder runs after its last block (a final norm) give
  the encoder's output, then the decoder's own forward (embedded inputs, the encoder's output and padding mask)
  stopped at its first block; the encoder's output travels from here on as one of the tensors the decoder blocks
  take (so its gradient flows back through every decoder stage);
* one layer per decoder block;
* the *epilogue*: the modules the model runs after the decoder's last block (final norm, LM head), plus BART's
  ``final_logits_bias`` -> logits; the model's own seq2seq LM loss (cross-entropy over the labelled tokens, labels
  as given), whole-batch normalized.

The decoder's inputs are the labels shifted right as the model does (``prepare_decoder_input_ids_from_labels`` or
its module's ``shift_tokens_right``) unless the batch has ``decoder_input_ids``. At setup the chain is checked on
a probe batch (built from the config: token ids, or Whisper's mel features of the length its encoder requires)
against the model's own forward given only the labels: logits and loss. What this cannot reproduce (LayerDrop, eager
attention whose masks change with the padding, T5-style stacks passing a position bias from block to block, a
top-level forward that changes the logits) trains as one layer with one warning naming why, when its own loss is the
seq2seq LM loss; a single-label sequence classifier (BART's pools at the last ``<eos>``) trains as one layer too;
other heads are refused at setup. Labels longer than the decoder's positions are refused at the batch split.

Tensor parallelism (:func:`_tensor_parallel`): blocks whose attentions (self and cross) have ``q_proj`` /
``k_proj`` / ``v_proj`` / ``out_proj`` and reshape by ``-1`` heads (BART's), with ``fc1`` / ``fc2`` on the block:
q/k/v and ``fc1`` column-parallel, ``out_proj`` and ``fc2`` row-parallel. Whisper's attention reshapes its keys
with the full head count, so its blocks stay whole.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.auto import Family, HFTarget, count_tokens
from uniap_lightning.adapters.families.common import colwise, divisors_of_all, rowwise, token_loss
from uniap_lightning.adapters.families.generic import ATTENTION, _fqn, _register_attention, _task
from uniap_lightning.adapters.families.generic_check import _accept_one_layer, _verify
from uniap_lightning.adapters.families.generic_heads import _Task
from uniap_lightning.adapters.families.generic_layers import GenericBlock, GenericEpilogue, WholeModel, _Layer, _settled
from uniap_lightning.adapters.families.generic_probe import _eval_mode
from uniap_lightning.adapters.families.generic_trace import (
    _PREFIX,
    Unsplittable,
    _Calls,
    _capture,
    _find_blocks,
    _mode,
    _Plan,
    _refuse,
    _templates,
)
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


def seq2seq_prepare(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's inputs: given, or the labels shifted right (what the model does with labels alone)."""
    if "decoder_input_ids" in batch:
        return {}
    if "labels" not in batch:
        raise UniAPError("an encoder-decoder batch needs 'labels' (training) or 'decoder_input_ids' (prediction); "
                         f"it has {sorted(batch)}")
    decoder = _shift(model, batch["labels"])
    limit = getattr(model.config, "max_target_positions", None) or getattr(model.config, "max_position_embeddings",
                                                                           None)
    if isinstance(limit, int) and decoder.shape[-1] > limit:  # (else an index error deep in the decoder)
        raise UniAPError(f"the batch's labels hold {decoder.shape[-1]} decoder tokens; {type(model).__name__} takes at "
                         f"most {limit} (config.max_target_positions / max_position_embeddings)")
    return {"decoder_input_ids": decoder}


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


# ------------------------------------------------------------------------------------------------------ layers
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


# ------------------------------------------------------------------------------------------------------ building
def _outermost(names: list[str]) -> list[str]:
    return [n for n in names if not any(a != n and n.startswith(a + ".") for a in names)]


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def seq2seq_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    """The chain's layers (with the FQNs each wraps); :class:`~uniap_lightning.adapters.families.generic.
    Unsplittable` naming why when the model cannot be split this way."""
    try:
        return _split(model)
    except Unsplittable:
        raise
    except Exception as e:  # noqa: BLE001 - the model's code on an unexpected path: reported with its reason
        raise _refuse(model, f"{type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class _Stacks:
    """The model's encoder and decoder: modules, names (relative to the model), blocks, the decoder's token
    embedding and the encoder's inputs."""

    encoder: nn.Module
    decoder: nn.Module
    names: tuple[str, str]
    blocks: tuple[nn.ModuleList, nn.ModuleList]
    block_names: tuple[str, str]
    embedding: nn.Module
    inputs: tuple[str, ...]


def _stacks_of(model: Any) -> _Stacks:
    encoder, decoder = _stacks(model)
    fqn = {id(m): n for n, m in model.named_modules()}
    (enc_rel, enc_blocks), (dec_rel, dec_blocks) = _find_blocks(encoder), _find_blocks(decoder)
    embedding = decoder.get_input_embeddings()
    if not isinstance(embedding, nn.Module) or id(embedding) not in fqn:
        raise _refuse(model, "its decoder has no token embedding module")
    names = (fqn[id(encoder)], fqn[id(decoder)])
    return _Stacks(encoder, decoder, names, (enc_blocks, dec_blocks),
                   (f"{names[0]}.{enc_rel}", f"{names[1]}.{dec_rel}"), embedding, _encoder_inputs(model, encoder))


def _hooked(model: Any, s: _Stacks) -> dict[str, nn.Module]:
    """The modules whose calls are recorded: all but the blocks, their insides and the modules holding them."""
    ancestors = {b.rsplit(".", i)[0] for b in s.block_names for i in range(1, b.count(".") + 1)}
    return {n: m for n, m in model.named_modules()
            if n and n not in ancestors and not any(_inside(n, b) for b in s.block_names)
            and not isinstance(m, nn.modules.loss._Loss)}


@dataclass
class _Parts:
    """Module names (relative to the model) of the non-block layers, from the order the model's forward ran them."""

    first: list[str]  # the encoder's prologue, the decoder's token embedding, what shares their weights
    ends: list[str]  # what the encoder runs after its blocks (in order)
    bridge: list[str]  # the decoder's prologue (its forward calls them)
    after: list[str]  # what the model runs after the decoder's blocks (in order)
    rest: list[str]  # modules with parameters never called (carried by the epilogue)


def _parts(model: Any, s: _Stacks, units: dict[str, nn.Module], enc: _Calls, dec: _Calls) -> _Parts:
    enc_name, dec_name = s.names
    for stack, calls in (("encoder", enc), ("decoder", dec)):
        between = [n for n in calls.names("between") if n in units]
        if between:
            raise _refuse(model, f"it runs {between[0]} between its {stack} blocks")
    middle = [n for n in enc.names("after") if n in set(dec.names("before"))]
    stray = [n for n in middle if not _inside(n, enc_name) and not _inside(n, dec_name)]
    if stray:
        raise _refuse(model, f"it runs {stray[0]} between its encoder and its decoder")
    emb = _fqn(model, s.embedding)
    first = [n for n in enc.names("before") if n in units]
    first += [emb] if emb not in first else []
    ends = _outermost([n for n in middle if _inside(n, enc_name)])
    bridge = [n for n in middle if _inside(n, dec_name) and n in units and n != emb]
    after = _outermost(dec.names("after"))
    if not after:
        raise _refuse(model, "it runs nothing after its decoder blocks (no head)")
    covered = [n for n in units if any(_inside(n, a) for a in (*ends, *after))]
    twice = (set(first) | set(bridge)) & set(covered)
    if twice:
        raise _refuse(model, f"it runs {sorted(twice)[0]} before and after its blocks")
    # a module read without being called (Whisper's encoder positions), or sharing the token embedding's weight
    # (BART's ``shared``), stays with the stack that uses it
    unused = [n for n in units if n not in first and n not in bridge and n not in covered
              and any(True for _ in units[n].parameters())]
    first_params = {id(p) for n in first for p in units[n].parameters()}
    to_first = [n for n in unused if _inside(n, enc_name) or {id(p) for p in units[n].parameters()} <= first_params]
    to_bridge = [n for n in unused if n not in to_first and _inside(n, dec_name)]
    rest = [n for n in unused if n not in to_first and n not in to_bridge]
    return _Parts(first + to_first, ends, bridge + to_bridge, after, rest)


def _split(model: Any) -> list[tuple[nn.Module, list[str]]]:
    drops = {k: v for k, v in vars(model.config).items() if k.endswith("layerdrop") and v}
    if drops:
        raise _refuse(model, f"it skips blocks at random in training (LayerDrop: {drops})")
    s = _stacks_of(model)
    device = next(model.parameters()).device
    modules = dict(model.named_modules())
    hooked = _hooked(model, s)
    units = {n: m for n, m in hooked.items()
             if any(True for _ in m.parameters(recurse=False)) or not any(True for _ in m.children())}
    with _eval_mode(model):
        with torch.no_grad():
            enc_calls, dec_calls = _Calls(hooked, s.blocks[0]), _Calls(hooked, s.blocks[1])
            try:
                batch = _probe(model, s.encoder, s.inputs[0], 3, device)
                reference = model(**batch, **_flags(model))  # (the model shifts the labels itself)
            finally:
                enc_calls.close()
                dec_calls.close()
            parts = _parts(model, s, units, enc_calls, dec_calls)
            enc_plan, dec_plan = _plans(model, s, device)
            prologue = EncoderPrologue([modules[n] for n in parts.first], s.encoder, s.blocks[0], enc_plan, s.inputs,
                                       s.embedding)
            bridge = DecoderPrologue([modules[n] for n in parts.ends], [modules[n] for n in parts.bridge], s.decoder,
                                     s.blocks[1], dec_plan, enc_plan)
            encoders = [Seq2SeqBlock(b, enc_plan, i, model.config) for i, b in enumerate(s.blocks[0])]
            decoders = [Seq2SeqBlock(b, dec_plan, i, model.config) for i, b in enumerate(s.blocks[1])]
            bias = getattr(model, "final_logits_bias", None)
            epilogue = Seq2SeqEpilogue([modules[n] for n in parts.after], [modules[n] for n in parts.rest],
                                       bias if isinstance(bias, torch.Tensor) else None)
            chain_batch = {**{k: v for k, v in batch.items() if k != "labels"}, **seq2seq_prepare(model, batch)}
            _verify(model, _TASK, prologue, [*encoders, bridge, *decoders], epilogue, chain_batch, batch["labels"],
                    reference)

    def owners_first(names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: not any(True for _ in modules[n].parameters()))

    return [
        (prologue, owners_first(parts.first)),
        *[(layer, [f"{s.block_names[0]}.{i}"]) for i, layer in enumerate(encoders)],
        (bridge, owners_first(parts.ends + parts.bridge)),
        *[(layer, [f"{s.block_names[1]}.{i}"]) for i, layer in enumerate(decoders)],
        (epilogue, owners_first(parts.after) + parts.rest),
    ]


def _structure(model: Any, calls_by_rows: list[list[Any]]) -> _Plan:
    """The plan of what a stack's prologue sends its blocks, from captures of 2 and 3 samples and of 2 unpadded."""
    (templates, tensors2), (templates3, tensors3), (unpadded, _) = (_templates(c) for c in calls_by_rows)
    if templates != templates3:
        raise _refuse(model, "it passes its blocks other arguments for batches of 2 and 3 samples")
    if templates != unpadded:
        raise _refuse(model, "it passes its blocks other arguments for batches with and without padding")
    return _Plan(templates, [_mode(model, j, a, b) for j, (a, b) in enumerate(zip(tensors2, tensors3))])


def _plans(model: Any, s: _Stacks, device: torch.device) -> tuple[_Plan, _Plan]:
    """The encoder's and the decoder's plans, from probes of 2 and 3 samples and 2 without padding; the decoder's
    forward given the encoder's own output."""
    enc_flags, dec_flags = _flags(s.encoder), _flags(s.decoder)
    cross = "encoder_attention_mask" in inspect.signature(s.decoder.forward).parameters
    enc_calls, dec_calls = [], []
    for rows, padded in ((2, True), (3, True), (2, False)):
        probe = _probe(model, s.encoder, s.inputs[0], rows, device, padded)
        inputs = {**{k: probe[k] for k in s.inputs if k in probe}, **enc_flags}
        enc_calls.append(_capture(s.encoder, s.blocks[0], inputs)[1])
        out = s.encoder(**inputs)[0]
        kwargs: dict[str, Any] = {"inputs_embeds": s.embedding(_shift(model, probe["labels"])),
                                  "encoder_hidden_states": out, **dec_flags}
        if cross and "attention_mask" in probe:
            kwargs["encoder_attention_mask"] = probe["attention_mask"]
        dec_calls.append(_capture(s.decoder, s.blocks[1], kwargs)[1])
    return _structure(model, enc_calls), _structure(model, dec_calls)


# ------------------------------------------------------------------------------------------------------ family
def seq2seq_family(model: Any) -> Family:
    """The family of an encoder-decoder model with no builder in ``FAMILIES``: an LM is split as above, or trains as
    one layer (one warning naming why); a single-label sequence classifier (BART's: it pools the decoder's states at
    the last ``<eos>`` in its top-level forward) trains as one layer; a clear error for other heads."""
    encoder, _ = _stacks(model)
    if model.get_output_embeddings() is None:
        return _classifier(model, encoder)
    if _register_attention() and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(ATTENTION)
        except Exception:  # noqa: BLE001 - a model without SDPA: its own (eager) attention, whose masks are tensors
            pass
    inputs = _model_inputs(model, encoder)
    ties: tuple[tuple[str, str], ...] = ()
    src, dst = model.get_input_embeddings(), model.get_output_embeddings()
    if src is not None and getattr(src, "weight", None) is getattr(dst, "weight", 0):
        a, b = _fqn(model, src), _fqn(model, dst)
        if a and b:
            ties = ((a, b),)
    try:
        pairs = seq2seq_layers(model)
    except Unsplittable as e:
        batch = _probe(model, encoder, inputs[0], 3, next(model.parameters()).device)
        layer = _one_layer(model, inputs, _TASK, batch, {**batch, **seq2seq_prepare(model, batch)}, e)
        return Family(layers=lambda _: layer, loss=seq2seq_loss, inputs=inputs, count=count_tokens,
                      prepare=seq2seq_prepare, attention=None)
    return Family(layers=lambda _: pairs, loss=seq2seq_loss, inputs=inputs, count=count_tokens,
                  prepare=seq2seq_prepare, attention=None, ties=ties)


def _classifier(model: Any, encoder: nn.Module) -> Family:
    """A sequence classifier as one layer, on a probe whose every sample ends with ``<eos>`` (where BART pools)."""
    why = _refuse(model, "the generic split handles encoder-decoder LMs (*ForConditionalGeneration, MarianMTModel, "
                         "...: a decoder with an LM head and the seq2seq loss) and trains single-label sequence "
                         "classifiers as one layer")
    if not type(model).__name__.endswith("ForSequenceClassification"):
        raise why
    try:
        task = _task(model)
    except Unsplittable:
        raise why from None
    inputs = _encoder_inputs(model, encoder)
    batch = _probe(model, encoder, inputs[0], 3, next(model.parameters()).device)
    eos = getattr(model.config, "eos_token_id", None)
    if "input_ids" not in batch or not isinstance(eos, int):
        raise why
    last = batch["attention_mask"].sum(1) - 1
    other = eos + 1 if eos + 1 < int(model.config.vocab_size) else eos - 1  # one <eos> per sample
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["input_ids"] == eos, other)
    batch["input_ids"][torch.arange(len(last)), last] = eos
    batch["labels"] = task.labels(model, batch)
    layer = _one_layer(model, inputs, task, batch, batch, _refuse(model, "it pools in its top-level forward"))
    return Family(layers=lambda _: layer, loss=task.loss, inputs=inputs, count=task.count, attention=None)


def _one_layer(model: Any, inputs: tuple[str, ...], task: _Task, batch: dict[str, torch.Tensor],
               chain_batch: dict[str, torch.Tensor], why: UniAPError) -> list[tuple[nn.Module, list[str]]]:
    """The model as one layer, after checking on the probe ``batch`` (labels included; ``chain_batch``: what the
    layer takes) that its own loss is ``task``'s loss of its logits; one warning naming why."""
    layer = WholeModel(model, inputs)
    with _eval_mode(model), torch.no_grad():
        reference = model(**batch, **_flags(model))
        logits = layer(chain_batch)
    return [(layer, _accept_one_layer(model, task, logits, batch["labels"], reference, why))]
