"""Per-operation collective tables: each collective priced with its own bandwidth and latency, by hand."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import yaml

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import cluster_from
from uniap_lightning.planner.cost import all_gather_s, all_reduce_s, layer_cost, p2p_s, reduce_scatter_s
from uniap_lightning.planner.cost.layer import Strategy
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.profile import LayerProfile

BASE = dict(name="ops", nodes=2, devices_per_node=8, memory_gib=16, peak_tflops=1, intra_bw_gbps=10,
            inter_bw_gbps=1, intra_latency_us=5, inter_latency_us=50)
TABLES = {
    "all_reduce": {"intra": {2: {"bw_gbps": 8.0, "latency_us": 10.0}, 8: {"bw_gbps": 2.0, "latency_us": 40.0}}},
    "all_gather": {"intra": {2: {"bw_gbps": 4.0, "latency_us": 100.0}, 8: {"bw_gbps": 1.0, "latency_us": 400.0}}},
    "reduce_scatter": {"intra": {2: {"bw_gbps": 0.5, "latency_us": 1000.0}},
                       "inter": {16: {"bw_gbps": 0.25, "latency_us": 2000.0}}},
    "p2p": {"intra": {2: {"bw_gbps": 3.0, "latency_us": 20.0}}, "inter": {2: {"bw_gbps": 0.5, "latency_us": 70.0}}},
}
CL = Cluster(**BASE, collective_tables=TABLES)


def test_each_op_priced_with_its_own_table():
    # group of 4 inside a node: halfway between the 2- and 8-point in log2(p), for bandwidth and latency alike
    assert all_reduce_s(CL, 1e9, 4, False) == pytest.approx(2 * 3 * 25e-6 + 2 * 3 / 4 * 1e9 / 5e9)
    assert all_gather_s(CL, 1e9, 4, False) == pytest.approx(3 * 250e-6 + 3 / 4 * 1e9 / 2.5e9)
    assert reduce_scatter_s(CL, 1e9, 4, False) == pytest.approx(3 * 1000e-6 + 3 / 4 * 1e9 / 0.5e9)  # clamped
    assert reduce_scatter_s(CL, 1e9, 16, True) == pytest.approx(15 * 2000e-6 + 15 / 16 * 1e9 / 0.25e9)
    assert p2p_s(CL, 1e6, False) == pytest.approx(20e-6 + 1e6 / 3e9)
    assert p2p_s(CL, 1e6, True) == pytest.approx(70e-6 + 1e6 / 0.5e9)
    # the same all-gather priced with the all-reduce figures (what the model did before) is another number
    assert all_gather_s(CL, 1e9, 4, False) != pytest.approx(3 * 25e-6 + 3 / 4 * 1e9 / 5e9)
    assert CL.bandwidth_bytes_per_s(4, False, op="all_gather") == pytest.approx(2.5e9)
    assert CL.latency_s(False, op="all_gather", group_size=4) == pytest.approx(250e-6)
    assert CL.latency_s(False, op="all_gather", group_size=64) == pytest.approx(400e-6)  # clamped


def test_missing_op_or_scope_falls_back_to_all_reduce_figures():
    # all-gather has no inter table and all-reduce has none either: flat inter figures, as before
    assert all_gather_s(CL, 1e9, 16, True) == pytest.approx(15 * 50e-6 + 15 / 16 * 1e9 / 1e9)
    # an op without a table is priced with all-reduce's table for that scope
    cl = Cluster(**BASE, collective_tables={"all_reduce": TABLES["all_reduce"]})
    assert all_gather_s(cl, 1e9, 4, False) == pytest.approx(3 * 25e-6 + 3 / 4 * 1e9 / 5e9)
    assert p2p_s(cl, 1e6, False) == pytest.approx(10e-6 + 1e6 / 8e9)


def test_without_tables_pricing_is_unchanged():
    plain = Cluster(**BASE)
    legacy = Cluster(**BASE, bandwidth_tables={"intra": {2: 20.0, 8: 5.0}})
    assert plain.collective_tables == {}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        assert plain.bandwidth_bytes_per_s(4, False, op=op) == pytest.approx(10e9)
        assert plain.latency_s(True, op=op, group_size=4) == pytest.approx(50e-6)
        assert legacy.bandwidth_bytes_per_s(4, False, op=op) == pytest.approx(12.5e9)
        assert legacy.latency_s(False, op=op, group_size=8) == pytest.approx(5e-6)
    assert plain.latency_s(False) == pytest.approx(5e-6)  # old call form
    assert all_gather_s(legacy, 1e9, 4, False) == pytest.approx(3 * 5e-6 + 3 / 4 * 1e9 / 12.5e9)
    assert reduce_scatter_s(plain, 1e9, 4, True) == pytest.approx(3 * 50e-6 + 3 / 4 * 1e9 / 1e9)
    assert p2p_s(plain, 1e6, True) == pytest.approx(50e-6 + 1e6 / 1e9)


def test_fsdp_layer_pays_the_reduce_scatter_table():
    layer = LayerProfile(name="l", forward_s=1e-3, backward_s=2e-3, params=1_000_000, activation_bytes=1e6,
                         output_bytes=1e5, tp_degrees=(1,), tp_allreduces=0)
    tr = TrainingConfig(global_batch_size=8, weight_bytes=2, grad_bytes=2, optimizer_bytes=12)
    c = layer_cost(layer, Strategy(2, 1, "zero3"), 8, 2, CL, tr)
    ag = 100e-6 + 0.5 * 2e6 / 4e9
    rs = 1000e-6 + 0.5 * 2e6 / 0.5e9
    assert c.comm_s == pytest.approx(2 * ag + rs)
    plain = layer_cost(layer, Strategy(2, 1, "zero3"), 8, 2, Cluster(**BASE), tr)
    assert c.comm_s > plain.comm_s


def test_from_dict_parses_yaml_and_json_keys_and_round_trips():
    text = """
name: y
nodes: 1
devices_per_node: 4
memory_gib: 8
peak_tflops: 1
collective_tables:
  reduce_scatter:
    intra:
      2: {bw_gbps: 0.22, latency_us: 2436}
      4: {bw_gbps: 0.16, latency_us: 1145}
  p2p:
    intra:
      "2": {bw_gbps: 2.8, latency_us: 196}
"""
    cl = Cluster.from_dict(yaml.safe_load(text))
    assert cl.collective_tables["reduce_scatter"]["intra"][4] == {"bw_gbps": 0.16, "latency_us": 1145.0}
    assert cl.collective_tables["p2p"]["intra"] == {2: {"bw_gbps": 2.8, "latency_us": 196.0}}
    # through JSON (string keys) and back: same figures, same pricing
    again = Cluster.from_dict(json.loads(json.dumps(asdict(cl))))
    assert again.collective_tables == cl.collective_tables
    assert reduce_scatter_s(again, 1e8, 4, False) == reduce_scatter_s(cl, 1e8, 4, False)
    assert again is not cl and again != cl  # identity semantics (cost caches key on the object)
    # a config written before the field existed still loads
    old = {k: v for k, v in asdict(cl).items() if k != "collective_tables"}
    assert Cluster.from_dict(old).collective_tables == {}
    assert Cluster.from_dict({**old, "collective_tables": None}).collective_tables == {}
    # a Hydra/OmegaConf config handed over as dict(cfg): nested DictConfig mappings are read too
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(yaml.safe_load(text))
    assert Cluster.from_dict(dict(cfg)).collective_tables == cl.collective_tables


def test_shipped_cluster_configs_still_load():
    assert cluster_from("local_cpu").collective_tables == {}


@pytest.mark.parametrize(
    "tables, match",
    [
        ({"broadcast": {"intra": {2: {"bw_gbps": 1, "latency_us": 1}}}}, "unknown op 'broadcast'"),
        ({"all_gather": {"cross": {2: {"bw_gbps": 1, "latency_us": 1}}}}, "keys must be 'intra'/'inter'"),
        ({"all_gather": {"intra": {1: {"bw_gbps": 1, "latency_us": 1}}}}, "group sizes must be integers >= 2"),
        ({"all_gather": {"intra": {"two": {"bw_gbps": 1, "latency_us": 1}}}}, "group sizes must be integers"),
        ({"all_gather": {"intra": {2.5: {"bw_gbps": 1, "latency_us": 1}}}}, "group sizes must be integers"),
        ({"all_gather": {"intra": {2: {"bw_gbps": 0, "latency_us": 1}}}}, r"\[2\].bw_gbps must be > 0"),
        ({"all_gather": {"intra": {2: {"bw_gbps": math.nan, "latency_us": 1}}}}, "bw_gbps must be > 0"),
        ({"all_gather": {"intra": {2: {"bw_gbps": 1, "latency_us": -1}}}}, "latency_us must be >= 0"),
        ({"all_gather": {"intra": {2: {"bw_gbps": 1}}}}, r"must be \{bw_gbps: GB/s, latency_us: us\}"),
        ({"all_gather": {"intra": {2: {"bw_gbps": 1, "latency_us": 1, "lat": 2}}}}, "must be {bw_gbps"),
        ({"all_gather": {"intra": {2: 1.0}}}, "must be {bw_gbps"),
        ({"all_gather": {"intra": {2: {"bw_gbps": 1, "latency_us": 1}, "2": {"bw_gbps": 1, "latency_us": 1}}}},
         "group size 2 given twice"),
        ({"all_gather": {"intra": [2]}}, "must be a mapping"),
        ({"all_gather": 3}, "must be a mapping"),
        ([1], "must be a mapping"),
    ],
)
def test_bad_collective_tables_are_refused(tables, match):
    with pytest.raises(UniAPError, match=match) as err:
        Cluster(**BASE, collective_tables=tables)
    assert "cluster 'ops': collective_tables" in str(err.value)


def test_unknown_op_asked_for_is_refused():
    with pytest.raises(UniAPError, match="unknown collective 'all2all'"):
        CL.bandwidth_bytes_per_s(2, False, op="all2all")
    with pytest.raises(UniAPError, match="unknown collective"):
        CL.latency_s(False, op="bcast")


@pytest.mark.parametrize("field", ["pipeline_overhead_us", "optimizer_ns_per_param", "optimizer_us_per_tensor"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "1ms", True])
def test_bad_measured_cluster_figures_are_refused(field, value):
    with pytest.raises(UniAPError, match=f"{field} must be >= 0"):
        Cluster.from_dict({"name": "c", "nodes": 1, "devices_per_node": 2, "memory_gib": 8, "peak_tflops": 1,
                           field: value})
