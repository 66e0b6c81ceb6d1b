"""Heterogeneous clusters: per-rank speed and memory. A stage computes at its slowest device's speed and fits its
smallest device's memory; the MILP stays exact (brute force over the same formulas) and puts less work where the
devices are slow."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from bruteforce import brute_force
from planner_factories import random_problem, repeated_problem

from uniap_lightning.errors import InfeasibleError, UniAPError
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.problem import Problem, TrainingConfig
from uniap_lightning.planner.profile import LayerProfile, ModelProfile
from uniap_lightning.planner.solver import resolve_solver, search

SOLVERS = ["cbc"] + (["highs"] if resolve_solver("auto") == "highs" else [])


def _hetero(problem: Problem, seed: int) -> Problem:
    rng = random.Random(1000 + seed)
    n = problem.cluster.num_devices
    speed = [rng.choice([0.25, 0.5, 1.0, 1.0, 1.5]) for _ in range(n)]
    memory = [problem.cluster.memory_gib * rng.choice([0.25, 0.5, 1.0, 2.0]) for _ in range(n)]
    cluster = replace(problem.cluster, rank_speed=tuple(speed), rank_memory_gib=tuple(memory))
    return replace(problem, cluster=cluster)


CASES = [(seed, (1, 2) if seed % 3 == 0 else (2, 2) if seed % 3 == 1 else (1, 4)) for seed in range(10)]


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize(("seed", "shape"), CASES)
def test_milp_matches_brute_force_on_heterogeneous_clusters(seed, shape, solver):
    nodes, per_node = shape
    base = random_problem(seed, num_layers=4 if nodes * per_node == 2 else 3, nodes=nodes, per_node=per_node,
                          schedule=("1f1b", "gpipe")[seed % 2], memory_gib=(1.0, 4.0, 16.0)[seed % 3])
    problem = _hetero(base, seed)
    assert problem.cluster.heterogeneous
    oracle = brute_force(problem)
    if oracle is None:
        with pytest.raises(InfeasibleError):
            search(problem, solver=solver, time_limit_s=60)
        return
    plan = search(problem, solver=solver, time_limit_s=60)
    assert plan.solver.status == "optimal"
    assert plan.solver.objective_s == pytest.approx(plan.estimate.tpi_s, rel=1e-6)
    assert plan.estimate.tpi_s == pytest.approx(evaluate(problem, plan).tpi_s, rel=1e-12)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
    limits = plan.estimate.stage_memory_limit_bytes
    assert all(m <= lim for m, lim in zip(plan.estimate.stage_memory_bytes, limits))


@pytest.mark.parametrize("seed", range(4))
def test_grouped_runs_stay_exact_when_stages_differ(seed):
    base = repeated_problem(seed, pattern="ABBBBC"[: 4 if seed % 2 else 6], nodes=1, per_node=2 + 2 * (seed % 2),
                            schedule="gpipe", memory_gib=(2.0, 8.0)[seed % 2])
    problem = _hetero(base, seed)
    oracle = brute_force(problem)
    if oracle is None:
        with pytest.raises(InfeasibleError):
            search(problem)
        return
    plan = search(problem)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)


def _uniform_chain(layers: int = 8) -> ModelProfile:
    return ModelProfile("uniform", [LayerProfile(name=f"b{u}", forward_s=2e-3, backward_s=4e-3, params=1_000_000,
                                                 activation_bytes=1e5, output_bytes=1e4) for u in range(layers)])


def test_a_slow_stage_gets_less_work_and_the_plan_says_where_it_runs():
    equal = Cluster(name="pair", nodes=1, devices_per_node=2, memory_gib=16, peak_tflops=10, intra_bw_gbps=50)
    slow = replace(equal, rank_speed=(1.0, 0.5), rank_device=("fast", "slow"))
    training = TrainingConfig(global_batch_size=8, microbatches=(8,), schedule="1f1b")  # one stage per device
    base = search(Problem(_uniform_chain(), equal, training), solver="cbc")
    plan = search(Problem(_uniform_chain(), slow, training), solver="cbc")
    work = [len(plan.layers_of_stage(i)) for i in range(plan.pp)]
    assert plan.pp == 2 and work[1] < work[0], work  # rank 1, half as fast, holds fewer blocks
    if base.pp == 2:
        assert [len(base.layers_of_stage(i)) for i in range(2)] == [4, 4]
    assert plan.estimate.stage_device == ["fast", "slow"]
    # told the devices are equal, the planner's split is slower on the real (slow) cluster
    problem = Problem(_uniform_chain(), slow, training)
    assert evaluate(problem, plan).tpi_s <= evaluate(problem, base).tpi_s


def test_a_stage_fits_its_smallest_device():
    big_small = Cluster(name="mem", nodes=1, devices_per_node=2, memory_gib=1.0, peak_tflops=10,
                        rank_memory_gib=(1.0, 0.02))
    model = ModelProfile("m", [LayerProfile(name=f"b{u}", forward_s=1e-3, backward_s=2e-3, params=1_000_000,
                                            activation_bytes=1e3, output_bytes=1e3) for u in range(4)])
    problem = Problem(model, big_small, TrainingConfig(global_batch_size=4, microbatches=(4,)))
    plan = search(problem, solver="cbc")
    # 16 MB per layer of fp32 Adam state: the 20 MiB rank holds one layer, the 1 GiB rank the rest (pp=2), or the
    # layers are sharded over both (pp=1): either way every stage fits the smaller limit where it applies
    est = plan.estimate
    assert all(m <= lim for m, lim in zip(est.stage_memory_bytes, est.stage_memory_limit_bytes))
    if plan.pp == 2:
        assert len(plan.layers_of_stage(1)) == 1


def test_device_groups_in_yaml_and_bad_rank_lists(tmp_path):
    cl = Cluster.from_dict({"name": "mix", "nodes": 2, "devices_per_node": 2, "peak_tflops": 312,
                            "device_groups": [{"name": "A100-80GB", "count": 2, "memory_gib": 80},
                                              {"name": "V100-32GB", "count": 2, "memory_gib": 32, "speed": 0.4}]})
    assert cl.rank_speed == (1.0, 1.0, 0.4, 0.4) and cl.rank_memory_gib == (80, 80, 32, 32)
    assert cl.memory_gib == 80 and cl.device == "A100-80GB+V100-32GB"
    assert cl.stage_device(range(1, 3)) == "A100-80GB+V100-32GB"
    assert cl.with_rank_speed([1, 1, 1, 0.5]).rank_speed == (1.0, 1.0, 1.0, 0.5)
    for bad, msg in [
        ({"rank_speed": [1.0, 1.0]}, "lists 2 ranks"),
        ({"rank_speed": [1.0, 0.0, 1.0, 1.0]}, r"rank_speed\[1\] must be a number > 0"),
        ({"rank_memory_gib": [8, 8, 8, "x"]}, r"rank_memory_gib\[3\]"),
        ({"device_groups": [{"name": "a", "count": 3, "memory_gib": 8}]}, "lists 3 ranks"),
        ({"device_groups": [{"name": "a", "count": 4}]}, "device_groups"),
        ({"device_groups": []}, "non-empty list"),
    ]:
        with pytest.raises(UniAPError, match=msg):
            Cluster.from_dict({"name": "b", "nodes": 2, "devices_per_node": 2, "memory_gib": 8, "peak_tflops": 1,
                               **bad})


def test_the_shipped_mixed_cluster_plans_and_names_device_kinds():
    from rich.console import Console

    from uniap_lightning.profiling.pricing import build_problem
    from uniap_lightning.planner.report import print_plan

    problem = build_problem(model="gpt2_xl", cluster="a100_v100_4x8", global_batch_size=64)
    cluster = problem.cluster
    assert cluster.heterogeneous and cluster.rank_device[0] == "a100_80gb"
    # the catalogue's bf16 peaks: a V100 runs a bf16 model's matmuls at its fp32 rate (15.7 of the A100's 312)
    assert cluster.rank_device[-1] == "v100_32gb" and cluster.stage_speed(range(8, 24)) == pytest.approx(15.7 / 312)
    plan = search(problem, time_limit_s=60)
    assert plan.estimate.feasible
    assert len(plan.estimate.stage_device) == plan.pp
    console = Console(record=True, width=160)
    print_plan(plan, console=console)
    text = console.export_text()
    assert all(kind in text for kind in plan.estimate.stage_device)
    # told that every device is an A100, the planner's plan is no faster on the real pool
    equal = replace(problem, cluster=replace(cluster, rank_speed=None, rank_memory_gib=None))
    naive = search(equal, time_limit_s=60)
    naive_real = evaluate(problem, naive)
    assert not naive_real.feasible or naive_real.tpi_s >= plan.estimate.tpi_s * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_a_re_solve_warm_started_from_the_running_plan_finds_the_same_optimum(seed):
    """What the rebalance callback does when speeds change: solve(warm_start=running plan, baselines=False) returns
    the cold solve's optimum (the warm start only prunes); a warm start the configuration rules out (another
    schedule) or that no longer fits is ignored, never returned."""
    from uniap_lightning.planner.solver import solve

    base = repeated_problem(seed, pattern="ABBBBBC", nodes=1, per_node=4, memory_gib=(16.0, 40.0)[seed % 2])
    running = solve(base, time_limit_s=60)
    slowed = _hetero(base, seed)
    cold = solve(slowed, time_limit_s=60)
    warm = solve(slowed, time_limit_s=60, warm_start=running, baselines=False)
    assert cold.solver.status == warm.solver.status == "optimal"
    assert warm.estimate.tpi_s == pytest.approx(cold.estimate.tpi_s, rel=1e-9)
    assert warm.estimate.tpi_s == pytest.approx(evaluate(slowed, warm).tpi_s, rel=1e-12)
    assert warm.estimate.tpi_s <= evaluate(slowed, running).tpi_s * (1 + 1e-12) or not evaluate(slowed, running).feasible
    # a running plan outside the search space (another pipeline degree, another schedule) is not handed back, even
    # where it would be faster than anything inside
    by_pp = {}
    for p in slowed.pp_candidates():
        try:
            by_pp[p] = solve(slowed, time_limit_s=60, pp=[p], baselines=False)
        except InfeasibleError:
            pass
    fastest = min(by_pp.values(), key=lambda pl: pl.estimate.tpi_s)
    for p in set(by_pp) - {fastest.pp}:
        assert solve(slowed, time_limit_s=60, pp=[p], warm_start=fastest, baselines=False).pp == p
    assert len(by_pp) >= 2
    pinned = replace(slowed, training=replace(slowed.training, schedule="gpipe"))
    assert solve(pinned, time_limit_s=60, warm_start=replace(fastest, schedule="1f1b"),
                 baselines=False).schedule == "gpipe"
