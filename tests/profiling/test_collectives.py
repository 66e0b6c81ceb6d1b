"""Cluster profiling on a real 2-process gloo group: measured tables feed the cost model."""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from uniap_lightning.cluster import Cluster  # noqa: E402
from uniap_lightning.profiling.collectives import _fit, apply_to_cluster, measure_collectives  # noqa: E402


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
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_worker, args=(2, _free_port(), q), nprocs=2, join=True, start_method="spawn")
    res = q.get(timeout=10)
    assert res["world_size"] == 2
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        rec = res["ops"][op][2]
        assert rec["bw_gbps"] > 0 and rec["latency_us"] >= 0 and rec["inter_node"] is False
    base = Cluster(name="local", nodes=1, devices_per_node=2, memory_gib=4, peak_tflops=0.05)
    measured = apply_to_cluster(base, res)
    assert measured.bandwidth_tables["intra"][2] == pytest.approx(res["ops"]["all_reduce"][2]["bw_gbps"])
    assert measured.bandwidth_bytes_per_s(2, False) == pytest.approx(res["ops"]["all_reduce"][2]["bw_gbps"] * 1e9)
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
