"""The planner: MILP per (pp, c) candidate (:mod:`.milp`), outer search (:mod:`.search`), baselines."""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager

from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.solver.baselines import BASELINES, baseline_plans
from uniap_lightning.planner.solver.search import SOLVERS, resolve_solver, search

__all__ = ["BASELINES", "SOLVERS", "baseline_plans", "resolve_solver", "search", "solve"]


@contextmanager
def no_gc():
    """python-mip's HiGHS backend frees models from cffi finalizers; a garbage-collection pass that runs one
    while cffi holds its lock deadlocked a spawned process. Collect before, not during, a solve."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def solve(
    problem: Problem,
    *,
    solver: str = "auto",
    time_limit_s: float = 60.0,
    pp: list[int] | None = None,
    baselines: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Find the plan with the least predicted time per iteration that fits memory.

    ``solver``: ``"auto"`` (HiGHS when installed, else CBC), ``"cbc"``, ``"highs"`` or ``"gurobi"``.
    ``time_limit_s`` bounds the whole search. With ``baselines=True`` the baselines are computed first, used as
    incumbents (so the plan is never worse than any of them) and reported in ``plan.baselines``.
    Raises :class:`~uniap_lightning.errors.InfeasibleError` when nothing fits, naming the memory shortfall.
    """
    with no_gc():
        return _solve(problem, solver=solver, time_limit_s=time_limit_s, pp=pp, baselines=baselines,
                      progress=progress)


def _solve(problem, *, solver, time_limit_s, pp, baselines, progress) -> Plan:
    base: dict[str, Plan | None] = {}
    incumbent = None
    if baselines:
        base = baseline_plans(problem, solver=solver, time_limit_s=time_limit_s / 4)
        feasible = [p for p in base.values() if p is not None and p.estimate and p.estimate.feasible]
        incumbent = min(feasible, key=lambda p: p.estimate.tpi_s, default=None)
    plan = search(problem, solver=solver, time_limit_s=time_limit_s, pp=pp, incumbent=incumbent, progress=progress)
    plan.baselines = {k: (v.estimate.tpi_s if v is not None else None) for k, v in base.items()}
    # the incumbent may be a baseline object: give the caller its own copy of the estimate
    plan.estimate = evaluate(problem, plan)
    return plan
