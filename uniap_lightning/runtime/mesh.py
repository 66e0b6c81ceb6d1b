"""Device meshes and process groups for one plan.

Rank layout (see :mod:`uniap_lightning.planner.plan`): ``world = pp * n``; device group ``g`` owns ranks
``[g*n, (g+1)*n)`` and runs the plan's pipeline stages placed on it (``virtual_stages`` of them); the rank at
position ``r`` inside its group is on pipeline *lane* ``r``, and lane ``r`` is the pipeline ``r, n+r, 2n+r, ...``.
Inside a group a layer with strategy ``(dp, tp)`` sees the group's ranks as a ``(dp, tp)`` grid with ``tp``
innermost.

Every mesh is built as a *world* mesh with a leading ``pp`` dimension and then sliced, because
``init_device_mesh`` and ``new_group`` are collective over the whole world: each rank must create every group
in the same order, including groups it is not a member of. Building them all up front, in an order derived from
the plan alone, keeps that true without any negotiation between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from uniap_lightning.planner.plan import Plan

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh


def layout_transitions(plan: Plan) -> list[tuple[int, int]]:
    """Every ``(dp_from, dp_to)`` activation re-layout the plan needs, sorted; ``n`` is the stage-boundary layout
    (every pipeline stage starts and ends in it)."""
    n = plan.devices_per_stage
    pairs: set[tuple[int, int]] = set()
    for stage in range(plan.num_stages):
        current = n
        for u in plan.layers_of_stage(stage):
            dp = plan.layers[u].strategy.dp
            if dp != current:
                pairs.add((current, dp))
            current = dp
        if current != n:
            pairs.add((current, n))
    return sorted(pairs)


@dataclass
class PlanMeshes:
    """The meshes and groups of one plan, as seen from this rank."""

    plan: Plan
    rank: int
    device_type: str
    world: DeviceMesh
    grids: dict[tuple[int, int], DeviceMesh] = field(default_factory=dict)
    regather_groups: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.plan.devices_per_stage

    @property
    def group(self) -> int:
        """This rank's device group (torch's pipeline rank)."""
        return self.plan.group_of_rank(self.rank)

    @property
    def lane(self) -> int:
        return self.plan.lane_of_rank(self.rank)

    @property
    def lane_group(self) -> dist.ProcessGroup:
        """The pipeline group of this rank: one rank per stage, same position inside each stage."""
        return self.world.get_group("pp")

    @property
    def stage_group(self) -> dist.ProcessGroup:
        return self.world.get_group("stage")

    def grid(self, dp: int, tp: int) -> DeviceMesh:
        """The ``(dp, tp)`` mesh of this rank's stage (a 2-D slice of a ``(pp, dp, tp)`` world mesh)."""
        return self.grids[(dp, tp)]["dp", "tp"]

    def tp_mesh(self, dp: int, tp: int) -> DeviceMesh:
        return self.grids[(dp, tp)]["tp"]

    def dp_mesh(self, dp: int, tp: int) -> DeviceMesh:
        return self.grids[(dp, tp)]["dp"]

    def chunk_index(self, dp: int) -> int:
        """Which of the ``dp`` batch chunks this rank holds in layout ``dp``."""
        return self.plan.batch_chunk_of_rank(self.rank, dp)

    def regather_group(self, dp_a: int, dp_b: int) -> dist.ProcessGroup:
        """Ranks that hold the same coarse chunk (``min`` layout) but different fine chunks (``max`` layout)."""
        return self.regather_groups[(max(dp_a, dp_b), min(dp_a, dp_b))]


def build_meshes(plan: Plan, *, rank: int, device_type: str) -> PlanMeshes:
    """Create every mesh and group the plan needs (collective: all ranks call it with the same plan)."""
    from torch.distributed.device_mesh import init_device_mesh

    n = plan.devices_per_stage
    world = init_device_mesh(device_type, (plan.pp, n), mesh_dim_names=("pp", "stage"))
    meshes = PlanMeshes(plan=plan, rank=rank, device_type=device_type, world=world)
    for dp, tp in sorted({(lp.strategy.dp, lp.strategy.tp) for lp in plan.layers}):
        meshes.grids[(dp, tp)] = init_device_mesh(device_type, (plan.pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    for fine, coarse in sorted({(max(a, b), min(a, b)) for a, b in layout_transitions(plan)}):
        mesh = init_device_mesh(
            device_type,
            (plan.pp, coarse, fine // coarse, n // fine),
            mesh_dim_names=("pp", "coarse", "gather", "inner"),
        )
        meshes.regather_groups[(fine, coarse)] = mesh.get_group("gather")
    return meshes
