"""The solver's valid inequalities and candidate bounds (:mod:`uniap_lightning.planner.solver.bounds`) never cut
off a plan: checked on random plans of every candidate, and against each candidate's brute-force optimum, on
homogeneous and heterogeneous clusters (devices faster than the profiled one included)."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
from bruteforce import brute_force
from bruteforce_groups import group_value_brute
from planner_factories import forced_problem, random_problem, repeated_problem

from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.cost.evaluate import stage_terms
from uniap_lightning.planner.cost.layer import strategies_for
from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver import resolve_solver
from uniap_lightning.planner.solver.bounds import (
    chain_bottleneck_s,
    chain_sync_floor_s,
    group_sync_floor_s,
    memory_chain_floor_s,
    memory_chain_sync_floor_s,
    memory_partition_floor,
    partition_floor,
    pigeonhole_floor,
    pigeonhole_floor_uneven,
    stage_memory_allowance_bytes,
    staged_partition_floor,
    time_lower_bound_s,
)
from uniap_lightning.planner.solver.group_floor import (GroupMemoryFloor, cheapest_stage_sum_s, group_memory_floor_s,
                                                       group_stage_floor_s, run_ends, run_group_stage_floor_s)
from uniap_lightning.planner.solver.milp import GroupedMilp

REL = 1e-9
SOLVER = resolve_solver("auto")


def _hetero(problem, seed: int):
    """Per-rank speeds (some faster than the profile, 1.5) and memories; every third seed all ranks are fast."""
    rng = random.Random(2000 + seed)
    n = problem.cluster.num_devices
    speed = [1.5] * n if seed % 3 == 0 else [rng.choice([0.25, 0.5, 1.0, 1.5]) for _ in range(n)]
    memory = [problem.cluster.memory_gib * rng.choice([0.5, 1.0, 2.0]) for _ in range(n)]
    return replace(problem, cluster=replace(problem.cluster, rank_speed=tuple(speed), rank_memory_gib=tuple(memory)))


def _problem(seed: int):
    """Alternately random chains and runs of identical blocks (more layers than stages: the floors bind)."""
    shape = [(1, 2), (2, 2), (1, 4)][seed % 3]
    if seed % 2:
        p = repeated_problem(seed, pattern="ABBBBBBC", nodes=shape[0], per_node=shape[1],
                             memory_gib=(8.0, 40.0, 16.0)[seed % 3], schedule=("1f1b", "gpipe")[seed % 2])
    else:
        p = random_problem(seed, num_layers=4, nodes=shape[0], per_node=shape[1], memory_gib=(2.0, 8.0, 40.0)[seed % 3],
                           compression=("none", "bf16") if seed % 4 == 0 else ("none",))
    return _hetero(p, seed) if seed % 5 in (1, 3) else p


def _candidates(problem):
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            t = CostTables(problem, pp, c)
            if t.feasible_shape:
                yield t


def _small(problem, t) -> bool:
    """The brute force over this candidate stays small: its largest stage has few assignments."""
    sizes = sorted((len(strategies_for(lp, t.n, problem.cluster, t.b, compression=problem.compression))
                    for lp in problem.model.layers), reverse=True)
    return math.prod(sizes[: len(sizes) - t.pp + 1]) <= 200_000


def _bottleneck_and_sync(plan) -> tuple[float, float]:
    est = plan.estimate
    return max(est.stage_time_s), max(est.stage_sync_s)


def test_partition_floor_is_the_linear_partition_optimum_from_below():
    rng = random.Random(0)
    for _ in range(200):
        w = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(rng.randint(1, 7))]
        P = rng.randint(1, len(w))
        exact = min(
            max(sum(w[a:b]) for a, b in zip((0, *cuts), (*cuts, len(w))))
            for cuts in itertools.combinations(range(1, len(w)), P - 1)
        )
        got = partition_floor(w, P)
        assert got <= exact * (1 + 1e-12) + 1e-15
        assert got >= exact * (1 - 1e-9) - 1e-12


@pytest.mark.parametrize("seed", range(12))
def test_floors_hold_for_random_plans_of_every_candidate(seed):
    """(c - 1) max_i p_i + max_i sync_i >= chain_sync_floor_s and max_i p_i >= chain_bottleneck_s (pp > 1), and
    TPI >= time_lower_bound_s when the plan fits, for random splits and strategies (dominated ones too)."""
    problem = _problem(seed)
    rng = random.Random(seed)
    L = problem.model.num_layers
    checked = 0
    for t in _candidates(problem):
        floor, chain, bound = chain_sync_floor_s(t), chain_bottleneck_s(t), time_lower_bound_s(t)
        options = [strategies_for(lp, t.n, problem.cluster, t.b, compression=problem.compression)
                   for lp in problem.model.layers]
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, L), t.pp - 1))
            stage_of = [sum(u >= x for x in cuts) for u in range(L)]
            plan = problem.plan_for(stage_of_layer=stage_of, strategies=[rng.choice(o) for o in options],
                                    pp=t.pp, microbatches=t.c)
            plan = plan.with_report(estimate=evaluate(problem, plan))
            T, Y = _bottleneck_and_sync(plan)
            assert t.tpi_s(0.0, 0.0, T, Y) >= floor * (1 - REL), (t.pp, t.c, stage_of)
            if t.pp > 1:
                assert T >= chain * (1 - REL)
            if plan.estimate.feasible:  # the run floors count memory: they bound the plans that fit
                assert plan.estimate.tpi_s >= bound * (1 - REL)
                _assert_memory_floors(problem, t, plan)
            checked += 1
    assert checked > 0


def _assert_memory_floors(problem, t, plan) -> None:
    """A plan that fits memory holds the memory-aware floors and the candidate's bound that includes them."""
    terms = stage_terms(problem, plan)
    groups = [sum(terms.stage_time_s[k] for k in t.stages_of(g)) for g in range(t.pp)]
    T = t.bottleneck_s(groups, terms.boundary_s, terms.stage_time_s)
    assert max(terms.stage_time_s) >= t.stage_time_s(memory_chain_floor_s(t)) * (1 - REL), [lp.stage for lp in plan.layers]
    assert t.tpi_s(0.0, 0.0, T, max(terms.sync_s)) >= memory_chain_sync_floor_s(t) * (1 - REL), [lp.stage for lp in plan.layers]
    assert t.tpi_s(0.0, 0.0, T, max(terms.sync_s)) >= group_stage_floor_s(t) * (1 - REL), [lp.stage for lp in plan.layers]
    floor = t.tpi_s(cheapest_stage_sum_s(t), 0.0, 0.0, 0.0) + group_stage_floor_s(t, stage_sum=True)
    assert t.tpi_s(sum(terms.stage_time_s), 0.0, T, max(terms.sync_s)) >= floor * (1 - REL), [lp.stage for lp in plan.layers]
    assert plan.estimate.tpi_s >= time_lower_bound_s(t, refined=True) * (1 - REL), [lp.stage for lp in plan.layers]
    # each device group's memory (computed on demand, then part of the floors above)
    assert t.tpi_s(0.0, 0.0, T, max(terms.sync_s)) >= group_memory_floor_s(t) * (1 - REL), [lp.stage for lp in plan.layers]
    assert plan.estimate.tpi_s >= time_lower_bound_s(t, refined=True, group_memory=True) * (1 - REL)


@pytest.mark.parametrize("seed", range(8))
def test_floors_never_cut_off_a_candidates_brute_force_optimum(seed):
    """Per candidate, the brute-force optimum satisfies the MILP's cut and the candidate's bound, and the MILP
    (which holds the cut) finds that optimum: the global oracle tests alone could miss a candidate whose optimum
    a wrong cut removed but another candidate's plan beat anyway."""
    problem = _problem(seed)
    checked = 0
    for t in _candidates(problem):
        if not _small(problem, t):
            continue
        best = brute_force(problem, candidate=(t.pp, t.c))
        if best is None:
            continue
        checked += 1
        T, Y = _bottleneck_and_sync(best)
        floor = chain_sync_floor_s(t)
        assert t.tpi_s(0.0, 0.0, T, Y) >= floor * (1 - REL), (t.pp, t.c)
        assert best.estimate.tpi_s >= time_lower_bound_s(t) * (1 - REL), (t.pp, t.c)
        _assert_memory_floors(problem, t, best)
        res = GroupedMilp(t, solver=SOLVER).solve(time_limit_s=60)
        assert res.status == "optimal" and res.objective_s == pytest.approx(best.estimate.tpi_s, rel=1e-6), (t.pp, t.c)
    assert checked > 0


def test_the_sync_floor_is_tight_on_repeated_blocks():
    """The floor is not vacuous: on runs of identical blocks the optimum's (c - 1) T + Y equals it on some
    pipelined candidate (the busiest stage holds whole blocks at their best mix of time and sync)."""
    found = 0
    for seed in (1, 3, 5, 7):
        problem = _problem(seed)
        for t in _candidates(problem):
            if t.pp == 1 or not _small(problem, t):
                continue
            best = brute_force(problem, candidate=(t.pp, t.c))
            if best is None:
                continue
            T, Y = _bottleneck_and_sync(best)
            found += abs(t.tpi_s(0.0, 0.0, T, Y) - chain_sync_floor_s(t)) <= 1e-6 * chain_sync_floor_s(t)
    assert found > 0


@pytest.mark.parametrize("seed", range(6))
def test_the_group_floor_of_bottleneck_and_sync_holds_with_several_stages_per_device(seed):
    """b_T T + Y >= group_sync_floor_s for random plans of looped and V schedules (v = 2, 3): each device group
    holds whole layers' time and sync, wherever its v stages sit in the chain; and a plan that fits costs at least
    the candidate's bound."""
    problem = repeated_problem(seed, pattern="ABBBBBBBC", nodes=1, per_node=(2, 4)[seed % 2], schedule="auto",
                               memory_gib=(8.0, 40.0)[seed % 2])
    problem = replace(problem, training=replace(problem.training, max_virtual_stages=3))
    if seed % 2:  # devices of different speeds: each group's layers priced at its own speed
        problem = _hetero(problem, seed)
    rng = random.Random(seed)
    L = problem.model.num_layers
    checked = 0
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            for schedule, v in problem.training.schedule_candidates(pp, c, L):
                if v == 1:
                    continue
                t = CostTables(problem, pp, c, schedule=schedule, virtual_stages=v)
                if not t.feasible_shape:
                    continue
                floor, bound = group_sync_floor_s(t), time_lower_bound_s(t)
                options = [strategies_for(lp, t.n, problem.cluster, t.b, compression=problem.compression)
                           for lp in problem.model.layers]
                for _ in range(30):
                    cuts = sorted(rng.sample(range(1, L), t.stages - 1))
                    stage_of = [sum(u >= x for x in cuts) for u in range(L)]
                    plan = problem.plan_for(stage_of_layer=stage_of, strategies=[rng.choice(o) for o in options],
                                            pp=pp, microbatches=c, schedule=schedule, virtual_stages=v)
                    plan = plan.with_report(estimate=evaluate(problem, plan))
                    T, Y = _bottleneck_and_sync(plan)
                    assert t.tpi_s(0.0, 0.0, T, Y) >= floor * (1 - REL), (pp, c, schedule, v, stage_of)
                    if plan.estimate.feasible:
                        assert plan.estimate.tpi_s >= bound * (1 - REL), (pp, c, schedule, v, stage_of)
                        _assert_memory_floors(problem, t, plan)
                    checked += 1
    assert checked > 0


def test_the_group_floor_is_the_pigeonhole_bound_from_below():
    """pigeonhole_floor never exceeds the least largest group sum over every way to share the weights."""
    rng = random.Random(1)
    for _ in range(150):
        w = [rng.uniform(0, 10) for _ in range(rng.randint(1, 7))]
        g = rng.randint(1, 3)
        exact = min(max(sum(x for x, a in zip(w, assign) if a == k) for k in range(g))
                    for assign in itertools.product(range(g), repeat=len(w)))
        assert pigeonhole_floor(w, g) <= exact * (1 + 1e-12) + 1e-15
    # tight where it matters: 9 equal weights on 4 groups put 3 on one group
    assert pigeonhole_floor([1.0] * 9, 4) == pytest.approx(3.0)


def test_the_uneven_pigeonhole_floor_is_a_lower_bound_and_sees_a_slow_group():
    """Groups that price items differently (a slowed node's group): the floor never exceeds the brute-force least
    largest group sum, and equals pigeonhole_floor when every group prices alike."""
    rng = random.Random(2)
    for _ in range(150):
        n = rng.randint(1, 6)
        classes = [(rng.randint(1, 2), [rng.uniform(0, 10) for _ in range(n)])]
        classes.append((rng.randint(1, 2), [w * rng.uniform(1.0, 3.0) for w in classes[0][1]]))
        groups = [w for count, w in classes for _ in range(count)]
        exact = min(max(sum(groups[g][u] for u in range(n) if assign[u] == g) for g in range(len(groups)))
                    for assign in itertools.product(range(len(groups)), repeat=n))
        assert pigeonhole_floor_uneven(classes) <= exact * (1 + 1e-12) + 1e-15
    w = [rng.uniform(0, 5) for _ in range(9)]
    assert pigeonhole_floor_uneven([(4, w)]) == pigeonhole_floor(w, 4)
    # 4 equal items on one fast and one 3x slower group: the slow group takes at most 1, so the fast one 3
    assert pigeonhole_floor_uneven([(1, [1.0] * 4), (1, [3.0] * 4)]) == pytest.approx(3.0)


def test_the_staged_partition_floor_is_the_least_largest_part_from_below():
    """Each part prices the layers its own way (a slow stage's layers cost more): the floor equals the brute-force
    least largest part over every split into contiguous parts in order (empty parts allowed), from below."""
    rng = random.Random(11)
    for _ in range(200):
        L, P = rng.randint(1, 7), rng.randint(1, 4)
        speeds = [rng.choice((1.0, 0.5, 0.3)) for _ in range(P)]
        base = [rng.uniform(0.0, 3.0) for _ in range(L)]
        weights = [[b / s for b in base] for s in speeds]
        best = math.inf
        for cuts in itertools.combinations_with_replacement(range(L + 1), P - 1):
            edges = (0, *cuts, L)
            best = min(best, max(sum(weights[i][edges[i]:edges[i + 1]]) for i in range(P)))
        got = staged_partition_floor(weights)
        assert got <= best + 1e-12 and got >= best * (1 - 1e-9), (got, best)


def _least_largest_part(t, price) -> float:
    """Brute force of what :func:`memory_partition_floor` computes: over every split of the chain into the
    candidate's stages in order (empty parts allowed) and every strategy of every layer, with each stage's layers
    within its allowance, the least largest stage price."""
    S, L = t.stages, len(t.layers)
    allowance = [stage_memory_allowance_bytes(t, i) for i in range(S)]
    best = math.inf
    for cuts in itertools.combinations_with_replacement(range(L + 1), S - 1):
        edges = (0, *cuts, L)
        worst = 0.0
        for i in range(S):
            least = math.inf
            for ks in itertools.product(*(t.cost[u] for u in range(edges[i], edges[i + 1]))):
                memory = sum(t.layer_memory_bytes(i, k) for k in ks) + max((k.transient_bytes for k in ks), default=0)
                if memory <= allowance[i]:
                    least = min(least, sum(price(t.stage_speed(i), k) for k in ks))
            worst = max(worst, least)
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_memory_partition_floor_is_the_brute_force_least_largest_stage(seed):
    """The greedy split with exact strategy mixes equals brute force over splits and strategies, on chains whose
    memory forces recomputation or sharding (and ``inf`` exactly when nothing fits)."""
    problem = forced_problem(seed, memory_gib=(0.5, 1.0, 2.0)[seed % 3], activation_scale=40.0, param_scale=0.2,
                             num_layers=4, per_node=2)
    problem = replace(problem, training=replace(problem.training, schedule="auto", max_virtual_stages=2))
    checked = 0
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            for schedule, v in problem.training.schedule_candidates(pp, c, problem.model.num_layers):
                t = CostTables(problem, pp, c, schedule=schedule, virtual_stages=v)
                if not t.feasible_shape:
                    continue
                price = lambda speed, k: t._time_at(k, speed)  # noqa: E731
                exact, got = _least_largest_part(t, price), memory_partition_floor(t, price)
                if exact == math.inf:
                    assert got == math.inf
                else:
                    assert exact * (1 - 1e-6) <= got <= exact * (1 + 1e-12), (pp, c, schedule, v, got, exact)
                checked += 1
    assert checked > 0


def test_the_memory_floors_see_what_memory_forces():
    """Not vacuous: on chains whose activations do not all fit, some candidate's memory-aware floor is above the
    plain one, and some candidate's brute-force optimum meets the memory-aware bound of bottleneck and sync."""
    above = tight = 0
    for seed in (1, 3, 5):
        problem = repeated_problem(seed, pattern="ABBBBBC", nodes=1, per_node=2, memory_gib=4.0)
        for t in _candidates(problem):
            if t.pp == 1 or memory_chain_floor_s(t) == math.inf:
                continue
            above += memory_chain_floor_s(t) > chain_bottleneck_s(t) * (1 + 1e-6)
            best = brute_force(problem, candidate=(t.pp, t.c))
            if best is None:
                continue
            _assert_memory_floors(problem, t, best)
            T, Y = _bottleneck_and_sync(best)
            floor = memory_chain_sync_floor_s(t)
            tight += abs(t.tpi_s(0.0, 0.0, T, Y) - floor) <= 1e-6 * floor and floor > chain_sync_floor_s(t) * (1 + 1e-6)
    assert above > 0 and tight > 0, (above, tight)


def test_the_search_tightens_a_candidates_bound_with_memory_before_solving_it():
    """The memory-aware floors join a candidate's bound when it reaches the front of the queue (they cost too much
    to compute for every candidate up front): some candidate's recorded bound is above its cheap one, no recorded
    bound is above what the candidate's own optimum costs, and the search still finds the brute-force optimum."""
    from uniap_lightning.planner.solver.search import search

    problem = repeated_problem(1, pattern="ABBBBBC", nodes=1, per_node=2, memory_gib=4.0)
    plan = search(problem, solver=SOLVER, time_limit_s=60, workers=1)
    oracle = brute_force(problem)
    assert plan.solver.status == "optimal"
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
    tightened = 0
    for record in plan.search:
        if record["bound_s"] is None:  # does not fit (memory_lower_bound_bytes): never queued
            continue
        t = CostTables(problem, record["pp"], record["microbatches"])
        assert record["bound_s"] >= time_lower_bound_s(t, refined=True) * (1 - 1e-12), record
        tightened += time_lower_bound_s(t, refined=True) > time_lower_bound_s(t) * (1 + 1e-9)
        own = brute_force(problem, candidate=(record["pp"], record["microbatches"]))
        if own is not None:
            assert record["bound_s"] <= own.estimate.tpi_s * (1 + 1e-9), record
    assert tightened > 0


@pytest.mark.parametrize("seed", range(4))
def test_the_memory_floors_hold_for_the_brute_force_optimum_with_several_stages_per_device(seed):
    """Looped and V schedules (v = 2, 3), memory tight: a device group's stages share its memory, so each stage's
    allowance is what the others leave at least; every candidate's brute-force optimum (numpy oracle, which
    shares nothing with the bounds) holds both memory-aware floors and the bound that includes them."""
    from bruteforce_pipeline import brute_force_candidate

    problem = repeated_problem(seed, pattern="ABBBBC", nodes=1, per_node=2, schedule="auto",
                               memory_gib=(4.0, 3.0, 4.0, 6.0)[seed])
    problem = replace(problem, training=replace(problem.training, max_virtual_stages=3))
    checked = 0
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            for schedule, v in problem.training.schedule_candidates(pp, c, problem.model.num_layers):
                if v == 1:
                    continue
                t = CostTables(problem, pp, c, schedule=schedule, virtual_stages=v)
                best = brute_force_candidate(problem, pp, c, schedule, v) if t.feasible_shape else None
                if best is not None:
                    _assert_memory_floors(problem, t, best)
                    checked += 1
    assert checked > 0


def _multi_stage_tables(problem):
    """Every candidate of ``problem`` with several stages per device group whose shape is feasible."""
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            for schedule, v in problem.training.schedule_candidates(pp, c, problem.model.num_layers):
                if v > 1:
                    t = CostTables(problem, pp, c, schedule=schedule, virtual_stages=v)
                    if t.feasible_shape:
                        yield pp, c, schedule, v, t


@pytest.mark.parametrize("seed", range(4))
def test_the_group_memory_program_is_the_brute_force_least_value(seed, monkeypatch):
    """A device group's program (counts per stage and strategy, the group's memory shared by its stages) equals
    brute force over every split of X run layers over its stages and every strategy mix, end layers included; and
    inf exactly when nothing fits. (Its time budget is lifted: this checks the value, not the budget.)"""
    from uniap_lightning.planner.solver import group_memory

    monkeypatch.setattr(group_memory, "MEMORY_BUDGET_S", 1e6)
    problem = forced_problem(seed, memory_gib=(0.5, 1.0, 2.0, 1.0)[seed], activation_scale=40.0, param_scale=0.2,
                             num_layers=3, per_node=2)
    layers = [problem.model.layers[0]] + [problem.model.layers[1]] * 4 + [problem.model.layers[2]]
    problem = replace(problem, model=replace(problem.model, layers=[replace(lp, name=f"L{u}") for u, lp in enumerate(layers)]),
                      training=replace(problem.training, schedule="auto", max_virtual_stages=2))
    checked = 0
    for pp, c, schedule, v, t in _multi_stage_tables(problem):
        a, e = next((a, e) for a, e in t.runs() if e > a)
        L, S = len(t.layers), t.stages
        ends = run_ends(t, a, e)
        lo, hi = max(0, S - L + a), min(e, S - 1)
        for a_p in (0.0, t.shape.a_p):
            program = GroupMemoryFloor(t, a, e, ends, t.shape.b_T * max(1.0, t.shape.stage_weight), a_p)
            for grp in range(t.pp):
                mine = [k for k in t.stages_of(grp) if lo <= k <= hi or k in ends]
                reachable = [k for k in mine if lo <= k <= hi]
                outside = [k for k in mine if k not in reachable]
                for X in range(0, 4):
                    got = program.value_ms(grp, reachable, outside, X)
                    assert got is not None, (pp, c, schedule, grp, X)
                    exact = group_value_brute(t, program, grp, reachable, outside, X)
                    if exact == math.inf:
                        assert got == math.inf, (pp, c, schedule, grp, X, got)
                    else:
                        assert got == pytest.approx(exact, rel=1e-7), (pp, c, schedule, grp, X)
                    checked += 1
    assert checked > 0


def test_each_groups_memory_raises_the_group_floor_and_the_milp_keeps_the_optimum():
    """Not vacuous: where a group's stages cannot all take their fastest mix within the memory they share, the
    floor with memory is above the one without (on some candidate) and below the brute-force optimum's b_T T + Y;
    the MILP, which gets it as a row once computed, still finds that optimum."""
    from bruteforce_pipeline import brute_force_candidate

    above = 0
    for seed in range(4):
        problem = repeated_problem(seed, pattern="ABBBBC", nodes=1, per_node=2, schedule="auto",
                                   memory_gib=(4.0, 3.0, 4.0, 6.0)[seed])
        problem = replace(problem, training=replace(problem.training, max_virtual_stages=3))
        for pp, c, schedule, v, t in _multi_stage_tables(problem):
            without = max((run_group_stage_floor_s(t, a, e, memory=False) for a, e in t.runs() if e > a),
                          default=0.0)
            with_memory = group_memory_floor_s(t)
            assert with_memory >= without * (1 - 1e-6)
            above += with_memory > without * (1 + 1e-6)
            best = brute_force_candidate(problem, pp, c, schedule, v)
            if best is None:
                continue
            res = GroupedMilp(t, solver=SOLVER).solve(time_limit_s=60)
            assert res.status == "optimal", (pp, c, schedule, v)
            assert res.objective_s == pytest.approx(best.estimate.tpi_s, rel=1e-6), (pp, c, schedule, v)
    assert above > 0
