"""Create every device mesh and process group of a plan (:func:`build_meshes`), into a
:class:`~uniap_lightning.runtime.mesh.PlanMeshes`.

``init_device_mesh`` and ``new_group`` are collective over the whole world: every rank creates every group in the
same order, including groups it is not a member of. The order is derived from the plan alone: the world mesh
``(pp, stage)``, the ``(replicas, tp)`` grids every layer runs on (sorted; the base layout, see
:class:`~uniap_lightning.runtime.mesh.PlanMeshes`), then each dimension's groups in
:data:`~uniap_lightning.runtime.dimensions.GROUP_ORDER` (each into its own store), then the relayout groups between
the layouts of consecutive layers (:mod:`.reshard`), which belong to no dimension. A new dimension adds its groups
through its runtime module; nothing here or in :mod:`.mesh` names one.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from uniap_lightning.planner.plan import Plan
from uniap_lightning.runtime.dimensions import create_groups
from uniap_lightning.runtime.mesh import PlanMeshes, grid_shapes, layout_transitions
from uniap_lightning.runtime.reshard import gather_classes, moves_of


def build_meshes(plan: Plan, *, rank: int, device_type: str) -> PlanMeshes:
    """Create every mesh and group the plan needs (collective: all ranks call it with the same plan)."""
    n = plan.devices_per_stage
    world = init_device_mesh(device_type, (plan.pp, n), mesh_dim_names=("pp", "stage"))
    meshes = PlanMeshes(plan=plan, rank=rank, device_type=device_type, world=world)
    for reps, tp in grid_shapes(plan):  # the replicas dimension holds a layer's dp x cp replicas
        meshes.grids[(reps, tp)] = init_device_mesh(device_type, (plan.pp, reps, tp), mesh_dim_names=("pp", "dp", "tp"))
    create_groups(meshes)
    needed = sorted({m for a, b in layout_transitions(plan) for m in moves_of(a, b)})
    for layout, k in needed:  # every rank creates every group, in this order (new_group is collective)
        for g in range(plan.pp):
            for lanes in gather_classes(layout, k):
                ranks = [g * n + lane for lane in lanes]
                group = dist.new_group(ranks)
                if rank in ranks:
                    meshes.relayout_groups[(layout, k)] = group
    return meshes
