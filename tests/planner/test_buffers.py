"""NCCL's buffers per communicator (planner.cost.buffers), by hand: which communicators a strategy and a stage use,
the bytes a layer's transient gains, where a cluster gets its figure, and the device reserve's parts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from uniap_lightning.planner.cluster import GIB, Cluster
from uniap_lightning.planner.config import cluster_from
from uniap_lightning.planner.cost import layer_cost
from uniap_lightning.planner.cost.buffers import communicator_bytes, communicators
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.devices import (CUBLAS_WORKSPACES_GIB, CUDA_CONTEXT_GIB, NCCL_COMMUNICATOR_GIB,
                                             NCCL_PAIR_SHARE, available_devices, lookup_device)
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.profile import LayerProfile

CL = Cluster(name="hand", nodes=2, devices_per_node=4, memory_gib=80, peak_tflops=1, nccl_comm_gib=0.5)
TR = TrainingConfig(global_batch_size=8, weight_bytes=2, grad_bytes=2, optimizer_bytes=12)
LAYER = LayerProfile(name="l", forward_s=1e-3, backward_s=2e-3, params=1_000_000, activation_bytes=1e6,
                     output_bytes=1e5, tp_degrees=(1, 2, 4), tp_allreduces=2, activation_tp_fraction=1.0)


def test_the_communicators_of_a_strategy_and_a_stage():
    assert communicators(Strategy(1, 1), 1, 1) == (0, 0)  # one device: no NCCL at all
    assert communicators(Strategy(8, 1), 8, 8) == (2, 0)  # world + the data-parallel group
    assert communicators(Strategy(2, 4), 8, 8) == (3, 0)  # world + tp + dp
    assert communicators(Strategy(1, 4), 4, 8) == (2, 2)  # world + tp; two stages: a pair each side
    assert communicators(Strategy(1, 1), 1, 8) == (1, 2)  # pp 8: world and the two hand-offs


def test_a_layers_transient_holds_its_communicators_buffers():
    base = replace(CL, nccl_comm_gib=0.0)
    for s, n in ((Strategy(2, 2), 4), (Strategy(4, 1), 8), (Strategy(1, 2), 2)):
        with_nccl, without = layer_cost(LAYER, s, 8, n, CL, TR), layer_cost(LAYER, s, 8, n, base, TR)
        groups, pairs = communicators(s, n, 8)
        assert with_nccl.transient_bytes - without.transient_bytes == pytest.approx(
            0.5 * GIB * (groups + NCCL_PAIR_SHARE * pairs))
        assert with_nccl.static_bytes == without.static_bytes  # held once per device, not per layer
        assert with_nccl.activation_bytes == without.activation_bytes
    assert communicator_bytes(base, Strategy(2, 2), 4) == 0.0


def test_a_catalogue_device_prices_nccl_and_a_file_of_its_own_figures_may_not():
    cat = cluster_from({"name": "c", "device": "h100_sxm", "nodes": 1, "devices_per_node": 8})
    assert cat.nccl_comm_gib == pytest.approx(NCCL_COMMUNICATOR_GIB) == pytest.approx(688e6 / GIB)
    own = cluster_from({"name": "c", "device": "h100_sxm", "nodes": 1, "devices_per_node": 8, "nccl_comm_gib": 0.2})
    assert own.nccl_comm_gib == 0.2
    bare = cluster_from({"name": "b", "nodes": 1, "devices_per_node": 2, "memory_gib": 16, "peak_tflops": 100})
    assert bare.nccl_comm_gib == 0.0


def test_every_devices_reserve_covers_its_cuda_context_and_workspaces():
    for name in available_devices():
        assert lookup_device(name).framework_reserve_gib >= CUDA_CONTEXT_GIB + CUBLAS_WORKSPACES_GIB, name
