"""The experts dimension's runtime (``ep``): a mixture-of-experts layer's experts split over ``ep`` of its ``dp x cp``
replicas (the expert parallelism itself is :mod:`uniap_lightning.runtime.experts`).

Groups: per ``(replicas, tp, ep)`` with ``ep > 1`` (sorted), a ``(pp, edp, ep, tp)`` world mesh (the replicas in
``replicas / ep`` blocks of ``ep`` consecutive ranks: ``ep`` splits the experts, ``edp`` holds the same ones) and
the same ranks as a ``(pp, ep, edp, tp)`` mesh (an expert's place in the full ``[E, ...]`` tensor: checkpoints),
kept in the meshes' ``experts`` store and read through :func:`ep_mesh`, :func:`expert_data_group`,
:func:`expert_data_mesh` and :func:`expert_layout`. Created after the base grids, before the context groups.

Wrap (layers with replicas only; after CP, before the data dimension): modules pooling statistics over the
micro-batch get the replica group (:func:`apply_batch_group`); with ``ep > 1`` the layer keeps its ``E / ep``
experts and routes over its ep mesh, and its expert shards get their own reduction (:func:`reduce_experts`), held
apart from the layer's data parallelism (:attr:`LayerJob.held_apart`); without, routing still counts every
replica's tokens (:func:`apply_global_routing`). Finish (after the data dimension made the layer an FSDP2 unit):
:func:`finish_expert_zero`, and the shards marked with their layout for checkpoints. torchtitan's MoE models
likewise split experts before FSDP, which shards the experts over their own (``edp``) mesh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from uniap_lightning.runtime.dimensions.base import LayerJob, RuntimeDimension
from uniap_lightning.runtime.experts import (apply_batch_group, apply_expert_parallel, apply_global_routing,
                                             check_expert_plan, expert_modules, mark_expert_shards,
                                             split_expert_params)
from uniap_lightning.runtime.zero import ZERO_MODES

if TYPE_CHECKING:
    import torch.distributed as dist

    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.runtime.data_parallel import ReplicatedGrads
    from uniap_lightning.runtime.experts import AllToAllCounter
    from uniap_lightning.runtime.mesh import PlanMeshes
    from uniap_lightning.runtime.zero import ZeroLayers


NAME = "experts"


class ExpertMeshes(NamedTuple):
    """The meshes of one ``(replicas, tp, ep)``, as the ``experts`` store holds them."""

    grid: DeviceMesh  #: ``(pp, edp, ep, tp)``
    #: the same ranks with ``ep`` before ``edp``: an expert's place in the full ``[E, ...]`` tensor is its ep block,
    #: then its ZeRO shard inside the block (checkpoints, :mod:`uniap_lightning.runtime.experts`)
    layout: DeviceMesh  #: ``(pp, ep, edp, tp)``


def groups(meshes: PlanMeshes) -> None:
    plan, device_type, store = meshes.plan, meshes.device_type, meshes.store(NAME)
    world = plan.pp * plan.devices_per_stage
    for reps, tp, ep in sorted({(lp.strategy.replicas, lp.strategy.tp, lp.strategy.ep) for lp in plan.layers}):
        if ep > 1:  # the replicas dimension split into (replicas / ep) blocks of ep consecutive ranks
            grid = init_device_mesh(device_type, (plan.pp, reps // ep, ep, tp),
                                    mesh_dim_names=("pp", "edp", "ep", "tp"))
            ranks = torch.arange(world).reshape(plan.pp, reps // ep, ep, tp).permute(0, 2, 1, 3)
            layout = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "ep", "edp", "tp"))
            store[(reps, tp, ep)] = ExpertMeshes(grid, layout)


def ep_mesh(meshes: PlanMeshes, replicas: int, tp: int, ep: int) -> DeviceMesh:
    """The ``ep`` replicas that split a layer's experts with this rank (a consecutive block of the ``replicas``
    with this rank's tensor-parallel index, as ``Strategy.ep`` plans it; its rank order is the experts')."""
    return meshes.store(NAME)[(replicas, tp, ep)].grid["ep"]


def expert_data_group(meshes: PlanMeshes, replicas: int, tp: int, ep: int) -> dist.ProcessGroup:
    """The ``replicas / ep`` ranks that hold this rank's experts (same position in every ep block): expert
    gradients are summed over them only."""
    return meshes.store(NAME)[(replicas, tp, ep)].grid.get_group("edp")


def expert_data_mesh(meshes: PlanMeshes, replicas: int, tp: int, ep: int) -> DeviceMesh:
    """The ranks holding this rank's experts, as a mesh (ZeRO over them shards the expert shards further)."""
    return meshes.store(NAME)[(replicas, tp, ep)].grid["edp"]


def expert_layout(meshes: PlanMeshes, replicas: int, tp: int, ep: int) -> DeviceMesh:
    """The ``(ep, edp)`` mesh of this rank's experts: dim 0 splits the experts, dim 1 holds the same ones."""
    return meshes.store(NAME)[(replicas, tp, ep)].layout["ep", "edp"]


def check(layer: nn.Module, name: str, st: Strategy) -> None:
    if st.ep > 1:
        check_expert_plan(layer, f"plan layer {name!r}", st.ep)


def wrap(job: LayerJob) -> None:
    st, layer, meshes = job.st, job.layer, job.meshes
    reps = st.replicas
    if reps == 1:
        return
    group = meshes.dp_mesh(reps, st.tp).get_group()
    apply_batch_group(layer, group)
    if st.ep > 1:
        apply_ep(layer, meshes, reps, st.tp, st.ep, job.counter)
        job.held_apart |= reduce_experts(layer, st, meshes, job.replicated, job.zero)
    else:  # experts replicated: still route by the global batch's counts, as one process does
        apply_global_routing(layer, group)


def finish(job: LayerJob) -> None:
    st = job.st
    if st.replicas == 1 or st.ep == 1:
        return
    finish_expert_zero(job.layer, st, job.meshes.dp_mesh(st.replicas, st.tp).get_group(), job.replicated)
    mark_expert_shards(job.layer, expert_layout(job.meshes, st.replicas, st.tp, st.ep))  # (ZeRO replaced them)


def apply_ep(layer: nn.Module, meshes: PlanMeshes, replicas: int, tp: int, ep: int, counter: AllToAllCounter) -> None:
    """Keep this rank's ``E / ep`` experts of every MoE layer of ``layer``, route tokens over its ep mesh; capacity
    and load-balancing statistics count every replica's tokens (the layer's data group), as one process does."""
    apply_expert_parallel(layer, ep_group=ep_mesh(meshes, replicas, tp, ep).get_group(),
                          token_group=meshes.dp_mesh(replicas, tp).get_group(), counter=counter)


def reduce_experts(layer: nn.Module, st: Any, meshes: PlanMeshes, replicated: ReplicatedGrads,
                   zero: ZeroLayers) -> set[nn.Parameter]:
    """How the expert shards of an ``ep > 1`` layer hold state and reduce gradients over the ``replicas / ep`` ranks
    holding the same experts (as the planner prices them): each shard's gradient already sums its ep group's tokens
    (the backward all-to-alls), so it is summed over those ranks only and divided by all ``replicas``. ``ep =
    replicas``: one rank, nothing to sum. ``replicate``: a bucket over them. ZeRO modes: each MoE module becomes an
    FSDP2 unit of its own over them, ignoring the rest of the module (the router: the layer's unit, built after,
    leaves a nested unit's subtree alone, so it stays whole, see :func:`finish_expert_zero`). Returns the shards the
    layer's own data parallelism must leave out."""
    reps, tp, ep = st.replicas, st.tp, st.ep
    shards = split_expert_params(layer)[0]
    if reps == ep:
        replicated.add_divided(shards, reps)
        return set(shards)
    if st.dp_mode not in ZERO_MODES:
        replicated.add_params(shards, expert_data_group(meshes, reps, tp, ep), reps)
        return set(shards)
    edp = expert_data_mesh(meshes, reps, tp, ep)
    for _, m in expert_modules(layer):
        mine = {id(getattr(m, p)) for p in m.uniap_expert_params}
        rest = {p for p in m.parameters() if id(p) not in mine}
        zero.add(m, st.dp_mode, edp, replicated, edp.get_group(), reps, ignored=rest)  # (zero1: buckets / reps)
    return set()


def finish_expert_zero(layer: nn.Module, st: Any, group: Any, replicated: ReplicatedGrads) -> None:
    """After the layer's own data parallelism, for MoE modules that are FSDP2 units of their own (ZeRO, see
    :func:`reduce_experts`): zero2/zero3 reduce-scatters average over the ``replicas / ep`` ranks holding the same
    experts, so the window's gradient is divided by ``ep`` more (FSDP2's own divide factor needs a premultiplied
    sum, which gloo lacks). Parameters the unit ignores, which the layer's unit does not take either (FSDP2 leaves
    a nested unit's subtree alone: the router, ``E x h``), stay whole on every replica and are averaged."""
    for _, m in expert_modules(layer):
        if not hasattr(m, "_get_fsdp_state"):
            continue
        experts = set(m.uniap_expert_params)
        orphans = [p for name, p in m.named_parameters() if name.split(".")[0] not in experts
                   and not isinstance(p, DTensor)]
        replicated.add_params(orphans, group, st.replicas)
        if st.dp_mode in ("zero2", "zero3"):
            replicated.add_divided([getattr(m, name) for name in m.uniap_expert_params], st.ep)


EXPERTS = RuntimeDimension(NAME, groups=groups, check=check, wrap=wrap, finish=finish)
