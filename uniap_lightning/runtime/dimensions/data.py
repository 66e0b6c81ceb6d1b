"""The data dimension's runtime (``dp``, ``dp_mode``; the plan's ``compression`` rides on it): the replica meshes and
the layer's data-parallel state over them.

Groups: one ``(pp, dp, tp)`` world mesh per ``(replicas, tp)`` pair of the plan (sorted), whose ``dp`` dimension
holds a layer's ``dp x cp`` replicas and whose ``tp`` dimension is the tensor dimension's mesh (:meth:`PlanMeshes.
tp_mesh`): one 2-D mesh, so FSDP2 builds 2-D (replicas x tp) parameters from the DTensor TP shards. Created first:
every other dimension's groups and the relayout groups come after (the order ``new_group`` sees is fixed).

Wrap (last of the parallelisms, as torchtitan's FSDP: it shards whatever parameters it finds, so it must find the
TP shards and the experts split already): ``replicate`` puts the layer's gradients in the replicated-gradient
buckets (compressed as the plan says); ``zero1``/``zero2``/``zero3`` make it an FSDP2 unit (:mod:`..zero`). The
parameters another dimension reduces on its own (:attr:`LayerJob.held_apart`: expert shards) stay out. A layer
that a dimension before this one already made an FSDP2 unit (with its own policy: state offload) is left as it
is: FSDP2 shards a module once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from uniap_lightning.runtime.dimensions.base import LayerJob, RuntimeDimension
from uniap_lightning.runtime.zero import ZERO_MODES

if TYPE_CHECKING:
    from uniap_lightning.runtime.mesh import PlanMeshes


def groups(meshes: PlanMeshes) -> None:
    plan = meshes.plan
    for reps, tp in sorted({(lp.strategy.replicas, lp.strategy.tp) for lp in plan.layers}):
        meshes.grids[(reps, tp)] = init_device_mesh(meshes.device_type, (plan.pp, reps, tp),
                                                    mesh_dim_names=("pp", "dp", "tp"))


def wrap(job: LayerJob) -> None:
    st = job.st
    reps = st.replicas
    if reps == 1 or isinstance(job.layer, FSDPModule):
        return
    mesh = job.meshes.dp_mesh(reps, st.tp)
    if st.dp_mode in ZERO_MODES:
        job.zero.add(job.layer, st.dp_mode, mesh, job.replicated, mesh.get_group(), reps, st.compression,
                     ignored=job.held_apart)
    else:
        job.replicated.add(job.layer, mesh.get_group(), reps, st.compression, exclude=job.held_apart)


DATA = RuntimeDimension("data", groups=groups, wrap=wrap)
