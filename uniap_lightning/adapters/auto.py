"""Hugging Face models with no user code: the strategy recognizes the family and builds the chain itself.

A LightningModule that holds one ``transformers.PreTrainedModel`` attribute (and no ``nn.Sequential`` chain or
``uniap_layers()``) trains under ``Trainer(strategy="uniap")`` as it is: :func:`find_pretrained` finds the model,
:func:`pretrained_chain` asks the family's builder (:data:`FAMILIES`, by ``config.model_type``) for

* the layers: views over the model's own modules (embedding, one layer per block, head), so parameter names stay
  the model's and a consolidated export loads back with ``from_pretrained`` / ``load_state_dict``;
* the loss: the model's own (labels in the batch dict), normalized by the whole batch's count of labelled items so
  that padded batches split into micro-batches give the one-device loss exactly (see :class:`HFTarget`);
* the batch layout: a dict batch (``input_ids``, ``attention_mask``, ``labels``, ...) as Hugging Face users have it.

Layers carry tensor-parallel plans for attention and MLP where the family's modules allow it. A family without a
builder goes the generic way (:mod:`uniap_lightning.adapters.families.generic`: causal LMs, encoders with every
head, image and audio encoders split from their own module tree and forward, checked against the model on a probe
batch at setup; what it cannot reproduce trains as one layer); a loss that does not decompose over micro-batches
or a head it does not know is refused with a :class:`~uniap_lightning.errors.UniAPError` naming why and what to
implement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# the family record and the registry live below the families, which import them (no cycle); named here as before
from uniap_lightning.adapters.family import (FAMILIES, Family, HFTarget, count_next_tokens, count_rows, count_tokens,
                                             register)
from uniap_lightning.adapters import families  # noqa: F401 - registers every built-in family
from uniap_lightning.adapters.families.generic import generic_family
from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime import chain as runtime_chain
from uniap_lightning.runtime.chain import Chain

__all__ = ["FAMILIES", "Family", "HFTarget", "count_next_tokens", "count_rows", "count_tokens", "extract_chain",
           "find_pretrained", "hugging_face_chain", "pretrained_chain", "register"]


def find_pretrained(module: nn.Module) -> tuple[str, Any] | None:
    """The one ``PreTrainedModel`` attribute of ``module`` as ``(attribute, model)``; ``None`` when there is none
    (or transformers is not installed)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    found = [(n, m) for n, m in module.named_children() if isinstance(m, PreTrainedModel)]
    if len(found) > 1:
        raise UniAPError(
            f"{type(module).__name__} holds {len(found)} Hugging Face models ({', '.join(n for n, _ in found)}); the "
            "strategy can build the chain of one. Define uniap_layers() for the combination."
        )
    return found[0] if found else None


def _split_for(family: Family, model: Any) -> Callable[[Any], tuple[dict[str, torch.Tensor], Any]]:
    """The batch layout: the inputs the chain takes, and the target (labels and their whole-batch scale; ``None``
    for a batch without labels, e.g. for ``trainer.predict``)."""

    def split(batch: Any) -> tuple[dict[str, torch.Tensor], Any]:
        if not isinstance(batch, dict):
            raise UniAPError(
                f"a Hugging Face model trains on dict batches with 'labels' (its own loss), got a "
                f"{type(batch).__name__}; the model takes {list(family.inputs)} (and 'labels')"
            )
        missing = [k for k in family.inputs[:1] if k not in batch]
        if missing:
            raise UniAPError(f"the batch has no {missing[0]!r} entry (it has {sorted(batch)})")
        inputs = {k: batch[k] for k in family.inputs if k in batch}
        if family.prepare is not None:
            inputs.update(family.prepare(model, batch))
        labels = family.labels(batch) if family.labels is not None else batch.get("labels")
        if labels is None:
            return inputs, None
        items = family.count(labels).to(torch.float64).clamp(min=1)
        scale = (labels.shape[0] / items).to(torch.float32)
        return inputs, {"labels": labels, "global_scale": scale.expand(labels.shape[0], *scale.shape).contiguous()}

    return split


def extract_chain(module: nn.Module) -> Chain:
    """The chain of ``module`` as the strategy finds it: ``module.uniap_layers()``, else its one ``nn.Sequential``
    attribute (:func:`uniap_lightning.runtime.chain.extract_chain`), else the chain of the one Hugging Face model it
    holds (:func:`hugging_face_chain`).

    This is the function to call on a user's LightningModule (the strategy, setup and live re-planning do): the
    runtime's :func:`~uniap_lightning.runtime.chain.extract_chain` sits below the adapters and knows no model
    family unless given one (its ``adapter`` argument, which this function fills in).
    """
    return runtime_chain.extract_chain(module, adapter=hugging_face_chain)


def hugging_face_chain(module: nn.Module) -> Chain | None:
    """The chain of the one Hugging Face model ``module`` holds (:func:`pretrained_chain`); ``None`` when it holds
    none (the runtime's ``adapter`` contract, :data:`uniap_lightning.runtime.chain.ChainAdapter`)."""
    found = find_pretrained(module)
    return None if found is None else pretrained_chain(module, *found)


def pretrained_chain(module: nn.Module, attribute: str, model: Any) -> Chain:
    """The :class:`~uniap_lightning.runtime.chain.Chain` of ``module.<attribute>`` (a Hugging Face model)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    family = FAMILIES.get(kind)
    if family is None:  # no hand-written family: the generic split from the model's own structure
        family = generic_family(model)
    if family.head is not None:
        family = family.head(model)
    if family.attention is not None and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(family.attention)
    tied = [(src, dst) for src, dst in family.ties if _untie(model, src, dst)]
    pairs = family.layers(model)
    layers = [layer for layer, _ in pairs]
    parts = [[f"{attribute}.{p}" for p in fqns] for _, fqns in pairs]
    names = [p[0] for p in parts]
    _check_covers(module, attribute, model, parts)
    ties = [_tie(layers, model, src, dst) for src, dst in tied]
    target_loss = family.loss

    def loss_fn(output: Any, target: dict[str, torch.Tensor] | None) -> torch.Tensor:
        if target is None:
            raise UniAPError(
                f"a Hugging Face model trains on dict batches with 'labels' (its own loss); this batch has none "
                f"(the model takes {list(family.inputs)} and 'labels')"
            )
        return target_loss(model, output, HFTarget(target["labels"], target["global_scale"]))

    loss_fn.uniap_sequence_loss = getattr(target_loss, "uniap_sequence_loss", None)  # type: ignore[attr-defined]
    return Chain(module=module, layers=layers, names=names, loss_fn=loss_fn, split_batch=_split_for(family, model),
                 parts=parts, ties=ties)


def _untie(model: Any, src: str, dst: str) -> bool:
    """``dst`` gets its own parameter, equal to ``src``'s, when they are the same parameter (then ``True``; a model
    of the family without one of the two modules, e.g. another head, has no such tie)."""
    try:
        a, b = model.get_submodule(src), model.get_submodule(dst)
    except AttributeError:
        return False
    if a.weight is not b.weight:
        return False
    b.weight = nn.Parameter(a.weight.detach().clone(), requires_grad=a.weight.requires_grad)
    return True


def _tie(layers: list[nn.Module], model: Any, src: str, dst: str) -> tuple[int, int, str, str]:
    """The tie as (layer a, layer b, parameter name in a, in b): the layers holding ``src`` and ``dst``."""
    found = []
    for fqn in (src, dst):
        weight = model.get_submodule(fqn).weight
        for u, layer in enumerate(layers):
            names = [n for n, p in layer.named_parameters() if p is weight]
            if names:
                found.append((u, names[0]))
                break
    (a, name_a), (b, name_b) = found
    return a, b, name_a, name_b


def _check_covers(module: nn.Module, attribute: str, model: Any, parts: list[list[str]]) -> None:
    """Every trainable parameter of the model belongs to exactly one layer: tied weights (an output embedding that
    is the input embedding) cannot sit on two pipeline stages."""
    owned: dict[int, tuple[int, str]] = {}
    for i, fqns in enumerate(parts):
        for fqn in fqns:
            for p in module.get_submodule(fqn).parameters():
                if id(p) in owned and owned[id(p)][0] != i:
                    raise UniAPError(
                        f"{type(model).__name__}: '{owned[id(p)][1]}' and '{fqn}' share a parameter (tied weights), "
                        "which cannot sit on different pipeline stages; build the model with "
                        "tie_word_embeddings=False"
                    )
                owned[id(p)] = (i, fqn)
    stray = [f"{attribute}.{n}" for n, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
    if stray:
        raise UniAPError(f"the {type(model).__name__} adapter leaves parameters outside the chain: {stray[:5]}")
