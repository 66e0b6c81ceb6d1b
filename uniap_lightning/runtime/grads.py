"""Gradients under Lightning's automatic optimization, and clipping across stages and shards.

Why stash: Lightning's closure runs ``training_step``, *then* ``zero_grad`` (first batch of an accumulation
window), *then* ``strategy.backward``. A pipeline schedule runs forward and backward inside ``training_step``, so
its gradients would be wiped. The strategy takes the fresh gradients out of ``.grad`` right after the schedule,
puts the previous ones back, and adds the fresh ones in ``backward``. On the last batch of an accumulation window
the replicated layers' buckets (:class:`~uniap_lightning.runtime.data_parallel.ReplicatedGrads`) already sum the
fresh gradients with the previous ones during the schedule - unless the batch also opens the window, where
Lightning's ``zero_grad`` drops the previous ones - and ``backward`` overwrites the sum with the average.

Why a custom norm: with pipeline stages each rank holds only some parameters, sharded (FSDP, TP) or replicated in
mixed ways, so ``torch.nn.utils.clip_grad_norm_`` on local parameters would clip by a local norm. The global norm
sums each distinct gradient element once: a rank weighs its local shard by ``1 / copies`` where ``copies`` is how
many ranks of its stage hold the same shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from uniap_lightning.runtime.data_parallel import local_tensor

GradStash = list[tuple[nn.Parameter, torch.Tensor | None]]


def take_grads(params: Iterable[nn.Parameter]) -> GradStash:
    """Detach the current gradients from the parameters (leaving ``None``) and return them."""
    out = []
    for p in params:
        out.append((p, p.grad))
        p.grad = None
    return out


def put_grads(stash: GradStash) -> None:
    for p, g in stash:
        p.grad = g


@torch.no_grad()
def add_grads(stash: GradStash) -> None:
    for p, g in stash:
        if g is None:
            continue
        p.grad = g if p.grad is None else p.grad + g


def all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: float) -> None:
    """Sum ``grads`` over ``group`` in one all-reduce of their concatenation (none when the group is missing or
    has one rank), divide by ``divisor`` and write the result back in place."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat /= divisor
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _copies(p: torch.Tensor, devices_per_stage: int) -> int:
    """How many ranks of the stage hold the same piece of ``p``'s gradient."""
    shards = getattr(p, "uniap_ep", 1)  # an expert shard: E / ep experts (runtime.experts.mark_expert_shards)
    if isinstance(p, DTensor):
        for dim, placement in enumerate(p.placements):
            # not `is_shard()`: FSDP2 x TP uses _StridedShard, which splits the tensor but is no `Shard`
            if not (placement.is_replicate() or placement.is_partial()):
                shards *= p.device_mesh.size(dim)
    return max(devices_per_stage // shards, 1)


@torch.no_grad()
def global_grad_norm(params: Iterable[nn.Parameter], devices_per_stage: int, *, device: torch.device) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, identical on every rank (collective over the world)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            g = local_tensor(p.grad).to(device, torch.float64)
            total += g.pow(2).sum() / _copies(p, devices_per_stage)
    dist.all_reduce(total)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[nn.Parameter], max_norm: float, devices_per_stage: int, *, device: torch.device
) -> torch.Tensor:
    """Same rule as ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``, at most 1)."""
    params = list(params)
    norm = global_grad_norm(params, devices_per_stage, device=device)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local_tensor(p.grad).mul_(coef.to(p.grad.dtype))
    return norm
