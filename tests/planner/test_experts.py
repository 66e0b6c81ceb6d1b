"""Expert parallelism in the planner: ``Strategy.ep`` priced (:func:`expert_parallel_s`, expert state over ``ep``,
gradient sync split), enumerated, exact in the search (MILP optimum == brute force on small MoE instances where ep
wins), carried by the plan JSON (format 4), the profile's expert fields, and the analytic MoE models."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from bruteforce import brute_force
from bruteforce_pipeline import brute_force_candidate
from planner_factories import moe_problem

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.analytic import ModelSpec
from uniap_lightning.profiling.pricing import analytic_profile
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import cluster_from
from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.cost.comm import all_gather_s, all_reduce_s, all_to_all_s, reduce_scatter_s
from uniap_lightning.planner.cost.layer import Pricing, expert_parallel_s, layer_cost, strategies_for
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.profile import LayerProfile, ModelProfile
from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.schedule_rules import unsupported
from uniap_lightning.planner.solver import search
from uniap_lightning.planner.solver.parallel import solve_candidate

# (seed, layers, nodes, devices per node, memory GiB): 2 and 4 devices, memory binding and loose; in each the
# optimum with expert parallelism beats the best plan without it
CASES = [(1, 4, 1, 2, 2.0), (0, 4, 1, 2, 8.0), (7, 4, 1, 4, 2.0), (4, 4, 1, 4, 8.0), (9, 4, 1, 4, 2.0),
         (11, 4, 2, 2, 2.0), (11, 4, 2, 2, 8.0)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-L{c[1]}-{c[2]}x{c[3]}-{c[4]}G")
def test_milp_equals_brute_force_and_ep_wins(case):
    seed, layers, nodes, per_node, memory = case
    problem = moe_problem(seed, num_layers=layers, nodes=nodes, per_node=per_node, memory_gib=memory)
    oracle = brute_force(problem)
    assert oracle is not None
    plan = search(problem, solver="auto", time_limit_s=60, workers=1)
    assert plan.solver.status == "optimal"
    assert plan.estimate.tpi_s == pytest.approx(evaluate(problem, plan).tpi_s, rel=1e-12)
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
    assert any(lp.strategy.ep > 1 for lp in plan.layers)
    dense = search(problem, solver="auto", time_limit_s=60, workers=1, allowed=lambda s: s.ep == 1)
    assert plan.estimate.tpi_s < dense.estimate.tpi_s * (1 - 1e-9)


@pytest.mark.parametrize("case", [(9, 4, 1, 4, 2.0), (11, 4, 2, 2, 8.0)], ids=lambda c: f"seed{c[0]}")
def test_every_schedule_candidate_milp_equals_brute_force(case):
    """Zero-bubble and interleaved schedules price ``ep`` through the same terms: each candidate's MILP optimum
    equals brute force over every split into ``pp * v`` stages and every strategy."""
    seed, layers, nodes, per_node, memory = case
    problem = moe_problem(seed, num_layers=layers, nodes=nodes, per_node=per_node, memory_gib=memory)
    problem = replace(problem, training=replace(problem.training, schedule="auto", max_virtual_stages=2))
    seen = set()
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            for schedule, v in problem.training.schedule_candidates(pp, c, layers) if pp > 1 else ():
                oracle = brute_force_candidate(problem, pp, c, schedule, v)
                tables = CostTables(problem, pp, c, schedule=schedule, virtual_stages=v,
                                    allowed=lambda k, s=schedule: unsupported(s, k) is None)
                res = solve_candidate(tables, "cbc", 60.0, None) if tables.feasible_shape else None
                where = f"pp={pp} c={c} {schedule} v={v}"
                if oracle is None or res is None:
                    assert oracle is None and (res is None or res.objective_s is None), where
                    continue
                assert res.objective_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6, abs=1e-12), where
                seen.add((schedule, v, any(lp.strategy.ep > 1 for lp in oracle.layers)))
    assert len({x[:2] for x in seen}) >= 2 and any(x[2] for x in seen), seen


# ------------------------------------------------------------------ the formulas

CL = Cluster(name="moe", nodes=2, devices_per_node=4, memory_gib=80, peak_tflops=100, intra_bw_gbps=100,
             inter_bw_gbps=10, intra_latency_us=5, inter_latency_us=20,
             collective_tables={"all_to_all": {"intra": {2: {"bw_gbps": 30.0, "latency_us": 40.0},
                                                         4: {"bw_gbps": 20.0, "latency_us": 60.0}},
                                               "inter": {8: {"bw_gbps": 2.0, "latency_us": 200.0}}}})
TR = TrainingConfig(global_batch_size=64, weight_bytes=2, grad_bytes=2, optimizer_bytes=12)
MOE = LayerProfile(name="moe", forward_s=1e-3, backward_s=2e-3, params=100_000_000, activation_bytes=4e6,
                   output_bytes=1e6, tp_degrees=(1, 2), tp_allreduces=2, experts=8, top_k=2,
                   expert_params=80_000_000)


def _cost(s: Strategy, layer: LayerProfile = MOE, n: int = 8, mb: int = 16, accumulate: bool = False):
    return layer_cost(layer, s, Pricing(mb, n, accumulate), cluster=CL, training=TR)


def test_expert_state_is_divided_by_ep_and_zero_modes_shard_each_part_over_its_group():
    P, Pe, w, g, o = 100e6, 80e6, 2, 2, 12
    # replicate over 8, experts over ep=4: the rest held by all 8 (+ its all-reduce bucket), each rank's quarter
    # of the experts by the 2 ranks holding the same experts (+ their bucket)
    got = _cost(Strategy.of(8, 1, ep=4)).static_bytes
    assert got == pytest.approx((P - Pe) * (w + g + o + g) + Pe / 4 * (w + g + o + g))
    # ep = every replica: each expert shard is alone (no bucket)
    assert _cost(Strategy.of(8, 1, ep=8)).static_bytes == pytest.approx((P - Pe) * (w + 2 * g + o) + Pe / 8 * (w + g + o))
    # ZeRO-2 over 8 and over 8 / ep for the experts
    got = _cost(Strategy.of(8, 1, "zero2", ep=2)).static_bytes
    assert got == pytest.approx((P - Pe) * w + (P - Pe) * (w + o + g) / 8 + Pe / 2 * w + Pe / 2 * (w + o + g) / 4)
    # ZeRO-3: the same bytes at rest (P / d either way), but the gathered copy holds only a rank's experts
    z3, z3ep = _cost(Strategy.of(8, 1, "zero3")), _cost(Strategy.of(8, 1, "zero3", ep=4))
    assert z3ep.static_bytes == pytest.approx(z3.static_bytes)
    assert z3ep.transient_bytes == pytest.approx(z3.transient_bytes - Pe * w * 3 / 4)
    # tensor parallelism splits both parts first
    got = _cost(Strategy.of(4, 2, ep=2)).static_bytes
    assert got == pytest.approx((P - Pe) / 2 * (w + 2 * g + o) + Pe / 4 * (w + 2 * g + o))
    # activations and compute do not change
    a, b = _cost(Strategy.of(8, 1)), _cost(Strategy.of(8, 1, ep=8))
    assert (a.activation_bytes, a.compute_s) == (b.activation_bytes, b.compute_s)


def test_four_all_to_alls_per_micro_batch_with_the_clusters_all_to_all_figures():
    def a2a(nbytes, p, inter):  # the ring formula with the table's figures, written out
        bw = CL.bandwidth_bytes_per_s(p, inter, op="all_to_all")
        return (p - 1) * CL.latency_s(inter, op="all_to_all", group_size=p) + (p - 1) / p * nbytes / bw

    assert CL.bandwidth_bytes_per_s(4, False, op="all_to_all") != CL.bandwidth_bytes_per_s(4, False)  # the table
    mb, n = 16, 8
    for s, inter in [(Strategy.of(8, 1, ep=4), False), (Strategy.of(8, 1, ep=2), False),
                     (Strategy.of(4, 2, ep=4), True),  # 4 replicas x tp 2 = 8 ranks: the ep group leaves the node
                     (Strategy.of(8, 1, ep=8), True)]:
        tokens = mb / s.dp
        X = MOE.output_bytes * tokens * MOE.top_k / s.tp  # a rank's hidden states once per routed slot
        want = 4 * a2a(X, s.ep, inter)
        assert expert_parallel_s(MOE, s, tokens, CL) == pytest.approx(want, rel=1e-12)
        base = _cost(s._replace(ep=1))
        # ZeRO-free replicate: per micro-batch, the all-to-alls are the whole difference in time
        assert _cost(s).comm_s - base.comm_s == pytest.approx(want, rel=1e-9)
        # recomputation runs the forward's dispatch and combine again
        rec, rec1 = _cost(s._replace(recompute=True)), _cost(s._replace(recompute=True, ep=1))
        assert rec.comm_s - rec1.comm_s == pytest.approx(1.5 * want, rel=1e-9)
    # a capacity factor pads the dispatch buffers
    cf = replace(MOE, capacity_factor=1.5)
    s = Strategy.of(8, 1, ep=4)
    assert expert_parallel_s(cf, s, 2, CL) == pytest.approx(4 * a2a(MOE.output_bytes * 2 * 2 * 1.5, 4, False))
    assert expert_parallel_s(MOE, Strategy.of(8, 1), 2, CL) == 0.0


def test_gradient_sync_split_between_all_replicas_and_the_expert_groups():
    P, Pe, g = 100e6, 80e6, 2
    s = Strategy.of(8, 1, ep=2)
    # a stage of 8 devices over two 4-device nodes: every data-parallel group crosses nodes
    inter = True
    got = _cost(s).sync_s
    want = all_reduce_s(CL, (P - Pe) * g, 8, inter) + all_reduce_s(CL, Pe / 2 * g, 4, inter)
    assert got == pytest.approx(want, rel=1e-12)
    # ep = replicas: the experts' gradients stay where they are
    assert _cost(Strategy.of(8, 1, ep=8)).sync_s == pytest.approx(all_reduce_s(CL, (P - Pe) * g, 8, inter))
    # ZeRO-2: reduce-scatter + all-gather of each part over its own group
    got = _cost(Strategy.of(8, 1, "zero2", ep=4)).sync_s
    want = sum(reduce_scatter_s(CL, p * g, d, inter) + all_gather_s(CL, p * 2, d, inter)
               for p, d in (((P - Pe), 8), (Pe / 4, 2)))
    assert got == pytest.approx(want, rel=1e-12)
    # without experts (or ep = 1) the layer is priced as before: one part
    dense = replace(MOE, experts=0, top_k=1, expert_params=0)
    assert _cost(Strategy.of(8, 1), dense) == _cost(Strategy.of(8, 1))


def test_enumeration_takes_ep_over_divisors_of_the_replicas_that_divide_the_experts():
    def eps(layer, n=8, t=1):
        return sorted({s.ep for s in strategies_for(layer, n, CL, 16) if s.tp == t})

    assert eps(MOE) == [1, 2, 4, 8]
    assert eps(MOE, t=2) == [1, 2, 4]
    assert eps(replace(MOE, experts=6)) == [1, 2]
    assert eps(replace(MOE, experts=0, expert_params=0, top_k=1)) == [1]
    with_comp = strategies_for(MOE, 8, CL, 16, compression=("none", "bf16"))
    assert all(s.ep == 1 for s in with_comp if s.compression != "none")
    assert any(s.ep > 1 for s in with_comp)
    assert {s.ep for s in strategies_for(MOE, 1, CL, 16)} == {1}


def test_strategy_label_and_check():
    assert Strategy.of(8, 2, "zero1", ep=4).label() == "z1dp8xtp2+ep4"
    assert Strategy.of(1, 2, ep=2).ep == 1  # one replica: nothing to split
    with pytest.raises(UniAPError, match="ep=3 must divide the dp\\*cp = 4 replicas"):
        Strategy(4, 1, ep=3).check("layer 1")
    with pytest.raises(UniAPError, match="needs compression 'none'"):
        Strategy(4, 1, compression="bf16", ep=2).check("layer 1")
    with pytest.raises(UniAPError, match="layer 1: ep=2 on a layer without experts"):
        Strategy(4, 1, ep=2).check("layer 1", experts=0)
    with pytest.raises(UniAPError, match="ep=4 must divide the layer's 6 experts"):
        Strategy(4, 1, ep=4).check("layer 1", experts=6)
    Strategy(4, 2, ep=4).check("layer 1", experts=8)


# ------------------------------------------------------------------ files


def _moe_plan():
    problem = moe_problem(7, num_layers=4, nodes=1, per_node=4, memory_gib=2.0)
    return problem, search(problem, solver="auto", time_limit_s=60, workers=1)


def test_plan_json_round_trip_with_ep_and_older_formats_read_ep_1(tmp_path):
    problem, plan = _moe_plan()
    assert any(lp.strategy.ep > 1 for lp in plan.layers)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    data = json.loads(path.read_text())
    assert [x["ep"] for x in data["layers"]] == [lp.strategy.ep for lp in plan.layers]
    back = Plan.from_json(path)
    assert [lp.strategy for lp in back.layers] == [lp.strategy for lp in plan.layers]
    assert evaluate(problem, back).tpi_s == pytest.approx(plan.estimate.tpi_s, rel=1e-12)
    # format 3 knows no ep (nor cp): a stray key is not read
    old = copy.deepcopy(data)
    old["format_version"] = 3
    for x in old["layers"]:
        for key in ("cp", "cp_method", "sp"):
            x.pop(key)
    assert all(lp.strategy.ep == 1 for lp in Plan.from_dict(old).layers)
    # format 4 without ep (written before it existed): ep = 1
    for x in data["layers"]:
        x.pop("ep")
    assert all(lp.strategy.ep == 1 for lp in Plan.from_dict(data).layers)


def test_bad_ep_in_a_plan_file_is_refused_in_one_line():
    problem, plan = _moe_plan()
    data = plan.to_dict()
    u = next(i for i, lp in enumerate(plan.layers) if lp.strategy.ep > 1)
    dp = plan.layers[u].strategy.replicas
    for value, match in [(dp + 1, f"ep={dp + 1} must divide"), (0, "ep"), (True, "ep"), ("2", "ep")]:
        bad = copy.deepcopy(data)
        bad["layers"][u]["ep"] = value
        with pytest.raises(UniAPError, match=match) as err:
            Plan.from_dict(bad)
        assert "\n" not in str(err.value) and f"plan layer {u}" in str(err.value)
    # ep on a dense layer: refused when the plan is scored against the model
    d = next(i for i, lp in enumerate(problem.model.layers) if not lp.experts and plan.layers[i].strategy.replicas > 1)
    bad = copy.deepcopy(data)
    bad["layers"][d]["ep"] = plan.layers[d].strategy.replicas
    bad["layers"][d]["compression"] = "none"
    with pytest.raises(UniAPError, match=f"plan layer {d} .*on a layer without experts"):
        evaluate(problem, Plan.from_dict(bad))


def test_profile_expert_fields_round_trip_and_are_checked():
    prof = ModelProfile("m", [MOE, replace(MOE, name="cf", capacity_factor=1.25),
                              replace(MOE, name="dense", experts=0, top_k=1, expert_params=0)])
    d = prof.to_dict()
    assert "experts" not in d["layers"][2] and "top_k" not in d["layers"][2] and "capacity_factor" not in d["layers"][0]
    assert ModelProfile.from_dict(json.loads(json.dumps(d))).layers == prof.layers
    for edit, match in [({"expert_params": 200_000_000}, "expert_params=200000000 must be at most params"),
                        ({"top_k": 9}, "top_k=9 must be at most experts=8"),
                        ({"experts": -1}, "experts must be >= 0"),
                        ({"capacity_factor": 0}, "capacity_factor must be > 0"),
                        ({"experts": 0}, "need 'experts' > 0")]:
        bad = copy.deepcopy(d)
        bad["layers"][0].update(edit)
        with pytest.raises(UniAPError, match=match):
            ModelProfile.from_dict(bad)


# ------------------------------------------------------------------ analytic models


def _spec(name: str) -> ModelSpec:
    return ModelSpec.from_dict(yaml.safe_load((Path(__file__).parents[2] / "conf" / "model" / f"{name}.yaml").read_text()))


def test_analytic_moe_models_have_their_published_sizes():
    cl = cluster_from("h100_4x8")
    mix = analytic_profile(_spec("mixtral_8x7b"), cl)
    assert mix.total_params == pytest.approx(46.7e9, rel=0.005)  # Mixtral 8x7B: 46.7B parameters
    block = mix.layers[1]
    assert (block.experts, block.top_k, block.expert_params) == (8, 2, 8 * 3 * 4096 * 14336)
    qwen = analytic_profile(_spec("qwen_moe_a2.7b"), cl)
    assert qwen.total_params == pytest.approx(14.3e9, rel=0.005)  # Qwen1.5-MoE-A2.7B: 14.3B parameters
    assert (qwen.layers[1].experts, qwen.layers[1].top_k) == (60, 4)
    assert qwen.layers[1].expert_params == 60 * 3 * 2048 * 1408
    # top-2 of 8 experts of Llama-7B-like width: twice the MLP FLOPs of one expert per token, not eight times
    dense = analytic_profile(replace(_spec("mixtral_8x7b"), experts=0, top_k=1, expert_ffn=0), cl).layers[1]
    assert dense.experts == 0 and dense.expert_params == 0
    assert 1.5 < block.forward_s / dense.forward_s < 2.0
    for edit, match in [({"top_k": 9}, "top_k=9 must be an integer from 1 to 8"),
                        ({"experts": 0, "top_k": 2}, "need experts > 0")]:
        raw = {**{k: v for k, v in _spec("mixtral_8x7b").__dict__.items() if k != "segments"}, **edit}
        with pytest.raises(UniAPError, match=match):
            ModelSpec.from_dict(raw)


def test_uniap_plan_mixtral_picks_expert_parallelism(tmp_path):
    out = tmp_path / "plan.json"
    # wide enough for the stage table's labels (a stage holds several: at 80 columns they are cut to "z1dp4xcp…")
    res = subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", "plan", "model=mixtral_8x7b",
                          "cluster=h100_4x8", "time_limit=20", "baselines=false", f"out={out}"],
                         capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "COLUMNS": "250"})
    assert res.returncode == 0, res.stderr
    assert "+ep" in res.stdout
    layers = json.loads(out.read_text())["layers"]
    assert any(x["ep"] > 1 for x in layers) and all(8 % x["ep"] == 0 for x in layers)


def test_setup_measurement_fits_all_to_all_and_the_planner_prices_with_it():
    """``profiling.collectives`` times ``all_to_all_single`` like the other ops; its alpha-beta fit (each rank
    keeps ``1 / p`` of its buffer) lands in the cluster's ``collective_tables`` and prices the expert all-to-alls."""
    from uniap_lightning.profiling.collectives import _fit, apply_to_cluster

    p, alpha, bw = 4, 30e-6, 5e9
    sizes = (1 << 12, 1 << 22)
    times = tuple((p - 1) * alpha + (p - 1) / p * s / bw for s in sizes)
    got_bw, got_lat = _fit("all_to_all", p, sizes, times)
    assert got_bw == pytest.approx(bw / 1e9, rel=1e-6) and got_lat == pytest.approx(alpha * 1e6, rel=1e-6)
    base = Cluster(name="m", nodes=1, devices_per_node=4, memory_gib=8, peak_tflops=1)
    measured = {"ops": {"all_to_all": {4: {"bw_gbps": got_bw, "latency_us": got_lat, "inter_node": False}}}}
    cl = apply_to_cluster(base, measured)
    assert all_to_all_s(cl, 1e8, 4, False) == pytest.approx(3 * alpha + 3 / 4 * 1e8 / bw, rel=1e-6)
    assert all_to_all_s(cl, 1e8, 4, False) != pytest.approx(all_to_all_s(base, 1e8, 4, False))
