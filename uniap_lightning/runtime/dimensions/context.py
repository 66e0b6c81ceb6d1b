"""The context dimension's runtime (``cp``, ``cp_method``): each sample's sequence over a layer's ``cp`` ranks.

Groups: per ``(dp, cp, tp)`` layout with ``cp > 1`` (sorted), the ``cp`` ranks with the same dp and tp index, cut
from a ``(pp, dp, cp, tp)`` world mesh (cp rank order = sequence piece order), kept in the meshes' ``context``
store and read through :func:`cp_group`. Created after the experts' meshes (the order of the commits that added
them; ``new_group`` is collective, so the order is fixed).

Wrap: after TP (:func:`~uniap_lightning.runtime.sequence.enable_context_parallel` checks the heads per TP rank), as
torchtitan applies CP to the attention modules after ``apply_tp``; before the layer's data parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from uniap_lightning.runtime.dimensions.base import LayerJob, RuntimeDimension
from uniap_lightning.runtime.sequence import check_sequence_strategy, enable_context_parallel

if TYPE_CHECKING:
    import torch.distributed as dist

    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.runtime.mesh import PlanMeshes


NAME = "context"


def groups(meshes: PlanMeshes) -> None:
    plan, store = meshes.plan, meshes.store(NAME)
    for dp, cp, tp in sorted({(lp.strategy.dp, lp.strategy.cp, lp.strategy.tp) for lp in plan.layers}):
        if cp > 1:
            mesh = init_device_mesh(meshes.device_type, (plan.pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
            store[(dp, cp, tp)] = mesh.get_group("cp")


def cp_group(meshes: PlanMeshes, dp: int, cp: int, tp: int) -> dist.ProcessGroup:
    """The ``cp`` ranks with this rank's dp and tp index in layout ``(dp, cp, tp)`` (cp rank order = sequence
    piece order)."""
    return meshes.store(NAME)[(dp, cp, tp)]


def check(layer: nn.Module, name: str, st: Strategy) -> None:
    """Context and sequence parallelism the layer can run (``sp`` too: it splits the same sequence)."""
    check_sequence_strategy(layer, name, cp=st.cp, cp_method=st.cp_method, tp=st.tp, sp=st.sp)


def wrap(job: LayerJob) -> None:
    st = job.st
    if st.cp > 1:
        enable_context_parallel([job.layer], cp_group(job.meshes, st.dp, st.cp, st.tp), method=st.cp_method)


CONTEXT = RuntimeDimension(NAME, groups=groups, check=check, wrap=wrap)
