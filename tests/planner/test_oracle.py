"""The MILP's optimum equals brute force over the same cost formulas (randomized, seeded).

The instances cover every dimension of a layer's strategy: (d, t), dp_mode (replicate / zero1 / zero2 / zero3),
recomputation, and gradient compression where the problem allows it; small memories force sharding,
recomputation or pipelining, or make nothing fit. ``test_oracle_optima_use_every_dimension`` checks that the
optima really do use each of them, so the equalities are not won on a space that never leaves the old one.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
from bruteforce import brute_force
from planner_factories import forced_problem, random_problem, repeated_problem

from uniap_lightning.errors import InfeasibleError
from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.solver import resolve_solver, search

SOLVERS = ["cbc"] + (["highs"] if resolve_solver("auto") == "highs" else [])

SHAPES = [(1, 2), (1, 4), (2, 2), (2, 1), (2, 4)]  # (nodes, devices per node)
MEMORY_GIB = [0.5, 1.0, 2.0, 4.0, 8.0, 40.0]  # small ones force sharding / recomputation / pipelining, or no fit
COMPRESSION = [("none",), ("none", "bf16"), ("none", "powersgd", "topk"), ("none", "bf16", "powersgd", "topk")]


def _case(seed: int) -> tuple:
    nodes, per_node = SHAPES[seed % len(SHAPES)]
    devices = nodes * per_node
    comp = COMPRESSION[seed % len(COMPRESSION)]
    # the brute force is exponential in the layers (~10-30 strategies each)
    layers = {2: 3 + seed % 3, 4: 3 + seed % 2}.get(devices, 3)
    if len(comp) > 2:
        layers = min(layers, 4 if devices <= 2 else 3)
    return seed, layers, nodes, per_node, ("1f1b", "gpipe")[seed % 2], MEMORY_GIB[seed % len(MEMORY_GIB)], comp


CASES = [_case(seed) for seed in range(24)]


def _problem(case):
    if case[0] == "forced":
        _, seed, memory_gib, act, params, *shape = case
        layers, nodes, per_node, comp = shape or (4, 1, 2, ("none",))
        return forced_problem(seed, memory_gib=memory_gib, activation_scale=act, param_scale=params,
                              num_layers=layers, nodes=nodes, per_node=per_node, compression=comp)
    seed, layers, nodes, per_node, schedule, memory_gib, comp = case
    return random_problem(seed, num_layers=layers, nodes=nodes, per_node=per_node, schedule=schedule,
                          memory_gib=memory_gib, compression=comp)


@lru_cache(maxsize=None)
def _oracle(case):
    return brute_force(_problem(case))


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-L{c[1]}-{c[2]}x{c[3]}-{c[5]}G-{'+'.join(c[6])}")
def test_milp_matches_brute_force(case, solver):
    problem = _problem(case)
    oracle = _oracle(case)
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
    allowed = set(problem.compression)
    assert all(lp.strategy.compression in allowed for lp in plan.layers)


def test_oracle_optima_use_every_dimension():
    """Across the instances, the optimal plans use recomputation, every ZeRO mode and a compression method, and
    some instance has no plan at all: the comparison covers the whole space."""
    seen = set()
    infeasible = 0
    for case in CASES + FORCED:
        best = _oracle(case)
        if best is None:
            infeasible += 1
            continue
        for lp in best.layers:
            if lp.strategy.dp > 1:
                seen.add(lp.strategy.dp_mode)
            if lp.strategy.recompute:
                seen.add("recompute")
            if lp.strategy.compression != "none":
                seen.add("compressed")
    assert {"replicate", "zero1", "zero2", "zero3", "recompute", "compressed"} <= seen, seen
    assert infeasible > 0


# Activations large and memory tight: the optimum recomputes, shards or accumulates (checked: the search restricted
# to replicated layers without recomputation is worse or finds nothing).
FORCED = [("forced", 0, 1.0, 5, 0.05), ("forced", 1, 1.0, 2, 0.3), ("forced", 4, 2.0, 2, 0.3),
          ("forced", 6, 0.5, 5, 0.05), ("forced", 3, 1.0, 5, 0.05),
          # ZeRO-1 costs more memory than ZeRO-2 as the runtime holds it, and its all-reduce more time than ZeRO-2's
          # reduce-scatter: it wins only where its gradients compress (two nodes of one device, slow link)
          ("forced", 2, 2.0, 2, 0.3, 3, 2, 1, ("none", "bf16", "powersgd", "topk"))]


@pytest.mark.parametrize("case", FORCED, ids=lambda c: f"seed{c[1]}-{c[2]}G")
def test_memory_forces_recomputation_or_sharding(case):
    problem = _problem(case)
    oracle = _oracle(case)
    assert oracle is not None
    plan = search(problem, time_limit_s=60)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
    assert plan.solver.objective_s == pytest.approx(plan.estimate.tpi_s, rel=1e-6)
    try:
        plain = search(problem, allowed=lambda s: not s.recompute and s.dp_mode == "replicate", time_limit_s=60)
    except InfeasibleError:
        plain = None
    assert plain is None or plain.estimate.tpi_s > plan.estimate.tpi_s * (1 + 1e-9)
    assert any(lp.strategy.recompute or (lp.strategy.dp > 1 and lp.strategy.dp_mode != "replicate") for lp in plan.layers)


PATTERNS = ["ABBBC", "AAAA", "ABBB", "AABBB", "ABABB", "ABBBBC"]
REPEATED = [
    (seed, PATTERNS[seed % len(PATTERNS)][:5 if SHAPES[seed % 4][0] * SHAPES[seed % 4][1] >= 4 else 6],
     *SHAPES[seed % 4], ("1f1b", "gpipe")[seed % 2], (0.5, 1.0, 2.0, 4.0, 40.0)[seed % 5])
    for seed in range(12)
]


@pytest.mark.parametrize(("seed", "pattern", "nodes", "per_node", "schedule", "memory_gib"), REPEATED)
def test_grouped_milp_matches_brute_force_on_repeated_layers(seed, pattern, nodes, per_node, schedule, memory_gib):
    """Runs of identical layers are what the grouped formulation aggregates: it must stay exact there."""
    problem = repeated_problem(
        seed, pattern=pattern, nodes=nodes, per_node=per_node, schedule=schedule, memory_gib=memory_gib,
        compression=("none", "bf16") if seed % 3 == 2 else ("none",),
    )
    if seed % 3 == 2 and nodes * per_node >= 4:  # compression widens the space: keep the brute force small
        problem = repeated_problem(seed, pattern=pattern[:4], nodes=nodes, per_node=per_node, schedule=schedule,
                                   memory_gib=memory_gib, compression=problem.compression)
    oracle = brute_force(problem)
    if oracle is None:
        with pytest.raises(InfeasibleError):
            search(problem)
        return
    plan = search(problem)
    assert plan.solver.status == "optimal"
    assert plan.solver.objective_s == pytest.approx(plan.estimate.tpi_s, rel=1e-6)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2, *(pytest.param(s, marks=pytest.mark.slow) for s in (3, 4, 5))])
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
            a = StageMilp(tables, solver=SOLVERS[-1]).solve(time_limit_s=60)
            b = GroupedMilp(tables, solver=SOLVERS[-1]).solve(time_limit_s=60)
            assert (a.objective_s is None) == (b.objective_s is None), (pp, c, a.status, b.status)
            if a.objective_s is not None:
                assert b.objective_s == pytest.approx(a.objective_s, rel=1e-6), (pp, c)
                checked += 1
    assert checked > 0


# Micro-batches smaller than a stage with pp > 1 (issue 39): the stage boundaries cut the micro-batch into
# g = gcd(b, n) chunks, each held by n / g lanes (tp and cp ranks share a chunk). (seed, nodes, devices per node,
# memory GiB, batch), each checked to have such an optimum: dp 2 x tp 2 layers next to a tp 4 one (b = 2 < n = 4:
# the tp 4 layer gathers at the boundary), ZeRO-2 dp 2 x tp 2 next to tp 4, and tp 2 stages with one sample (b = 1).
SMALL_MICROBATCH = [(12, 2, 4, 1.0, 8), (20, 2, 4, 1.0, 8), (24, 1, 4, 1.0, 8)]


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("case", SMALL_MICROBATCH, ids=lambda c: f"seed{c[0]}-{c[1]}x{c[2]}-b{c[4]}")
def test_milp_matches_brute_force_with_micro_batches_smaller_than_a_stage(case, solver):
    seed, nodes, per_node, memory_gib, batch = case
    problem = random_problem(seed, num_layers=3, nodes=nodes, per_node=per_node, batch=batch, memory_gib=memory_gib)
    oracle = brute_force(problem)
    assert oracle is not None
    assert oracle.pp > 1 and oracle.micro_batch_size < oracle.devices_per_stage, (oracle.pp, oracle.micro_batch_size)
    assert oracle.estimate.boundary_s[0] > 0
    plan = search(problem, solver=solver, time_limit_s=60)
    assert plan.solver.status == "optimal"
    assert plan.solver.objective_s == pytest.approx(plan.estimate.tpi_s, rel=1e-6)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
