"""``evaluate(problem, plan)``: time per iteration, per-stage time and memory of ANY plan, without a solver.

This is the ground truth the solver is checked against: the MILP's objective must equal ``evaluate`` of the plan
it returns, baselines are scored with it, and the brute-force oracle enumerates plans through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from uniap_lightning.planner.cost.layer import cost_cache, cp_methods, expert_degrees, strategies_for
from uniap_lightning.planner.cost.tables import CandidateCosts
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions import OPT_INS
from uniap_lightning.planner.plan import COMPRESSIONS, Estimate, Plan
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.decision import COMPRESSIBLE_DP_MODES

if TYPE_CHECKING:
    from uniap_lightning.planner.cluster import Cluster
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.profile import LayerProfile


#: every opt-in dimension with all its values allowed: a pinned plan's layer may use any (what the user allowed
#: only restricts the search), so it is checked against these candidates
_EVERY_OPT_IN = {name: o.values for name, o in OPT_INS.items()}


def check_plan_matches(problem: Problem, plan: Plan) -> None:
    """Refuse a plan made for another model, device count or batch size, naming the mismatch."""
    model = problem.model
    if len(plan.layers) != model.num_layers:
        raise UniAPError(
            f"plan has {len(plan.layers)} layers but model '{model.model}' has {model.num_layers}: "
            "the plan was made for another model"
        )
    names = [lp.name for lp in model.layers]
    for u, (lp, name) in enumerate(zip(plan.layers, names)):
        if lp.name != name:
            raise UniAPError(f"plan layer {u} is {lp.name!r} but the model's layer {u} is {name!r}: another model?")
    if plan.model_fingerprint and plan.model_fingerprint != model.fingerprint():
        raise UniAPError(
            f"plan was made for a model with fingerprint {plan.model_fingerprint}, this model has "
            f"{model.fingerprint()} (same layer names, different sizes)"
        )
    if plan.num_devices != problem.num_devices:
        raise UniAPError(f"plan is for {plan.num_devices} devices but the cluster has {problem.num_devices}")
    if plan.global_batch_size != problem.training.global_batch_size:
        raise UniAPError(
            f"plan is for global batch size {plan.global_batch_size}, the training config says "
            f"{problem.training.global_batch_size}"
        )


@cost_cache()  # identical blocks priced once (within the enclosing solve's cache, when there is one)
def evaluate(problem: Problem, plan: Plan, *, check_strategies: bool = True) -> Estimate:
    """Score ``plan`` with the cost model (seconds, bytes). ``feasible`` is False when a stage exceeds memory."""
    plan.validate()
    check_plan_matches(problem, plan)
    cl = problem.cluster
    pp, c, n, b = plan.pp, plan.microbatches, plan.devices_per_stage, plan.micro_batch_size
    costs = CandidateCosts(problem, pp, c, schedule=plan.schedule, virtual_stages=plan.virtual_stages,
                           compression_options=plan.compression_options)
    strat = [lp.strategy for lp in plan.layers]
    if check_strategies:
        for u, (lp, s) in enumerate(zip(costs.layers, strat)):
            s.check(f"plan layer {u} ({lp.name})", experts=lp.experts)  # ep against the layer's experts
            if s not in strategies_for(lp, n, cl, b, compression=COMPRESSIONS, **_EVERY_OPT_IN):
                raise UniAPError(f"plan layer {u} ({lp.name}): strategy {s.label()} (dp={s.dp} cp={s.cp} tp={s.tp}) "
                                 f"is not allowed here: {why_not_allowed(lp, s, cl, b)}")
    t = _stage_terms(costs, plan)
    stage_time, boundary, weight, sync = t.stage_time_s, t.boundary_s, t.weight_s, t.sync_s
    static, activation, transient = t.static_bytes, t.activation_bytes, t.transient_bytes
    group_time = [sum(stage_time[k] for k in costs.stages_of(g)) for g in range(pp)]
    memory = [costs.group_memory_bytes(g, static, activation, transient[g]) for g in range(pp)]
    tpi = costs.tpi_s(sum(stage_time), sum(boundary), costs.bottleneck_s(group_time, boundary, stage_time), max(sync),
                      sum(weight), max(weight))
    limits = [costs.memory_limit_bytes(costs.stages_of(g)[0]) for g in range(pp)]
    limit = min(limits)
    return Estimate(
        tpi_s=tpi,
        samples_per_s=plan.global_batch_size / tpi if tpi > 0 else float("inf"),
        stage_time_s=group_time,
        stage_memory_bytes=memory,
        stage_sync_s=sync,
        boundary_s=boundary,
        memory_limit_bytes=limit,
        feasible=all(m <= lim for m, lim in zip(memory, limits)),
        stage_memory_limit_bytes=limits if cl.rank_memory_gib else None,
        stage_device=[cl.stage_device(costs.stage_ranks(costs.stages_of(g)[0])) for g in range(pp)]
        if cl.rank_device else None,
    )


def bubble_s(plan: Plan) -> float:
    """Idle time of the plan's busiest device group per iteration: what the time per iteration holds beyond that
    group's ``c`` micro-batches of work and the largest end-of-step sync (the schedule's bubble, plus waits on
    hand-offs)."""
    est = plan.estimate
    busy = plan.microbatches * max(est.stage_time_s) + max(est.stage_sync_s)
    return max(est.tpi_s - busy, 0.0)


def why_not_allowed(layer: LayerProfile, s: Strategy, cluster: Cluster, micro_batch: int) -> str:
    """Which rule of :func:`~uniap_lightning.planner.cost.layer.strategies_for` strategy ``s`` breaks for
    ``layer`` (the first, in the order it checks them), in words that name the field and the value."""
    t, c, d, dpn, L = s.tp, s.cp, s.dp, cluster.devices_per_node, layer.sequence_length
    if t not in layer.tp_degrees:
        return f"tp={t} is not one of the layer's tp_degrees {list(layer.tp_degrees)} in the profile"
    if t > dpn or dpn % t:
        return f"tp={t} must divide the {dpn} devices per node of the cluster (tensor parallelism stays in a node)"
    if micro_batch % d:
        return f"dp={d} does not divide the micro-batch of {micro_batch} samples"
    if c > 1 and L is None:
        return f"cp={c} splits the sequence, but the profile gives the layer no sequence_length"
    if c > 1 and L % c:
        return f"cp={c} does not divide the layer's sequence_length={L} in the profile"
    methods = cp_methods(layer, c, t, cluster)
    if s.cp_method not in methods:
        return (f"cp_method={s.cp_method!r} does not run with cp={c}, tp={t} here (possible: {list(methods)}; "
                f"ulysses needs cp to divide the {layer.attention_heads} attention heads / tp, ring needs a cluster "
                f"with ring attention and 2 x cp dividing the sequence_length={L})")
    if s.sp and not (t > 1 and layer.sequence_parallel and L and L % (c * t) == 0):
        return (f"sp needs tp > 1, a layer with sequence_parallel in the profile and cp x tp = {c * t} dividing its "
                f"sequence_length={L}")
    if s.compression != "none" and not (d * c > 1 and s.dp_mode in COMPRESSIBLE_DP_MODES):
        return f"compression={s.compression!r} needs replicas (dp x cp > 1) in dp_mode {list(COMPRESSIBLE_DP_MODES)}"
    if s.ep not in expert_degrees(layer, d * c) or (s.ep > 1 and s.compression != "none"):
        return (f"ep={s.ep} must divide both the dp x cp = {d * c} replicas and the layer's experts={layer.experts}, "
                "with uncompressed gradients")
    for o in OPT_INS.values():  # each opt-in dimension's own reason (a device without the feature, ...)
        reason = o.why_not(layer, s, cluster) if o.why_not is not None else None
        if reason:
            return reason
    return (f"tp_degrees={list(layer.tp_degrees)}, devices per node={dpn}, micro-batch={micro_batch}, "
            f"sequence_length={L}")


class StageTerms(NamedTuple):
    """Per pipeline stage (chain order, ``pp * virtual_stages`` of them) what :func:`evaluate` sums: the stage's
    time per micro-batch ``p_k`` and its weight-gradient part ``w_k``, static and activation bytes; per hand-off
    ``o_j``; per device group the sync and the largest transient."""

    stage_time_s: list[float]
    weight_s: list[float]
    static_bytes: list[float]
    activation_bytes: list[float]
    boundary_s: list[float]
    sync_s: list[float]
    transient_bytes: list[float]


def _stage_terms(costs: CandidateCosts, plan: Plan) -> StageTerms:
    pp, S = plan.pp, plan.num_stages  # pipeline stages; device group g runs plan.stages_of_group(g)
    layer_time, reshard, weight = [0.0] * S, [0.0] * S, [0.0] * S
    sync, static, activation, transient = [0.0] * pp, [0.0] * S, [0.0] * S, [0.0] * pp
    boundary = [0.0] * (S - 1)
    stage_of, strat = [lp.stage for lp in plan.layers], [lp.strategy for lp in plan.layers]
    for u, s in enumerate(strat):
        i = stage_of[u]
        g = costs.group_of(i)
        terms = costs.terms(u, s)
        layer_time[i] += costs.layer_time_s(i, terms)
        weight[i] += costs.weight_time_s(i, terms)
        sync[g] += terms.sync_s
        static[i] += terms.static_bytes
        activation[i] += terms.activation_bytes
        transient[g] = max(transient[g], terms.transient_bytes)  # one layer of the group runs its backward at once
        if u + 1 < len(strat):
            if stage_of[u + 1] == i:
                reshard[i] += costs.reshard_s(u, s.layout, strat[u + 1].layout)
            else:
                boundary[i] = costs.boundary_s(u, s.layout, strat[u + 1].layout, i)
    stage_time = [costs.stage_time_s(layer_time[i], reshard[i]) for i in range(S)]
    return StageTerms(stage_time, weight, static, activation, boundary, sync, transient)


def stage_terms(problem: Problem, plan: Plan) -> StageTerms:
    """The per-stage numbers behind ``evaluate(problem, plan)`` (the plan picture draws its timeline from them)."""
    plan.validate()
    check_plan_matches(problem, plan)
    costs = CandidateCosts(problem, plan.pp, plan.microbatches, schedule=plan.schedule,
                           virtual_stages=plan.virtual_stages, compression_options=plan.compression_options)
    return _stage_terms(costs, plan)
