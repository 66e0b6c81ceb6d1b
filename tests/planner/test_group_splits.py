"""Each device group's splits that can still beat the incumbent (:mod:`uniap_lightning.planner.solver.group_splits`)
never drop a split some better plan has: checked against brute force over every split and strategy of small
candidates (one and several stages per group, memory that binds); the MILP with them as rows keeps the optimum
below the cutoff and finds nothing at or above it; the search computes them for a candidate it solves again."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
from bruteforce_groups import group_value_brute
from bruteforce_pipeline import brute_force_candidate
from planner_factories import repeated_problem

from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.schedule_rules import unsupported
from uniap_lightning.planner.solver import resolve_solver
from uniap_lightning.planner.solver.group_floor import GroupMemoryFloor, run_ends
from uniap_lightning.planner.solver.group_splits import _climb, split_table, surviving_splits
from uniap_lightning.planner.solver.milp import GroupedMilp

SOLVER = resolve_solver("auto")


def _problem(seed: int):
    """Runs of identical blocks on two devices, memory from roomy to tight, up to three stages per group."""
    problem = repeated_problem(seed, pattern="ABBBBC", nodes=1, per_node=2, schedule="auto",
                               memory_gib=(4.0, 3.0, 4.0, 6.0, 2.5, 8.0)[seed])
    return replace(problem, training=replace(problem.training, max_virtual_stages=3))


def _tables(problem):
    """Every candidate (one or several stages per group) with a usable shape, priced as the search prices it."""
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            for schedule, v in problem.training.schedule_candidates(pp, c, problem.model.num_layers):
                t = CostTables(problem, pp, c, schedule=schedule, virtual_stages=v,
                               allowed=lambda k, s=schedule: unsupported(s, k) is None)
                if t.feasible_shape:
                    yield pp, c, schedule, v, t


def _counts(t, gs, stage_of) -> tuple[int, ...]:
    a, e = t.runs()[gs.run]
    return tuple(sum(1 for u in range(a, e + 1) if stage_of[u] == k) for k in gs.stages)


def test_no_plan_below_the_cutoff_loses_its_split():
    """For cutoffs from just above the brute-force optimum to 30% above it: every split of the chain whose best
    plan that fits is below the cutoff has, in every device group, counts among the group's surviving splits; the
    table is hopeless only when nothing is below the cutoff. Not vacuous: some split that some plan has is dropped."""
    checked = dropped = 0
    for pp, c, schedule, v, t in (x for seed in range(6) for x in _tables(_problem(seed))):
        problem = t.problem
        per_split: dict = {}
        best = brute_force_candidate(problem, pp, c, schedule, v, per_split=per_split)
        if best is None:
            continue
        opt = best.estimate.tpi_s
        for factor in (1 + 1e-7, 1.01, 1.05, 1.3):
            cutoff = opt * factor
            t.bound_cache.pop("group_splits", None)
            table = surviving_splits(t, cutoff, budget_s=1e6)
            assert not table.hopeless, (pp, c, schedule, v, factor)
            for stage_of, value in per_split.items():
                lost = [gs.group for gs in table.groups if _counts(t, gs, stage_of) not in gs.splits]
                if value < cutoff:
                    assert not lost, (pp, c, schedule, v, factor, stage_of, value, cutoff)
                    checked += 1
                elif lost and value < math.inf:
                    dropped += 1
    assert checked > 0 and dropped > 0


def test_a_cutoff_at_the_optimum_leaves_the_milp_nothing_and_one_above_leaves_it_the_optimum():
    """The MILP with the split rows: cutoff a hair above the brute-force optimum: finds it (and ``evaluate`` agrees
    through the objective); cutoff at it or below: no better plan (the rows may make that plain before any solve)."""
    checked = 0
    for seed in range(4):
        problem = _problem(seed)
        for pp, c, schedule, v, t in _tables(problem):
            best = brute_force_candidate(problem, pp, c, schedule, v)
            if best is None:
                continue
            opt = best.estimate.tpi_s
            for factor, finds in ((1 + 1e-6, True), (1.0, False), (1 - 1e-6, False)):
                t.bound_cache.pop("group_splits", None)
                surviving_splits(t, opt * factor, budget_s=1e6)
                assert split_table(t, opt * factor) is not None
                res = GroupedMilp(t, solver=SOLVER).solve(time_limit_s=60, cutoff_s=opt * factor)
                if finds:
                    assert res.status == "optimal", (pp, c, schedule, v)
                    assert res.objective_s == pytest.approx(opt, rel=1e-6), (pp, c, schedule, v)
                else:
                    assert res.status == "infeasible", (pp, c, schedule, v, factor, res.status, res.objective_s)
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("seed", range(3))
def test_the_split_program_is_the_brute_force_least_value(seed):
    """A group's program with each stage's count fixed equals brute force over every strategy mix of that split
    (end layers included), ``inf`` exactly when nothing fits."""
    problem = _problem(seed + 1)
    checked = 0
    for pp, c, schedule, v, t in _tables(problem):
        if v == 1:
            continue
        a, e = next((a, e) for a, e in t.runs() if e > a)
        L, S = len(t.layers), t.stages
        ends = run_ends(t, a, e)
        lo, hi = max(0, S - L + a), min(e, S - 1)
        program = GroupMemoryFloor(t, a, e, ends, t.shape.b_T * max(1.0, t.shape.stage_weight), t.shape.a_p,
                                   budget_s=1e6)
        for grp in range(t.pp):
            reachable = [k for k in t.stages_of(grp) if lo <= k <= hi]
            outside = [k for k in t.stages_of(grp) if k in ends and k not in reachable]
            for counts in itertools.product(range(3), repeat=len(reachable)):
                if sum(counts) > e - a + 1 or any(n == 0 and program.must_hold(k) for k, n in zip(reachable, counts)):
                    continue
                got = program.split_value_ms(grp, reachable, outside, counts)
                exact = group_value_brute(t, program, grp, reachable, outside, sum(counts), counts)
                if exact == math.inf:
                    assert got == math.inf, (pp, c, schedule, grp, counts, got)
                else:
                    assert got == pytest.approx(exact, rel=1e-7), (pp, c, schedule, grp, counts)
                checked += 1
    assert checked > 0


def test_the_climb_finds_every_split_a_monotone_test_keeps():
    """Against every split in the box: the same set, for random monotone tests (weighted sums under a cap) and
    lower bounds per stage; None past the limit."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 4)
        total = rng.randint(0, 9)
        least = [rng.randint(0, 1) for _ in range(n)]
        weights = [rng.uniform(0.2, 2.0) for _ in range(n)]
        cap = rng.uniform(0, 10)

        def keep(s):
            return sum(w * x for w, x in zip(weights, s)) <= cap

        every = sorted(s for s in itertools.product(*[range(lo, total + 1) for lo in least])
                       if sum(s) <= total and keep(s))
        got = _climb(keep, least, total, limit=10_000)
        assert got is not None and sorted(got) == every
        if len(every) > 1:
            assert _climb(keep, least, total, limit=len(every) - 1) is None


def test_the_search_gives_a_candidate_it_solves_again_its_splits(monkeypatch):
    """A candidate whose first slice runs out (played) gets its splits for the incumbent of the moment when it comes
    back; its second solve uses them (as rows) and the search still ends exact, with the brute-force optimum."""
    from bruteforce_pipeline import brute_force_all

    from uniap_lightning.planner.solver import parallel
    from uniap_lightning.planner.solver.backend import MilpResult
    from uniap_lightning.planner.solver.search import search

    problem = _problem(2)
    oracle = brute_force_all(problem)
    hard: list = []
    seen: list = []
    real = parallel.solve_candidate

    def solve(tables, solver, time_limit_s, cutoff_s):
        if not hard and tables.runs() != [(u, u) for u in range(len(tables.layers))]:
            hard.append(tables)  # the first handed out that has a run of interchangeable layers
        if hard and tables is hard[0]:
            if time_limit_s < 150:
                return MilpResult("no_solution", None, None, None, None, 0.0, time_limit_s, 1, 1)
            seen.append((split_table(tables, cutoff_s), cutoff_s))
        return real(tables, solver, time_limit_s, cutoff_s)

    monkeypatch.setattr(parallel, "solve_candidate", solve)
    plan = search(problem, solver=SOLVER, time_limit_s=1000, workers=1)
    assert plan.solver.status == "optimal"
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
    if seen:  # not pruned by its bound first
        table, cutoff = seen[0]
        assert table is not None and table.cutoff_s == pytest.approx(cutoff) and table.groups
    else:
        record = next(r for r in plan.search if r["pp"] == hard[0].pp and r["microbatches"] == hard[0].c
                      and r["schedule"] == hard[0].schedule and r["virtual_stages"] == hard[0].v)
        assert record["outcome"] == "pruned by bound" and "group_splits" in hard[0].bound_cache
