"""How the generic split traces a Hugging Face model (:mod:`.generic`): the blocks (the ``nn.ModuleList`` of
same-class modules holding most parameters), which modules run before, between and after them, and what the model
passes each block, recorded by running the base model's own forward up to its last block with the blocks' ``forward``
replaced by recorders. The recorded arguments become templates (the hidden states and the tensors replaced by
markers) and a payload plan (:class:`_Plan`: how each tensor holds the batch on dim 0, learned from two probes of
different batch sizes). :func:`_refuse` is the one error every part of the split raises for a model it cannot handle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import FAMILIES
from uniap_lightning.errors import UniAPError

_PREFIX = "uniap_ctx"
_CONSTANTS = (type(None), bool, int, float, str)


class _Stop(Exception):
    """Raised by the last block's recorder: the prologue has what it needs."""


@dataclass(frozen=True)
class _Ref:
    """Where a block takes payload tensor ``index``."""

    index: int


_HIDDEN = "<hidden>"


class Unsplittable(UniAPError):
    """A model the generic split cannot handle; ``reason`` says why."""

    reason = ""


def _refuse(model: Any, why: str) -> UniAPError:
    error = Unsplittable(
        f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r}) is not a Hugging Face "
        f"family the strategy can split: no hand-written family (those: {sorted(FAMILIES)}) and the generic split "
        f"cannot handle it: {why}. Implement uniap_layers() on your LightningModule returning the model's layers in "
        "order (each taking and returning a tensor, a tuple or a dict of tensors), with uniap_loss(output, target) "
        "and, for dict batches, uniap_split_batch(batch); see uniap_lightning.runtime.chain"
    )
    error.reason = why
    return error


def _find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of same-class modules holding the most parameters."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0 or len({type(c) for c in m}) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if size and (best is None or size > best[0]):
            best = (size, name, m)
    if best is None:
        raise _refuse(model, "it has no nn.ModuleList of repeated blocks")
    return best[1], best[2]


def _units(model: nn.Module, blocks_name: str) -> dict[str, nn.Module]:
    """The modules outside the blocks a layer can hold: leaves and modules owning parameters directly."""
    out = {}
    for name, m in model.named_modules():
        if name == blocks_name or name.startswith(blocks_name + "."):
            continue
        if any(True for _ in m.parameters(recurse=False)) or not any(True for _ in m.children()):
            out[name] = m
    return out


class _Calls:
    """Hooks recording the order in which modules run, and which run before / after the blocks."""

    def __init__(self, units: dict[str, nn.Module], blocks: nn.ModuleList) -> None:
        self.order: list[tuple[str, str]] = []  # (phase, name) of each first call per phase
        self.phase = "before"
        names = {id(m): n for n, m in units.items()}
        self.handles = [m.register_forward_pre_hook(self._pre(names[id(m)])) for m in units.values()]
        self.handles.append(blocks[0].register_forward_pre_hook(lambda *_: self._set("between")))
        self.handles.append(blocks[-1].register_forward_hook(lambda *_: self._set("after")))

    def _set(self, phase: str) -> None:
        self.phase = phase

    def _pre(self, name: str) -> Any:
        def hook(*_: Any) -> None:
            if (self.phase, name) not in self.order:
                self.order.append((self.phase, name))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def names(self, phase: str) -> list[str]:
        return [n for p, n in self.order if p == phase]


#: a module's hook tables (emptied on the blocks while the prologue records)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _capture(base: nn.Module, blocks: nn.ModuleList, inputs: dict[str, Any]) -> tuple[torch.Tensor, list[Any]]:
    """The base model's forward up to its blocks: (hidden states block 0 takes, ``(args, kwargs)`` of each block)."""
    calls: list[tuple[tuple, dict]] = []
    saved = [b.__dict__.get("forward") for b in blocks]

    def recorder(i: int) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append((args, kwargs))
            if i == len(blocks) - 1:
                raise _Stop
            return args[0] if args else kwargs.get("hidden_states")
        return forward

    # the blocks' own hooks stay out of it (FSDP would gather a block's weights for a call that never runs it)
    hooks = [{k: v for k, v in b.__dict__.items() if k in _HOOKS} for b in blocks]
    for i, b in enumerate(blocks):
        b.forward = recorder(i)
        for k, v in hooks[i].items():
            setattr(b, k, type(v)())
    try:
        base(**inputs)
    except _Stop:
        pass
    finally:
        for b, f, h in zip(blocks, saved, hooks):
            del b.forward
            if f is not None:
                b.forward = f
            for k, v in h.items():
                setattr(b, k, v)
    if len(calls) != len(blocks):
        raise UniAPError(f"the model's forward called {len(calls)} of its {len(blocks)} blocks")
    args, kwargs = calls[0]
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise UniAPError("its first block does not take the hidden states first (or as hidden_states=)")
    return hidden, calls


def _templates(calls: list[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """Each block's ``(args, kwargs)`` with the hidden states and the tensors replaced by markers, and the distinct
    tensors (by identity, in order of first use)."""
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    def mark(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen[id(v)] = len(tensors)
                tensors.append(v)
            return _Ref(seen[id(v)])
        if isinstance(v, (tuple, list)):
            return tuple(mark(x) for x in v)
        if not isinstance(v, _CONSTANTS):
            raise UniAPError(f"it passes its blocks a {type(v).__name__}, which cannot travel between stages")
        return v

    out = []
    for args, kwargs in calls:
        if args:
            a = (_HIDDEN, *[mark(x) for x in args[1:]])
            k = {n: mark(v) for n, v in kwargs.items()}
        else:
            a = ()
            k = {n: (_HIDDEN if n == "hidden_states" else mark(v)) for n, v in kwargs.items()}
        out.append((a, k))
    return out, tensors


def _fill(t: Any, hidden: torch.Tensor, values: dict[int, torch.Tensor]) -> Any:
    if isinstance(t, _Ref):
        return values[t.index]
    if isinstance(t, str) and t == _HIDDEN:
        return hidden
    if isinstance(t, tuple):
        return tuple(_fill(x, hidden, values) for x in t)
    return t


def _refs(t: Any) -> set[int]:
    if isinstance(t, _Ref):
        return {t.index}
    if isinstance(t, tuple):
        return set().union(*[_refs(x) for x in t]) if t else set()
    if isinstance(t, dict):
        return _refs(tuple(t.values()))
    return set()


def _mode(model: Any, j: int, small: torch.Tensor, large: torch.Tensor) -> tuple[str, int]:
    """How payload tensor ``j`` holds the batch, from its dim 0 with batches of 2 and 3 samples."""
    if small.dim() == 0 or large.dim() == 0:
        return "constant", 1
    rows2, rows3 = small.shape[0], large.shape[0]
    if rows2 == 1 and rows3 == 1:
        return "broadcast", 1
    if rows2 % 2 == 0 and rows3 % 3 == 0 and rows2 // 2 == rows3 // 3:
        return "rows", rows2 // 2
    if rows2 == rows3:
        return "constant", 1
    raise _refuse(model, f"its blocks take a tensor with {rows2} rows for 2 samples and {rows3} for 3")


@dataclass
class _Plan:
    """What the prologue sends and how each block takes it back."""

    templates: list[Any]
    modes: list[tuple[str, int]]

    def encode(self, tensors: list[torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
        out = {}
        for j, (t, (mode, k)) in enumerate(zip(tensors, self.modes)):
            if mode == "constant":
                t = t.unsqueeze(0).expand(rows, *t.shape)
            elif t.shape[0] == 1 and k == 1:
                t = t.expand(rows, *t.shape[1:])
            elif mode == "rows" and t.shape[0] == rows * k:
                t = t.reshape(rows, k, *t.shape[1:]) if k > 1 else t
            else:
                raise UniAPError(f"the model passes its blocks a tensor of shape {tuple(t.shape)} for {rows} samples "
                                 f"(at setup: {mode}, {k} rows per sample)")
            out[f"{_PREFIX}{j}"] = t
        return out

    def decode(self, d: dict[str, torch.Tensor], indices: set[int], rows: int) -> dict[int, torch.Tensor]:
        out = {}
        for j in indices:
            x, (mode, k) = d[f"{_PREFIX}{j}"], self.modes[j]
            if mode == "constant":
                x = x[0]
            elif mode == "broadcast":
                x = x[:1]
            elif k > 1:
                x = x.reshape(rows * k, *x.shape[2:])
            out[j] = x
        return out


def _fqn(model: nn.Module, module: Any) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None
