"""The model contract: how the strategy finds the chain of layers, the loss and the batch layout.

A LightningModule trains under ``strategy="uniap"`` with no glue code when

* its network is a chain: either exactly one ``nn.Sequential`` attribute (its children are the layers), or a
  ``uniap_layers()`` method returning the ordered layers (each a submodule of the LightningModule, so parameter
  names stay stable for checkpoints); every trainable parameter belongs to exactly one layer;
* each layer takes and returns a *payload*: one tensor, a tuple of tensors or a flat dict of tensors, every tensor
  with the batch on dim 0 (the first layer may take integer token ids); how a layer is called with each kind, and
  how a dict's entries a layer does not return travel on, is in :mod:`.payload`; checked at setup on the sample
  batch by :func:`check_layer_output`;
* its loss is computed from the chain's output and the target: a ``uniap_loss(output, target)`` method or a
  ``loss_fn`` attribute (e.g. ``nn.CrossEntropyLoss()``), returning the *mean* over the samples it is given;
* a batch is ``(input, target)``, a dict with a ``labels`` entry (the input is the other entries, as a dict), or
  the module defines ``uniap_split_batch(batch) -> (input, target)``; input and target may be payloads;
* or its network is a Hugging Face ``PreTrainedModel`` of a supported family (one attribute): the chain, the loss
  (the model's own, labels in the batch dict) and the batch layout come from :mod:`uniap_lightning.adapters.auto`.
  The runtime knows no model family (it sits below the adapters): :func:`extract_chain` takes the builder as its
  ``adapter`` argument, and :func:`uniap_lightning.adapters.extract_chain`, which the strategy calls, passes the
  Hugging Face one.

:class:`UniAPModule` states this as a Protocol. Models that are not chains get an adapter
(:mod:`uniap_lightning.adapters`) that exposes them as one.

Under the strategy, ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` of the module
are *not* called: the strategy runs the chain itself (pipeline schedules need the loss on the last stage) and logs
``train_loss`` / ``val_loss`` / ``test_loss`` on every rank. All other hooks, ``configure_optimizers``, callbacks,
schedulers, clipping and accumulation work as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.payload import Payload, Spec, call_layer, flatten, is_payload, rows, spec_of


@runtime_checkable
class UniAPModule(Protocol):
    """What a LightningModule may define to describe itself to the strategy (all optional but the loss)."""

    def uniap_layers(self) -> Sequence[nn.Module]:
        """The ordered layers of the network; each maps a payload (a tensor, a tuple or a flat dict of tensors,
        see :mod:`.payload`) to the next layer's."""
        ...

    def uniap_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """Mean loss over the samples of ``output`` and ``target``."""
        ...


@dataclass
class Chain:
    """The layers of a module, their names (FQNs inside the module), the loss and the batch splitter."""

    module: nn.Module
    layers: list[nn.Module]
    names: list[str]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    split_batch: Callable[[Any], tuple[Payload, Any]]
    #: per layer, the modules of ``module`` (FQNs) holding its parameters, when the layer is a view over the
    #: module's own modules (adapters built by the strategy) rather than a submodule itself; ``None``: ``names``
    parts: list[list[str]] | None = None
    #: the structure of the chain's input and of each layer's output (:mod:`.payload`), learned from the sample
    #: batch by :func:`check_chain_contract`; ``None`` until then (a single tensor everywhere)
    input_spec: Spec = None
    specs: list[Spec] | None = None
    #: tied weights kept as two equal copies (``(layer a, layer b, parameter name in a, name in b)``, see
    #: :mod:`.ties`); only adapters the strategy builds declare them, a user's chain must not share parameters
    ties: list[tuple[int, int, str, str]] = field(default_factory=list)

    def replace(self, index: int, new: nn.Module) -> None:
        """Put ``new`` where layer ``index`` sits in the module tree (keeps every other name unchanged); a view
        layer's parts are replaced by ``nn.Identity`` (their parameter names simply disappear)."""
        if self.parts is not None:
            for fqn in self.parts[index]:
                self._set(fqn, nn.Identity())
        else:
            self._set(self.names[index], new)
        self.layers[index] = new

    def _set(self, fqn: str, new: nn.Module) -> None:
        parent_name, _, child = fqn.rpartition(".")
        parent = self.module.get_submodule(parent_name) if parent_name else self.module
        setattr(parent, child, new)

    def spec_before(self, index: int) -> Spec:
        """The structure of layer ``index``'s input."""
        if index == 0:
            return self.input_spec
        return self.specs[index - 1] if self.specs is not None else None

    def spec_after(self, index: int) -> Spec:
        return self.specs[index] if self.specs is not None else None

    def prediction_input(self, batch: Any) -> Payload:
        """The chain's input in a prediction batch: ``(input,)``, ``(input, target)``, a layout ``split_batch``
        knows, or the input itself."""
        if isinstance(batch, (tuple, list)) and len(batch) == 1:
            return batch[0]
        return self.split_batch(batch)[0] if isinstance(batch, (tuple, list, dict)) else batch


def default_split_batch(batch: Any) -> tuple[Payload, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict) and "labels" in batch and len(batch) > 1:
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
    raise UniAPError(
        f"the batch is a {type(batch).__name__}; the strategy expects (input, target) or a dict with 'labels'. "
        "Define uniap_split_batch(batch) -> (input, target) on the LightningModule for other layouts."
    )


#: ``module -> its Chain``, or ``None`` for a module it does not recognize: how a model that is not a chain by the
#: contract above gets one (:func:`uniap_lightning.adapters.extract_chain` passes the Hugging Face builder)
ChainAdapter = Callable[[nn.Module], "Chain | None"]


def _find_layers(module: nn.Module, adapter: ChainAdapter | None) -> list[nn.Module] | Chain:
    if hasattr(module, "uniap_layers"):
        layers = list(module.uniap_layers())
        if not layers:
            raise UniAPError(f"{type(module).__name__}.uniap_layers() returned no layers")
        return layers
    seqs = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if len(seqs) == 1:
        return list(seqs[0][1].children())
    built = adapter(module) if adapter is not None else None
    if built is not None:
        return built
    found = f"found {len(seqs)} nn.Sequential attributes ({', '.join(n for n, _ in seqs)})" if seqs else (
        "found no nn.Sequential attribute"
    )
    hf = "" if adapter is not None else (
        " (uniap_lightning.adapters.extract_chain, which the strategy calls, builds its chain; "
        "uniap_lightning.runtime.extract_chain without an adapter knows no model family)")
    raise UniAPError(
        f"{type(module).__name__} is not a chain of layers the strategy can split: {found}. Put the network in one "
        "nn.Sequential attribute, define uniap_layers() returning the ordered layers, hold a Hugging Face model of a "
        f"supported family (uniap_lightning.adapters.auto.FAMILIES) as one attribute{hf}, or use an adapter from "
        "uniap_lightning.adapters (plain GPT)."
    )


def _find_loss(module: nn.Module) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    if hasattr(module, "uniap_loss"):
        return module.uniap_loss
    loss = getattr(module, "loss_fn", None)
    if callable(loss):
        return loss
    step = getattr(type(module), "training_step", None)
    own_step = step is not None and getattr(step, "__module__", "").split(".")[0] not in ("lightning", "pytorch_lightning")
    raise UniAPError(
        f"{type(module).__name__} has no loss the strategy can call: define uniap_loss(output, target) or a "
        "loss_fn attribute (e.g. self.loss_fn = nn.CrossEntropyLoss())"
        + (f"; {type(module).__name__}.training_step is not called: the strategy runs the layers and the loss itself, "
           "stage by stage" if own_step else "") + "."
    )


def extract_chain(module: nn.Module, adapter: ChainAdapter | None = None) -> Chain:
    """Find the chain, its loss and batch layout; refuse what the runtime cannot split, with the reason.

    The chain is ``module.uniap_layers()``, else the children of its one ``nn.Sequential`` attribute, else what
    ``adapter`` builds (``module -> Chain``, ``None`` when it does not recognize the module). The runtime sits below
    the adapters and knows no model family: for a LightningModule holding a Hugging Face model call
    :func:`uniap_lightning.adapters.extract_chain` (this function with the Hugging Face adapter), which is what the
    strategy, setup and live re-planning call; without ``adapter`` such a module is refused, naming that function.
    """
    layers = _find_layers(module, adapter)
    if isinstance(layers, Chain):  # built by the adapter (a Hugging Face model)
        return layers
    names_by_id = {id(m): n for n, m in module.named_modules() if n}
    names = []
    for i, layer in enumerate(layers):
        if id(layer) not in names_by_id:
            raise UniAPError(
                f"layer {i} ({type(layer).__name__}) returned by uniap_layers() is not a submodule of "
                f"{type(module).__name__}; register it (e.g. in an nn.ModuleList) so its parameters have stable names"
            )
        names.append(names_by_id[id(layer)])
    owner: dict[int, str] = {}
    for name, layer in zip(names, layers):
        for p in layer.parameters():
            if id(p) in owner:
                raise UniAPError(
                    f"layers '{owner[id(p)]}' and '{name}' share a parameter (tied weights); pipeline stages cannot "
                    "share weights. Untie them (e.g. tie_word_embeddings=False for Hugging Face models)."
                )
            owner[id(p)] = name
    stray = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owner]
    if stray:
        raise UniAPError(
            f"trainable parameters outside the chain would not be trained: {stray[:5]}"
            f"{' ...' if len(stray) > 5 else ''}. Move them into a layer of the chain."
        )
    split = getattr(module, "uniap_split_batch", None) or default_split_batch
    return Chain(module=module, layers=layers, names=names, loss_fn=_find_loss(module), split_batch=split)


def check_layer_output(index: int, name: str, layer: nn.Module, output: Any, rows: int) -> None:
    """What a layer may return: a payload (one tensor, a tuple or a flat dict of tensors, :mod:`.payload`), every
    tensor with the batch (``rows`` samples) on dim 0.

    The one place that states the contract on outputs.
    """
    where = f"layer {index} '{name}' ({type(layer).__name__})"
    rule = ("the chain contract is one tensor, a tuple or a flat dict of tensors per layer, each with the batch on "
            "dim 0")
    if not is_payload(output):
        what = type(output).__name__
        if isinstance(output, (tuple, dict)):
            kinds = sorted({type(v).__name__ for v in (output.values() if isinstance(output, dict) else output)})
            what = f"{what} holding {', '.join(kinds) or 'nothing'}"
        raise UniAPError(
            f"{where} returned a {what}; {rule} (return only tensors, e.g. out[0] of a Hugging Face block, or "
            "wrap the layer)"
        )
    bad = [tuple(t.shape) for t in flatten(output) if t.dim() == 0 or int(t.shape[0]) != rows]
    if bad:
        raise UniAPError(
            f"{where} returned a tensor of shape {bad[0]} for a micro-batch of {rows} samples; {rule} (constants "
            "such as causal masks or rotary tables are rebuilt inside each layer, not passed on)"
        )


def check_chain_contract(
    chain: Chain, x: Payload, *, context: Callable[[], AbstractContextManager[Any]] = nullcontext
) -> None:
    """Run the chain once on ``x`` (no gradients, under ``context``, e.g. the precision's autocast), check every
    layer's output with :func:`check_layer_output` and record the structure of each (``chain.specs``).

    A layer that raises is not a contract violation: the check stops there and profiling reports the error (and
    falls back to a structural profile) as it would without the check. The caller keeps RNG and buffers unchanged.
    """
    n = rows(x)
    chain.input_spec = spec_of(x)
    specs: list[Spec] = []
    with torch.no_grad(), context():
        for i, (layer, name) in enumerate(zip(chain.layers, chain.names)):
            try:
                y = call_layer(layer, x)
            except Exception:  # noqa: BLE001 - reported by profiling, which runs the same layer on the same input
                return
            check_layer_output(i, name, layer, y, n)
            specs.append(spec_of(y))
            x = y
    chain.specs = specs
