"""Limits the planner must honour: the time limit of a whole solve, and inputs too large for naive loops."""

from __future__ import annotations

import pytest
from planner_factories import random_problem

from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.problem import divisors
from uniap_lightning.planner.solver import backend, milp, solve
from uniap_lightning.planner.solver.bounds import least_memory_bytes
from uniap_lightning.profiling import pricing


class FakeClock:
    """Time that moves only when a (fake) solver runs: exactly as long as it was allowed to."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.limits_s: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    def optimize(self, model, time_limit_s):
        self.limits_s.append(time_limit_s)
        self.now_s += max(time_limit_s, backend.MIN_SOLVE_S)
        return "no_solution", None, None, max(time_limit_s, backend.MIN_SOLVE_S)


@pytest.mark.parametrize("limit_s", [2.0, 60.0])
def test_solve_spends_at_most_its_time_limit_baselines_included(monkeypatch, limit_s):
    """Every solver call uses all the time it is given. The whole solve (two baseline searches and the main
    search) must still end within ``time_limit_s`` (plus one minimal solve): the old code gave each baseline
    search a quarter of the limit on top of the main search's full limit, 1.5x in all."""
    clock = FakeClock()
    monkeypatch.setattr(backend, "now_s", clock)
    monkeypatch.setattr(milp, "optimize", clock.optimize)
    # a small instance (1 node): the clock is fake, so the size of the search is not the subject; llama_7b on
    # h100_4x8 spent 27 s per case building the same calls
    problem = pricing.build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16)
    start = clock.now_s
    plan = solve(problem, solver="cbc", time_limit_s=limit_s)
    assert len(clock.limits_s) >= 2, "the instance must make both the baselines and the main search solve"
    assert clock.now_s - start <= limit_s + backend.MIN_SOLVE_S
    assert plan.estimate.feasible  # the incumbent (a baseline or uniform plan) is what comes back
    assert plan.solver.status == "time_limit"


@pytest.mark.timeout(60)  # a safety net, not a measurement: a trial-division loop over 10^12 would run for hours
def test_divisors_of_a_huge_batch_size_are_quick():
    ds = divisors(1_000_000_000_000)
    assert ds[:4] == [1, 2, 4, 5] and ds[-1] == 10**12 and len(ds) == 169  # 2^12 5^12: 13 * 13 divisors
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 400))


def least_memory_reference(t: CostTables) -> float:
    """The exact O(P L^2) dynamic program least_memory_bytes replaced."""
    L, P = len(t.layers), t.pp
    mem = [[min(t.layer_memory_bytes(i, k) for k in t.cost[u]) for u in range(L)] for i in range(P)]
    f = [[float("inf")] * L for _ in range(P)]
    for u in range(L):
        f[0][u] = sum(mem[0][: u + 1])
    for i in range(1, P):
        for u in range(i, L):
            f[i][u] = min(max(f[i - 1][v], sum(mem[i][v + 1 : u + 1])) for v in range(i - 1, u))
    return f[P - 1][L - 1]


@pytest.mark.parametrize("seed", range(12))
def test_least_memory_matches_the_exact_dynamic_program(seed):
    problem = random_problem(seed, num_layers=3 + seed % 7, nodes=(1, 2)[seed % 2], per_node=4,
                             schedule=("1f1b", "gpipe")[seed % 3 == 0])
    checked = 0
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            t = CostTables(problem, pp, c)
            if not all(t.strategies):
                continue
            assert least_memory_bytes(t) == pytest.approx(least_memory_reference(t), rel=1e-8)
            checked += 1
    assert checked > 0


@pytest.mark.timeout(120)  # a safety net: the quadratic version took minutes; timings belong to benchmarks/planner.py
def test_least_memory_of_ten_thousand_layers_is_quick():
    """The error message for 'nothing fits' computes this per candidate; it used to be quadratic in layers."""
    problem = random_problem(0, num_layers=10_000, nodes=2, per_node=4, batch=64)
    t = CostTables(problem, 8, 8)
    least = least_memory_bytes(t)
    lightest = [min(t.layer_memory_bytes(7, k) for k in costs) for costs in t.cost]  # fewest in flight
    heaviest = [min(t.layer_memory_bytes(0, k) for k in costs) for costs in t.cost]
    assert sum(lightest) / 8 * (1 - 1e-9) <= least <= sum(heaviest)


@pytest.mark.timeout(180)  # a safety net (it took minutes before); no wall-clock assertion on a shared host
def test_a_huge_chain_that_fits_nowhere_answers_within_the_time_limit():
    """Tabulating 10,000 layers takes about a second per (pp, c) candidate here: the search stops at the deadline
    and says so, instead of running on (it took minutes: the memory message alone was quadratic in layers)."""
    from uniap_lightning.errors import UniAPError

    problem = random_problem(0, num_layers=10_000, nodes=2, per_node=4, batch=64, memory_gib=1.0)
    with pytest.raises(UniAPError, match="time limit ran out|no plan fits"):
        solve(problem, solver="cbc", time_limit_s=2.0)


def test_a_hard_candidate_goes_back_into_the_queue_and_cannot_starve_the_rest(monkeypatch):
    """The candidate with the best bound plays a hard MILP: any solve shorter than 150 s ends without a solution.
    Its first solve gets a slice (a tenth of the 1,000 s search), runs out, and the candidate goes back into the
    queue with twice the time; every other candidate is solved (or pruned) before its second turn, and the search
    still ends exact, with the plan of a search where nothing was hard."""
    from uniap_lightning.planner.solver import parallel
    from uniap_lightning.planner.solver.backend import MilpResult
    from uniap_lightning.planner.solver.search import search

    problem = random_problem(3, num_layers=6, nodes=2, per_node=2, memory_gib=40.0)
    expected = search(problem, solver="cbc", time_limit_s=120, workers=1)
    assert expected.solver.status == "optimal"
    real, calls = parallel.solve_candidate, []
    hard: list[tuple] = []

    def solve(tables, solver, time_limit_s, cutoff_s):
        key = (tables.pp, tables.c, tables.schedule, tables.v)
        if not hard:
            hard.append(key)  # the first handed out: the best bound
        calls.append((key, time_limit_s))
        if key == hard[0] and time_limit_s < 150:
            return MilpResult("no_solution", None, None, None, None, 0.0, time_limit_s, 1, 1)
        return real(tables, solver, time_limit_s, cutoff_s)

    monkeypatch.setattr(parallel, "solve_candidate", solve)
    plan = search(problem, solver="cbc", time_limit_s=1000, workers=1)
    assert plan.solver.status == "optimal" and plan.solver.gap == 0.0
    assert plan.estimate.tpi_s == pytest.approx(expected.estimate.tpi_s, rel=1e-9)
    turns = [i for i, (key, _) in enumerate(calls) if key == hard[0]]
    assert len(turns) == 2 and 90 <= calls[turns[0]][1] <= 100  # a tenth of what is left of the 1,000 s
    assert calls[turns[1]][1] >= 150  # twice the slice, or what was left when it was the last one
    assert turns[1] == len(calls) - 1 and len(calls) > 2  # the others ran in between
    record = next(r for r in plan.search if (r["pp"], r["microbatches"], r["schedule"], r["virtual_stages"]) == hard[0])
    assert record["resolves"] == 1


def test_a_candidate_whose_refined_bound_falls_behind_waits_its_turn(monkeypatch):
    """The refined floors are computed when a candidate first reaches the front of the queue; if its bound then
    falls behind the next candidate's, it goes back in bound order instead of being solved first. Played with a
    refined bound just behind the second candidate's that is still below the first's own optimum (so still a lower
    bound): the second is solved first, and the search ends exact with the plan of an unhindered search."""
    import importlib

    from bruteforce import brute_force

    from uniap_lightning.planner.solver import parallel
    from uniap_lightning.planner.solver.search import search

    search_module = importlib.import_module("uniap_lightning.planner.solver.search")
    problem = random_problem(3, num_layers=6, nodes=2, per_node=2, memory_gib=40.0)
    expected = search(problem, solver="cbc", time_limit_s=120, workers=1)
    real_bound, real_solve = search_module.time_lower_bound_s, parallel.solve_candidate
    trace: list[dict] = []
    cands, _ = search_module._candidates(problem, None, None, trace, search_module.Deadline.after(60))
    cands.sort(key=lambda cd: cd.bound_s)
    first, second = cands[0], cands[1]
    key = lambda t: (t.pp, t.c, t.schedule, t.v)  # noqa: E731
    behind = second.bound_s * (1 + 1e-9)
    own = brute_force(problem, candidate=(first.pp, first.c))
    assert own is not None and own.estimate.tpi_s > behind  # the played bound is a true lower bound
    order: list[tuple] = []

    def bound(tables, *, refined=False, group_memory=False):
        if refined and key(tables) == key(first.tables):
            return max(real_bound(tables, refined=True, group_memory=group_memory), behind)
        return real_bound(tables, refined=refined, group_memory=group_memory)

    def solve(tables, solver, time_limit_s, cutoff_s):
        order.append(key(tables))
        return real_solve(tables, solver, time_limit_s, cutoff_s)

    monkeypatch.setattr(search_module, "time_lower_bound_s", bound)
    monkeypatch.setattr(parallel, "solve_candidate", solve)
    plan = search(problem, solver="cbc", time_limit_s=120, workers=1)
    assert plan.solver.status == "optimal"
    assert plan.estimate.tpi_s == pytest.approx(expected.estimate.tpi_s, rel=1e-9)
    assert order[0] == key(second.tables)  # the first went back behind the second
    record = next(r for r in plan.search if (r["pp"], r["microbatches"], r["schedule"], r["virtual_stages"])
                  == key(first.tables))
    assert record["bound_s"] >= behind


def test_past_the_deadline_no_candidate_gets_its_costlier_floors(monkeypatch):
    """The refined floors take up to a second per candidate (LLaMA-70B on 8,192 devices: about 100 candidates
    still queued at the deadline ran 54 s past a 60 s limit). Played with a clock where the first solve uses the
    whole time left: no refined floor is computed after it, every candidate still queued is reported with the bound
    it had ("not solved (time limit)" or pruned by it), and the gap is taken over those bounds."""
    import importlib

    from uniap_lightning.planner.solver import parallel
    from uniap_lightning.planner.solver.backend import MilpResult

    search_module = importlib.import_module("uniap_lightning.planner.solver.search")
    clock = FakeClock()
    monkeypatch.setattr(backend, "now_s", clock)
    monkeypatch.setattr(search_module, "now_s", clock)
    problem = random_problem(3, num_layers=6, nodes=2, per_node=2, memory_gib=40.0)
    real_bound = search_module.time_lower_bound_s
    refined_after: list[float] = []
    deadline_at = clock.now_s + 100.0

    def bound(tables, *, refined=False, group_memory=False):
        if refined and clock.now_s >= deadline_at:
            refined_after.append(clock.now_s)
        return real_bound(tables, refined=refined, group_memory=group_memory)

    def solve(tables, solver, time_limit_s, cutoff_s):  # a solve that runs to the end of what it is given
        clock.now_s = deadline_at
        return MilpResult("no_solution", None, None, None, None, 0.0, time_limit_s, 1, 1)

    monkeypatch.setattr(search_module, "time_lower_bound_s", bound)
    monkeypatch.setattr(parallel, "solve_candidate", solve)
    plan = search_module.search(problem, solver="cbc", time_limit_s=100.0, workers=1)
    assert refined_after == []
    assert clock.now_s == deadline_at
    outcomes = [r["outcome"] for r in plan.search]
    assert outcomes.count("no_solution") == 1 and len(outcomes) > 2
    assert set(outcomes) <= {"no_solution", "not solved (time limit)", "pruned by bound", "does not fit"}
    assert plan.solver.status == "time_limit" and plan.solver.gap is not None and plan.solver.gap > 0
