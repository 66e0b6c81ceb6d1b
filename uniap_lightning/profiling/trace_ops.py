"""Tracing a layer as operations (step 1 of :mod:`uniap_lightning.profiling.roofline`): a reference implementation
runs forward and backward on the ``meta`` device under a dispatch mode that records every aten operation with its
FLOPs (torch's own :data:`torch.utils.flop_counter.flop_registry`), the bytes it reads and writes and, for a matmul,
its shape; the tensors autograd saves for backward are the layer's activation bytes. Split from ``roofline.py``
(which prices the operations) to keep files under 400 lines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}
#: softmax kernels (forward and backward): priced by the length of the row they reduce. The loss's log-softmax is
#: left out: the measurement behind SOFTMAX_LONG_ROW_EFFICIENCY is an attention's softmax, and a vocabulary-parallel
#: loss (Megatron's) runs no torch log-softmax at all
_SOFTMAXES = {torch.ops.aten._softmax, torch.ops.aten._softmax_backward_data}
#: operations that launch no kernel: allocations, and ``_unsafe_view`` (a view its schema does not mark as one)
_CREATION = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty, torch.ops.aten.empty_strided,
             torch.ops.aten.lift_fresh, torch.ops.aten._unsafe_view}
#: advanced indexing (a gather of a few elements, a scatter into them): the bytes are the indices and the elements
#: picked or stored (read and written), not the tensor indexed into (Megatron's loss picks one logit per token)
_GATHERS = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_}
_ACTIVE: list[_Recorder] = []  # the recorder of the trace running now (fused attention records itself into it)


@dataclass(frozen=True)
class Op:
    """One traced operation: its FLOPs, the bytes it moves, and for a matmul its shape ``(batch, M, N, K)``."""

    name: str
    flops: float
    bytes: float
    shape: tuple[int, int, int, int] | None = None  # a matmul's (batch, M, N, K); None: not a matmul
    fused_attention: bool = False
    row: int = 0  # a softmax's (forward or backward) reduced length; 0: not a softmax


@dataclass(frozen=True)
class Trace:
    """A layer's forward and backward operations and the bytes autograd saves between them."""

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    saved_bytes: float


def _nbytes(x: Any) -> float:
    return float(x.numel() * x.element_size()) if isinstance(x, torch.Tensor) else 0.0


def _tensors(xs: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [xs]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def _is_view(func: Any) -> bool:
    """An operation that returns an alias of its input without writing (view, transpose, expand, detach...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _matmul_shape(func: Any, args: Sequence[Any]) -> tuple[int, int, int, int]:
    packet = func._overloadpacket
    a, b = (args[1], args[2]) if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm) else (args[0], args[1])
    if a.dim() == 3:
        return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
    return 1, a.shape[0], b.shape[1], a.shape[1]


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if _is_view(func) or packet in _CREATION:
            return out
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        moved = sum(map(_nbytes, ins)) + sum(_nbytes(o) for o in outs if not any(o is i for i in ins))
        if packet in _GATHERS:  # the indices, and the picked (index) or stored (index_put: values) elements twice
            picked = outs[0] if packet is torch.ops.aten.index else args[2]
            moved = sum(map(_nbytes, _tensors(args[1]))) + 2 * _nbytes(picked)
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            shape = _matmul_shape(func, args) if packet in _MATMULS else None
            self.ops.append(Op(str(packet), flops, moved, shape))
        elif packet in _SOFTMAXES:
            x = outs[0]
            dim = args[1] if packet is torch.ops.aten._softmax else args[2]
            self.ops.append(Op(str(packet), 0.0, moved, row=int(x.shape[dim])))
        else:
            self.ops.append(Op(str(packet), 0.0, moved))
        return out


def trace(forward: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]) -> Trace:
    """Record ``forward()`` (meta tensors; returns the output and the parameters) and its backward."""
    saved: dict[int, float] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage()) if t.device.type != "meta" else id(t._base if t._base is not None else t)
        saved.setdefault(key, _nbytes(t._base if t._base is not None else t))
        return t

    rec = _Recorder()
    _ACTIVE.append(rec)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec:
            out, weights = forward()
        params = {id(w) for w in weights}
        forward_ops = tuple(rec.ops)
        rec.ops = []
        with rec:
            out.backward(torch.empty_like(out))
    finally:
        _ACTIVE.pop()
    # parameters saved for backward (a linear keeps its weight) are not activations
    activation = sum(b for k, b in saved.items() if k not in params)
    return Trace(forward_ops, tuple(rec.ops), float(activation))
