"""State offload (``uniap_lightning.planner.dimensions.state_offload``): the record's field and rules, the candidates
(where offload is allowed, under ZeRO-3 or without replicas), the price and memory terms pinned, the plan format,
MILP == brute force with it in the space, and LLaMA-13B on one 80 GB H100: no plan fits without it, one does with
it."""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
from bruteforce import assert_search_matches, brute_force
from planner_factories import offload_problem

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import load_group
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.cost.layer import Pricing, layer_cost, strategies_for
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan import PLAN_FORMAT_VERSION, Plan
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.profile import LayerProfile
from uniap_lightning.planner.report import make_console, print_plan
from uniap_lightning.planner.solver import search
from uniap_lightning.planner.solver.baselines import baseline_plans

LAYER = LayerProfile(name="l", forward_s=1e-2, backward_s=2e-2, params=10**6, activation_bytes=1e8,
                     output_bytes=1e6)
# bf16 weights and gradients, fp32 Adam state with master weights: 16 bytes per parameter
TRAIN = TrainingConfig(global_batch_size=2, weight_bytes=2, grad_bytes=2, optimizer_bytes=12)


def _cluster(**kw) -> Cluster:
    return Cluster(name="c", nodes=1, devices_per_node=2, memory_gib=16.0, peak_tflops=10, **kw)


def test_the_record_label_and_rules():
    s = Strategy(2, 1, "zero3", state_offload=True)
    assert s.label() == "fsdp2+soff" and "state_offload" in Strategy._fields
    s.check("w")
    Strategy(1, 1, state_offload=True, offload=True, recompute=False).check("w")
    with pytest.raises(UniAPError, match="state_offload needs dp_mode 'zero3'"):
        Strategy(2, 1, "zero2", state_offload=True).check("w")
    with pytest.raises(UniAPError, match="without expert parallelism and in the run's own matmul precision"):
        Strategy(1, 1, precision="fp8", state_offload=True).check("w")
    with pytest.raises(UniAPError, match="state_offload must be true or false"):
        Strategy(1, 1, state_offload=1).check("w")


def test_candidates_where_offload_is_allowed_under_zero3_or_without_replicas():
    plain = strategies_for(LAYER, 2, _cluster(), 2)
    assert not any(s.state_offload for s in plain)
    assert not any(s.state_offload for s in strategies_for(LAYER, 2, _cluster(host_link_gbps=25.0), 2))
    both = strategies_for(LAYER, 2, _cluster(offload="auto", host_link_gbps=25.0), 2)
    soff = [s for s in both if s.state_offload]
    assert soff and all(s.replicas == 1 or s.dp_mode == "zero3" for s in soff)
    assert {s._replace(state_offload=False) for s in soff} == \
        {s for s in both if not s.state_offload and (s.replicas == 1 or s.dp_mode == "zero3")}
    # a layer without parameters has no state to offload
    assert not any(s.state_offload for s in strategies_for(LayerProfile(name="n", forward_s=1e-3, backward_s=1e-3,
                                                                        params=0, activation_bytes=1.0,
                                                                        output_bytes=1.0),
                                                           2, _cluster(offload="auto", host_link_gbps=25.0), 2))


def test_price_and_memory_terms_without_replicas():
    """P = 1e6 parameters, 16 bytes each, on one device, micro-batch 2: forward 20 ms, backward 40 ms. At 1 GB/s
    the 2 MB weight copy (in, each pass) and the 2 MB gradient copy (out) hide behind compute: only two kernel
    floors (10 us) show. The step moves to the host: 16 MB of state over the link, 16 ms, for the device's
    optimizer time; the 16 MB leave the device, the gathered 2 MB weights stay transient."""
    cl, pr = _cluster(offload="auto", host_link_gbps=1.0, optimizer_ns_per_param=1.0), Pricing(2, 1)
    keep = layer_cost(LAYER, Strategy(1, 1), pr, cluster=cl, training=TRAIN)
    off = layer_cost(LAYER, Strategy(1, 1, state_offload=True), pr, cluster=cl, training=TRAIN)
    assert keep.static_bytes == pytest.approx(16e6) and off.static_bytes == 0.0
    assert off.transient_bytes - keep.transient_bytes == pytest.approx(2e6)
    assert off.time_s - keep.time_s == pytest.approx(2e-5)
    assert off.sync_s - keep.sync_s == pytest.approx(16e6 / 1e9 - 1e-9 * 1e6)
    assert (off.activation_bytes, off.compute_s) == (keep.activation_bytes, keep.compute_s)
    # a slow link (10 MB/s): each copy takes 200 ms, 180 ms beyond the forward and 160 ms beyond the backward
    slow = layer_cost(LAYER, Strategy(1, 1, state_offload=True), pr,
                      cluster=Cluster(**{**cl.__dict__, "host_link_gbps": 0.01}), training=TRAIN)
    assert slow.time_s - keep.time_s == pytest.approx(0.18 + 0.16 + 2e-5)


def test_price_and_memory_terms_under_zero3():
    """Two ZeRO-3 replicas: each holds half the state (8 MB), which leaves the device; the gathered copy is
    ZeRO-3's already; each copy moves the 1 MB shard."""
    cl, pr = _cluster(offload="auto", host_link_gbps=1.0), Pricing(2, 2)
    keep = layer_cost(LAYER, Strategy(2, 1, "zero3"), pr, cluster=cl, training=TRAIN)
    off = layer_cost(LAYER, Strategy(2, 1, "zero3", state_offload=True), pr, cluster=cl, training=TRAIN)
    assert keep.static_bytes == pytest.approx(8e6) and off.static_bytes == 0.0
    assert off.transient_bytes == keep.transient_bytes
    assert off.sync_s - keep.sync_s == pytest.approx(8e6 / 1e9)
    assert off.time_s - keep.time_s == pytest.approx(2e-5)


def test_plan_json_writes_state_offload_and_older_versions_read_it_off():
    problem = offload_problem(3, num_layers=3, nodes=1, per_node=2, memory_gib=40.0)
    plan = problem.plan_for(stage_of_layer=[0, 0, 0], strategies=[
        Strategy(2, 1, "zero3", state_offload=True), Strategy(2, 1), Strategy(1, 2, state_offload=True)], pp=1,
        microbatches=1)
    doc = json.loads(plan.to_json())
    assert doc["format_version"] == PLAN_FORMAT_VERSION == 7
    assert [x["state_offload"] for x in doc["layers"]] == [True, False, True]
    assert [lp.strategy for lp in Plan.from_dict(json.loads(json.dumps(doc))).layers] == \
        [lp.strategy for lp in plan.layers]
    assert not any(lp.strategy.state_offload for lp in Plan.from_dict(dict(doc, format_version=6)).layers)
    with pytest.raises(UniAPError, match="state_offload"):
        Plan.from_dict({**doc, "layers": [{**doc["layers"][0], "state_offload": "yes"}, *doc["layers"][1:]]})
    with pytest.raises(UniAPError, match="state_offload needs dp_mode"):
        Plan.from_dict({**doc, "layers": [{**doc["layers"][0], "dp_mode": "zero1"}, *doc["layers"][1:]]})
    console = make_console(record=True)
    print_plan(plan, console=console)
    text = console.export_text()
    assert " state " in text and " host " in text


# (seed, layers, nodes, per node, memory GiB): small memories make the state bind (state offload, ZeRO-3, tensor
# parallelism, recomputation and activation offload compete); a large one shows it left alone
CASES = [(0, 3, 1, 2, 1.0), (1, 3, 1, 2, 0.5), (2, 3, 1, 2, 0.5), (3, 3, 1, 2, 1.0), (4, 3, 1, 2, 1.0),
         (5, 3, 1, 1, 1.0), (7, 3, 1, 2, 1.0), (8, 3, 2, 1, 0.5), (9, 3, 1, 1, 1.0), (11, 3, 2, 1, 0.5),
         (3, 3, 1, 2, 40.0)]


@lru_cache(maxsize=None)
def _oracle(case):
    return brute_force(offload_problem(case[0], num_layers=case[1], nodes=case[2], per_node=case[3],
                                       memory_gib=case[4]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-L{c[1]}-{c[2]}x{c[3]}-{c[4]}G")
def test_milp_matches_brute_force_with_state_offload(case):
    problem = offload_problem(case[0], num_layers=case[1], nodes=case[2], per_node=case[3], memory_gib=case[4])
    assert_search_matches(problem, _oracle(case))


def test_oracle_optima_offload_state_somewhere_and_not_everywhere():
    best = [b for b in map(_oracle, CASES) if b is not None]
    used = [sum(lp.strategy.state_offload for lp in b.layers) for b in best]
    assert sum(map(bool, used)) >= 5 and not all(used) and len(best) < len(CASES), used
    strategies = [lp.strategy for b in best for lp in b.layers if lp.strategy.state_offload]
    assert any(s.replicas > 1 for s in strategies) and any(s.replicas == 1 for s in strategies)
    assert any(s.recompute for s in strategies) and any(s.offload for s in strategies)


@pytest.mark.slow
def test_llama_13b_on_one_h100_fits_only_with_state_offload():
    """LLaMA-13B (bf16, Adam: 208 GB of state) on one 80 GB H100 (PCIe 5.0 host link, 51.2 GB/s): no plan fits
    without offload; with it allowed, every block keeps its state on the host."""
    base = dict(load_group("cluster", "h100_4x8"), nodes=1, devices_per_node=1, name="h100_1x1")
    model = load_group("model", "llama_13b")
    with pytest.raises(UniAPError, match="no plan fits in memory"):
        search(build_problem(model=model, cluster=base, training="default"), time_limit_s=60)
    plan = search(build_problem(model=model, cluster=dict(base, offload="auto"), training="default"),
                  time_limit_s=60)
    blocks = [lp.strategy for lp in plan.layers if lp.name.startswith("block")]
    assert blocks and all(s.state_offload for s in blocks)


def test_baselines_neither_offload_nor_keep_state_on_the_host():
    """The baselines stand for systems that do not offload per layer: where offload is allowed and the planner's
    own optima use it, the ZeRO-2 and pipeline + DP baselines still keep every layer's state and activations on
    the device (or report no plan)."""
    used = 0
    for case in CASES[:6]:
        problem = offload_problem(case[0], num_layers=case[1], nodes=case[2], per_node=case[3], memory_gib=case[4])
        plans = baseline_plans(problem, time_limit_s=20)
        for name in ("zero2", "inter_only", "ddp", "fsdp", "megatron"):
            plan = plans[name]
            if plan is not None:
                assert not any(lp.strategy.offload or lp.strategy.state_offload for lp in plan.layers), name
        used += any(lp.strategy.state_offload or lp.strategy.offload
                    for p in (plans["intra_only"],) if p is not None for lp in p.layers)
    assert used  # the planner's own ablation may offload: the restriction is the baselines', not the space's
