"""Uniform plans: one strategy for every layer, an even split of the chain. Baselines and warm starts."""

from __future__ import annotations

from collections.abc import Iterable

from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.cost.layer import Strategy, cost_cache, strategies_for
from uniap_lightning.planner.cost.tables import costing_layers
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.solver.backend import Deadline


def even_split(num_layers: int, pp: int) -> list[int]:
    """Stage index of each layer when ``num_layers`` are split into ``pp`` near-equal contiguous parts."""
    base, extra = divmod(num_layers, pp)
    out: list[int] = []
    for i in range(pp):
        out += [i] * (base + (1 if i < extra else 0))
    return out


def uniform_plan(problem: Problem, pp: int, c: int, s: Strategy, schedule: str | None = None,
                 virtual_stages: int = 1) -> Plan | None:
    """The plan with strategy ``s`` on every layer and an even split into ``pp * virtual_stages`` stages, or None if
    a layer does not allow ``s``."""
    n = problem.num_devices // pp
    b = problem.training.global_batch_size // c
    layers = problem.model.layers
    if pp * virtual_stages > len(layers):
        return None
    distinct = {id(lp): lp for lp in costing_layers(problem.model)}.values()  # identical blocks: checked once
    if any(s not in strategies_for(lp, n, problem.cluster, b) for lp in distinct):
        return None
    return problem.plan_for(stage_of_layer=even_split(len(layers), pp * virtual_stages), strategies=[s] * len(layers),
                            pp=pp, microbatches=c, schedule=schedule, virtual_stages=virtual_stages)


@cost_cache()  # the candidates share their layers' terms (within the enclosing solve's cache, when there is one)
def best_uniform(
    problem: Problem, candidates: Iterable[tuple[int, int, Strategy]], *, deadline: Deadline | None = None,
    schedule: str | None = None, virtual_stages: int = 1,
) -> Plan | None:
    """The fastest memory-feasible uniform plan among ``(pp, c, strategy)`` candidates (under ``schedule`` with
    ``virtual_stages``); those left when the deadline passes are not scored (each is an ``evaluate`` of the whole
    chain)."""
    best: Plan | None = None
    for pp, c, s in candidates:
        if deadline is not None and deadline.remaining_s() <= 0:
            break
        try:
            plan = uniform_plan(problem, pp, c, s, schedule, virtual_stages)
        except UniAPError:
            continue
        if plan is None:
            continue
        plan = plan.with_report(estimate=evaluate(problem, plan, check_strategies=False))
        if plan.estimate.feasible and (best is None or plan.estimate.tpi_s < best.estimate.tpi_s):
            best = plan
    return best
