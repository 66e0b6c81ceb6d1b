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

Tensor parallelism (:func:`.seq2seq_layers._tensor_parallel`): blocks whose attentions (self and cross) have
``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj`` and reshape by ``-1`` heads (BART's), with ``fc1`` / ``fc2`` on
the block: q/k/v and ``fc1`` column-parallel, ``out_proj`` and ``fc2`` row-parallel. Whisper's attention reshapes
its keys with the full head count, so its blocks stay whole.

The inputs (the decoder's from the labels, the probe batch, the loss) are :mod:`.seq2seq_inputs`, the layers
:mod:`.seq2seq_layers`; this module assembles and checks the split and builds the Family.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import Family, count_tokens
from uniap_lightning.adapters.families.generic_attention import ATTENTION, _register_attention
from uniap_lightning.adapters.families.generic_check import _accept_one_layer, _verify
from uniap_lightning.adapters.families.generic_heads import _Task, _task
from uniap_lightning.adapters.families.generic_layers import WholeModel
from uniap_lightning.adapters.families.generic_probe import _eval_mode
from uniap_lightning.adapters.families.generic_trace import (
    Unsplittable,
    _Calls,
    _capture,
    _find_blocks,
    _fqn,
    _mode,
    _Plan,
    _refuse,
    _templates,
)
from uniap_lightning.adapters.families.seq2seq_inputs import (
    _TASK,
    _encoder_inputs,
    _flags,
    _model_inputs,
    _probe,
    _shift,
    _stacks,
    seq2seq_loss,
    seq2seq_prepare,
)
from uniap_lightning.adapters.families.seq2seq_layers import (
    DecoderPrologue,
    EncoderPrologue,
    Seq2SeqBlock,
    Seq2SeqEpilogue,
)
from uniap_lightning.errors import UniAPError

__all__ = ["DecoderPrologue", "EncoderPrologue", "Seq2SeqBlock", "Seq2SeqEpilogue", "seq2seq_family",
           "seq2seq_layers", "seq2seq_loss", "seq2seq_prepare"]


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
