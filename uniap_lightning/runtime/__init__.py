"""Execute a :class:`~uniap_lightning.planner.plan.Plan` on real processes.

One concern per module, applied in this order by :func:`apply_plan`:

1. :mod:`.groups` - every device mesh and process group of the plan (collective, same order on every rank; each
   dimension's by its module of :mod:`.dimensions`), held by :class:`.mesh.PlanMeshes`;
2. :mod:`.stage` - keep this rank's layers, broadcast their initial weights, then apply each dimension's runtime
   module (:mod:`.dimensions`, one ordered registry: float8 conversion, TP, CP, experts, data parallelism;
   recomputation and offload at the call) to every layer;
3. :mod:`.reshard` - activation re-layout between layers with different layouts ``(dp, cp, tp)`` (batch and
   sequence splits; context and sequence parallelism in :mod:`.sequence`, :mod:`.sequence_tp`);
4. :mod:`.pipeline` - micro-batches through ``torch.distributed.pipelining`` schedules over the pipeline lanes.

:mod:`.step` runs one training batch under Lightning's closure (with :mod:`.grads`: gradients kept apart and handed
back, clipping by the global norm); :mod:`.checkpoint` saves and reshards-on-load; :mod:`.chain` is the model
contract and :mod:`.planning` caches and solves plans for :mod:`uniap_lightning.setup`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.schedule_rules import unsupported
from uniap_lightning.runtime.chain import Chain, UniAPModule, extract_chain
from uniap_lightning.runtime.data_parallel import ReplicatedGrads
from uniap_lightning.runtime.dimensions import check_layer
from uniap_lightning.runtime.experts import AllToAllCounter
from uniap_lightning.runtime.groups import build_meshes
from uniap_lightning.runtime.mesh import PlanMeshes
from uniap_lightning.runtime.pipeline import PipelineRunner, check_schedule_runs
from uniap_lightning.runtime.stage import StageModule, build_stages
from uniap_lightning.runtime.zero import ZeroLayers
from uniap_lightning.runtime.ties import TiedGrads


@dataclass
class Runtime:
    """A plan applied on this rank."""

    plan: Plan
    chain: Chain
    meshes: PlanMeshes
    stage_modules: list[StageModule]  # one per pipeline stage of this rank's device group, in chain order
    replicated: ReplicatedGrads
    runner: PipelineRunner
    ties: TiedGrads | None = None  # tied weights kept as equal copies (an adapter's chain, see .ties)

    _params: list[nn.Parameter] | None = field(default=None, init=False, repr=False)

    def local_parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters (the set is fixed once the plan is applied; ``requires_grad`` is read
        each time, since callbacks may freeze or unfreeze layers during training)."""
        if self._params is None:
            self._params = [p for m in self.stage_modules for p in m.parameters()]
        return [p for p in self._params if p.requires_grad]

    @property
    def all_to_all(self) -> AllToAllCounter:
        """The all-to-alls of this rank's expert-parallel layers (:mod:`.experts`), in the order they ran."""
        return self.stage_modules[0].all_to_all

    @property
    def zero(self) -> ZeroLayers:
        """The ZeRO book of every local layer (the stage modules share it)."""
        return self.stage_modules[0].zero


def check_plan_executable(plan: Plan, chain: Chain) -> None:
    """Checks that need only the plan and the chain (so every rank fails alike, before any collective)."""
    check_schedule_runs(plan)
    for u, lp in enumerate(plan.layers):
        check_layer(chain.layers[u], chain.names[u], lp.strategy)  # each dimension's refusals, registry order
        reason = unsupported(plan.schedule, lp.strategy)
        if reason is not None:
            raise UniAPError(f"plan layer {chain.names[u]!r}: {reason}")


def apply_plan(chain: Chain, plan: Plan, *, rank: int, device: torch.device) -> Runtime:
    """Parallelize ``chain.module`` in place according to ``plan`` (collective over the world)."""
    check_plan_executable(plan, chain)
    meshes = build_meshes(plan, rank=rank, device_type=device.type)
    stage_modules, replicated = build_stages(chain, plan, meshes)
    ties = None
    if chain.ties:
        ties = TiedGrads(chain.ties, chain.layers, plan, meshes)
        ties.sync_values()
    runner = PipelineRunner(plan, meshes, stage_modules, device)
    return Runtime(plan, chain, meshes, stage_modules, replicated, runner, ties)


__all__ = ["Chain", "Runtime", "UniAPModule", "apply_plan", "extract_chain"]
