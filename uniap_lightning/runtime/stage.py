"""Build this rank's pipeline stages from a plan (one module per stage of its device group): keep the local
layers, parallelize each, re-layout between them.

:func:`build_stages` (1) drops the layers of other device groups, (2) broadcasts the local layers' initial weights
from the group's first rank (ranks may have initialized differently), then (3) applies the plan's dimensions to
every local layer through the runtime registry (:mod:`uniap_lightning.runtime.dimensions`, whose docstring gives
the order and how it follows torchtitan's ``parallelize``): every layer's conversions first (float8), then, layer
by layer, every dimension's wrap (TP, CP, experts, data parallelism) and finish. :class:`StageModule` runs each
layer as the first dimension that runs it says (recomputation, activation offload), else plainly: nothing is
wrapped, so parameter names (and checkpoints) stay the user's. Neither names a dimension.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from uniap_lightning.planner.plan import Plan
from uniap_lightning.runtime import dimensions
from uniap_lightning.runtime.chain import Chain
from uniap_lightning.runtime.data_parallel import ReplicatedGrads
from uniap_lightning.runtime.dimensions import LayerJob
from uniap_lightning.runtime.experts import AllToAllCounter
from uniap_lightning.runtime.mesh import PlanMeshes, boundary_layout, layout_of
from uniap_lightning.runtime.payload import Spec, call_layer, flatten, spec_of, unflatten
from uniap_lightning.runtime.reshard import Layout, relayout
from uniap_lightning.runtime.zero import ZeroLayers


def _when_gradient_reaches(x: Any, action: Any) -> None:
    """Run ``action()`` once, when backward first reaches one of ``x``'s tensors (none needing a gradient: never;
    the copies then come back on demand)."""
    for t in flatten(x):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            def hook(grad: torch.Tensor) -> None:
                action()
            t.register_hook(hook)
            return


class StageModule(nn.Module):
    """The local layers of one stage, with activation re-layouts between layers of different layouts
    (``(dp, cp, tp)``, :mod:`.reshard`).

    Not attached to the LightningModule (its layers are, under their original names), so checkpoint keys and
    the optimizer's parameters stay those of the user's module.

    Pipeline stages exchange flat tuples of tensors, so the forward takes the tensors of its input payload
    (:mod:`.payload`) as positional arguments, rebuilds the payload from ``in_spec``, and returns the output's
    tensors: one tensor when the output is one (the original contract), else a flat tuple, whose structure is
    ``out_spec``.
    """

    def __init__(self, layers: list[nn.Module], layouts: list[Layout | int], meshes: PlanMeshes, *,
                 in_spec: Spec = None, out_spec: Spec = None, strategies: list[Any] | None = None,
                 zero: ZeroLayers | None = None, all_to_all: AllToAllCounter | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        n = meshes.n
        self.layouts = [(x, 1, n // x) if isinstance(x, int) else tuple(x) for x in layouts]
        self.meshes = meshes
        #: per layer, the dimension that runs it in forward (``"recompute"``, ``"offload"``) or ``None``: a plain
        #: call (:func:`~uniap_lightning.runtime.dimensions.runner_of` of the layer's plan record)
        self.runners: list[str | None] = ([dimensions.runner_of(st) for st in strategies] if strategies is not None
                                          else [None] * len(layers))
        self._side_stream: Any = None  # a CUDA stream beside the compute (offload's copies; made on first use)
        self.zero = zero if zero is not None else ZeroLayers()  # zero1/zero2 switches per micro-batch
        #: the expert layers' all-to-alls (bytes sent, per exchange), shared by the stages of this rank
        self.all_to_all = all_to_all if all_to_all is not None else AllToAllCounter()
        self.in_spec, self.out_spec = in_spec, out_spec
        # the last stage under a loss on sequence pieces (pipeline: sequence.piece_loss) keeps its last layout
        self.keep_layout = False

    def side_stream(self) -> Any:
        """A CUDA stream beside the compute stream, shared by the stage's layers (``None`` without CUDA)."""
        if self._side_stream is None and torch.cuda.is_available():
            self._side_stream = torch.cuda.Stream()
        return self._side_stream

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        edge = boundary_layout(self.meshes.plan)
        current = edge
        x = unflatten(tensors, self.in_spec)
        then = None  # what the previous layer's runner asked to do as backward reaches this layer's output
        for layer, layout, runner in zip(self.layers, self.layouts, self.runners):
            x = relayout(x, current, layout, self.meshes)
            current = layout
            if runner is not None and torch.is_grad_enabled():
                x, later = dimensions.run_of(runner)(self, layer, x)
            else:
                x, later = call_layer(layer, x), None
            if then is not None:
                _when_gradient_reaches(x, then)
            then = later
        if then is not None:  # the stage's last layer: as its own backward begins
            _when_gradient_reaches(x, then)
        if not self.keep_layout:
            x = relayout(x, current, edge, self.meshes)
        self.out_spec = spec_of(x)
        flat = tuple(t.contiguous() for t in flatten(x))  # sent as is (an expanded tensor is not contiguous)
        return flat[0] if self.out_spec is None else flat


def drop_other_stages(chain: Chain, plan: Plan, group: int) -> None:
    """Replace layers of other device groups with ``nn.Identity`` so their parameter names simply disappear here."""
    local = set(plan.layers_of_group(group))
    for u in range(len(chain.layers)):
        if u not in local:
            chain.replace(u, nn.Identity())


@torch.no_grad()
def broadcast_from_stage_leader(modules: list[nn.Module], meshes: PlanMeshes) -> None:
    if meshes.n == 1:
        return
    src = meshes.plan.ranks_of_group(meshes.group)[0]
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            dist.broadcast(t.data, src=src, group=meshes.stage_group)


def build_stages(chain: Chain, plan: Plan, meshes: PlanMeshes) -> tuple[list[StageModule], ReplicatedGrads]:
    """Apply the plan to this rank's layers, in place; return one stage module per pipeline stage of this rank's
    device group (in chain order) and the replicated-gradient book. The modules share that book and one
    :class:`ZeroLayers` (``modules[0].zero``), so gradient sync, ZeRO and the optimizer see every local layer once."""
    group = meshes.group
    drop_other_stages(chain, plan, group)
    indices = plan.layers_of_group(group)
    layers = [chain.layers[u] for u in indices]
    broadcast_from_stage_leader(layers, meshes)
    replicated = ReplicatedGrads(compression_options=dict(plan.compression_options))
    counter = AllToAllCounter()  # every expert layer of this rank records its all-to-alls there
    zero = ZeroLayers()
    originals = [dict(layer.named_parameters()) for layer in layers]
    jobs = [LayerJob(u, chain.names[u], layers[i], plan.layers[u].strategy, meshes, replicated, zero, counter)
            for i, u in enumerate(indices)]
    for i, job in enumerate(jobs):  # every layer's conversions before any parallelism (as model converters)
        if dimensions.convert(job) is not layers[i]:  # the layer itself was replaced (an nn.Linear)
            chain.replace(job.u, job.layer)
            layers[i] = job.layer
    for job in jobs:
        dimensions.parallelize(job)
    repoint_aliases(chain.module, originals, layers)
    modules = []
    for k in plan.stages_of_group(group):
        us = plan.layers_of_stage(k)
        specs = {"in_spec": chain.spec_before(us[0]), "out_spec": chain.spec_after(us[-1])} if us else {}
        modules.append(StageModule([chain.layers[u] for u in us], [layout_of(plan, u) for u in us], meshes,
                                   **specs, strategies=[plan.layers[u].strategy for u in us], zero=zero,
                                   all_to_all=counter))
    return modules, replicated


def repoint_aliases(root: nn.Module, originals: list[dict[str, nn.Parameter]], layers: list[nn.Module]) -> None:
    """Give modules of ``root`` outside the layers that held a layer's parameter (a tie inside one layer: T5's
    ``encoder.embed_tokens`` and ``decoder.embed_tokens`` are its ``shared`` embedding, which the embedding layer
    holds) the parameter that tensor parallelism or FSDP2 registered in its place (a DTensor). Otherwise they keep
    the original parameter, which no longer trains: the state dict, the checkpoints and the consolidated export
    would carry its initial values under those names."""
    moved: dict[int, nn.Parameter] = {}
    for before, layer in zip(originals, layers, strict=True):
        after = dict(layer.named_parameters())
        for name, p in before.items():
            if name in after and after[name] is not p:
                moved[id(p)] = after[name]
    if not moved:
        return
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in moved:
                module._parameters[name] = moved[id(p)]
