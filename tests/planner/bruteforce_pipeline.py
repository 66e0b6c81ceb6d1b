"""Exhaustive search for one candidate ``(pp, c, schedule, virtual_stages)``: every split of the chain into
``pp * v`` stages and every strategy of every layer, scored at once with numpy (one array axis per layer).

Unlike :mod:`bruteforce` it prunes nothing, because with several stages per device the stages interact through
their device group's summed time, memory and sync, and zero-bubble schedules price each stage's weight-gradient
time too. It shares nothing with the MILP (no ``CostTables``, no dominance pruning, no runs): it reads the
per-layer terms (``CandidateCosts.terms`` / ``reshard_s`` / ``boundary_s``), the schedule's in-flight counts and
its ``tpi_s`` formula, adds everything up itself, and the plan it returns is re-scored with ``evaluate``.
"""

from __future__ import annotations

import numpy as np
from bruteforce import splits

from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.cost.layer import strategies_for
from uniap_lightning.planner.cost.tables import CandidateCosts
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.schedule_rules import unsupported

MAX_GRID = 3_000_000  # assignments per split: a bigger instance is a mistake in the test, not a slow test


def _axis(values, u: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[u] = len(values)
    return np.asarray(values, dtype=float).reshape(shape)


def brute_force_candidate(problem: Problem, pp: int, c: int, schedule: str, v: int,
                          per_split: dict | None = None) -> Plan | None:
    """The best plan of one candidate, or None when nothing fits (or the shape is unusable). ``per_split``, when
    given, receives each split's (``stage_of`` tuple) least TPI among the assignments that fit."""
    layers = problem.model.layers
    L, S = len(layers), pp * v
    n = problem.num_devices // pp
    b = problem.training.global_batch_size // c
    if S > L:
        return None
    # the strategies the runtime runs under this schedule (zero-bubble: planner.schedule_rules)
    options = [[s for s in strategies_for(lp, n, problem.cluster, b, compression=problem.compression, **problem.opt_ins)
                if unsupported(schedule, s) is None] for lp in layers]
    if not all(options):
        return None
    shape = [len(o) for o in options]
    if np.prod(shape, dtype=float) > MAX_GRID:
        raise AssertionError("brute force instance too large")
    costs = CandidateCosts(problem, pp, c, schedule=schedule, virtual_stages=v)
    terms = [[costs.terms(u, s) for s in opts] for u, opts in enumerate(options)]
    best, best_tpi = None, float("inf")
    for stage_of in splits(L, S):
        group = [costs.group_of(k) for k in range(S)]
        time = [np.zeros([1] * L) for _ in range(S)]
        weight = [np.zeros([1] * L) for _ in range(S)]
        static = [np.zeros([1] * L) for _ in range(S)]
        act = [np.zeros([1] * L) for _ in range(S)]
        sync = [np.zeros([1] * L) for _ in range(pp)]
        transient = [np.zeros([1] * L) for _ in range(pp)]
        bounds = []
        for u in range(L):
            k, g = stage_of[u], group[stage_of[u]]
            cs = terms[u]
            time[k] = time[k] + _axis([costs.layer_time_s(k, x) for x in cs], u, L)
            weight[k] = weight[k] + _axis([costs.weight_time_s(k, x) for x in cs], u, L)
            static[k] = static[k] + _axis([x.static_bytes for x in cs], u, L)
            act[k] = act[k] + _axis([x.activation_bytes for x in cs], u, L)
            sync[g] = sync[g] + _axis([x.sync_s for x in cs], u, L)
            transient[g] = np.maximum(transient[g], _axis([x.transient_bytes for x in cs], u, L))
            if u + 1 < L:  # a (K_u, K_u+1) table on two axes: resharding inside a stage, or the boundary
                if stage_of[u + 1] == k:
                    pair = [[costs.reshard_s(u, s.layout, s2.layout) for s2 in options[u + 1]] for s in options[u]]
                else:
                    pair = [[costs.boundary_s(u, s.layout, s2.layout, k) for s2 in options[u + 1]] for s in options[u]]
                table = np.asarray(pair, dtype=float).reshape([1] * u + [shape[u], shape[u + 1]] + [1] * (L - u - 2))
                if stage_of[u + 1] == k:
                    time[k] = time[k] + table
                else:
                    bounds.append(table)
        p = [costs.stage_time_s(t) for t in time]
        group_time = [sum(p[k] for k in range(S) if group[k] == g) for g in range(pp)]
        memory = [sum(static[k] + costs.in_flight(k) * act[k] for k in range(S) if group[k] == g) + transient[g]
                  for g in range(pp)]
        limits = [costs.memory_limit_bytes(group.index(g)) for g in range(pp)]
        T = group_time[0]
        for x in group_time[1:] + [costs.shape.boundary_weight * o for o in bounds] + \
                [costs.shape.stage_weight * x for x in p]:
            T = np.maximum(T, x)
        Y = sync[0]
        for x in sync[1:]:
            Y = np.maximum(Y, x)
        wmax = weight[0]
        for x in weight[1:]:
            wmax = np.maximum(wmax, x)
        tpi = costs.tpi_s(sum(p), sum(bounds) if bounds else 0.0, T, Y, sum(weight), wmax)
        tpi = np.broadcast_to(tpi, shape)
        ok = np.ones(shape, dtype=bool)
        for m, lim in zip(memory, limits):
            ok &= np.broadcast_to(m <= lim, shape)
        if not ok.any():
            continue
        masked = np.where(ok, tpi, np.inf)
        flat = int(np.argmin(masked))
        if per_split is not None:
            per_split[tuple(stage_of)] = float(masked.flat[flat])
        if masked.flat[flat] < best_tpi:
            best_tpi = float(masked.flat[flat])
            idx = np.unravel_index(flat, shape)
            best = problem.plan_for(stage_of_layer=stage_of, strategies=[options[u][k] for u, k in enumerate(idx)],
                                    pp=pp, microbatches=c, schedule=schedule, virtual_stages=v)
    if best is not None:
        best = best.with_report(estimate=evaluate(problem, best))
        assert best.estimate.feasible
        assert abs(best.estimate.tpi_s - best_tpi) <= 1e-9 * best_tpi, (best.estimate.tpi_s, best_tpi)
    return best


def brute_force_all(problem: Problem) -> Plan | None:
    """The best plan over every ``(pp, c)`` and every ``(schedule, v)`` the problem's search prices."""
    best = None
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            for schedule, v in problem.training.schedule_candidates(pp, c, problem.model.num_layers):
                plan = brute_force_candidate(problem, pp, c, schedule, v)
                if plan is not None and (best is None or plan.estimate.tpi_s < best.estimate.tpi_s):
                    best = plan
    return best


def assert_milp_equals_brute_force(problem: Problem, pp: int, c: int, schedule: str, v: int) -> list | None:
    """One candidate: the MILP (on the tables the search builds, with the schedule's refusals) reaches brute
    force's optimum within 1e-6 and ``evaluate`` re-scores its plan to the objective; both agree when nothing fits
    or the shape is unusable. Returns the MILP's strategies, or None when there is no plan."""
    import pytest

    from uniap_lightning.planner.cost.tables import CostTables
    from uniap_lightning.planner.solver.parallel import solve_candidate

    oracle = brute_force_candidate(problem, pp, c, schedule, v)
    tables = CostTables(problem, pp, c, schedule=schedule, virtual_stages=v,
                        allowed=lambda k: unsupported(schedule, k) is None)
    where = f"pp={pp} c={c} {schedule} v={v}"
    if not tables.feasible_shape:  # the search skips it too
        assert oracle is None, where
        return None
    res = solve_candidate(tables, "cbc", 60.0, None)
    if oracle is None:
        assert res.objective_s is None, where
        return None
    assert res.status == "optimal", where
    assert res.objective_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6, abs=1e-12), where
    # the candidate's cheap bound (it prunes without a solve) never exceeds the optimum
    from uniap_lightning.planner.solver.bounds import time_lower_bound_s

    assert oracle.estimate.tpi_s >= time_lower_bound_s(tables) * (1 - 1e-9), where
    strategies = [tables.strategies[u][k] for u, k in enumerate(res.strategy_index)]
    plan = problem.plan_for(stage_of_layer=res.stage_of_layer, pp=pp, microbatches=c, schedule=schedule,
                            virtual_stages=v, strategies=strategies)
    assert evaluate(problem, plan).tpi_s == pytest.approx(res.objective_s, rel=1e-9), where
    return strategies
