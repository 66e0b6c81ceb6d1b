"""Data parallelism per layer: sharded (FSDP2 ``fully_shard``) or replicated (gradient average per step).

Replication is done here rather than with DDP or ``replicate()``: the plan's cost model charges one gradient
all-reduce per optimizer *step* (not per micro-batch), layers of one stage may use different data-parallel groups,
and tensor-parallel layers carry DTensor parameters that DDP does not handle. So replicated layers only record
their parameters and group; :class:`ReplicatedGrads` averages their gradients once, after the last backward of
an optimizer step (see ``UniAPStrategy.optimizer_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_fsdp(layer: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Shard the layer's parameters, gradients and optimizer states over ``dp_mesh`` (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard of ``t`` held by this rank (``t`` itself for a plain tensor); in-place edits reach ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class ReplicatedGrads:
    """Parameters replicated over a data-parallel group, averaged once per optimizer step."""

    groups: list[tuple[dist.ProcessGroup, int, list[nn.Parameter]]] = field(default_factory=list)

    def add(self, layer: nn.Module, group: dist.ProcessGroup, dp: int) -> None:
        params = [p for p in layer.parameters() if p.requires_grad]
        if dp > 1 and params:
            for g, size, plist in self.groups:
                if g is group:
                    plist.extend(params)
                    return
            self.groups.append((group, dp, params))

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Average gradients over each group, one flat bucket per group."""
        for group, size, params in self.groups:
            grads = [local_tensor(p.grad) for p in params if p.grad is not None]
            if len(grads) != len(params):
                # A parameter without gradient on one rank and with one on another would desynchronize the
                # collective; materialize zeros so every rank contributes the same buffer layout.
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                grads = [local_tensor(p.grad) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
