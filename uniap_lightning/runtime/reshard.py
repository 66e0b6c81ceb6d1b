"""Activation re-layout between layers whose data-parallel degree differs.

Layout ``d``: the micro-batch is cut into ``d`` chunks along dim 0 and the rank at stage position ``r`` holds chunk
``r // (n / d)`` (so the ``tp`` ranks of one tensor-parallel group hold the same chunk). Stage boundaries use
layout ``n`` (every rank a different slice), which is what the cost model assumes.

Gradient scale convention, which makes every data-parallel reduction a plain *average* over its ``dp`` ranks:
in layout ``d`` the gradient a rank holds is the gradient of the mean loss over *its* chunk. Going from a fine
layout ``d_f`` to a coarse one ``d_c`` is an all-gather forward and "take my slice, times ``d_f / d_c``" backward;
going from coarse to fine is "take my slice" forward and an all-gather of gradients, times ``d_c / d_f``,
backward. With that, a replicated or sharded layer that averages over its ``dp`` ranks gets exactly the
gradient of the global mean loss, whatever the layouts around it.

A layer's input or output may hold several tensors (:mod:`.payload`): each is re-laid out alike (tensors without
gradients, e.g. integer padding masks, by the same gather / split outside autograd).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from uniap_lightning.runtime.mesh import PlanMeshes


def _all_gather_cat(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, size: int, index: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.index, ctx.rows = group, size, index, x.shape[0]
        return _all_gather_cat(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        mine = grad.narrow(0, ctx.index * ctx.rows, ctx.rows) * ctx.size
        return mine, None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, size: int, index: int) -> torch.Tensor:
        if x.shape[0] % size:
            raise RuntimeError(f"cannot split {x.shape[0]} samples into {size} equal chunks")
        ctx.group, ctx.size = group, size
        rows = x.shape[0] // size
        return x.narrow(0, index * rows, rows).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_gather_cat(grad, ctx.group, ctx.size) / ctx.size, None, None, None


def relayout(x: Any, dp_from: int, dp_to: int, meshes: PlanMeshes) -> Any:
    """Move activation ``x`` (a tensor, or every tensor of a payload) from layout ``dp_from`` to layout ``dp_to``
    (identity when equal)."""
    if dp_from == dp_to:
        return x
    from uniap_lightning.runtime.payload import map_tensors

    group = meshes.regather_group(dp_from, dp_to)
    if dp_from > dp_to:  # fine -> coarse: gather the fine chunks that make up my coarse chunk
        size = dp_from // dp_to
        index = meshes.chunk_index(dp_from) % size
        return map_tensors(lambda t: _Gather.apply(t, group, size, index) if t.requires_grad
                           else _all_gather_cat(t, group, size), x)
    size = dp_to // dp_from
    index = meshes.chunk_index(dp_to) % size
    return map_tensors(lambda t: _Split.apply(t, group, size, index), x)
