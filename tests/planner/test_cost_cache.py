"""The cost model's caches live for one solve, not for the process (issue 42, item 7): ``strategies_for`` and
``layer_cost`` reuse their results within a :func:`~uniap_lightning.planner.cost.layer.cost_cache` scope that
``solve`` / ``search`` / the baselines / ``evaluate`` open and clear on exit, so a process that plans again and
again (or a test session) does not accumulate entries, and nothing the planner memoizes at module level is
unbounded."""

from __future__ import annotations

import gc
import importlib
import pkgutil

from planner_factories import repeated_problem

import uniap_lightning.planner as planner_pkg
from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.cost.layer import LayerCost, cost_cache, current_cost_cache
from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver import resolve_solver, solve

SOLVER = resolve_solver("auto")


def _problem():
    return repeated_problem(1, pattern="ABBBBC", nodes=1, per_node=4, memory_gib=6.0)


def _live_layer_costs() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is LayerCost)


def _plan_key(plan):
    return plan.to_dict()["layers"], plan.pp, plan.microbatches, plan.estimate.tpi_s


def test_nothing_the_cost_model_computed_outlives_a_solve():
    """Two solves in one process: after each, no scope is open and no LayerCost is left alive (a module-level
    cache, ``lru_cache`` or dict, would keep thousands); the second solve finds the same plan as the first."""
    problem = _problem()
    before = _live_layer_costs()
    plans = []
    for _ in range(2):
        plans.append(_plan_key(solve(problem, solver=SOLVER, time_limit_s=60.0)))
        assert current_cost_cache() is None
        assert _live_layer_costs() <= before
    assert plans[0] == plans[1]


def test_no_planner_function_memoizes_without_a_small_bound():
    """Every ``functools`` cache in ``uniap_lightning.planner`` has a small ``maxsize`` (a few hundred at most: a
    catalogue look-up, a schema; the per-solve scope is where the cost model caches)."""
    for info in pkgutil.walk_packages(planner_pkg.__path__, planner_pkg.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if hasattr(obj, "cache_info") and getattr(obj, "__module__", None) == module.__name__:
                size = obj.cache_info().maxsize
                assert size is not None and size <= 256, f"{info.name}.{name}: lru_cache(maxsize={size})"


def test_a_scope_caches_within_and_clears_on_exit():
    """Inside one scope the solve, its searches and ``evaluate`` share one cache (nested scopes are the outer one);
    leaving the scope empties it; a cache that holds a handful of entries gives the same plan."""
    problem = _problem()
    with cost_cache() as cache:
        plan = solve(problem, solver=SOLVER, time_limit_s=60.0)
        assert current_cost_cache() is cache and len(cache.layer_costs) > 0 and len(cache.strategies) > 0
        with cost_cache() as inner:
            assert inner is cache
        assert evaluate(problem, plan) == plan.estimate
    assert len(cache) == 0 and current_cost_cache() is None
    with cost_cache() as small:
        small.max_entries = 5
        capped = solve(problem, solver=SOLVER, time_limit_s=60.0)
        assert len(small.layer_costs) <= 5 and len(small.strategies) <= 5
    assert _plan_key(capped) == _plan_key(plan)


def test_tables_priced_inside_a_scope_equal_those_priced_outside():
    problem = _problem()
    outside = CostTables(problem, 2, 2)
    with cost_cache():
        CostTables(problem, 2, 4)  # other entries first
        inside = CostTables(problem, 2, 2)
    assert inside.strategies == outside.strategies and inside.cost == outside.cost


def test_a_solve_never_walks_the_whole_heap(monkeypatch):
    """``no_gc`` collects only the youngest generation on entry: a full pass walks everything the process holds (a
    trainer and its model, a test session) and the bounds enter ``no_gc`` thousands of times per search; with full
    passes ``test_group_splits``' brute-force case took 205 s instead of 6.7 s in a process holding 1.5M objects."""
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or real(0))
    solve(_problem(), solver=SOLVER, time_limit_s=60.0)
    assert calls and all(g == 0 for g in calls), calls
