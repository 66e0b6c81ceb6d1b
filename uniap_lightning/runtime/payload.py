"""What flows between the layers of a chain: one tensor, a tuple of tensors or a flat dict of tensors.

Every tensor has the batch on dim 0, so splitting a batch into micro-batches, lanes and data-parallel chunks,
sending it between pipeline stages and gathering it back is the same operation applied to each tensor. A layer is
called with the previous layer's output (:func:`call_layer`):

* a tensor ``x``: ``layer(x)`` (the original contract);
* a tuple ``(a, b, ...)``: ``layer(a, b, ...)``; it returns the whole tuple the next layer takes (or one tensor);
* a dict ``d``: ``layer(d)``; it returns a dict of the entries it *changes or adds*: entries it does not return are
  carried forward unchanged (so a padding mask or an encoder's output travels to the layers that need it), and an
  entry it returns as ``None`` is dropped. A layer may also return a tensor (e.g. the head's logits).

Pipeline stages send the tensors of a payload as one flat tuple (:func:`flatten`); the receiving stage rebuilds the
payload from its :data:`Spec`, which every rank knows from the sample batch (see ``Chain.specs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch
from torch import nn

Payload = Union[torch.Tensor, tuple, dict]
#: the structure of a payload: ``None`` a tensor, an int the length of a tuple, a tuple of str a dict's keys
Spec = Union[None, int, tuple]


def is_payload(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, tuple):
        return len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x)
    if isinstance(x, dict):
        return len(x) > 0 and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in x.items())
    return False


def spec_of(x: Payload) -> Spec:
    if isinstance(x, torch.Tensor):
        return None
    if isinstance(x, tuple):
        return len(x)
    return tuple(x)


def flatten(x: Payload) -> tuple[torch.Tensor, ...]:
    """The tensors of ``x`` in a fixed order (a dict's in key order)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)):
        return tuple(x)
    return tuple(x.values())


def unflatten(tensors: Any, spec: Spec) -> Payload:
    """Inverse of :func:`flatten` given the payload's spec."""
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    tensors = tuple(tensors)
    if spec is None:
        if len(tensors) != 1:
            raise RuntimeError(f"expected one tensor, got {len(tensors)}")
        return tensors[0]
    if isinstance(spec, int):
        if len(tensors) != spec:
            raise RuntimeError(f"expected a tuple of {spec} tensors, got {len(tensors)}")
        return tensors
    if len(tensors) != len(spec):
        raise RuntimeError(f"expected the {len(spec)} tensors of a dict {list(spec)}, got {len(tensors)}")
    return dict(zip(spec, tensors))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], x: Payload) -> Payload:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return tuple(fn(t) for t in x)
    return {k: fn(t) for k, t in x.items()}


def rows(x: Payload) -> int:
    """Samples in ``x`` (dim 0 of its first tensor)."""
    return int(flatten(x)[0].shape[0])


def nbytes(x: Payload) -> int:
    """Bytes of every tensor in ``x`` (what crosses a stage boundary)."""
    return sum(t.numel() * t.element_size() for t in flatten(x))


def signature(x: Payload) -> list[Any]:
    """Shapes and dtypes of the tensors of ``x``, with the structure (for cache keys and cross-rank checks)."""
    return [spec_of(x) if not isinstance(spec_of(x), tuple) else list(spec_of(x)),
            [[list(t.shape), str(t.dtype)] for t in flatten(x)]]


def narrow(x: Payload, start: int, length: int) -> Payload:
    return map_tensors(lambda t: t.narrow(0, start, length), x)


def head(x: Payload, count: int) -> Payload:
    """The first ``count`` samples of ``x``."""
    return map_tensors(lambda t: t[:count], x)


def chunk(x: Payload, pieces: int) -> list[Payload]:
    """``x`` cut into ``pieces`` equal parts along dim 0 (the caller checked divisibility)."""
    size = rows(x) // pieces
    return [narrow(x, i * size, size) for i in range(pieces)]


def concat(parts: list[Payload]) -> Payload:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    flat = [flatten(p) for p in parts]
    joined = [torch.cat([f[i] for f in flat]) for i in range(len(flat[0]))]
    return unflatten(joined, spec_of(first))


def to_device(x: Payload, device: torch.device) -> Payload:
    return map_tensors(lambda t: t.to(device), x)


def call_layer(layer: nn.Module, x: Payload) -> Any:
    """Apply ``layer`` to payload ``x`` by the rules in the module docstring (the result is not checked here)."""
    if isinstance(x, torch.Tensor):
        return layer(x)
    if isinstance(x, tuple):
        return layer(*x)
    out = layer(x)
    if isinstance(out, dict):
        merged = dict(x)
        for key, value in out.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        return merged
    return out


def float_leaves(x: Payload) -> Payload:
    """Detached copies of ``x``'s tensors, the floating-point ones requiring grad (inputs of a timed backward)."""
    return map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), x)


def backward_ones(out: Payload) -> None:
    """Backward from every output tensor that requires grad, with a gradient of ones (profiling)."""
    tensors = [t for t in flatten(out) if t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
