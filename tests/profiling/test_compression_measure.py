"""Gradient compression timed at setup: ``measure_compression`` on 2 gloo ranks, written into the planning
cluster (``compression_ns_per_param``), and a cached cluster from before it existed is measured again."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import uniap_launch

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.profiling.collectives import apply_to_cluster, measure_compression


def _worker(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        small = measure_compression({"powersgd_rank": 2}, repeats=3, rows=128, cols=256)
        out.put((rank, small))
    finally:
        dist.destroy_process_group()


def test_measure_compression_on_two_ranks_reaches_the_cluster() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    q = uniap_launch.context().Queue()
    uniap_launch.start_processes(_worker, args=(2, port, q), nprocs=2)
    got = dict(q.get(timeout=10) for _ in range(2))
    assert got[0] == got[1]  # the median over ranks, the same everywhere
    figures = got[0]
    assert set(figures) == {"bf16", "powersgd", "topk"}
    # a real timing: positive, and per element far below a microsecond-per-element (no per-call cost dominates)
    assert all(0 < v < 1000 and math.isfinite(v) for v in figures.values()), figures
    base = Cluster(name="local", nodes=1, devices_per_node=2, memory_gib=4, peak_tflops=0.05)
    cluster = apply_to_cluster(base, {"ops": {}, "compression_ns_per_param": figures})
    for method, ns in figures.items():
        assert cluster.compression_s_per_param(method) == pytest.approx(ns * 1e-9)
    # no measured figure: the analytic default stands
    assert base.compression_s_per_param("topk") > 0 and base.compression_ns_per_param == {}


def test_a_cached_cluster_without_compression_figures_is_measured_again(tmp_path) -> None:
    from uniap_lightning.profiling.cache import save_cached_json
    from uniap_lightning.setup.agree import Ranks
    from uniap_lightning.setup.measure import Measurements
    from uniap_lightning.setup.options import SetupOptions

    base = Cluster(name="local", nodes=1, devices_per_node=2, memory_gib=4, peak_tflops=0.05)
    m = Measurements(ranks=Ranks(rank=0, world_size=2, num_nodes=1, devices_per_node=2, device=torch.device("cpu")),
                     options=SetupOptions(cache_dir=tmp_path), precision="32-true", forward_context=None)
    old = {"world_size": 2, "devices_per_node": 2, "ops": {}, "optimizer_ns_per_param": 1.0}
    save_cached_json(tmp_path, "cluster-x.json", old)
    assert m._cached_cluster(base, tmp_path / "cluster-x.json") is None
    save_cached_json(tmp_path, "cluster-y.json", {**old, "compression_ns_per_param": {"bf16": 0.5}})
    cached = m._cached_cluster(base, tmp_path / "cluster-y.json")
    assert cached is not None and cached.compression_ns_per_param == {"bf16": 0.5}


def test_profiles_carry_powersgd_dims_measured_and_structural() -> None:
    from torch import nn

    from uniap_lightning.profiling.module import profile_chain
    from uniap_lightning.profiling.structural import structural_profile

    layers = [nn.Linear(8, 16), nn.Sequential(nn.Conv1d(16, 4, 3), nn.LayerNorm(4))]
    frozen = nn.Linear(4, 4)
    frozen.weight.requires_grad_(False)  # not trained: not synchronized, not priced
    expected = [(8 + 16, 16), (4 + 16 * 3, 4 + 4 + 4), (0, 4)]
    measured = profile_chain([*layers, frozen], ["a", "b", "c"], torch.randn(2, 16, 6), repeats=1)
    structural = structural_profile([*layers, frozen], ["a", "b", "c"], None)
    for profile in (measured, structural):
        assert [(lp.matrix_dims, lp.vector_params) for lp in profile.layers] == expected, profile.source
    assert measured.source == "structural"  # Linear(8, ...) rejects this input: the fallback fills them too
    ok = profile_chain([nn.Linear(8, 16)], ["a"], torch.randn(2, 8), repeats=1)
    assert ok.source == "measured" and (ok.layers[0].matrix_dims, ok.layers[0].vector_params) == (24, 16)
