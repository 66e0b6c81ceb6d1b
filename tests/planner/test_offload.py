"""Activation offload (``uniap_lightning.planner.dimensions.offload``): the record's field and rules, its price and
memory terms, the host link from the device catalogue, the plan format, MILP == brute force with offload allowed,
and the planner choosing it where memory binds (and only there)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from functools import lru_cache

import pytest
from bruteforce import assert_search_matches, brute_force
from planner_factories import offload_problem, random_problem

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import cluster_from, load_group
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.cost.layer import Pricing, layer_cost, strategies_for
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan import PLAN_FORMAT_VERSION, Plan
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.report import make_console, print_plan
from uniap_lightning.planner.profile import LayerProfile
from uniap_lightning.planner.solver import search

LAYER = LayerProfile(name="l", forward_s=1e-2, backward_s=2e-2, params=10**6, activation_bytes=1e8,
                     output_bytes=1e6)


def _cluster(**kw) -> Cluster:
    return Cluster(name="c", nodes=1, devices_per_node=2, memory_gib=16.0, peak_tflops=10, **kw)


def test_the_record_label_and_rules():
    s = Strategy(2, 1, offload=True)
    assert s.label() == "dp2+off" and "offload" in Strategy._fields
    s.check("w")
    with pytest.raises(UniAPError, match="offload and recompute exclude each other"):
        Strategy(1, 1, recompute=True, offload=True).check("w")
    with pytest.raises(UniAPError, match="offload must be true or false"):
        Strategy(1, 1, offload=1).check("w")
    assert Strategy.of(1, 1, offload=1) == Strategy(1, 1, offload=True)


def test_candidates_only_where_the_cluster_opts_in_and_has_a_host_link():
    plain = strategies_for(LAYER, 2, _cluster(), 2)
    assert not any(s.offload for s in plain)
    assert not any(s.offload for s in strategies_for(LAYER, 2, _cluster(offload="auto"), 2))  # no host link: none
    assert not any(s.offload for s in strategies_for(LAYER, 2, _cluster(host_link_gbps=25.0), 2))  # not opted in
    # (state offload shares the permission: its candidates, tests/planner/test_state_offload.py, are left out here)
    both = [s for s in strategies_for(LAYER, 2, _cluster(offload="auto", host_link_gbps=25.0), 2)
            if not s.state_offload]
    # each candidate without offload, and beside it its offloaded twin unless it recomputes (the innermost choice)
    assert [s for s in both if not s.offload] == plain
    assert [s._replace(offload=False) for s in both if s.offload] == [s for s in plain if not s.recompute]
    with pytest.raises(UniAPError, match="offload must be one of"):
        _cluster(offload="always")
    with pytest.raises(UniAPError, match="host_link_gbps must be >= 0"):
        _cluster(host_link_gbps=-1.0)


def test_price_and_memory_terms():
    """B = 1e8 bytes of activations per sample, micro-batch 2 on one device: 2e8 bytes each way. Forward 20 ms,
    backward 40 ms of compute; at 5 GB/s a copy takes 40 ms: 20 ms exposed in forward, none in backward, plus two
    kernel floors (10 us each); the activations leave the in-flight memory and come back as twice the transient."""
    cl = _cluster(offload="auto", host_link_gbps=5.0)
    train = TrainingConfig(global_batch_size=2)
    pr = Pricing(2, 1)
    keep = layer_cost(LAYER, Strategy(1, 1), pr, cluster=cl, training=train)
    off = layer_cost(LAYER, Strategy(1, 1, offload=True), pr, cluster=cl, training=train)
    assert keep.activation_bytes == pytest.approx(2e8) and off.activation_bytes == 0.0
    assert off.transient_bytes - keep.transient_bytes == pytest.approx(4e8)
    assert off.time_s - keep.time_s == pytest.approx(0.02 + 2e-5)
    assert (off.static_bytes, off.sync_s, off.compute_s) == (keep.static_bytes, keep.sync_s, keep.compute_s)
    fast = layer_cost(LAYER, Strategy(1, 1, offload=True), pr, cluster=replace(cl, host_link_gbps=400.0),
                      training=train)
    assert fast.time_s - keep.time_s == pytest.approx(2e-5)  # hidden behind compute: only the floors


def test_host_link_from_the_catalogue_and_the_cluster_override():
    assert cluster_from("gh200_clariden").host_link_gbps == pytest.approx(360.0)  # NVLink-C2C 450 x 0.8
    h100 = cluster_from({"name": "h", "device": "h100_sxm", "nodes": 1, "devices_per_node": 8})
    assert h100.host_link_gbps == pytest.approx(51.2)  # PCIe 5.0 x16: 64 x 0.8
    assert cluster_from({"name": "a", "device": "a100_80gb", "nodes": 1, "devices_per_node": 8}).host_link_gbps == \
        pytest.approx(25.6)  # PCIe 4.0 x16
    mine = cluster_from({"name": "h", "device": "h100_sxm", "nodes": 1, "devices_per_node": 8, "host_link_gbps": 20})
    assert mine.host_link_gbps == 20
    assert cluster_from("local_cpu").host_link_gbps == 0.0 and cluster_from("local_cpu").offload == "off"


def test_plan_json_writes_offload_and_older_versions_read_it_off():
    problem = offload_problem(3, num_layers=3, nodes=1, per_node=2, memory_gib=40.0)
    plan = problem.plan_for(stage_of_layer=[0, 0, 0], strategies=[Strategy(2, 1, offload=True), Strategy(2, 1),
                                                                    Strategy(1, 2, offload=True)], pp=1,
                            microbatches=1)
    doc = json.loads(plan.to_json())
    assert doc["format_version"] == PLAN_FORMAT_VERSION >= 5
    assert [x["offload"] for x in doc["layers"]] == [True, False, True]
    assert [lp.strategy for lp in Plan.from_dict(json.loads(json.dumps(doc))).layers] == \
        [lp.strategy for lp in plan.layers]
    old = dict(doc, format_version=4)
    assert not any(lp.strategy.offload for lp in Plan.from_dict(old).layers)  # a version-4 file has no offload
    with pytest.raises(UniAPError, match="offload"):
        Plan.from_dict({**doc, "layers": [{**doc["layers"][0], "offload": "yes"}, *doc["layers"][1:]]})
    # offloaded layers show in the report's per-layer table; a plan without any has no such column
    assert " offload " in _printed(plan) and " host " in _printed(plan)
    plain = problem.plan_for(stage_of_layer=[0, 0, 0], strategies=[Strategy(2, 1)] * 3, pp=1, microbatches=1)
    assert " offload " not in _printed(plain)


def _printed(plan: Plan) -> str:
    console = make_console(record=True)
    print_plan(plan, console=console)
    return console.export_text()


# (seed, layers, nodes, per node, memory GiB, activation scale): small memories and large activations make memory
# bind, so offload competes with recomputation, ZeRO and pipelining; large ones show it is left alone
CASES = [(1, 3, 1, 2, 2.0, 3), (1, 3, 1, 4, 1.0, 3), (2, 3, 1, 4, 2.0, 10), (8, 3, 2, 2, 1.0, 10),
         (10, 3, 1, 4, 1.0, 1), (13, 3, 1, 2, 4.0, 3), (13, 3, 2, 2, 2.0, 1), (14, 3, 1, 2, 2.0, 3),
         (15, 3, 2, 2, 2.0, 10), (3, 3, 1, 2, 40.0, 1), (7, 3, 1, 2, 4.0, 5), (0, 3, 1, 2, 1.0, 5),
         (6, 3, 2, 1, 0.5, 5), (5, 4, 1, 2, 2.0, 3)]


@lru_cache(maxsize=None)
def _oracle(case):
    return brute_force(offload_problem(case[0], num_layers=case[1], nodes=case[2], per_node=case[3],
                                       memory_gib=case[4], activation_scale=case[5]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-L{c[1]}-{c[2]}x{c[3]}-{c[4]}G-act{c[5]}")
def test_milp_matches_brute_force_with_offload(case):
    problem = offload_problem(case[0], num_layers=case[1], nodes=case[2], per_node=case[3], memory_gib=case[4],
                              activation_scale=case[5])
    assert_search_matches(problem, _oracle(case))


def test_oracle_optima_offload_somewhere_and_not_everywhere():
    """The comparison covers the space: some optimum offloads a layer, some uses none, and one offloads beside
    recomputation or ZeRO in the same plan."""
    best = [b for b in map(_oracle, CASES) if b is not None]
    offloaded = [sum(lp.strategy.offload for lp in b.layers) for b in best]
    assert sum(map(bool, offloaded)) >= 5 and not all(offloaded) and len(best) < len(CASES), offloaded
    assert any(lp.strategy.offload for b in best for lp in b.layers if lp.strategy.dp_mode == "zero3")
    assert any(any(lp.strategy.offload for lp in b.layers) and any(lp.strategy.recompute for lp in b.layers)
               for b in best)


def test_offload_off_leaves_the_problem_as_it_was():
    """The default cluster (offload off) plans exactly as before: same candidates, same optimum."""
    problem = random_problem(5, num_layers=4, nodes=1, per_node=2, memory_gib=2.0)
    opted = replace(problem, cluster=replace(problem.cluster, host_link_gbps=25.0))  # a link, but not opted in
    assert search(problem, solver="cbc").estimate.tpi_s == search(opted, solver="cbc").estimate.tpi_s


def _llama_13b(seq_len: int):
    cluster = dict(load_group("cluster", "gh200_clariden"), offload="auto")
    model = dict(load_group("model", "llama_13b"), seq_len=seq_len)
    return build_problem(model=model, cluster=cluster, training="default", global_batch_size=8)


def test_llama_13b_on_four_gh200_offloads_where_activations_bind():
    """LLaMA-13B (bf16, Adam: 208 GB of state) on one GH200 node (4 x 96 GB, NVLink-C2C 360 GB/s effective),
    one pipeline stage: at 8192 tokens a sample's activations (~1.4 GB per layer) do not fit beside the sharded
    state, and offloading them (hidden behind compute over C2C) beats recomputing them; at 1024 tokens they fit
    and nothing is offloaded."""
    long = _llama_13b(8192)
    plan = search(long, time_limit_s=60, pp=[1])
    plain = search(long, time_limit_s=60, pp=[1], allowed=lambda s: not s.offload and not s.state_offload)
    offloaded = sum(lp.strategy.offload for lp in plan.layers)
    assert offloaded >= len(plan.layers) // 2, Counter(lp.strategy.label() for lp in plan.layers)
    assert plan.estimate.tpi_s < 0.9 * plain.estimate.tpi_s  # 2.77 s against 3.49 s (recompute), at this writing
    assert any(lp.strategy.recompute for lp in plain.layers)
    short = search(_llama_13b(1024), time_limit_s=60, pp=[1])
    assert not any(lp.strategy.offload for lp in short.layers)
