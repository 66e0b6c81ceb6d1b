"""Tied weights across the chain (T5's shared embedding is also its LM head), kept as two equal copies.

A parameter used by two layers cannot live on two pipeline stages, nor be sharded or replicated by two layers'
data parallelism at once. So the adapter gives the second layer its own copy (equal values) and records the tie in
``Chain.ties``; :class:`TiedGrads` then makes both copies behave as one parameter:

* at setup, the second copy takes the first's values (over the pipeline, when they sit on different stages);
* once per optimizer step, after the data-parallel averages, each copy's gradient becomes the *sum* of both (the
  gradient of the tied parameter: ``d loss / d w = d loss / d w_embedding + d loss / d w_head``); with the same
  optimizer and state both copies then take the same step and stay equal, as the one tied parameter would.

Copies on different stages are summed over a two-rank group per lane position (rank ``r`` of the first stage with
rank ``r`` of the other, which holds the same data-parallel shard); sharded or replicated copies are compared as
full tensors. Gradient clipping counts a tied gradient once per copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from uniap_lightning.planner.plan import Plan
from uniap_lightning.runtime.mesh import PlanMeshes


@dataclass
class _Tie:
    params: list[nn.Parameter]  # the copies on this rank (one or two)
    group: Any  # the two-rank group when the other copy is on another stage, else None
    lead: int  # global rank holding the first copy (the source of the values)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


@torch.no_grad()
def _write(t: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(t, DTensor):
        t.to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements).to_local())
    else:
        t.copy_(full)


class TiedGrads:
    """The ties of a chain on this rank (collective to build: every rank creates the same groups)."""

    def __init__(self, ties: list[tuple[int, int, str, str]], layers: list[nn.Module], plan: Plan,
                 meshes: PlanMeshes) -> None:
        self.ties: list[_Tie] = []
        n, rank = meshes.n, meshes.rank
        for a, b, name_a, name_b in ties:
            sa, sb = plan.group_of_stage(plan.layers[a].stage), plan.group_of_stage(plan.layers[b].stage)
            ranks_a, ranks_b = plan.ranks_of_group(sa), plan.ranks_of_group(sb)
            group = None
            if sa != sb:
                for r in range(n):  # every rank creates every group, in the same order
                    g = dist.new_group([ranks_a[r], ranks_b[r]])
                    if rank in (ranks_a[r], ranks_b[r]):
                        group = g
            local = [layers[u].get_parameter(name) for u, name, s in ((a, name_a, sa), (b, name_b, sb))
                     if s == meshes.group]
            if local:
                self.ties.append(_Tie(local, group, ranks_a[meshes.lane]))

    @torch.no_grad()
    def sync_values(self) -> None:
        """The second copy takes the first's values."""
        for tie in self.ties:
            full = _full(tie.params[0]).clone()
            if tie.group is not None:
                dist.broadcast(full, src=tie.lead, group=tie.group)
            for p in tie.params:
                _write(p, full)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Each copy's gradient becomes the sum of both copies' (call once per optimizer step, after the
        data-parallel averages)."""
        for tie in self.ties:
            grads = [p.grad for p in tie.params]
            if any(g is None for g in grads):
                continue
            total = sum((_full(g) for g in grads[1:]), _full(grads[0]).clone())
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for g in grads:
                _write(g, total)
