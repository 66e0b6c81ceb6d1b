"""The tensor dimension's runtime (``tp``, ``sp``): the layer's weights sharded over ``tp`` ranks of a node.

Groups: none of its own; its mesh is the ``tp`` dimension of the data dimension's ``(replicas, tp)`` grid
(:meth:`PlanMeshes.tp_mesh`), so FSDP2 can build 2-D parameters over the same ranks.

Wrap: first of the parallelisms, as in torchtitan's ``parallelize_llama`` (``apply_tp`` before CP, activation
checkpointing, compile and FSDP): FSDP2 shards whatever parameters it finds and must find the DTensor TP shards.
``sp``: the layer's sequence-parallel plan (:func:`~uniap_lightning.runtime.sequence_tp.apply_sp`) instead of the
plain one (:func:`~uniap_lightning.runtime.tensor_parallel.apply_tp`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from uniap_lightning.runtime.dimensions.base import LayerJob, RuntimeDimension
from uniap_lightning.runtime.sequence_tp import apply_sp
from uniap_lightning.runtime.tensor_parallel import apply_tp, check_tp_supported

if TYPE_CHECKING:
    from uniap_lightning.planner.decision import Strategy


def check(layer: nn.Module, name: str, st: Strategy) -> None:
    check_tp_supported(layer, name, st.tp)


def wrap(job: LayerJob) -> None:
    st = job.st
    if st.tp > 1:
        (apply_sp if st.sp else apply_tp)(job.layer, job.name, job.meshes.tp_mesh(st.replicas, st.tp))


TENSOR = RuntimeDimension("tensor", check=check, wrap=wrap)
