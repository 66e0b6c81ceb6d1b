"""``evaluate(problem, plan)``: time per iteration, per-stage time and memory of ANY plan, without a solver.

This is the ground truth the solver is checked against: the MILP's objective must equal ``evaluate`` of the plan
it returns, baselines are scored with it, and the brute-force oracle enumerates plans through it.
"""

from __future__ import annotations

from uniap_lightning.planner.cost.layer import Strategy, strategies_for
from uniap_lightning.planner.cost.tables import CandidateCosts
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import COMPRESSIONS, Estimate, LayerPlan, Plan
from uniap_lightning.planner.problem import Problem


def strategy_of(lp: LayerPlan) -> Strategy:
    """The cost model's strategy for a plan's layer."""
    if lp.dp == 1:
        return Strategy(1, lp.tp, "replicate", lp.recompute, "none")
    return Strategy(lp.dp, lp.tp, lp.dp_mode, lp.recompute, lp.compression)


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


def evaluate(problem: Problem, plan: Plan, *, check_strategies: bool = True) -> Estimate:
    """Score ``plan`` with the cost model (seconds, bytes). ``feasible`` is False when a stage exceeds memory."""
    plan.validate()
    check_plan_matches(problem, plan)
    cl = problem.cluster
    pp, c, n, b = plan.pp, plan.microbatches, plan.devices_per_stage, plan.micro_batch_size
    if pp > 1 and b % n:
        raise UniAPError(
            f"micro-batch size {b} must be divisible by the {n} devices per stage when pp > 1 (stage boundaries "
            "split the micro-batch over every rank of a stage)"
        )
    costs = CandidateCosts(problem, pp, c, compression_options=plan.compression_options)
    strat = [strategy_of(lp) for lp in plan.layers]
    if check_strategies:
        for u, (lp, s) in enumerate(zip(costs.layers, strat)):
            if s not in strategies_for(lp, n, cl, b, compression=COMPRESSIONS):
                raise UniAPError(
                    f"plan layer {u} ({lp.name}): strategy dp={s.d} tp={s.t} is not allowed here "
                    f"(tp_degrees={list(lp.tp_degrees)}, devices per node={cl.devices_per_node}, micro-batch={b})"
                )
    layer_time = [0.0] * pp
    reshard = [0.0] * pp
    sync = [0.0] * pp
    static = [0.0] * pp
    activation = [0.0] * pp
    transient = [0.0] * pp
    boundary = [0.0] * (pp - 1)
    stage_of = [lp.stage for lp in plan.layers]
    for u, s in enumerate(strat):
        i = stage_of[u]
        terms = costs.terms(u, s)
        layer_time[i] += costs.layer_time_s(i, terms)
        sync[i] += terms.sync_s
        static[i] += terms.static_bytes
        activation[i] += terms.activation_bytes
        transient[i] = max(transient[i], terms.transient_bytes)
        if u + 1 < len(strat):
            if stage_of[u + 1] == i:
                reshard[i] += costs.reshard_s(u, s.d, strat[u + 1].d)
            else:
                boundary[i] = costs.boundary_s(u, s.d, strat[u + 1].d, i)
    stage_time = [costs.stage_time_s(layer_time[i], reshard[i]) for i in range(pp)]
    memory = [costs.stage_memory_bytes(i, static[i], activation[i], transient[i]) for i in range(pp)]
    tpi = costs.tpi_s(sum(stage_time), sum(boundary), max(stage_time + boundary), max(sync))
    limits = [costs.memory_limit_bytes(i) for i in range(pp)]
    limit = min(limits)
    return Estimate(
        tpi_s=tpi,
        samples_per_s=plan.global_batch_size / tpi if tpi > 0 else float("inf"),
        stage_time_s=stage_time,
        stage_memory_bytes=memory,
        stage_sync_s=sync,
        boundary_s=boundary,
        memory_limit_bytes=limit,
        feasible=all(m <= lim for m, lim in zip(memory, limits)),
        stage_memory_limit_bytes=limits if cl.rank_memory_gib else None,
        stage_device=[cl.stage_device(costs.stage_ranks(i)) for i in range(pp)] if cl.rank_device else None,
    )
