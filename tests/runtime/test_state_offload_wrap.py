"""State offload's runtime (``uniap_lightning.runtime.dimensions.state_offload``) on one gloo process: the layer
becomes an FSDP2 unit with ``CPUOffloadPolicy`` (unpinned on a CPU-only build, where pinning fails), its parameters
host DTensor shards, and the data dimension leaves it. Parity with one process, mixed with ZeRO and pipeline
stages, and resuming across plans that differ in it, are in ``test_zero_recompute.py``."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import uniap_rt_helpers as h


def worker(rank: int, world: int, port: int, cases: dict[str, Any], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    result: dict[str, Any] = {}
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
        from torch.distributed.tensor import DTensor

        from uniap_lightning.planner.decision import Strategy
        from uniap_lightning.runtime.dimensions import by_name
        from uniap_lightning.runtime.zero import fsdp_params

        dist.init_process_group("gloo", rank=rank, world_size=world)
        grid = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
        meshes = SimpleNamespace(device_type="cpu", dp_mesh=lambda reps, tp: grid["dp"])
        layer = torch.nn.Linear(4, 4)
        job = SimpleNamespace(u=0, name="l", layer=layer, st=Strategy(1, 1, state_offload=True), meshes=meshes,
                              held_apart=set())
        by_name("state_offload").wrap(job)
        by_name("data").wrap(job)  # one replica: leaves it; with replicas, it leaves an FSDP2 unit too
        policy = layer._get_fsdp_state()._fsdp_param_group.offload_policy
        result.update(fsdp=isinstance(layer, FSDPModule), policy=type(policy).__name__, pinned=policy.pin_memory,
                      dtensor=isinstance(layer.weight, DTensor), device=str(layer.weight.device),
                      offloaded=all(fp.offload_to_cpu for fp in fsdp_params(layer)))
        x = torch.randn(3, 4)
        layer(x).sum().backward()
        result["grad_device"] = str(layer.weight.grad.device)
        try:  # what pinning does without an accelerator (why the CPU path runs unpinned)
            CPUOffloadPolicy(pin_memory=True)
            plain = torch.nn.Linear(2, 2)
            from torch.distributed.fsdp import fully_shard
            fully_shard(plain, mesh=grid["dp"], offload_policy=CPUOffloadPolicy(pin_memory=True))
            result["pinned_error"] = None
        except RuntimeError as err:
            result["pinned_error"] = str(err)
        dist.destroy_process_group()
    except Exception as err:  # recorded for the test to show
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    torch.save({"wrap": result}, Path(out_dir) / f"rank{rank}.pt")


def test_wrap_makes_a_host_offloaded_fsdp2_unit(tmp_path: Path) -> None:
    (r,) = h.spawn(1, {}, tmp_path, fn=worker)
    r = r["wrap"]
    assert "error" not in r, r.get("traceback")
    assert r["fsdp"] and r["policy"] == "CPUOffloadPolicy" and r["offloaded"] and r["dtensor"]
    assert r["device"] == "cpu" and r["grad_device"] == "cpu"
    assert r["pinned"] is torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert r["pinned_error"] and "accelerator" in r["pinned_error"], r["pinned_error"]


def test_the_local_gpu_cluster_takes_its_host_link_from_the_catalogue(monkeypatch):
    """``Trainer(strategy="uniap")`` without ``cluster=`` on a catalogue GPU prices offload over the device's host
    link as a cluster file naming the device does (an H200: 64 GB/s PCIe x 0.8); an unknown GPU has none, so no
    offload is offered there."""
    from uniap_lightning.planner.cluster import Cluster
    from uniap_lightning.runtime.planning import local_cluster

    def props(name: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, total_memory=141 * 1024**3)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props("NVIDIA H200"))
    local = local_cluster(nodes=1, devices_per_node=1, device_type="cuda")
    shipped = Cluster.from_dict({"name": "x", "nodes": 1, "devices_per_node": 1, "device": "h200"})
    assert local.device == "h200" and local.host_link_gbps == shipped.host_link_gbps > 0
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props("Some Future GPU"))
    assert local_cluster(nodes=1, devices_per_node=1, device_type="cuda").host_link_gbps == 0.0
