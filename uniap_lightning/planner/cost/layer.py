"""Strategies and the per-layer cost terms of each (the formulas); :mod:`.tables` assembles them per candidate.

All functions here return seconds and bytes. One (pp, c) candidate fixes the stage size ``n = N / pp`` and the
micro-batch size ``b = B / c``; everything else is a function of the layer, its strategy and its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.cost.comm import all_gather_s, all_reduce_s, reduce_scatter_s
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.profile import LayerProfile


class Strategy(NamedTuple):
    """Intra-layer strategy: ``d`` data-parallel copies (replicated or sharded) x ``t`` tensor-parallel ranks."""

    d: int
    t: int
    shard: bool

    def label(self) -> str:
        parts = []
        if self.d > 1:
            parts.append(f"{'fsdp' if self.shard else 'dp'}{self.d}")
        if self.t > 1:
            parts.append(f"tp{self.t}")
        return "x".join(parts) or "single"


@dataclass(frozen=True)
class LayerCost:
    """Costs of one layer under one strategy, for one micro-batch size."""

    time_s: float  # per micro-batch: compute + TP + FSDP communication
    compute_s: float
    comm_s: float
    sync_s: float  # per iteration: DP gradient all-reduce, then the optimizer step on this rank's parameters
    static_bytes: float  # weights + grads + optimizer state (+ a replicated layer's gradient bucket) on one device
    activation_bytes: float  # per micro-batch in flight, on one device
    transient_bytes: float  # extra bytes while an FSDP layer's weights are gathered


def strategies_for(layer: LayerProfile, n: int, cluster: Cluster, micro_batch: int) -> list[Strategy]:
    """Strategies ``(d, t, shard)`` with ``d * t = n`` that the layer allows on a stage of ``n`` devices.

    ``t`` must be a degree the layer supports and stay inside a node (aligned), and ``d`` must divide the
    micro-batch. ``shard`` only matters when ``d > 1``.
    """
    dpn = cluster.devices_per_node
    out = []
    for t in layer.tp_degrees:
        if n % t or t > dpn or dpn % t:
            continue
        d = n // t
        if micro_batch % d:
            continue
        out.append(Strategy(d, t, False))
        if d > 1:
            out.append(Strategy(d, t, True))
    return out


def dp_group_inter_node(cluster: Cluster, n: int) -> bool:
    """A data-parallel group spans the whole stage (stride t), so it crosses nodes iff the stage does."""
    return n > cluster.devices_per_node


def layer_cost(
    layer: LayerProfile, s: Strategy, micro_batch: int, n: int, cluster: Cluster, training: TrainingConfig
) -> LayerCost:
    return _layer_cost(layer, s, micro_batch, n, cluster, training)


@lru_cache(maxsize=200_000)
def _layer_cost(
    layer: LayerProfile, s: Strategy, micro_batch: int, n: int, cluster: Cluster, training: TrainingConfig
) -> LayerCost:
    d, t, shard = s
    samples = micro_batch / d
    compute = layer.compute_s(samples) / t
    comm = 0.0
    if t > 1:
        # measured (profile ``overheads``): all-reduces + unsplit compute + dispatch; else the ring formula
        measured = layer.overhead_s("tp", t, samples)
        if measured is not None:
            comm += max(measured, -0.5 * compute)
        elif layer.tp_allreduces:
            comm += 2 * layer.tp_allreduces * all_reduce_s(cluster, layer.output_bytes * samples, t, False)
    inter = dp_group_inter_node(cluster, n)
    local_params = layer.params / t
    sync = bucket = 0.0
    if d > 1 and shard:
        # measured inside a node for FSDP alone; FSDP x TP and groups across nodes use the formulas
        measured = layer.overhead_s("fsdp", d, samples) if t == 1 and not inter else None
        if measured is not None:
            comm += max(measured, 0.0)
        else:
            comm += 2 * all_gather_s(cluster, local_params * training.weight_bytes, d, inter)
            comm += reduce_scatter_s(cluster, local_params * training.grad_bytes, d, inter)
    elif d > 1:
        # measured inside a node for replication alone (the all-reduce beside the step's last backward, waited
        # for: on CPU ranks sharing cores it also slows that backward); else the ring formula
        measured = layer.overhead_s("dp", d, samples) if t == 1 and not inter else None
        if measured is not None:
            sync = max(measured, 0.0)
        else:
            sync = all_reduce_s(cluster, local_params * training.grad_bytes, d, inter)
        # the runtime's persistent all-reduce buckets hold one more copy of a replicated layer's gradients
        # (runtime.data_parallel.ReplicatedGrads)
        bucket = local_params * training.grad_bytes
    # the optimizer updates the parameters this rank holds, once per iteration, after the gradient sync
    sync += cluster.optimizer_s_per_param * local_params / (d if shard else 1)
    sync += cluster.optimizer_s_per_tensor * layer.param_tensors
    static = local_params * training.bytes_per_param / (d if shard else 1) + bucket
    transient = local_params * training.weight_bytes * (1 - 1 / d) if shard and d > 1 else 0.0
    f = layer.activation_tp_fraction
    act = layer.activation_bytes * samples * ((1 - f) + f / t)
    return LayerCost(compute + comm, compute, comm, sync, static, act, transient)


def reshard_s(cluster: Cluster, out_bytes: float, micro_batch: int, d_from: int, d_to: int) -> float:
    """Moving an activation (and, in backward, its gradient) from batch split ``d_from`` to ``d_to``.

    Going to fewer slices all-gathers in forward; going to more slices is a local slice in forward and an
    all-gather of the gradient in backward. Either way: one all-gather of ``out_bytes * b / min(d)`` over
    ``max(d) / min(d)`` ranks, which sit inside one tensor-parallel block and so inside a node.
    """
    if d_from == d_to:
        return 0.0
    lo, hi = min(d_from, d_to), max(d_from, d_to)
    return all_gather_s(cluster, out_bytes * micro_batch / lo, hi // lo, False)


def boundary_inter_node(cluster: Cluster, n: int, stage: int) -> bool:
    """Whether the point-to-point links between stage ``stage`` and ``stage + 1`` cross a node boundary."""
    dpn = cluster.devices_per_node
    if n >= dpn:
        return True
    return ((stage + 1) * n) % dpn == 0


def in_flight(schedule: str, c: int, pp: int, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak. torch's 1F1B needs at least ``pp``
    micro-batches; with fewer, the runtime runs GPipe, so that is what memory is costed as."""
    return c if schedule == "gpipe" or c < pp else min(c, pp - stage)
