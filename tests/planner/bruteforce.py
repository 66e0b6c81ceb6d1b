"""Exhaustive search over the same cost formulas: every (pp, c), contiguous split and strategy assignment.

Exponential in the layers; for checking the MILP on small instances (a few layers and devices). It shares
nothing with the MILP (no ``CostTables``, no dominance pruning of strategies, no runs): it reads the per-layer
terms (``CandidateCosts.terms`` / ``reshard_s`` / ``boundary_s``), adds them up itself, and the plan it returns is
re-scored with ``evaluate`` (:func:`brute_force` checks that its own total equals ``evaluate``'s).

The strategy space per layer is the product (d, t) x dp_mode x recompute x compression, ~20 per layer on 4
devices, so each stage's every assignment is scored at once with numpy broadcasting (one array axis per layer).
Stages interact only through their (time, sync) totals and the batch split of their first and last layer, and
the time per iteration is non-decreasing in every stage's time and sync, so per (first d, last d) only the
assignments no other beats in both are combined across stages: exact, and a different argument from the
solver's per-strategy dominance, which it therefore checks.
"""

from __future__ import annotations

import itertools

import numpy as np

from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.cost.layer import strategies_for
from uniap_lightning.planner.cost.tables import CandidateCosts
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem

MAX_ASSIGNMENTS = 5_000_000  # per stage: a bigger instance is a mistake in the test, not a slow test


def splits(num_layers: int, pp: int):
    """Stage index per layer for every split of the chain into ``pp`` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, num_layers), pp - 1):
        bounds = (0, *cuts, num_layers)
        yield [i for i in range(pp) for _ in range(bounds[i], bounds[i + 1])]


def _axis(values, u: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[u] = len(values)
    return np.asarray(values, dtype=float).reshape(shape)


def _stage_options(costs: CandidateCosts, options, terms, stage: int, first: int, last: int):
    """{(d first, d last): [((time, sync), strategy indices)]}: per pair of end splits, the memory-feasible
    assignments of the stage's layers that no other beats in both time and sync."""
    members = range(first, last + 1)
    ndim = len(members)
    if np.prod([len(options[u]) for u in members], dtype=float) > MAX_ASSIGNMENTS:
        raise AssertionError("brute force instance too large")
    time = sync = static = act = 0.0
    transient = np.zeros([1] * ndim)
    for j, u in enumerate(members):
        cs = terms[u]
        time = time + _axis([costs.layer_time_s(stage, c) for c in cs], j, ndim)
        sync = sync + _axis([c.sync_s for c in cs], j, ndim)
        static = static + _axis([c.static_bytes for c in cs], j, ndim)
        act = act + _axis([c.activation_bytes for c in cs], j, ndim)
        transient = np.maximum(transient, _axis([c.transient_bytes for c in cs], j, ndim))
        if u < last:  # resharding to the next layer: a (K_u, K_u+1) table on two axes
            move = np.array([[costs.reshard_s(u, s.layout, s2.layout) for s2 in options[u + 1]] for s in options[u]])
            shape = [1] * ndim
            shape[j], shape[j + 1] = move.shape
            time = time + move.reshape(shape)
    shape = [len(options[u]) for u in members]
    time = np.broadcast_to(costs.stage_time_s(time), shape).ravel()
    sync = np.broadcast_to(sync, shape).ravel()
    memory = np.broadcast_to(costs.stage_memory_bytes(stage, static, act, transient), shape).ravel()
    d_first = np.broadcast_to(_axis([_code(s) for s in options[first]], 0, ndim), shape).ravel()
    d_last = np.broadcast_to(_axis([_code(s) for s in options[last]], ndim - 1, ndim), shape).ravel()
    ok = memory <= costs.memory_limit_bytes(stage)
    out = {}
    for df in np.unique(d_first[ok]):
        for dl in np.unique(d_last[ok]):
            idx = np.flatnonzero(ok & (d_first == df) & (d_last == dl))
            if not len(idx):
                continue
            order = idx[np.lexsort((sync[idx], time[idx]))]
            kept, least = [], float("inf")
            for flat in order:
                if sync[flat] < least:
                    least = sync[flat]
                    ks = tuple(int(k) for k in np.unravel_index(flat, shape))
                    kept.append(((float(time[flat]), float(sync[flat])), ks))
            out[_layout(df), _layout(dl)] = kept
    return out


def _code(s) -> int:
    """A strategy's layout ``(dp, cp)`` as one integer (numpy keys), :func:`_layout` its inverse."""
    return s.dp * 100_000 + s.cp


def _layout(code) -> tuple[int, int]:
    return (int(code) // 100_000, int(code) % 100_000)


def brute_force(problem: Problem, *, candidate: tuple[int, int] | None = None) -> Plan | None:
    """The best plan over every ``(pp, c)``, or over ``candidate`` alone; None when nothing fits."""
    best: Plan | None = None
    best_tpi = float("inf")
    layers = problem.model.layers
    L = len(layers)
    for pp in problem.pp_candidates():
        n = problem.num_devices // pp
        for c in problem.training.microbatch_candidates():
            b = problem.training.global_batch_size // c
            if candidate is not None and (pp, c) != candidate:
                continue
            options = [strategies_for(lp, n, problem.cluster, b, compression=problem.compression, **problem.opt_ins)
                       for lp in layers]
            if not all(options):
                continue
            costs = CandidateCosts(problem, pp, c)
            terms = [[costs.terms(u, s) for s in opts] for u, opts in enumerate(options)]
            for stage_of in splits(L, pp):
                bounds = [(stage_of.index(i), L - 1 - stage_of[::-1].index(i)) for i in range(pp)]
                per_stage = [_stage_options(costs, options, terms, i, a, e) for i, (a, e) in enumerate(bounds)]
                if not all(per_stage):
                    continue
                flat = [[(key, vec, idx) for key, items in st.items() for vec, idx in items] for st in per_stage]
                for combo in itertools.product(*flat):
                    times = [vec[0] for _, vec, _ in combo]
                    syncs = [vec[1] for _, vec, _ in combo]
                    outs = [costs.boundary_s(bounds[j][1], combo[j][0][1], combo[j + 1][0][0], j) for j in range(pp - 1)]
                    tpi = costs.tpi_s(sum(times), sum(outs), costs.bottleneck_s(times, outs), max(syncs))
                    if tpi < best_tpi:
                        idx = [k for _, _, ks in combo for k in ks]
                        plan = problem.plan_for(stage_of_layer=stage_of, strategies=[options[u][k] for u, k in enumerate(idx)],
                                                pp=pp, microbatches=c)
                        best, best_tpi = plan, tpi
    if best is not None:
        best = best.with_report(estimate=evaluate(problem, best))
        assert best.estimate.feasible
        assert abs(best.estimate.tpi_s - best_tpi) <= 1e-9 * best_tpi, (best.estimate.tpi_s, best_tpi)
    return best


def assert_search_matches(problem: Problem, oracle: Plan | None) -> None:
    """The search on ``problem`` equals the brute-force ``oracle``: infeasible both, or proven optimal at the
    oracle's time, its estimate that of ``evaluate`` and of the solver's objective."""
    import pytest

    from uniap_lightning.errors import InfeasibleError
    from uniap_lightning.planner.solver import search

    if oracle is None:
        with pytest.raises(InfeasibleError):
            search(problem, solver="cbc", time_limit_s=60)
        return
    plan = search(problem, solver="cbc", time_limit_s=60)
    assert plan.solver.status == "optimal"
    assert plan.estimate.tpi_s == pytest.approx(evaluate(problem, plan).tpi_s, rel=1e-12)
    assert plan.solver.objective_s == pytest.approx(plan.estimate.tpi_s, rel=1e-6)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
