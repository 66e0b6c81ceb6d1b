"""Strategies and the per-layer cost terms of each (the formulas); :mod:`.tables` assembles them per candidate.

All functions here return seconds and bytes. One (pp, c) candidate fixes the stage size ``n = N / pp`` and the
micro-batch size ``b = B / c``; everything else is a function of the layer, its strategy and its neighbours.

With ``P`` the layer's parameters on one rank (``params / t``), ``d`` data-parallel copies and ``w, g, o`` bytes
per parameter of weights, gradients and optimizer state:

=========  ===========================================  ===========================================================
dp_mode    memory held (``static_bytes``)               communication
=========  ===========================================  ===========================================================
replicate  ``P (w + g + o) + P g`` (all-reduce bucket)  gradient all-reduce once per step (``sync_s``)
zero1      ``P (w + g) + P o / d``                      gradient all-reduce + all-gather of ``P w``, once per step
zero2      ``P w + P (g + o) / d`` (+ ``P g`` when the  reduce-scatter of ``P g`` + all-gather of ``P w``, once per
           step accumulates, c > 1)                     step
zero3      ``P (w + g + o) / d``, + ``P w (1 - 1/d)``   two all-gathers of ``P w`` and a reduce-scatter of ``P g``
           while gathered (``transient_bytes``)          per micro-batch (``time_s``)
=========  ===========================================  ===========================================================

Recomputation: the layer keeps its input (``input_bytes`` per sample, whole on every TP rank) instead of its
activations, its activations live again while it recomputes (``transient_bytes``: a stage holds the largest
transient), and ``time_s`` gains one forward (compute and forward TP all-reduces). Every layer's transient
also holds NCCL's buffers for the communicators its strategy uses (:mod:`.buffers`) and what its backward adds at
its peak (the profile's ``backward_peak_bytes``: gradients in and out, temporaries), split by tensor parallelism
like its activations. Compression (replicate / zero1) replaces the
gradient all-reduce: bf16 halves its bytes; PowerSGD rank ``r`` all-reduces ``4 r (n + k)`` bytes per ``n x k``
matrix in two rounds and the vectors uncompressed; top-k all-gathers ``8 k`` bytes per rank (``k =
ratio * P``, at least one per tensor). Each adds the cluster's compression compute per element and, for PowerSGD
and top-k, an fp32 error-feedback buffer (``4 P`` bytes; PowerSGD also its factors) to ``static_bytes``.

A dimension's own terms are its cost hooks (``price_compute``, ``price_state``, ``price_activations`` of its
:class:`~uniap_lightning.planner.dimensions.base.Dimension`, documented in its module), which
:func:`_layer_cost` calls for every dimension of the registry at three points: after the layer's compute on a
rank (before the backward split and recomputation read it), after the replicas' state (before the experts' own
state joins), and after the activations and recomputation (before NCCL's buffers join the transient). It names
no dimension there.

Expert parallelism (a mixture-of-experts layer with ``E`` experts, ``top_k`` = k, ``expert_params``, under
``ep > 1``; ``P_e = expert_params / t``, ``X = output_bytes x tokens x k x cf / t``, ``cf`` the capacity factor or
1 when dropless):

===================  ===========================================================================================
term                 with ``ep`` (``ep = 1``: the rows above with ``P``)
===================  ===========================================================================================
memory, time, sync   the table above twice: ``P - P_e`` held alike by the ``d`` replicas, and ``P_e / ep`` held
                     alike by the ``d / ep`` ranks at the same place of every ep group (``replicate`` when
                     ``d = ep``): ZeRO modes shard each part over its own group, gradients are reduced over it
all-to-all           ``4 x all_to_all_s(X, ep)`` per micro-batch (dispatch and combine, forward and backward;
                     ``(ep - 1) / ep`` of ``X`` leaves each rank), over the node links when ``ep t`` exceeds a
                     node; recomputation runs the forward pair again
compute              unchanged (balanced routing: each rank runs ``tokens x k`` expert rows, as without ``ep``)
===================  ===========================================================================================

Measured overheads (timed with whole experts) are not used under ``ep > 1``; compression is not combined with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.cost.buffers import communicator_bytes
from uniap_lightning.planner.cost.comm import all_gather_s, all_reduce_s, reduce_scatter_s
from uniap_lightning.planner.cost.movement import (  # noqa: F401 (named here too, where callers have found them)
    boundary_inter_node,
    context_parallel_s,
    expert_parallel_s,
    reshard_s,
    ring_attention_s,
)
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.dimensions import LayerTerms, Slot, candidates, price
# named here too, where callers have always found them: each lives with its dimension now
from uniap_lightning.planner.dimensions.context import cp_methods  # noqa: F401
from uniap_lightning.planner.dimensions.experts import expert_degrees  # noqa: F401
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.profile import LayerProfile


@dataclass(frozen=True)
class LayerCost:
    """Costs of one layer under one strategy, for one micro-batch size."""

    time_s: float  # per micro-batch: compute (+ recomputed forward) + TP + ZeRO-3 communication
    compute_s: float
    comm_s: float
    sync_s: float  # per iteration: gradient sync (compressed or not), ZeRO gathers, then the optimizer step
    static_bytes: float  # weights + grads + optimizer state per dp_mode (+ buckets, error feedback) on one device
    activation_bytes: float  # per micro-batch in flight, on one device (a recomputed layer: its input only)
    transient_bytes: float  # extra bytes while the layer runs: gathered ZeRO-3 weights + recomputed activations
    weight_grad_s: float = 0.0  # per micro-batch: the weight-gradient part of a split backward (zero-bubble's W)
    split_extra_s: float = 0.0  # per micro-batch: what splitting the backward adds (zero-bubble schedules pay it)


@dataclass(frozen=True)
class Pricing:
    """What a candidate fixes beyond the layer and strategy: micro-batch size, stage size, whether gradients
    accumulate over several micro-batches (ZeRO-2 then holds a full gradient), and the compressors' parameters."""

    micro_batch: int
    n: int
    accumulate: bool = False
    powersgd_rank: int = 1
    topk_ratio: float = 0.01
    dgc: bool = False  # top-k with DGC's momentum correction (compression_options.dgc_momentum > 0)


class CostCache:
    """What :func:`strategies_for` and :func:`layer_cost` computed, within one :func:`cost_cache` scope (one solve):
    identical blocks of a model, the candidates that share a micro-batch size and stage size, the baselines'
    restricted searches and the uniform plans all reuse the same entries. Keys are the functions' arguments (the
    frozen profiles, strategies and pricing by value, the cluster by identity), so an entry is exactly what the
    call would compute. Each map holds at most ``max_entries`` (then it starts over): bounded even within a solve."""

    __slots__ = ("strategies", "layer_costs", "max_entries")

    def __init__(self, max_entries: int = 400_000) -> None:
        self.strategies: dict[tuple, tuple[Strategy, ...]] = {}
        self.layer_costs: dict[tuple, LayerCost] = {}
        self.max_entries = max_entries

    def __len__(self) -> int:
        return len(self.strategies) + len(self.layer_costs)

    def clear(self) -> None:
        self.strategies.clear()
        self.layer_costs.clear()


#: the cache of the scope this thread (or task) is in; None outside every scope (then nothing is cached)
_SCOPE: ContextVar[CostCache | None] = ContextVar("uniap_cost_cache", default=None)


@contextmanager
def cost_cache() -> Iterator[CostCache]:
    """A scope in which :func:`strategies_for` and :func:`layer_cost` reuse what they computed: ``solve``,
    ``search``, the baselines, the uniform plans and ``evaluate`` open one (also as a decorator). Nested, it is the
    scope already open; the outermost clears it on exit, so nothing outlives the solve (a process that re-plans,
    or a test session, does not accumulate entries). Per thread: the context variable does not cross into threads
    (the search's solver threads only hand finished tables to worker processes, which never price a layer)."""
    cache = _SCOPE.get()
    if cache is not None:
        yield cache
        return
    cache = CostCache()
    token = _SCOPE.set(cache)
    try:
        yield cache
    finally:
        _SCOPE.reset(token)
        cache.clear()


def current_cost_cache() -> CostCache | None:
    """The cache of the :func:`cost_cache` scope open here, or None."""
    return _SCOPE.get()


def strategies_for(
    layer: LayerProfile, n: int, cluster: Cluster, micro_batch: int, *, compression: tuple[str, ...] = ("none",),
    sequence: bool = True, **opt_ins: tuple[str, ...],
) -> list[Strategy]:
    """Strategies with ``d * c * t = n`` that the layer allows on a stage of ``n`` devices (see
    :func:`_strategies`); ``sequence=False`` leaves out context and sequence parallelism; ``opt_ins``: what the user
    allowed each opt-in dimension, by its option (:data:`~uniap_lightning.planner.dimensions.OPT_INS`; absent or
    empty: off). Cached within a :func:`cost_cache` scope."""
    compression = tuple(compression)
    allowed = tuple(sorted((k, tuple(v)) for k, v in opt_ins.items() if v))
    cache = _SCOPE.get()
    if cache is None:
        return list(_strategies(layer, n, cluster, micro_batch, compression, sequence, allowed))
    key = (layer, n, cluster, micro_batch, compression, sequence, allowed)
    out = cache.strategies.get(key)
    if out is None:
        out = _strategies(layer, n, cluster, micro_batch, compression, sequence, allowed)
        if len(cache.strategies) >= cache.max_entries:
            cache.strategies.clear()
        cache.strategies[key] = out
    return list(out)


def _strategies(layer: LayerProfile, n: int, cluster: Cluster, micro_batch: int, compression: tuple[str, ...],
                sequence: bool = True,
                opt_ins: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> tuple[Strategy, ...]:
    """Strategies with ``d * c * t = n`` that the layer allows on a stage of ``n`` devices: each field's options
    in :mod:`uniap_lightning.planner.dimensions`, chosen in the registry's ``CHOICES`` order (outer first).

    ``t`` must be a degree the layer supports and stay inside a node (aligned), and ``d`` must divide the
    micro-batch. ``c`` (context parallelism) needs the layer's ``sequence_length`` and a method
    (:func:`cp_methods`); sequence parallelism (``sp``) a layer with a sequence-parallel TP plan, ``t > 1`` and a
    sequence ``c t`` divides. With ``d * c > 1`` every ``dp_mode``; compression (methods in ``compression``
    besides "none") only for replicate / zero1; recomputation on or off everywhere. A mixture-of-experts layer
    also takes every expert-parallel degree ``ep`` of :func:`expert_degrees` over its ``d x c`` replicas
    (uncompressed gradients only). Then each dimension's own options, opt-in ones among what ``opt_ins`` allowed.
    """
    slot = Slot(layer, n, cluster, micro_batch, compression, sequence, opt_ins)
    return tuple(Strategy._make(v) for v in candidates(slot))


def dp_group_inter_node(cluster: Cluster, n: int) -> bool:
    """A data-parallel group spans the whole stage (stride t), so it crosses nodes iff the stage does."""
    return n > cluster.devices_per_node


def layer_cost(
    layer: LayerProfile, s: Strategy, micro_batch: int | Pricing, n: int | None = None,
    cluster: Cluster | None = None, training: TrainingConfig | None = None, *, input_bytes: float = 0.0,
) -> LayerCost:
    """Layer terms under ``s``. ``micro_batch`` is a :class:`Pricing` or (older shape) the micro-batch size with
    ``n`` given; ``input_bytes`` is the per-sample size of the layer's input (the previous layer's output), what a
    recomputed layer keeps for backward. Cached within a :func:`cost_cache` scope."""
    pricing = micro_batch if isinstance(micro_batch, Pricing) else Pricing(micro_batch, n)
    s = Strategy(*s)
    cache = _SCOPE.get()
    if cache is None:
        return _layer_cost(layer, s, pricing, cluster, training, input_bytes)
    key = (layer, s, pricing, cluster, training, input_bytes)
    out = cache.layer_costs.get(key)
    if out is None:
        out = _layer_cost(layer, s, pricing, cluster, training, input_bytes)
        if len(cache.layer_costs) >= cache.max_entries:
            cache.layer_costs.clear()
        cache.layer_costs[key] = out
    return out


def _layer_cost(
    layer: LayerProfile, s: Strategy, pr: Pricing, cluster: Cluster, training: TrainingConfig, input_bytes: float
) -> LayerCost:
    # d: ranks holding the same weights (data x context parallel: they reduce gradients and shard ZeRO state
    # together); a rank computes samples / cp of each of its samples' tokens
    d, t, cp = s.replicas, s.tp, s.cp
    mode = s.dp_mode if d > 1 else "replicate"
    samples = pr.micro_batch / s.dp
    tokens = samples / cp  # per rank, in samples' worth of tokens (what token-wise costs scale with)
    # what the dimensions' cost hooks read and adjust (planner.dimensions.base.LayerTerms), phase by phase
    x = LayerTerms(layer, s, cluster, training, pr, d, mode, tokens, compute=layer.compute_s(tokens) / t)
    price("price_compute", x)  # before anything reads the compute
    compute = x.compute
    # under a split backward (zero-bubble schedules) the backward takes ``split_overhead`` times as long (profiled,
    # else 1): the extra, and W, the weight-gradient share of that split backward (profiled, else the profile's
    # default), split by TP like compute
    backward = compute * (1 - layer.forward_fraction)
    split_extra = backward * (layer.split_overhead() - 1)
    weight_grad = (backward + split_extra) * layer.backward_split()
    tp_comm = 0.0
    if t > 1:
        # measured (profile ``overheads``): all-reduces + unsplit compute + dispatch; else the ring formula
        measured = layer.overhead_s("tp", t, tokens)
        if measured is not None:
            tp_comm = max(measured, -0.5 * compute)
        elif layer.tp_allreduces:
            # (with sequence parallelism: an all-gather and a reduce-scatter of the same bytes)
            tp_comm = 2 * layer.tp_allreduces * all_reduce_s(cluster, layer.output_bytes * tokens, t, False)
    cp_comm = context_parallel_s(layer, s, tokens, cluster, compute)
    comm = tp_comm + cp_comm
    if s.recompute:  # the forward again in backward: its compute and its forward TP / CP communication
        compute += compute * layer.forward_fraction
        comm += (tp_comm + cp_comm) / 2
    ep_comm = expert_parallel_s(layer, s, tokens, cluster)
    comm += ep_comm
    if s.recompute:  # the forward's dispatch and combine again
        comm += ep_comm / 2
    inter = dp_group_inter_node(cluster, pr.n)
    P = layer.params / t  # parameters on one rank after tensor parallelism
    # measured overheads were timed with whole sequences and whole experts: they stand for data parallelism alone
    measured_ok = t == 1 and not inter and cp == 1 and s.ep == 1
    # the parameters every replica holds (all of them without expert parallelism), then the experts' share of
    # each of the ``ep`` ranks, held alike by the ``d / ep`` ranks at the same place of every ep group
    Pe = layer.expert_params / t if s.ep > 1 else 0.0
    x.state_comm, x.sync, x.static, x.transient = _state(layer, s, mode, P - Pe, d, inter, measured_ok, samples,
                                                         cluster, training, pr)
    x.shared, x.gather_s = P - Pe, lambda nbytes: all_gather_s(cluster, nbytes, d, inter)
    price("price_state", x)  # before the experts' own state joins
    comm_s, sync, static, transient = x.state_comm, x.sync, x.static, x.transient
    if s.ep > 1:
        de = d // s.ep
        ec, es, est, etr = _state(layer, s, mode if de > 1 else "replicate", Pe / s.ep, de, inter, False, samples,
                                  cluster, training, pr)
        comm_s, sync, static, transient = comm_s + ec, sync + es, static + est, transient + etr
    comm += comm_s
    sync += cluster.optimizer_s_per_tensor * layer.param_tensors
    # sequence parallelism splits what tensor parallelism alone leaves whole (norms, dropout, residuals)
    f = 1.0 if s.sp else layer.activation_tp_fraction
    act = layer.activation_bytes * tokens * ((1 - f) + f / t)
    if s.sp:  # torch's ColwiseParallel(input_layouts=Shard(1)) saves the all-gathered input of each column-parallel
        # projection whole (Megatron gathers it again in backward instead): one per TP all-reduce it replaces
        act += (1 - 1 / t) * layer.tp_allreduces * layer.output_bytes * tokens
    if cp > 1 and layer.attention_heads:
        # attention's output is kept twice: head-sharded (saved by attention) and, after the all-to-all back,
        # sequence-sharded (the output projection's input); the profile, one process, saw one. Ring attention
        # keeps as much (its output in the load-balanced layout, saved for backward, besides the projection's
        # input; measured, benchmarks/memory_sequence.py cp2_ring)
        act += layer.output_bytes * tokens / t
    # what the layer's backward adds at its peak (the gradients in and out, temporaries), split like activations
    transient += layer.backward_peak_bytes * tokens * ((1 - f) + f / t)
    if s.recompute:
        # keeps only its input (whole on every TP rank, split over CP); its activations live again while it recomputes
        transient += act
        act = input_bytes * tokens
    x.compute, x.comm, x.sync, x.static, x.act, x.transient = compute, comm, sync, static, act, transient
    price("price_activations", x)  # where the activations live and what moving them costs
    compute, comm, sync, static, act, transient = x.compute, x.comm, x.sync, x.static, x.act, x.transient
    transient += communicator_bytes(cluster, s, pr.n)  # NCCL's buffers of the layer's communicators (cost.buffers)
    return LayerCost(compute + comm, compute, comm, sync, static, act, transient, weight_grad, split_extra)



def _state(layer: LayerProfile, s: Strategy, mode: str, P: float, d: int, inter: bool, measured_ok: bool,
           samples: float, cluster: Cluster, training: TrainingConfig, pr: Pricing) -> tuple[float, ...]:
    """``(comm_s, sync_s, static_bytes, transient_bytes)`` of ``P`` parameters per rank held alike by ``d`` ranks
    under ``mode`` (the table in the module docstring): per micro-batch communication (ZeRO-3's gathers), the
    per-step gradient reduction, gathers and optimizer update, the bytes held, and ZeRO-3's gathered copy."""
    w, g, o = training.weight_bytes, training.grad_bytes, training.optimizer_bytes
    comm = sync = extra = 0.0
    if mode == "zero3":
        # measured inside a node for FSDP alone; FSDP x TP and groups across nodes use the formulas
        measured = layer.overhead_s("fsdp", d, samples) if measured_ok else None
        if measured is not None:
            comm += max(measured, 0.0)
        else:
            comm += 2 * all_gather_s(cluster, P * w, d, inter)
            comm += reduce_scatter_s(cluster, P * g, d, inter)
        static = P * (w + g + o) / d
    elif mode == "zero2":
        # measured inside a node without TP (profile overhead "zero2": FSDP2's gather, reduce-scatter and per-call
        # work of one whole step); else the formulas
        measured = layer.overhead_s("zero2", d, pr.micro_batch / d) if measured_ok else None
        if measured is not None:
            sync = max(measured, 0.0)
        else:
            sync = reduce_scatter_s(cluster, P * g, d, inter) + all_gather_s(cluster, P * w, d, inter)
        # with accumulation FSDP2 keeps the unsharded gradient until the last micro-batch's reduce-scatter
        # FSDP2 keeps the parameter shard (what the optimizer updates) beside the gathered copy
        static = P * w + P * (w + o + g) / d + (P * g if pr.accumulate else 0.0)
    elif mode == "zero1":
        sync, extra = _gradient_sync(layer, s, P, d, inter, cluster, training, pr, measured_ok)
        measured = layer.overhead_s("zero1", d, pr.micro_batch / d) if measured_ok else None
        if measured is not None and s.compression == "none":
            # measured (profile overhead "zero1"): the whole step's all-reduce, shard update and gather
            sync = max(measured, 0.0)
        else:
            sync += all_gather_s(cluster, P * w, d, inter)  # the updated parameters
        # measured (runtime.zero): beside the formula's P (w + g) + P o / d, FSDP2's parameter shard, the sharded
        # gradient the optimizer reads, and the all-reduce bucket the whole gradient travels through
        static = P * (w + g) + P * (w + g + o) / d + P * g + extra
    else:
        sync, extra = (_gradient_sync(layer, s, P, d, inter, cluster, training, pr, measured_ok) if d > 1
                       else (0.0, 0.0))
        # the runtime's persistent all-reduce buckets hold one more copy of a replicated layer's gradients
        # (runtime.data_parallel.ReplicatedGrads)
        static = P * (w + g + o) + (P * g if d > 1 else 0.0) + extra
    # the optimizer updates the parameters this rank holds, once per iteration, after the gradient sync
    sync += cluster.optimizer_s_per_param * P / (1 if mode == "replicate" else d)
    # a ZeRO-3 layer's gathered parameters: a full copy beside the shard it keeps (counted in static)
    return comm, sync, static, (P * w if mode == "zero3" else 0.0)

def _gradient_sync(layer: LayerProfile, s: Strategy, P: float, d: int, inter: bool, cluster: Cluster,
                   training: TrainingConfig, pr: Pricing, measured_ok: bool = True) -> tuple[float, float]:
    """Seconds of a replicate / zero1 layer's per-step gradient reduction and the bytes its compressor keeps
    (error feedback): all-reduce of ``P g`` bytes, or its compressed form. Top-k with DGC's momentum correction
    (``dgc_momentum > 0``) also keeps its fp32 momentum (``4 P`` more). Steady state: the run-time warm-up
    (``start_iter`` / ``start_fraction``: uncompressed steps first, :mod:`uniap_lightning.runtime.compression`)
    is not priced."""
    method = s.compression
    if method == "none":
        # measured inside a node without TP (profile overhead "dp": the runtime's own bucketed all-reduce beside
        # the step's last backward, waited for; on CPU ranks sharing cores it also slows that backward)
        measured = layer.overhead_s("dp", d, pr.micro_batch / d) if measured_ok else None
        if measured is not None:
            return max(measured, 0.0), 0.0
        return all_reduce_s(cluster, P * training.grad_bytes, d, inter), 0.0
    work = cluster.compression_s_per_param(method) * P
    if method == "bf16":
        return all_reduce_s(cluster, P * 2, d, inter) + work, 0.0
    if method == "powersgd":
        r = pr.powersgd_rank
        dims, vectors = layer.powersgd_dims()
        # a TP shard splits one side of each matrix: (n / t + k) or (n + k / t)
        dims = dims * (1 + 1 / s.tp) / 2
        low_rank = 4 * r * dims  # P (n r) then Q (k r), fp32
        sync = 2 * all_reduce_s(cluster, low_rank / 2, d, inter) + all_reduce_s(cluster, 4 * vectors / s.tp, d, inter)
        return sync + work * r, P * 4 + low_rank  # error feedback (fp32) and the P, Q factors
    # topk: every rank sends k values (fp32) and indices (int32) per tensor, all-gathered
    k = max(math.ceil(pr.topk_ratio * P), max(layer.param_tensors, 1))
    # error feedback (fp32), and with DGC its local momentum (fp32)
    return all_gather_s(cluster, 8 * k * d, d, inter) + work, P * 4 * (2 if pr.dgc else 1)
