"""What one runtime dimension declares (:class:`RuntimeDimension`) and what its hooks are given (:class:`LayerJob`).

A runtime dimension is the torch half of a planner dimension (:mod:`uniap_lightning.planner.dimensions`): the
process groups it needs for a plan, how it changes a layer when the plan is applied, and how it runs a layer in the
stage's forward. Every hook is optional; :mod:`.` (the registry) calls them in its orders, so
:func:`~uniap_lightning.runtime.groups.build_meshes` and :func:`~uniap_lightning.runtime.stage.build_stages` loop
over it and name no dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.runtime.data_parallel import ReplicatedGrads
    from uniap_lightning.runtime.experts import AllToAllCounter
    from uniap_lightning.runtime.mesh import PlanMeshes
    from uniap_lightning.runtime.zero import ZeroLayers


@dataclass
class LayerJob:
    """One local layer while the plan is applied to it, as every dimension's hook sees it: its chain index ``u``,
    its name, the module (a conversion may replace it: :attr:`RuntimeDimension.convert`), its plan record, this
    rank's meshes and the books the layers share (replicated gradients, ZeRO, the all-to-all counter).
    ``held_apart``: parameters a dimension reduces on its own (expert shards), which the layer's data parallelism
    must leave out."""

    u: int
    name: str
    layer: nn.Module
    st: Strategy
    meshes: PlanMeshes
    replicated: ReplicatedGrads
    zero: ZeroLayers
    counter: AllToAllCounter
    held_apart: set[nn.Parameter] = field(default_factory=set)

    @property
    def where(self) -> str:
        return f"plan layer {self.u} ({self.name})"


#: how a dimension runs a layer in the stage's forward (with gradients on): ``run(stage, layer, x)`` returns the
#: output and an action to run once backward reaches the *next* layer's output (or ``None``)
Run = Callable[[Any, nn.Module, Any], tuple[Any, Callable[[], None] | None]]


@dataclass(frozen=True)
class RuntimeDimension:
    """One dimension's runtime: its ``name`` (the planner dimension's), and its hooks, each optional.

    - ``groups(meshes)``: create the meshes and process groups the plan's layers need (collective over the world:
      every rank calls it with the same plan, in :data:`~.GROUP_ORDER`), kept in ``meshes.store(name)`` (the
      dimension's own dict on :class:`PlanMeshes`, which names no dimension) and read through accessors the
      dimension's module exports (``context.cp_group(meshes, dp, cp, tp)``); the base layout (world, lane and
      stage groups, ``(replicas, tp)`` grids) is :class:`PlanMeshes`' own;
    - ``check(layer, name, st)``: refuse, in one line, a plan the layer cannot run (before any collective);
    - ``convert(job)``: replace modules of the layer before any parallelism (a model converter, as torchtitan's
      float8 converter runs before ``parallelize``); returns the module to use;
    - ``wrap(job)``: parallelize the layer (in registry order, every dimension's ``wrap`` for one layer before the
      next layer's);
    - ``finish(job)``: after every dimension's ``wrap`` of the layer (what needs the others' wrapping done);
    - ``runs(st)`` / ``run``: whether the dimension runs a layer of record ``st`` in the stage's forward, and how
      (:data:`Run`); the first dimension in registry order that runs a layer is the one that does.
    """

    name: str
    groups: Callable[[PlanMeshes], None] | None = None
    check: Callable[[nn.Module, str, Strategy], None] | None = None
    convert: Callable[[LayerJob], nn.Module] | None = None
    wrap: Callable[[LayerJob], None] | None = None
    finish: Callable[[LayerJob], None] | None = None
    runs: Callable[[Strategy], bool] | None = None
    run: Run | None = None
