"""Which ranks hold which experts (:mod:`.experts`): the expert-parallel degree's check, the MoE layers of a module,
the layout of a layer's data ranks into ep groups and expert data groups, their process groups, and the gradient
reduction that sums dense gradients over the data ranks and expert gradients over the ranks holding the same
experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.grads import all_reduce_flat

def check_expert_degree(n_experts: int, ep: int, where: str = "MoE layer") -> None:
    """Refuse an expert-parallel degree that does not divide the experts, in one line."""
    if ep < 1 or n_experts % ep != 0:
        raise UniAPError(f"{where}: expert parallelism ep={ep} must divide the number of experts E={n_experts} "
                         f"(each rank holds E/ep experts)")


def expert_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE layers of ``module`` (modules declaring ``uniap_expert_params``), with their names."""
    return [(name, m) for name, m in module.named_modules() if hasattr(m, "uniap_expert_params")]


@dataclass(frozen=True)
class ExpertLayout:
    """The data ranks of a layer (sharing its batch) and its expert-parallel degree.

    Ep groups are consecutive blocks of ``ep`` data ranks; the ranks holding the same experts are those at the same
    position in every block. ``ExpertLayout((0, 1, 2, 3), 2)``: ep groups ``(0, 1), (2, 3)``, expert data groups
    ``(0, 2), (1, 3)``.
    """

    data_ranks: tuple[int, ...]
    ep: int

    def __post_init__(self) -> None:
        if self.ep < 1 or len(self.data_ranks) % self.ep != 0:
            raise UniAPError(f"expert parallelism ep={self.ep} must divide the {len(self.data_ranks)} data ranks "
                             f"{list(self.data_ranks)} of the layer")

    def ep_groups(self) -> list[tuple[int, ...]]:
        r, ep = self.data_ranks, self.ep
        return [tuple(r[i:i + ep]) for i in range(0, len(r), ep)]

    def expert_data_groups(self) -> list[tuple[int, ...]]:
        return [tuple(self.data_ranks[i::self.ep]) for i in range(self.ep)]

    def group_of(self, rank: int, groups: list[tuple[int, ...]]) -> tuple[int, ...]:
        return next(g for g in groups if rank in g)


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's process groups for one layout (``None`` where the group is this rank alone)."""

    data: Any
    ep: Any
    expert_data: Any
    data_size: int


def new_expert_groups(layout: ExpertLayout, rank: int) -> ExpertGroups:
    """Create the layout's groups; every rank of the world must call this with the same layouts in the same order."""
    def make(groups: list[tuple[int, ...]]) -> Any:
        mine = None
        for g in groups:
            pg = dist.new_group(list(g))
            if rank in g:
                mine = pg
        return mine

    data = make([layout.data_ranks])
    ep = make(layout.ep_groups())
    expert_data = make(layout.expert_data_groups())
    return ExpertGroups(data, ep, expert_data, len(layout.data_ranks))


def split_expert_params(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(expert parameters, all other parameters)`` of ``module``, trainable ones only."""
    expert = {id(getattr(m, p)) for _, m in expert_modules(module) for p in m.uniap_expert_params}
    params = [p for p in module.parameters() if p.requires_grad]  # frozen ones take no gradient
    return [p for p in params if id(p) in expert], [p for p in params if id(p) not in expert]


def reduce_gradients(module: nn.Module, groups: ExpertGroups) -> None:
    """Average gradients as one process on the data ranks' concatenated batch would compute them.

    Non-expert gradients: summed over the data group. Expert gradients already hold the contributions of every
    token rank of the ep group (the backward all-to-alls brought them), so they are summed only over the expert
    data group. Both are divided by the number of data ranks (each rank's loss is the mean over its own batch).
    """
    expert, other = split_expert_params(module)
    for params, group in ((other, groups.data), (expert, groups.expert_data)):
        if not params:
            continue
        for p in params:  # the same tensors on every rank of the group, whatever this rank's routing touched
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_flat([p.grad for p in params], group, groups.data_size)
