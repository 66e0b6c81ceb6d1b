"""Cluster profiling on a real 2-process gloo group: measured tables feed the cost model."""

from __future__ import annotations

import json
import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import uniap_launch  # noqa: E402

from uniap_lightning.planner.cluster import Cluster  # noqa: E402
from uniap_lightning.planner.cost import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s  # noqa: E402
from uniap_lightning.profiling.collectives import (  # noqa: E402
    _fit,
    apply_to_cluster,
    describe_collectives,
    measure_collectives,
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = measure_collectives(repeats=3, devices_per_node=world)
        if rank == 0:
            out.put(res)
    finally:
        dist.destroy_process_group()


def test_measure_collectives_two_ranks():
    q = uniap_launch.context().Queue()
    uniap_launch.start_processes(_worker, args=(2, _free_port(), q), nprocs=2)
    res = q.get(timeout=10)
    assert res["world_size"] == 2
    for op in OPS:
        rec = res["ops"][op][2]
        assert rec["bw_gbps"] > 0 and rec["latency_us"] >= 0 and rec["inter_node"] is False
    base = Cluster(name="local", nodes=1, devices_per_node=2, memory_gib=4, peak_tflops=0.05)
    measured = apply_to_cluster(base, res)
    assert measured.bandwidth_tables["intra"][2] == pytest.approx(res["ops"]["all_reduce"][2]["bw_gbps"])
    assert measured.bandwidth_bytes_per_s(2, False) == pytest.approx(res["ops"]["all_reduce"][2]["bw_gbps"] * 1e9)
    for op in OPS:  # every op lands in the cluster with its own figures
        row = measured.collective_tables[op]["intra"][2]
        assert row == {"bw_gbps": pytest.approx(res["ops"][op][2]["bw_gbps"]),
                       "latency_us": pytest.approx(res["ops"][op][2]["latency_us"])}
        assert row["bw_gbps"] > 0 and row["latency_us"] >= 0
        assert measured.bandwidth_bytes_per_s(2, False, op=op) == pytest.approx(row["bw_gbps"] * 1e9)
    assert reduce_scatter_s(measured, 1e6, 2, False) > 0 and all_gather_s(measured, 1e6, 2, False) > 0
    # a two-stage torch.distributed.pipelining schedule: the fixed cost of one slot, in the cluster
    assert 0 <= res["pipeline_slot_us"] < 1e6
    assert measured.pipeline_overhead_us == pytest.approx(res["pipeline_slot_us"])
    assert res["seconds"] < 60


def test_alpha_beta_fit_recovers_the_model():
    # all-reduce over 4 ranks with alpha = 10 us, bw = 2 GB/s
    def t(S):
        return 6 * 10e-6 + 1.5 * S / 2e9

    bw, lat = _fit("all_reduce", 4, (1000, 1_000_000), (t(1000), t(1_000_000)))
    assert bw == pytest.approx(2.0)
    assert lat == pytest.approx(10.0)


def test_alpha_beta_fit_survives_noise():
    # the 1 MiB all-reduce timed no slower than the 4 KiB one (noise): no absurd bandwidth, the lower bound instead
    bw, lat = _fit("all_reduce", 2, (4096, 1 << 20), (2e-3, 1.9e-3))
    assert bw == pytest.approx((1 << 20) / 1.9e-3 / 1e9)
    assert lat >= 0


def _synthetic(world: int, dpn: int) -> dict:
    """A ``measure_collectives`` result: op i at group size p has bandwidth (i + 1) / p GB/s, latency 10 p (i + 1)."""
    ops = {}
    for i, op in enumerate(OPS):
        sizes = [2] if op == "p2p" else [p for p in (2, 4, 8) if p <= world]
        ops[op] = {p: {"bw_gbps": (i + 1) / p, "latency_us": 10.0 * p * (i + 1), "inter_node": p > dpn} for p in sizes}
    return {"world_size": world, "devices_per_node": dpn, "ops": ops, "seconds": 1.0}


def test_apply_to_cluster_fills_every_op():
    base = Cluster(name="two-nodes", nodes=2, devices_per_node=4, memory_gib=4, peak_tflops=0.05)
    cl = apply_to_cluster(base, _synthetic(8, 4))
    assert set(cl.collective_tables) == set(OPS)
    assert cl.collective_tables["reduce_scatter"] == {
        "intra": {2: {"bw_gbps": 1.5, "latency_us": 60.0}, 4: {"bw_gbps": 0.75, "latency_us": 120.0}},
        "inter": {8: {"bw_gbps": 0.375, "latency_us": 240.0}},
    }
    assert cl.collective_tables["p2p"] == {"intra": {2: {"bw_gbps": 2.0, "latency_us": 80.0}}}
    # all-reduce also fills the tables and flat figures read by displays and older code, as before
    assert cl.bandwidth_tables == {"intra": {2: 0.5, 4: 0.25}, "inter": {8: 0.125}}
    assert cl.intra_latency_us == pytest.approx(30.0) and cl.inter_latency_us == pytest.approx(80.0)
    assert cl.intra_bw_gbps == pytest.approx(0.375)
    # each op is priced with its own row, not all-reduce's
    assert all_reduce_s(cl, 1e9, 4, False) == pytest.approx(2 * 3 * 40e-6 + 2 * 3 / 4 * 1e9 / 0.25e9)
    assert all_gather_s(cl, 1e9, 4, False) == pytest.approx(3 * 80e-6 + 3 / 4 * 1e9 / 0.5e9)
    assert reduce_scatter_s(cl, 1e9, 8, True) == pytest.approx(7 * 240e-6 + 7 / 8 * 1e9 / 0.375e9)
    assert p2p_s(cl, 1e6, False) == pytest.approx(80e-6 + 1e6 / 2e9)
    assert p2p_s(cl, 1e6, True) == pytest.approx(cl.inter_latency_us * 1e-6 + 1e6 / 0.125e9)  # no inter p2p row
    text = describe_collectives(cl)
    assert text.splitlines()[2] == "reduce_scatter: {2: 1.50 GB/s / 60 us, 4: 0.75 GB/s / 120 us}"
    assert describe_collectives(base) == ""


def test_apply_to_cluster_reads_cached_json_and_older_results():
    measured = json.loads(json.dumps(_synthetic(2, 2)))  # the on-disk cache: group sizes as strings
    cl = apply_to_cluster(Cluster(name="c", nodes=1, devices_per_node=2, memory_gib=4, peak_tflops=0.05), measured)
    assert cl.collective_tables["all_gather"]["intra"] == {2: {"bw_gbps": 1.0, "latency_us": 40.0}}
    only_ar = {"ops": {"all_reduce": measured["ops"]["all_reduce"]}}
    cl = apply_to_cluster(Cluster(name="c", nodes=1, devices_per_node=2, memory_gib=4, peak_tflops=0.05), only_ar)
    assert set(cl.collective_tables) == {"all_reduce"}
    assert cl.bandwidth_bytes_per_s(2, False, op="reduce_scatter") == pytest.approx(0.5e9)  # all-reduce's figure
