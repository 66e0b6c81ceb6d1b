"""The MILP's optimum equals brute force over the same cost formulas (randomized, seeded)."""

from __future__ import annotations

import pytest
from planner_factories import random_problem, repeated_problem

from uniap_lightning.planner.cost import evaluate
from uniap_lightning.errors import InfeasibleError
from uniap_lightning.planner.solver import resolve_solver, search
from bruteforce import brute_force

SOLVERS = ["cbc"] + (["highs"] if resolve_solver("auto") == "highs" else [])

SHAPES = [(1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (2, 1)]  # (nodes, devices per node)
MEMORY_GIB = [2.0, 4.0, 8.0, 40.0]  # small ones force sharding / pipelining, or make nothing fit
CASES = [
    (seed, 3 + seed % 4, *SHAPES[seed % len(SHAPES)], ("1f1b", "gpipe")[seed % 2], MEMORY_GIB[seed % 4])
    for seed in range(24)
]


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize(("seed", "layers", "nodes", "per_node", "schedule", "memory_gib"), CASES)
def test_milp_matches_brute_force(seed, layers, nodes, per_node, schedule, memory_gib, solver):
    problem = random_problem(
        seed, num_layers=layers, nodes=nodes, per_node=per_node, schedule=schedule, memory_gib=memory_gib
    )
    oracle = brute_force(problem)
    if oracle is None:
        with pytest.raises(InfeasibleError):
            search(problem, solver=solver, time_limit_s=60)
        return
    plan = search(problem, solver=solver, time_limit_s=60)
    assert plan.solver.status == "optimal"
    # The solver's objective equals evaluate() of its plan, and both equal the oracle's optimum.
    assert plan.estimate.tpi_s == pytest.approx(evaluate(problem, plan).tpi_s, rel=1e-12)
    assert plan.solver.objective_s == pytest.approx(plan.estimate.tpi_s, rel=1e-6)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
    assert plan.estimate.feasible


PATTERNS = ["ABBBC", "AAAA", "ABBB", "AABBB", "ABABB", "ABBBBC"]
REPEATED = [
    (seed, PATTERNS[seed % len(PATTERNS)], *SHAPES[seed % 4], ("1f1b", "gpipe")[seed % 2], (1.0, 2.0, 4.0, 40.0)[seed % 4])
    for seed in range(12)
]


@pytest.mark.parametrize(("seed", "pattern", "nodes", "per_node", "schedule", "memory_gib"), REPEATED)
def test_grouped_milp_matches_brute_force_on_repeated_layers(seed, pattern, nodes, per_node, schedule, memory_gib):
    """Runs of identical layers are what the grouped formulation aggregates: it must stay exact there."""
    problem = repeated_problem(
        seed, pattern=pattern, nodes=nodes, per_node=per_node, schedule=schedule, memory_gib=memory_gib
    )
    oracle = brute_force(problem)
    if oracle is None:
        with pytest.raises(InfeasibleError):
            search(problem)
        return
    plan = search(problem)
    assert plan.solver.status == "optimal"
    assert plan.solver.objective_s == pytest.approx(plan.estimate.tpi_s, rel=1e-6)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_grouped_and_per_layer_milp_agree_per_candidate(seed):
    """Per (pp, c) candidate, without pruning: the package's MILP and the per-layer reference MILP (a test
    reference, :mod:`reference_milp`) find the same optimum (or both none)."""
    from reference_milp import StageMilp

    from uniap_lightning.planner.cost.tables import CostTables
    from uniap_lightning.planner.solver.milp import GroupedMilp

    problem = repeated_problem(seed, pattern="ABBBBBBC", nodes=2, per_node=4, memory_gib=(2.0, 4.0, 8.0)[seed % 3])
    checked = 0
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            tables = CostTables(problem, pp, c)
            if not tables.feasible_shape:
                continue
            a = StageMilp(tables, solver="cbc").solve(time_limit_s=60)
            b = GroupedMilp(tables, solver="cbc").solve(time_limit_s=60)
            assert (a.objective_s is None) == (b.objective_s is None), (pp, c, a.status, b.status)
            if a.objective_s is not None:
                assert b.objective_s == pytest.approx(a.objective_s, rel=1e-6), (pp, c)
                checked += 1
    assert checked > 0
