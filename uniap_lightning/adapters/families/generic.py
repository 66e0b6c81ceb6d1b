"""Hugging Face models with no hand-written family, split from the model's own structure and code: decoder-only
causal LMs (OPT, Mistral, Qwen2/3, GPT-NeoX, Phi, Gemma 1/3, Falcon, BLOOM, GPT-J, MPT, OLMo, StableLM, ...) and
encoders (RoBERTa, ELECTRA, DistilBERT, ...) with every head Hugging Face has for them: masked LM, sequence
classification (single-label, regression, multi-label), token classification, question answering (``[batch, seq,
2]`` start / end logits), multiple choice (one layer: it flattens the choices in its top-level forward); image
encoders (``pixel_values``: DeiT, ConvNeXt (one layer per stage), CLIP's image classifier) and audio encoders
(``input_values`` / ``input_features``: Wav2Vec2 CTC, Whisper's audio classifier). The probe batch is built from the
config (vocabulary, image size and channels, the feature extractor's kernels and strides, mel bins). A contrastive
loss over the whole batch (``CLIPModel``) does not decompose over micro-batches and is refused.

:func:`generic_family` is what :func:`~uniap_lightning.adapters.auto.pretrained_chain` falls back to when
:data:`~uniap_lightning.adapters.auto.FAMILIES` has no builder for ``config.model_type`` (a hand-written family
always wins). The chain is

* the *prologue*: the base model's own forward on the batch (``input_ids``, ``attention_mask``, ...), stopped where
  it calls its first block. The blocks' ``forward`` are replaced by recorders for that call, so what the model
  passes each block (hidden states, causal or bidirectional + padding masks, rotary ``(cos, sin)``, position ids,
  ALiBi, flags) is recorded with the model's own code, whatever the family. The prologue returns the hidden states
  and the distinct tensors the blocks take (``uniap_ctx<j>``) as a dict payload; the non-tensor arguments
  (``use_cache=False``, ``None`` caches) are constants of each block layer;
* one layer per block (the ``nn.ModuleList`` of same-class modules holding most parameters): ``block(hidden,
  **its recorded arguments)``, its first output the new hidden states;
* the *epilogue*: the outermost modules the model runs after its last block, in the order it runs them (final norm,
  projection, LM head; an encoder's head module) -> logits, with the pooling a head does in its top-level forward
  (first token, mean over the sequence or the feature map) found on the probe batch; the model's own loss (the
  head's), whole-batch normalized like the hand-written families (each head's loss, counts and labels:
  :mod:`.generic_heads`); for a mixture-of-experts causal LM trained with ``output_router_logits=True``, plus the
  routers' load-balancing term, rebuilt from per-sample statistics the blocks carry (:mod:`.generic_router`).

Payload tensors carry the batch on dim 0: a tensor the model broadcasts over the batch (a ``[1, seq, dim]`` rotary
table) is expanded and taken back as one row, one independent of the batch is sent per row and taken back once, one
holding ``k`` rows per sample (ALiBi's ``[batch * heads, ...]``) is sent as ``[batch, k, ...]``; which is which is
learned from two probes of different batch sizes at setup. Attention runs as SDPA with masks always materialized
(``uniap_sdpa``: SDPA whose mask function never skips the mask), so every batch has the same payload structure; the
4-D boolean mask (``batch x seq x seq`` bytes) crosses each stage boundary.

At setup the chain is checked on a probe batch against the model's own forward (logits and loss, the batch split
into two micro-batches). A model this cannot reproduce (logits changed in the top-level forward, a shared block run
several times, pooling outside a module) trains as one layer (:class:`WholeModel`: replicated or ZeRO, one
warning naming why) when its own loss is the one the chain computes; anything else is refused with a
:class:`~uniap_lightning.errors.UniAPError` naming why, never trained wrong.

This module decides and assembles (the task, the attention, the split, the fallback); the parts are their own
modules: :mod:`.generic_trace` (the blocks and what the model passes them), :mod:`.generic_probe` (the setup
batches), :mod:`.generic_layers` (prologue, block, epilogue, whole model), :mod:`.generic_tp` (a block's
tensor-parallel plan), :mod:`.generic_check` (the checks against the model's own forward), :mod:`.generic_heads`
(each head's loss and which head a model has), :mod:`.generic_router` (the routers' load-balancing term) and
:mod:`.generic_attention` (the ``uniap_sdpa`` attention). An encoder-decoder LM goes to :mod:`.seq2seq`, which
shares those parts.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import Family
from uniap_lightning.adapters.families.generic_attention import ATTENTION, _register_attention
from uniap_lightning.adapters.families.generic_check import _accept_one_layer, _epilogue, _verify
from uniap_lightning.adapters.families.generic_heads import _Task, _task
from uniap_lightning.adapters.families.generic_layers import GenericBlock, GenericEpilogue, GenericPrologue, WholeModel
from uniap_lightning.adapters.families.generic_probe import _accepted, _base_inputs, _eval_mode, _probe
from uniap_lightning.adapters.families.generic_router import router_loss_of, router_modules
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
    _units,
)
from uniap_lightning.adapters.families.seq2seq import seq2seq_family
from uniap_lightning.errors import UniAPError

__all__ = ["ATTENTION", "GenericBlock", "GenericEpilogue", "GenericPrologue", "Unsplittable", "WholeModel",
           "generic_family", "generic_layers"]

def generic_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    """The chain's layers (with the FQNs each wraps); :class:`Unsplittable` naming why when the model cannot be split
    this way (whatever failed, here at setup rather than later in training)."""
    try:
        return _split(model)
    except Unsplittable:
        raise
    except Exception as e:  # noqa: BLE001 - the model's code on an unexpected path: reported with its reason
        raise _refuse(model, f"{type(e).__name__}: {e}") from e


def _split(model: Any) -> list[tuple[nn.Module, list[str]]]:
    drops = {k: v for k, v in vars(model.config).items() if k.endswith("layerdrop") and v}
    if drops:  # (wav2vec2's default 0.1, ...)
        raise _refuse(model, f"it skips blocks at random in training (LayerDrop: {drops})")
    base = model.base_model
    blocks_name, blocks = _find_blocks(model)
    base_prefix = next((n for n, m in model.named_modules() if m is base), None)
    if base_prefix is None or not (base_prefix == "" or blocks_name.startswith(base_prefix + ".")):
        raise _refuse(model, f"its blocks '{blocks_name}' are not inside its base model")
    units = _units(model, blocks_name)
    inputs, extra = _base_inputs(base)
    device = next(model.parameters()).device
    ancestors = {blocks_name.rsplit(".", i)[0] for i in range(1, blocks_name.count(".") + 1)}
    hooked = {n: m for n, m in model.named_modules()
              if n and n not in ancestors and n != blocks_name and not n.startswith(blocks_name + ".")
              and not isinstance(m, nn.modules.loss._Loss)}  # (DistilBERT's loss module: the loss is ours)
    task = _task(model)
    calls = _Calls(hooked, blocks)
    with _eval_mode(model):
        with torch.no_grad():
            try:
                small = _capture(base, blocks, {**_probe(model, 2, device), **extra})
                large = _capture(base, blocks, {**_probe(model, 3, device), **extra})
                unpadded = _capture(base, blocks, {**_probe(model, 2, device, padded=False), **extra})
                batch = _probe(model, 3, device)
                labels = task.labels(model, batch)
                calls.order.clear()
                calls.phase = "before"
                reference = model(**batch, **task.kwargs(labels), **_accepted(model, extra))
            finally:
                calls.close()
            templates, tensors2 = _templates(small[1])
            templates3, tensors3 = _templates(large[1])
            if templates != templates3:
                raise _refuse(model, "it passes its blocks other arguments for batches of 2 and 3 samples")
            if templates != _templates(unpadded[1])[0]:  # e.g. no mask at all without padding
                raise _refuse(model, "it passes its blocks other arguments for batches with and without padding")
            plan = _Plan(templates, [_mode(model, j, a, b) for j, (a, b) in enumerate(zip(tensors2, tensors3))])
            before, between, after = calls.names("before"), calls.names("between"), calls.names("after")
            between = [n for n in between if n in units]
            if between:
                raise _refuse(model, f"it runs {between[0]} between its blocks")
            before = [n for n in before if n in units]
            # a module owning parameters directly holds its children too (DeiT's embeddings and patch embedding)
            before = [n for n in before if not any(n.startswith(a + ".") for a in before)]
            if not after:
                raise _refuse(model, "it runs nothing after its blocks (no head)")
            # the outermost modules run after the blocks (a head module as a whole, with what its forward does)
            after = [n for n in after if not any(a != n and n.startswith(a + ".") for a in after)]
            covered = [n for n in units if any(n == a or n.startswith(a + ".") for a in after)]
            twice = set(before) & set(covered)
            if twice:
                raise _refuse(model, f"it runs {sorted(twice)[0]} before and after its blocks")
            unused = [n for n in units if n not in before and n not in covered
                      and not any(n.startswith(a + ".") for a in before)
                      and any(True for _ in units[n].parameters())]
            unused = [n for n in unused if not any(n.startswith(a + ".") for a in unused)]
            prologue = GenericPrologue([units[n] for n in before], base, blocks, plan, extra, inputs,
                                       _embeddings(model, "input"))
            router = router_loss_of(model)
            prologue.router = router
            layers = [GenericBlock(b, plan, i, model.config,
                                   None if router is None else (router, router_modules(model, b)))
                      for i, b in enumerate(blocks)]
            heads = dict(model.named_modules())
            epilogue = _epilogue(model, task, prologue, layers, [heads[n] for n in after], [units[n] for n in unused],
                                 batch, reference)
            epilogue.router = router
            _verify(model, task, prologue, layers, epilogue, batch, labels, reference)

    every = dict(model.named_modules())

    def owners_first(names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: not any(True for _ in every[n].parameters()))

    return [
        (prologue, owners_first(before)),
        *[(layer, [f"{blocks_name}.{i}"]) for i, layer in enumerate(layers)],
        (epilogue, owners_first(after) + unused),
    ]


def _embeddings(model: Any, which: str) -> nn.Module | None:
    """The model's input or output embedding; ``None`` for a model without one (an image or audio encoder)."""
    try:
        return getattr(model, f"get_{which}_embeddings")()
    except (NotImplementedError, AttributeError):
        return None


def generic_family(model: Any) -> Family:
    """The family of a causal LM, masked LM or sequence classifier with no builder in ``FAMILIES`` (the generic
    split, or the whole model as one layer); a clear error for anything else."""
    if getattr(model.config, "is_encoder_decoder", False) and (  # encoder-decoder LMs: their own split
            "decoder_input_ids" in inspect.signature(model.forward).parameters):  # (not Whisper's audio classifier)
        return seq2seq_family(model)
    task = _task(model)
    if _register_attention() and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(ATTENTION)
        except Exception:  # noqa: BLE001 - a model without SDPA: its own (eager) attention, whose masks are tensors
            pass
    ties: tuple[tuple[str, str], ...] = ()
    src, dst = _embeddings(model, "input"), _embeddings(model, "output")
    if src is not None and dst is not None and getattr(src, "weight", None) is getattr(dst, "weight", 0):
        a, b = _fqn(model, src), _fqn(model, dst)
        if a and b:
            ties = ((a, b),)
    try:
        inputs, _ = _base_inputs(model.base_model)
    except UniAPError as e:
        raise _refuse(model, str(e)) from None
    if task.one_layer:
        return _one_layer(model, task, inputs, _refuse(model, task.one_layer))
    router = router_loss_of(model)
    try:
        pairs = generic_layers(model)  # (the weights still tied: the split refers to modules, not to weights)
    except Unsplittable as e:
        if router is not None:  # one layer gives the logits only, not the routers' statistics
            raise _refuse(model, f"{e.reason}; and its loss adds the routers' load-balancing term "
                                 "(output_router_logits=True), which the one-layer fallback cannot rebuild (it sees "
                                 "the logits only): train it with output_router_logits=False") from None
        return _one_layer(model, task, inputs, e)
    return Family(layers=lambda _: pairs, loss=task.loss if router is None else router.wrap(task.loss),
                  inputs=inputs, count=task.count, attention=None, ties=ties,
                  labels=None if task.target is None else task.target(model))


def _one_layer(model: Any, task: _Task, inputs: tuple[str, ...], why: UniAPError) -> Family:
    """The fallback for a model the generic split cannot reproduce: the model as one layer, after checking that its
    own loss is the task's loss of its logits (then the whole-batch normalization holds)."""
    layer = WholeModel(model, inputs, task.output)
    with _eval_mode(model), torch.no_grad():
        batch = _probe(model, 3, next(model.parameters()).device)
        batch = task.probe(batch) if task.probe is not None else batch
        labels = task.labels(model, batch)
        kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
        try:
            reference = model(**batch, **task.kwargs(labels), **kwargs)
            logits = layer(batch)
        except Exception as e:  # noqa: BLE001 - the model's own forward fails on the probe: why says why
            raise why from e
    owners = _accept_one_layer(model, task, logits, labels, reference, why)
    return Family(layers=lambda _: [(layer, owners)], loss=task.loss, inputs=inputs, count=task.count, attention=None,
                  labels=None if task.target is None else task.target(model))
