"""The solver: the MILP per (pp, c) candidate (:mod:`.milp`), outer search (:mod:`.search`), baselines, and
``solve``, which runs them all within one deadline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.cost.layer import cost_cache
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem, compression_methods
from uniap_lightning.planner.search_options import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, SOLVERS
from uniap_lightning.planner.solver.backend import Deadline, no_gc
from uniap_lightning.planner.solver.baselines import BASELINES, baseline_plans
from uniap_lightning.planner.solver.search import resolve_solver, search

__all__ = ["BASELINES", "SOLVERS", "baseline_plans", "resolve_solver", "search", "solve"]


def solve(
    problem: Problem,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    pp: list[int] | None = None,
    baselines: bool = True,
    progress: Callable[[str], None] | None = None,
    compression: str | list[str] | tuple[str, ...] | None = None,
    warm_start: Plan | None = None,
) -> Plan:
    """Find the plan with the least predicted time per iteration that fits memory.

    ``solver``: ``"auto"`` (HiGHS when installed, else CBC), ``"cbc"``, ``"highs"`` or ``"gurobi"``.
    ``time_limit_s`` bounds the whole call, baselines included (one deadline; a solver may overrun it by
    ``backend.MIN_SOLVE_S``). With ``baselines=True`` the baselines are computed first, used as
    incumbents (so the plan is never worse than any of them) and reported in ``plan.baselines``.
    ``compression`` (None: the problem's own ``compression``) sets the gradient compression methods the solver may
    choose per layer: a method, "auto" (all), a list, or "none".
    ``warm_start``: a plan for this model and device count (e.g. the one a job is running when its devices' speeds
    change), re-scored on ``problem`` and, when it fits, used as the first incumbent: candidates that cannot beat it
    are pruned without a solve and every solve gets it as a cutoff. The result stays exact; it is the same optimum,
    found sooner.
    Raises :class:`~uniap_lightning.errors.InfeasibleError` when nothing fits, naming the memory shortfall.
    """
    if compression is not None:
        problem = replace(problem, compression=compression_methods(compression))
    with no_gc(), cost_cache():  # the cost model's cache lives for this call (cost.layer.cost_cache)
        return _solve(problem, solver=solver, time_limit_s=time_limit_s, pp=pp, baselines=baselines,
                      progress=progress, warm_start=warm_start)


def _in_search_space(problem: Problem, plan: Plan, pp: list[int] | None) -> bool:
    """The search could return ``plan``: its pipeline degree, micro-batch count and schedule are among the
    candidates (a warm start from outside them would hand back a plan the configuration rules out)."""
    t = problem.training
    return (plan.num_devices == problem.num_devices and plan.pp in (pp or problem.pp_candidates())
            and plan.microbatches in t.microbatch_candidates()
            and (plan.schedule, plan.virtual_stages) in t.schedule_candidates(plan.pp, plan.microbatches,
                                                                              problem.model.num_layers))


def _solve(problem, *, solver, time_limit_s, pp, baselines, progress, warm_start=None) -> Plan:
    deadline = Deadline.after(time_limit_s)
    base: dict[str, Plan | None] = {}
    feasible: list[Plan] = []
    if warm_start is not None and _in_search_space(problem, warm_start, pp):
        warm = warm_start.with_report(estimate=evaluate(problem, warm_start), solver=None, search=())
        if warm.estimate.feasible:
            feasible.append(warm)
    if baselines:
        base = baseline_plans(problem, solver=solver, deadline=deadline.share(0.5))
        feasible += [p for p in base.values() if p is not None and p.estimate and p.estimate.feasible]
    incumbent = min(feasible, key=lambda p: p.estimate.tpi_s, default=None)
    plan = search(problem, solver=solver, deadline=deadline, pp=pp, incumbent=incumbent, progress=progress)
    # the incumbent may be a baseline object: give the caller its own copy of the estimate
    return plan.with_report(baselines={k: (v.estimate.tpi_s if v is not None else None) for k, v in base.items()},
                            estimate=evaluate(problem, plan))
