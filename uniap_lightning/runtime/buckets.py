"""The gradient buckets of replicated layers (:mod:`.data_parallel`): one flat buffer per bucket and one all-reduce
(or one compressor's averaging) per optimizer step, built in reverse registration order so the last layers' bucket is
reduced while the earlier layers are still in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from uniap_lightning.planner.plan import COMPRESSION_DEFAULTS
from uniap_lightning.runtime.compression import ByteCounter, Compressor, all_reduce, make_compressor
from uniap_lightning.runtime.shards import local_tensor

#: DDP's default bucket sizes: large enough that per-collective latency stays small; the first bucket of a group
#: (the last layers' gradients) smaller, so that a reduction starts early in the backward even for a small stage
BUCKET_CAP_BYTES = 25 * 2**20
FIRST_BUCKET_CAP_BYTES = 2**20

@dataclass
class Bucket:
    """Gradients of some parameters of one group, one flat buffer, one all-reduce per optimizer step.

    The buffer persists (allocated at the first step) so no step pays for allocating and faulting it in again.
    """

    group: dist.ProcessGroup
    size: int  # ranks in ``group``: the divisor of the sum (for expert shards: the layer's replicas, more ranks)
    params: list[nn.Parameter]
    buffer: torch.Tensor
    slots: list[torch.Tensor]  # parameter i's piece of ``buffer``, shaped as its local gradient
    filled: list[bool] = field(default_factory=list)
    missing: int = 0  # slots not filled yet this step
    work: Any = None
    compressor: Compressor | None = None  # None: a plain all-reduce; else it averages (and holds error feedback)

    def reset(self) -> None:
        self.filled = [False] * len(self.params)
        self.missing = len(self.params)

    def fill(self, i: int, previous: torch.Tensor | None) -> None:
        """Copy parameter ``i``'s final gradient (plus ``previous``, the earlier batches of the window) in.

        No autograd bookkeeping needed: neither the buffer nor gradients require grad (and hooks run in backward).
        """
        grad, out = self.params[i].grad, self.slots[i]
        if grad is None:
            out.zero_()
        else:
            out.copy_(local_tensor(grad))
        if previous is not None:
            out.add_(local_tensor(previous))
        self.filled[i] = True
        self.missing -= 1

    @torch.no_grad()
    def launch(self, counter: ByteCounter | None, step: int | None = None) -> None:
        """Start averaging the complete buffer for optimizer step ``step``: the plain all-reduce, or the
        compressor's first collectives (a plain all-reduce too in its warm-up)."""
        if self.compressor is None:
            self.work = all_reduce(self.buffer, self.group, counter)
        else:
            self.work = self.compressor.start(self.buffer, self.slots, self.group, self.size, counter, step)

    @torch.no_grad()
    def write_back(self) -> None:
        """Wait for the all-reduce (or the compressed averaging) and replace each gradient by the average."""
        self.work.wait()
        self.work = None
        if self.compressor is None:  # a compressor leaves the average in the buffer itself
            self.buffer.div_(self.size)
        for i, p in enumerate(self.params):
            if not p.requires_grad:
                continue
            if p.grad is None:
                # Every rank takes part in the collective (a parameter unused here may have a gradient on
                # another rank), so this rank gets the average too.
                p.grad = torch.zeros_like(p)
            local_tensor(p.grad).copy_(self.slots[i])


def make_buckets(
    groups: list[tuple[Any, ...]],
    cap_bytes: int,
    *,
    first_cap_bytes: int = FIRST_BUCKET_CAP_BYTES,
    compression_options: dict[str, float] | None = None,
) -> list[Bucket]:
    """Buckets of at most ``cap_bytes`` (``first_cap_bytes`` for a group's first; a larger parameter gets its own),
    last-registered parameters first.

    Reverse registration order because backward produces the last layers' gradients first: their bucket can be
    reduced while the earlier layers are still in backward. Every rank of a group builds the same buckets in the
    same order (same layers, same parameters), which is what keeps the collectives matched. A group is
    ``(process group, size, parameters)`` or ``(..., compression)``; each bucket gets its own compressor.
    """
    out: list[Bucket] = []
    options = compression_options if compression_options is not None else COMPRESSION_DEFAULTS
    for group, size, params, *method in groups:
        name = method[0] if method else "none"
        current: list[nn.Parameter] = []
        current_bytes, limit = 0, min(first_cap_bytes, cap_bytes)
        for p in reversed(params):
            local = local_tensor(p)
            nbytes = local.numel() * local.element_size()
            same_kind = not current or (local.dtype, local.device) == _kind(current[0])
            if current and (current_bytes + nbytes > limit or not same_kind):
                out.append(_bucket(group, size, current, make_compressor(name, options)))
                current, current_bytes, limit = [], 0, cap_bytes
            current.append(p)
            current_bytes += nbytes
        if current:
            out.append(_bucket(group, size, current, make_compressor(name, options)))
    return out


def _kind(p: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    local = local_tensor(p)
    return local.dtype, local.device


def _bucket(group: dist.ProcessGroup, size: int, params: list[nn.Parameter],
            compressor: Compressor | None = None) -> Bucket:
    shapes = [local_tensor(p).shape for p in params]
    dtype, device = _kind(params[0])
    buffer = torch.empty(sum(s.numel() for s in shapes), dtype=dtype, device=device)
    slots = [piece.view(shape) for piece, shape in zip(buffer.split([s.numel() for s in shapes]), shapes)]
    bucket = Bucket(group, size, params, buffer, slots, compressor=compressor)
    bucket.reset()
    return bucket
