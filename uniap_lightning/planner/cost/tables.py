"""The one table of cost terms for a ``(pp, c)`` candidate, and the one place its terms become stage totals.

``evaluate``, the MILP and the bounds all read this table; none of them writes a per-stage total itself. A new
feature (recomputation, a ZeRO mode, gradient compression) adds a strategy dimension in
:func:`~uniap_lightning.planner.cost.layer.strategies_for` and its effect in
:func:`~uniap_lightning.planner.cost.layer.layer_cost` (one of the terms below), and every consumer follows.

Terms, in seconds and bytes (``u`` a layer, ``k`` its strategy; :class:`~.layer.LayerCost` field in brackets):

* time per micro-batch on its stage: compute + tensor-parallel + FSDP communication (``time_s``);
* sync per iteration: gradient all-reduce (or its compressed form) / reduce-scatter and the ZeRO-1/2 parameter
  all-gather at the end of the step, and the optimizer step (``sync_s``);
* memory held for the whole step: weights, gradients, optimizer state as the ``dp_mode`` shards them, for a
  replicated layer (``d > 1``) one more copy of its gradients (the runtime's all-reduce buckets), a compressor's
  error feedback (``static_bytes``);
* memory per micro-batch in flight: activations, or a recomputed layer's input (``activation_bytes``);
* memory held only while the layer runs (a ZeRO-3 layer's gathered weights, a recomputed layer's activations): a
  stage holds the largest one (``transient_bytes``);
* resharding between neighbours ``u``, ``u + 1`` on one stage whose batch splits ``d`` differ
  (:meth:`CandidateCosts.reshard_s`);
* a stage boundary after layer ``u``: leaving (reshard to the boundary layout, send forward and backward,
  :meth:`CandidateCosts.boundary_out_s`) plus entering (reshard from it, :meth:`CandidateCosts.boundary_in_s`);
* per stage: the pipeline slot overhead per micro-batch (``pp > 1``) and the micro-batches in flight;
* heterogeneous clusters: a stage's compute runs at its slowest device's speed (:meth:`CandidateCosts.layer_time_s`)
  and its memory limit is its smallest device's (:meth:`CandidateCosts.memory_limit_bytes`).

Combined, here only (the combinators take numbers or python-mip expressions alike, so the MILP builds its rows
from the same formulas ``evaluate`` computes):

* stage time ``p_i = sum_u time + sum reshard + slot`` (:meth:`CandidateCosts.stage_time_s`);
* stage memory ``m_i = sum static + in_flight(i) * sum activation + max transient``
  (:meth:`CandidateCosts.stage_memory_bytes`);
* ``TPI = sum_i p_i + sum_j o_j + (c - 1) max(p_i, o_j) + max_i sync_i`` (:meth:`CandidateCosts.tpi_s`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

from uniap_lightning.planner.cost.comm import all_gather_s, p2p_s
from uniap_lightning.planner.cost.layer import (
    LayerCost,
    Pricing,
    Strategy,
    boundary_inter_node,
    layer_cost,
    reshard_s,
    strategies_for,
)
from uniap_lightning.planner.cost.pipeline import pipeline_shape
from uniap_lightning.planner.cost.schedules import SCHEDULES
from uniap_lightning.planner.plan import boundary_chunks, group_of_stage, stage_ranks
from uniap_lightning.planner.problem import Problem


def costing_layers(model) -> list:
    """The model's layers without their names (one shared object per distinct layer), so that identical blocks
    share ``layer_cost``'s cache entries (and are priced once per table); cached on the model profile object."""
    ids = [id(lp) for lp in model.layers]
    cached = getattr(model, "_costing_layers", None)
    if cached is not None and cached[0] == ids:
        return cached[1]
    shared: dict = {}
    out = [shared.setdefault(replace(lp, name=""), replace(lp, name="")) for lp in model.layers]
    try:
        object.__setattr__(model, "_costing_layers", (ids, out))
    except AttributeError:  # a frozen or slotted stand-in: recompute next time
        pass
    return out


class TabulationStopped(Exception):
    """A table's ``stop`` callback said so (the search's deadline passed while tabulating a long chain)."""


class CandidateCosts:
    """Every term of one ``(pp, c)`` candidate for any strategy, and the formulas that combine them.

    ``evaluate`` uses this directly (a plan may carry a strategy the solver would not enumerate);
    :class:`CostTables` adds the enumeration the solver chooses from.
    """

    def __init__(self, problem: Problem, pp: int, c: int, *, schedule: str | None = None, virtual_stages: int = 1,
                 compression_options: dict | None = None) -> None:
        self.problem, self.pp, self.c = problem, pp, c
        self.n = problem.num_devices // pp  # devices per device group (a group runs virtual_stages stages)
        self._set_schedule(schedule or problem.training.concrete_schedule, virtual_stages)
        self.b = problem.training.global_batch_size // c  # micro-batch size
        self.layers = problem.model.layers
        opts = compression_options if compression_options is not None else problem.compression_options
        self.pricing = Pricing(self.b, self.n, accumulate=c > 1, powersgd_rank=int(opts.get("powersgd_rank", 1)),
                               topk_ratio=float(opts.get("topk_ratio", 0.01)),
                               dgc=float(opts.get("dgc_momentum", 0.0)) > 0)
        self._costed = costing_layers(problem.model)

    # ------------------------------------------------------------------ per-layer and pair terms
    def terms(self, u: int, s: Strategy) -> LayerCost:
        """Layer ``u``'s terms under strategy ``s`` (cached across candidates by ``layer_cost`` within a solve's
        :func:`~uniap_lightning.planner.cost.layer.cost_cache`); its input is
        layer ``u - 1``'s output (the first layer's input, token ids, is taken as free)."""
        inp = self.layers[u - 1].output_bytes if u > 0 else 0.0
        cost = layer_cost(self._costed[u], s, self.pricing, cluster=self.problem.cluster,
                          training=self.problem.training, input_bytes=inp)
        if s.cp > 1 and u == len(self.layers) - 1 and not self.layers[u].loss_on_pieces:
            cost = self._whole_sequences_for_the_loss(u, s, cost)
        return cost

    def _whole_sequences_for_the_loss(self, u: int, s: Strategy, cost: LayerCost) -> LayerCost:
        """The loss runs on whole sequences where the chain ends (the model's own loss shifts its labels inside;
        not where the profile says ``loss_on_pieces``: the loss then runs on each rank's piece):
        a last layer with its sequence split all-gathers its output over its ``cp`` ranks in forward (its gradient
        is a local slice) and keeps the whole-sequence output for the loss's backward. The loss's own input (this
        rank's chunk of the boundary layout, ``b / g`` samples, a view of it) every plan of the candidate holds and
        no layer counts, so the layer adds the rest (measured, ``benchmarks/memory_sequence.py``)."""
        cluster = self.problem.cluster
        whole = self.layers[u].output_bytes * self.b / s.dp
        gather = all_gather_s(cluster, whole, s.cp, s.cp * s.tp > cluster.devices_per_node)
        kept = whole - self.layers[u].output_bytes * self.b / self.edge
        return replace(cost, time_s=cost.time_s + gather, comm_s=cost.comm_s + gather,
                       activation_bytes=cost.activation_bytes + kept)

    def reshard_s(self, u: int, d_from, d_to) -> float:
        """Between layer ``u`` (layout ``d_from``: a :attr:`Strategy.layout`, or a batch split) and ``u + 1``
        (``d_to``) on one stage."""
        return reshard_s(self.problem.cluster, self.layers[u].output_bytes, self.b, d_from, d_to)

    @property
    def edge(self) -> int:
        """The boundary layout's batch split ``g = gcd(b, n)`` (:func:`~uniap_lightning.planner.plan.boundary_chunks`:
        ``n`` when ``n`` divides the micro-batch; else each of the ``g`` chunks is held by ``n / g`` lanes). Every
        layer's ``dp`` divides it, so entering a stage gathers (or keeps) and leaving it slices."""
        return boundary_chunks(self.b, self.n)

    def send_s(self, u: int, j: int) -> float:
        """Point-to-point send of layer ``u``'s output across boundary ``j`` (forward) and its gradient (backward);
        every rank of the stage sends its chunk, ``b / g`` samples, to the same lane of the next stage's group (the
        ``n / g`` lanes holding one chunk each send it, side by side)."""
        inter = boundary_inter_node(self.problem.cluster, self.n, self._group[j], self._group[j + 1])
        return 2 * p2p_s(self.problem.cluster, self.layers[u].output_bytes * self.b / self.edge, inter)

    def boundary_out_s(self, u: int, d_last: int, j: int) -> float:
        """Layer ``u`` (split ``d_last``) ends stage ``j``: reshard to the boundary layout (:attr:`edge`), then
        send."""
        return self.reshard_s(u, d_last, self.edge) + self.send_s(u, j)

    def boundary_in_s(self, u: int, d_first: int) -> float:
        """Layer ``u + 1`` (split ``d_first``) starts the next stage: reshard from the boundary layout."""
        return self.reshard_s(u, self.edge, d_first)

    def boundary_s(self, u: int, d_last: int, d_first: int, j: int) -> float:
        """Boundary ``j`` falls after layer ``u``: leaving plus entering."""
        return self.boundary_out_s(u, d_last, j) + self.boundary_in_s(u, d_first)

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations ``stage`` holds at its peak (the schedule's action order)."""
        return self._in_flight[stage]

    # ------------------------------------------------------------------ the schedule: stages on device groups
    def _set_schedule(self, schedule: str, virtual_stages: int) -> None:
        self.schedule, self.v = schedule, virtual_stages
        self.split_backward = SCHEDULES[schedule].split_backward  # zero-bubble: the backward runs as B and W
        self.stages = self.pp * virtual_stages  # pipeline stages, in chain order
        self.shape, self._in_flight = pipeline_shape(schedule, self.pp, virtual_stages, self.c)
        self._group = [group_of_stage(k, self.pp, virtual_stages, schedule) for k in range(self.stages)]
        self.bound_cache: dict = {}  # what solver.bounds derives from this table under this schedule, once

    def with_schedule(self, schedule: str, virtual_stages: int) -> CandidateCosts:
        """The same candidate's terms under another schedule (a shallow copy: the per-layer tables are shared)."""
        out = copy.copy(self)
        out._set_schedule(schedule, virtual_stages)
        return out

    def group_of(self, stage: int) -> int:
        """The device group that runs ``stage``."""
        return self._group[stage]

    def stages_of(self, group: int) -> list[int]:
        """The stages device group ``group`` runs."""
        return [k for k in range(self.stages) if self._group[k] == group]

    # ------------------------------------------------------------------ heterogeneous devices
    def stage_ranks(self, stage: int) -> range:
        """The ranks that run ``stage`` (its device group's)."""
        return stage_ranks(self._group[stage], self.n)

    def stage_speed(self, stage: int) -> float:
        """Relative compute speed of ``stage``'s slowest device (1.0 on a homogeneous cluster)."""
        return self.problem.cluster.stage_speed(self.stage_ranks(stage))

    def memory_limit_bytes(self, stage: int) -> float:
        """Usable memory of ``stage``'s smallest device."""
        return self.problem.cluster.stage_memory_bytes(self.stage_ranks(stage))

    def layer_time_s(self, stage: int, cost: LayerCost) -> float:
        """A layer's time per micro-batch on ``stage``: its compute (with what splitting the backward adds, where
        the schedule splits it) at the stage's (slowest device's) speed, plus its communication (links do not slow
        down with the device)."""
        return self._time_at(cost, self.stage_speed(stage))

    def fastest_layer_time_s(self, cost: LayerCost) -> float:
        """:meth:`layer_time_s` on the fastest device anywhere (what lower bounds may assume)."""
        return self._time_at(cost, self.problem.cluster.fastest_speed)

    def _time_at(self, cost: LayerCost, speed: float) -> float:
        extra = cost.split_extra_s if self.split_backward else 0.0
        if speed == 1.0:
            return cost.time_s + extra
        return (cost.compute_s + extra) / speed + (cost.time_s - cost.compute_s)

    @property
    def slot_overhead_s(self) -> float:
        """Fixed cost a stage pays per micro-batch under pipelining (0 without pipeline stages)."""
        return self.problem.cluster.pipeline_overhead_s if self.pp > 1 else 0.0

    # ------------------------------------------------------------------ the combinators (the only stage formulas)
    def stage_time_s(self, layers_s, reshard_s=0.0, *, per_s: float = 1.0):
        """``p_i = sum_u time + sum reshard + slot``. ``per_s`` is the unit of the arguments per second (the MILP
        works in milliseconds), needed because the slot overhead is the one constant."""
        return layers_s + reshard_s + self.slot_overhead_s * per_s

    def stage_memory_bytes(self, stage: int, static, activation, transient=0.0):
        """``m_i = sum static + in_flight(i) * sum activation + max transient`` (any unit: it is homogeneous)."""
        return static + self.in_flight(stage) * activation + transient

    def group_memory_bytes(self, group: int, static: list, activation: list, transient=0.0):
        """``m_g = sum over the group's stages k of (static_k + in_flight(k) * activation_k) + max transient``:
        a device holds every stage it runs; one of its layers runs its backward at a time (``static`` and
        ``activation`` per stage, ``transient`` the group's largest)."""
        return sum(self.stage_memory_bytes(k, static[k], activation[k]) for k in self.stages_of(group)) + transient

    @property
    def blocking_handoffs(self) -> bool:
        """Whether each device group's time per micro-batch carries the hand-offs on both of its sides
        (:attr:`~uniap_lightning.planner.problem.TrainingConfig.blocking_handoffs`; GPipe and 1F1B only)."""
        return self.problem.training.blocking_handoffs and self.schedule in ("gpipe", "1f1b")

    def handoffs_of(self, group: int) -> list[int]:
        """The boundaries a device group's stage sits between (one stage per group: the one before, the one after)
        where hand-offs block (:attr:`blocking_handoffs`), else none."""
        if not self.blocking_handoffs:
            return []
        return [j for j in (group - 1, group) if 0 <= j < self.stages - 1]

    def bottleneck_s(self, group_times: list, boundaries: list, stage_times: list = ()):
        """``T``: the largest device group's summed stage times (plus its hand-offs where they block: a
        DeepSpeed-run pipeline's stage waits out every send and receive, ``T >= p_k + o_{k-1} + o_k``), the largest
        hand-off and, with several stages per group, ``v`` times the longest stage (numbers only; the MILP states
        the same with one row per term)."""
        groups = [t + sum(boundaries[j] for j in self.handoffs_of(g)) for g, t in enumerate(group_times)]
        return max(groups + [self.shape.boundary_weight * o for o in boundaries]
                   + [self.shape.stage_weight * p for p in stage_times])

    def layer_memory_bytes(self, stage: int, cost: LayerCost) -> float:
        """One layer's share of :meth:`stage_memory_bytes` on ``stage``, without the transient term."""
        return self.stage_memory_bytes(stage, cost.static_bytes, cost.activation_bytes)

    def weight_time_s(self, stage: int, cost: LayerCost) -> float:
        """The weight-gradient part of a layer's time on ``stage`` (what zero-bubble schedules move into bubbles)."""
        speed = self.stage_speed(stage)
        return cost.weight_grad_s / speed

    def tpi_s(self, stages_s, boundaries_s, bottleneck_s, sync_s, weight_s=0.0, weight_max_s=0.0):
        """The schedule's time per iteration from the sums over stages of their times ``p_k`` (``stages_s``) and
        weight-gradient times ``w_k`` (``weight_s``), the sum of hand-offs ``o_j``, the bottleneck ``T`` (every
        device group's summed stage times, every hand-off), the largest ``w_k`` and the largest group's sync:
        ``a_p sum p + a_w sum w + a_o sum o + b_T T + b_W max w + Y`` with the coefficients of
        :func:`~uniap_lightning.planner.cost.pipeline.pipeline_shape` (1F1B / GPipe: ``sum p + sum o + (c - 1) T
        + Y``). Linear in them, which the MILP and the bounds rely on."""
        sh = self.shape
        return (sh.a_p * stages_s + sh.a_w * weight_s + sh.a_o * boundaries_s + sh.b_T * bottleneck_s
                + sh.b_W * weight_max_s + sync_s)


class CostTables(CandidateCosts):
    """The candidate's terms for every strategy the solver may choose: ``strategies[u][k]``, ``cost[u][k]``.

    ``allowed`` restricts the strategies (the baselines' restricted searches). Strategies another strategy of the
    same layer and batch split ``d`` dominates (no term larger; ties keep the first) are dropped: every other cost
    (resharding, boundaries) depends on ``d`` alone and every stage formula is non-decreasing in each term, so some
    optimal plan never uses them (``prune=False`` keeps them).
    """

    def __init__(self, problem: Problem, pp: int, c: int, *, allowed: Callable[[Strategy], bool] | None = None,
                 prune: bool = True, stop: Callable[[], bool] | None = None, schedule: str | None = None,
                 virtual_stages: int = 1) -> None:
        super().__init__(problem, pp, c, schedule=schedule, virtual_stages=virtual_stages)
        self.strategies: list[list[Strategy]] = []
        self.cost: list[list[LayerCost]] = []
        seen: dict[tuple, tuple[list[Strategy], list[LayerCost]]] = {}  # identical layers (a model's blocks) once
        for u, lp in enumerate(self.layers):
            if stop is not None and u % 512 == 511 and stop():
                raise TabulationStopped(f"stopped after {u} of {len(self.layers)} layers")
            # what terms(u, .) depends on: the layer but its name, its input, and whether the loss follows it
            key = (self._costed[u], self.layers[u - 1].output_bytes if u > 0 else 0.0, u == len(self.layers) - 1)
            if key not in seen:
                ks = strategies_for(self._costed[u], self.n, problem.cluster, self.b, compression=problem.compression,
                                    **problem.opt_ins)
                if allowed is not None:
                    ks = [k for k in ks if allowed(k)]
                cs = [self.terms(u, k) for k in ks]
                if prune:
                    keep = undominated(ks, cs, split_time=problem.cluster.rank_speed is not None)
                    ks, cs = [ks[j] for j in keep], [cs[j] for j in keep]
                seen[key] = (ks, cs)
            ks, cs = seen[key]
            self.strategies.append(ks)
            self.cost.append(cs)
        if prune:
            self._drop_dominated_sequence_layouts(split_time=problem.cluster.rank_speed is not None)

    def _drop_dominated_sequence_layouts(self, *, split_time: bool) -> None:
        """Drop every context-parallel strategy (``cp > 1``) when each one, in every layer, is dominated by a
        strategy of the same layer that puts its ``dp x cp`` ranks on the batch instead (layout ``(dp cp, 1)``:
        what happens whenever the micro-batch splits that far and attention only adds its all-to-alls).

        Exact: map every layer's layout ``(d, c)`` to ``(d c, 1)``; each layer's terms do not grow (dominance), and
        neither does any resharding, since between batch-only layouts it is one all-gather of ``S / min`` over
        ``max / min`` ranks, no more than the gathers from the common coarsening ``k <= min`` that
        :func:`~uniap_lightning.planner.cost.layer.reshard_s` charges a pair with a sequence split (larger pieces
        over more ranks). Only all at once: a pair of two sequence layouts can cost less than its image."""
        # identical layers share their lists (one entry per distinct layer, see __init__)
        distinct = list({id(cs): (ks, cs) for ks, cs in zip(self.strategies, self.cost)}.values())
        if not any(k.cp > 1 for ks, _ in distinct for k in ks):
            return
        for ks, cs in distinct:
            by_layout: dict[tuple[int, int], list[tuple[float, ...]]] = {}
            for k, c in zip(ks, cs):
                if k.cp == 1:
                    by_layout.setdefault(k.layout, []).append(_vector(c, split_time))
            for k, c in zip(ks, cs):
                if k.cp == 1:
                    continue
                vec = _vector(c, split_time)
                rivals = by_layout.get((k.dp * k.cp, 1), [])
                if not any(all(a <= b for a, b in zip(r, vec)) for r in rivals):
                    return  # some sequence split may pay: keep them all
        kept: dict[int, tuple[list[Strategy], list[LayerCost]]] = {}  # keyed by id: `distinct` keeps the lists alive
        for u, (ks, cs) in enumerate(zip(list(self.strategies), list(self.cost))):
            if id(cs) not in kept:
                keep = [j for j, k in enumerate(ks) if k.cp == 1]
                kept[id(cs)] = ([ks[j] for j in keep], [cs[j] for j in keep])
            self.strategies[u], self.cost[u] = kept[id(cs)]

    @property
    def feasible_shape(self) -> bool:
        """Every layer has at least one strategy (its ``dp`` divides the micro-batch) and every stage a layer;
        the micro-batch may be smaller than a stage (the boundary layout's chunks, :attr:`edge`)."""
        return all(self.strategies) and len(self.layers) >= self.stages

    def layer_key(self, u: int) -> tuple:
        """Everything the table knows about layer ``u``: two layers with equal keys are interchangeable."""
        return (self.layers[u].output_bytes, tuple(self.strategies[u]), tuple(self.cost[u]))

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs ``(first, last)`` of consecutive interchangeable layers (what the MILP aggregates)."""
        out: list[tuple[int, int]] = []
        for u in range(len(self.layers)):
            if out and self.layer_key(u) == self.layer_key(out[-1][0]):
                out[-1] = (out[-1][0], u)
            else:
                out.append((u, u))
        return out


def _vector(c: LayerCost, split_time: bool = False) -> tuple[float, ...]:
    time = (c.compute_s, c.time_s - c.compute_s) if split_time else (c.time_s,)
    # zero-bubble schedules price ``time - 2 w`` and the largest ``w``: a strategy dominates only where both agree
    # (the tables are shared by every schedule of the candidate)
    weight = (c.weight_grad_s, c.time_s + c.split_extra_s - 2 * c.weight_grad_s, c.split_extra_s)
    return (*time, *weight, c.sync_s, c.static_bytes, c.activation_bytes, c.transient_bytes)


def undominated(strategies: list[Strategy], costs: list[LayerCost], *, split_time: bool = False) -> list[int]:
    """Indices of the strategies no other strategy with the same layout ``(dp, cp)`` dominates (ties: the first one
    stays). ``split_time``: compare compute and communication separately (stages of different speeds scale only
    the compute, so a smaller total alone does not dominate)."""
    vec = [_vector(c, split_time) for c in costs]
    groups: dict[tuple[int, int], list[int]] = {}
    for j, s in enumerate(strategies):
        groups.setdefault(s.layout, []).append(j)
    keep = []
    for members in groups.values():
        # a dominating vector sorts no later (lexicographically, then by index for ties), and domination is
        # transitive: comparing each vector with the ones kept so far is enough
        kept: list[tuple[float, ...]] = []
        for j in sorted(members, key=lambda m: (vec[m], m)):
            v = vec[j]
            if not any(all(a <= b for a, b in zip(w, v)) for w in kept):
                kept.append(v)
                keep.append(j)
    return sorted(keep)
