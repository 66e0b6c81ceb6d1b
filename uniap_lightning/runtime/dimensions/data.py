"""The data dimension's runtime (``dp``, ``dp_mode``; the plan's ``compression`` rides on it): the replica meshes and
the layer's data-parallel state over them.

Groups: none of its own. It runs over the replica mesh of the layer's ``(replicas, tp)`` grid
(:meth:`PlanMeshes.dp_mesh`), which is the plan's base layout, not this dimension's: every layer runs on one, the
tensor, experts and state-offload dimensions read it too, and its ``tp`` dimension is the tensor dimension's mesh
(one 2-D mesh, so FSDP2 builds 2-D (replicas x tp) parameters from the DTensor TP shards).
:func:`~uniap_lightning.runtime.groups.build_meshes` creates the grids first, before every dimension's groups
(as this module did when it created them: the order ``new_group`` sees is unchanged).

Wrap (last of the parallelisms, as torchtitan's FSDP: it shards whatever parameters it finds, so it must find the
TP shards and the experts split already): ``replicate`` puts the layer's gradients in the replicated-gradient
buckets (compressed as the plan says); ``zero1``/``zero2``/``zero3`` make it an FSDP2 unit (:mod:`..zero`). The
parameters another dimension reduces on its own (:attr:`LayerJob.held_apart`: expert shards) stay out. A layer
that a dimension before this one already made an FSDP2 unit (with its own policy: state offload) is left as it
is: FSDP2 shards a module once.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule

from uniap_lightning.runtime.dimensions.base import LayerJob, RuntimeDimension
from uniap_lightning.runtime.zero import ZERO_MODES


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


DATA = RuntimeDimension("data", wrap=wrap)
