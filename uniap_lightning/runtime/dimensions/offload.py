"""The offload dimension's runtime (``offload``): the tensors a layer saves for backward kept in host memory.

Run: the layer's call under saved-tensor hooks (:class:`OffloadedActivations`); the copies back start when the
gradient reaches the next layer's output (one layer ahead, overlapping its backward). Nothing is wrapped (the
hooks are around the call, as recomputation's checkpoint), so parameter names stay the user's. No groups; no state
for checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from uniap_lightning.runtime.dimensions.base import RuntimeDimension
from uniap_lightning.runtime.payload import call_layer


class OffloadedActivations:
    """One layer's tensors saved for backward in one forward, kept in host memory until its backward
    (:func:`torch.autograd.graph.saved_tensors_hooks`' pack / unpack). Parameters stay where they are (they are
    the model's, not activations); a DTensor travels as its local shard. On a CUDA device each copy to the host
    runs on ``stream`` beside the compute (pinned memory, the tensor's memory held for the copy by
    ``record_stream``), and :meth:`prefetch` starts the copies back on it, called as the gradient reaches the
    next layer (so they overlap that layer's backward, one layer ahead); a tensor not prefetched comes back when
    backward needs it. Elsewhere the copies are plain (what CPU tests run: the same path, the same numbers)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.back: dict[int, torch.Tensor] = {}  # prefetched device copies by packed index
        self.packed: list[tuple[torch.device, torch.Tensor, Any]] = []

    def pack(self, t: torch.Tensor) -> Any:
        # a weight (FSDP2's gathered one too) and its transposed view are the model's, not activations; a stage's
        # input (a leaf that requires grad, from the previous stage) is one
        if isinstance(t if t._base is None else t._base, nn.Parameter):
            return t
        if isinstance(t, DTensor):
            return (DTensor, t.device_mesh, t.placements, t.shape, t.stride(), self.pack(t.to_local()))
        if type(t) is not torch.Tensor:  # another subclass: left alone
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)  # (its strides: the same kernels after)
        event = None
        if t.is_cuda:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        else:
            host.copy_(t)
        self.packed.append((t.device, host, event))
        return len(self.packed) - 1

    def unpack(self, p: Any) -> torch.Tensor:
        if isinstance(p, tuple) and p and p[0] is DTensor:
            _, mesh, placements, shape, stride, local = p
            return DTensor.from_local(self.unpack(local), mesh, placements, run_check=False, shape=shape,
                                      stride=stride)
        if not isinstance(p, int):
            return p
        if p in self.back:
            torch.cuda.current_stream(self.back[p].device).wait_stream(self.stream)
            return self.back.pop(p)
        device, host, event = self.packed[p]
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        return host.to(device, non_blocking=event is not None)

    def prefetch(self) -> None:
        """Start every copy back to the device (CUDA only; elsewhere the tensors are where backward reads them)."""
        for i, (device, host, event) in enumerate(self.packed):
            if event is not None and i not in self.back:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(event)
                    self.back[i] = host.to(device, non_blocking=True)


def run(stage: Any, layer: nn.Module, x: Any) -> tuple[Any, Callable[[], None]]:
    """The layer's call with its saved tensors in host memory, copied on the stage's side stream (CUDA)."""
    box = OffloadedActivations(stage.side_stream())
    with torch.autograd.graph.saved_tensors_hooks(box.pack, box.unpack):
        x = call_layer(layer, x)
    return x, box.prefetch


OFFLOAD = RuntimeDimension("offload", runs=lambda st: bool(st.offload), run=run)
