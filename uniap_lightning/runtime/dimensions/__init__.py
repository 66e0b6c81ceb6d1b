"""The runtime half of the dimensions, one module each, and their one ordered registry.

Each module declares one :class:`~.base.RuntimeDimension` named after its planner dimension
(:mod:`uniap_lightning.planner.dimensions`): the process groups it needs for a plan, the plan it refuses, how it
converts and wraps a layer, how it runs one in the stage's forward. :func:`~uniap_lightning.runtime.groups.
build_meshes`, :func:`~uniap_lightning.runtime.stage.build_stages`, :class:`~uniap_lightning.runtime.stage.
StageModule` and :func:`~uniap_lightning.runtime.check_plan_executable` loop over it and name no dimension. The
planner's ``compression`` has no runtime module: it is how the data dimension's replicated buckets reduce.

**The registry**, :data:`DIMENSIONS`, is the order a layer is changed in, after torchtitan's ``parallelize_llama``
(``torchtitan/models/llama3/infra/parallelize.py``: ``apply_tp``, CP on the attention modules, ``apply_ac``,
``apply_compile``, then ``apply_fsdp`` or ``apply_ddp``; float8 is a model converter run before ``parallelize``):

1. precision (``convert``, over every local layer before any wrap): float8 linears, which TP and FSDP2 then wrap;
2. tensor: TP / SP first, since FSDP2 must find the DTensor TP shards to build 2-D parameters;
3. context: after TP (it checks the heads per TP rank), as torchtitan;
4. experts: the micro-batch's statistics group, the experts split over the ep mesh and their own reduction; after
   CP, before FSDP (torchtitan's MoE models also split experts before FSDP); its ``finish`` runs after (5);
5. state offload: a layer whose state waits on the host becomes an FSDP2 unit with ``CPUOffloadPolicy`` (as
   torchtitan's ``apply_fsdp(offload_policy=...)``), just before data, which then leaves it;
6. data: replicate or ZeRO (FSDP2) over the replicas, last of the parallelisms, as torchtitan's FSDP;
7. recompute and 8. offload: how the stage's forward calls the layer (checkpoint / saved-tensor hooks), not a
   wrapper: where torchtitan wraps the block before FSDP (``apply_ac``), ours are around the call of the finished
   layer, so parameter names and checkpoints stay the user's. Recompute first: a recomputed layer saves nothing to
   offload. No compile step: the runtime does not compile.

:data:`GROUP_ORDER`, fixed by history, is the order the dimensions create their groups in (``new_group`` and
``init_device_mesh`` are collective: every rank creates every group in the same order): after the base
``(replicas, tp)`` grids every layer runs on (``build_meshes`` creates them first), the expert meshes, the context
groups (then ``build_meshes`` creates the relayout groups between layouts, which belong to no dimension). It
differs from :data:`DIMENSIONS` because the commits that added them did; changing it would change the groups'
creation order on every rank. A new dimension's groups go at its end. Each dimension keeps its groups in its own
store (``meshes.store(name)``) and exports the accessors that read it: :mod:`..mesh` names no dimension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from uniap_lightning.runtime.dimensions.base import LayerJob, Run, RuntimeDimension
from uniap_lightning.runtime.dimensions.context import CONTEXT
from uniap_lightning.runtime.dimensions.data import DATA
from uniap_lightning.runtime.dimensions.experts import EXPERTS
from uniap_lightning.runtime.dimensions.offload import OFFLOAD
from uniap_lightning.runtime.dimensions.precision import PRECISION
from uniap_lightning.runtime.dimensions.recompute import RECOMPUTE
from uniap_lightning.runtime.dimensions.state_offload import STATE_OFFLOAD
from uniap_lightning.runtime.dimensions.tensor import TENSOR

if TYPE_CHECKING:
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.runtime.mesh import PlanMeshes

#: THE runtime registry: the order a layer is converted, wrapped, finished and run in (see the module docstring)
DIMENSIONS: tuple[RuntimeDimension, ...] = (PRECISION, TENSOR, CONTEXT, EXPERTS, STATE_OFFLOAD, DATA, RECOMPUTE,
                                            OFFLOAD)

#: the order the dimensions create their process groups in (fixed by history; see the module docstring)
GROUP_ORDER: tuple[str, ...] = ("experts", "context")

_BY_NAME: dict[str, RuntimeDimension] = {d.name: d for d in DIMENSIONS}
if sorted(GROUP_ORDER) != sorted(d.name for d in DIMENSIONS if d.groups is not None):  # pragma: no cover
    raise AssertionError("runtime.dimensions.GROUP_ORDER must order exactly the dimensions that declare groups")


def by_name(name: str) -> RuntimeDimension:
    return _BY_NAME[name]


def create_groups(meshes: PlanMeshes) -> None:
    """Every dimension's meshes and groups for ``meshes.plan``, in :data:`GROUP_ORDER` (collective)."""
    for name in GROUP_ORDER:
        _BY_NAME[name].groups(meshes)  # type: ignore[misc]


def check_layer(layer: nn.Module, name: str, st: Strategy) -> None:
    """Refuse, in one line, a layer record the runtime cannot run (registry order: the first refusal is said)."""
    for d in DIMENSIONS:
        if d.check is not None:
            d.check(layer, name, st)


def convert(job: LayerJob) -> nn.Module:
    """The layer after every dimension's conversion (registry order); ``job.layer`` is set to it."""
    for d in DIMENSIONS:
        if d.convert is not None:
            job.layer = d.convert(job)
    return job.layer


def parallelize(job: LayerJob) -> None:
    """Every dimension's ``wrap`` of the layer, then every ``finish``, in registry order."""
    for d in DIMENSIONS:
        if d.wrap is not None:
            d.wrap(job)
    for d in DIMENSIONS:
        if d.finish is not None:
            d.finish(job)


def runner_of(st: Strategy) -> str | None:
    """The name of the dimension that runs a layer of record ``st`` in the stage's forward (the first in registry
    order that does), or ``None``: a plain call."""
    for d in DIMENSIONS:
        if d.runs is not None and d.runs(st):
            return d.name
    return None


def run_of(name: str) -> Run:
    return _BY_NAME[name].run  # type: ignore[return-value]


__all__ = ["DIMENSIONS", "GROUP_ORDER", "LayerJob", "Run", "RuntimeDimension", "by_name", "check_layer", "convert",
           "create_groups", "parallelize", "run_of", "runner_of"]
