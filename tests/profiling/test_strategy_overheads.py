"""Measured TP / FSDP overheads: the profile field, how the cost model uses it, and the collective measurement."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import pytest
import torch
import uniap_launch
from torch import nn

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.cost import all_gather_s, all_reduce_s, layer_cost, reduce_scatter_s
from uniap_lightning.planner.cost.layer import Strategy
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.profile import LayerProfile, ModelProfile, Overhead
from uniap_lightning.profiling.strategies import attach_overheads, strategy_kinds
from uniap_lightning.runtime.planning import cache_key

CL = Cluster(name="hand", nodes=2, devices_per_node=4, memory_gib=16, peak_tflops=1, intra_bw_gbps=10,
             inter_bw_gbps=1, intra_latency_us=5, inter_latency_us=50)
TR = TrainingConfig(global_batch_size=8, weight_bytes=2, grad_bytes=2, optimizer_bytes=12)
PLAIN = LayerProfile(name="l", forward_s=1e-3, backward_s=2e-3, params=1_000_000, activation_bytes=1e6,
                     output_bytes=1e5, tp_degrees=(1, 2, 4), tp_allreduces=2)
MEASURED = replace(PLAIN, overheads=(
    Overhead("tp", 2, 2, 0.010), Overhead("tp", 2, 8, 0.016),  # 10 ms at 2 samples, 16 ms at 8
    Overhead("fsdp", 2, 2, 0.004), Overhead("fsdp", 2, 8, 0.004),
))


def test_overhead_is_interpolated_in_the_micro_batch_and_flat_outside():
    assert MEASURED.overhead_s("tp", 2, 2) == pytest.approx(0.010)
    assert MEASURED.overhead_s("tp", 2, 4) == pytest.approx(0.012)
    assert MEASURED.overhead_s("tp", 2, 1) == pytest.approx(0.010)
    assert MEASURED.overhead_s("tp", 2, 64) == pytest.approx(0.016)
    assert MEASURED.overhead_s("tp", 4, 4) is None
    assert PLAIN.overhead_s("fsdp", 2, 4) is None


def test_measured_tp_overhead_replaces_the_allreduce_formula():
    # d=1, t=2 on a 2-device stage: 8 samples per device, compute split in two, then the measured 16 ms
    c = layer_cost(MEASURED, Strategy(1, 2), 8, 2, CL, TR)
    assert c.compute_s == pytest.approx(3e-3 * 8 / 2)
    assert c.comm_s == pytest.approx(0.016)
    formula = layer_cost(PLAIN, Strategy(1, 2), 8, 2, CL, TR)
    assert formula.comm_s == pytest.approx(2 * 2 * all_reduce_s(CL, 1e5 * 8, 2, False))
    # not measured at tp=4: the formula still applies
    c4 = layer_cost(MEASURED, Strategy(1, 4), 8, 4, CL, TR)
    assert c4.comm_s == pytest.approx(2 * 2 * all_reduce_s(CL, 1e5 * 8, 4, False))


def test_measured_fsdp_overhead_only_inside_a_node_and_without_tp():
    c = layer_cost(MEASURED, Strategy(2, 1, "zero3"), 8, 2, CL, TR)
    assert c.comm_s == pytest.approx(0.004)
    assert c.sync_s == 0
    # FSDP x TP: formula for the sharding part, measured TP at 4 samples (12 ms)
    ct = layer_cost(MEASURED, Strategy(2, 2, "zero3"), 8, 4, CL, TR)
    fsdp = 2 * all_gather_s(CL, 5e5 * 2, 2, False) + reduce_scatter_s(CL, 5e5 * 2, 2, False)
    assert ct.comm_s == pytest.approx(fsdp + 0.012)
    # a data-parallel group across nodes (stage of 8 devices on 4-device nodes): the formulas, inter-node link
    m8 = replace(MEASURED, overheads=(Overhead("fsdp", 8, 1, 0.5),))
    c8 = layer_cost(m8, Strategy(8, 1, "zero3"), 8, 8, CL, TR)
    assert c8.comm_s == pytest.approx(2 * all_gather_s(CL, 1e6 * 2, 8, True) + reduce_scatter_s(CL, 1e6 * 2, 8, True))


def test_measured_replication_replaces_the_allreduce_formula_once_per_step():
    rep = replace(PLAIN, param_tensors=2, overheads=(Overhead("dp", 2, 4, 0.007),))
    base = layer_cost(PLAIN, Strategy(2, 1), 8, 2, CL, TR)
    c = layer_cost(rep, Strategy(2, 1), 8, 2, CL, TR)
    formula = all_reduce_s(CL, 1e6 * 2, 2, False)
    optimizer = CL.optimizer_s_per_param * 1e6
    assert base.sync_s == pytest.approx(formula + optimizer)
    assert c.sync_s == pytest.approx(0.007 + optimizer + CL.optimizer_s_per_tensor * 2)
    assert c.time_s == base.time_s  # per micro-batch time unchanged: the average runs once per step
    # measured below zero (a GPU overlapping it entirely) never makes the sync pay back time
    neg = replace(PLAIN, overheads=(Overhead("dp", 2, 4, -0.003),))
    assert layer_cost(neg, Strategy(2, 1), 8, 2, CL, TR).sync_s == pytest.approx(optimizer)
    # with TP, or a group across nodes: the formula
    c22 = layer_cost(replace(rep, overheads=(Overhead("dp", 2, 2, 0.007),)), Strategy(2, 2), 8, 4, CL, TR)
    assert c22.sync_s == pytest.approx(all_reduce_s(CL, 5e5 * 2, 2, False) + optimizer / 2
                                       + CL.optimizer_s_per_tensor * 2)
    c8 = layer_cost(replace(rep, overheads=(Overhead("dp", 8, 1, 0.5),)), Strategy(8, 1), 8, 8, CL, TR)
    assert c8.sync_s == pytest.approx(all_reduce_s(CL, 1e6 * 2, 8, True) + optimizer + CL.optimizer_s_per_tensor * 2)


def test_measured_zero_modes_replace_their_step_collectives():
    from uniap_lightning.planner.cost.layer import Pricing

    z = replace(PLAIN, overheads=(Overhead("zero2", 2, 4, 0.009), Overhead("zero1", 2, 4, 0.011)))
    pr = Pricing(8, 2)
    optimizer = CL.optimizer_s_per_param * 1e6 / 2
    assert layer_cost(z, Strategy(2, 1, "zero2"), pr, cluster=CL, training=TR).sync_s == pytest.approx(0.009 + optimizer)
    assert layer_cost(z, Strategy(2, 1, "zero1"), pr, cluster=CL, training=TR).sync_s == pytest.approx(0.011 + optimizer)
    formula = reduce_scatter_s(CL, 1e6 * 2, 2, False) + all_gather_s(CL, 1e6 * 2, 2, False)
    assert layer_cost(PLAIN, Strategy(2, 1, "zero2"), pr, cluster=CL, training=TR).sync_s == pytest.approx(
        formula + optimizer)


def test_overheads_round_trip_and_bad_records_are_refused():
    prof = ModelProfile(model="m", layers=[MEASURED], source="measured")
    back = ModelProfile.from_dict(prof.to_dict())
    assert back.layers[0].overheads == MEASURED.overheads
    assert "overheads" not in ModelProfile(model="m", layers=[PLAIN]).to_dict()["layers"][0]  # optional field
    for bad, msg in [
        ({"kind": "ddp", "degree": 2, "micro_batch": 1, "seconds": 0.1}, "kind must be one of"),
        ({"kind": "tp", "degree": 1, "micro_batch": 1, "seconds": 0.1}, "degree must be >= 2"),
        ({"kind": "tp", "degree": 2, "micro_batch": 1}, "needs 'kind'"),
        ({"kind": "tp", "degree": 2, "micro_batch": 1, "seconds": float("nan")}, "finite number"),
    ]:
        d = prof.to_dict()
        d["layers"][0]["overheads"] = [bad]
        with pytest.raises(UniAPError, match=msg):
            ModelProfile.from_dict(d)
    d = prof.to_dict()
    d["layers"][0]["overheads"].append(dict(d["layers"][0]["overheads"][0]))
    with pytest.raises(UniAPError, match="twice"):
        ModelProfile.from_dict(d)


def test_a_plan_solved_without_overheads_is_not_reused_with_them():
    from uniap_lightning.planner.problem import TrainingConfig

    kw = dict(cluster=CL, world_size=8, training=TrainingConfig(global_batch_size=8), solver="auto")
    plain = ModelProfile(model="m", layers=[PLAIN, PLAIN])
    measured = attach_overheads(plain, {0: list(MEASURED.overheads), 1: list(MEASURED.overheads)})
    assert measured.meta["overheads_measured"] and measured.layers[1].overheads == MEASURED.overheads
    assert measured.fingerprint() == plain.fingerprint()  # same model
    assert cache_key(profile=plain, **kw) != cache_key(profile=measured, **kw)


def test_strategy_kinds_stay_inside_a_node():
    modes = lambda k: [("fsdp", k), ("dp", k), ("zero2", k), ("zero1", k)]  # noqa: E731
    assert strategy_kinds(4, 4, [1, 2, 4]) == [("tp", 2), *modes(2), ("tp", 4), *modes(4)]
    assert strategy_kinds(8, 2, [1, 4]) == modes(2)
    assert strategy_kinds(1, 1, [1, 2]) == []


# ---------------------------------------------------------------------------------------------- real processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chain() -> list[nn.Module]:
    torch.manual_seed(0)
    mlp = lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))  # noqa: E731
    return [nn.Linear(16, 32), mlp(), mlp(), nn.Sequential(nn.LayerNorm(32))]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from uniap_lightning.profiling.strategies import measure_overheads

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layers = _chain()
        before = [p.detach().clone() for m in layers for p in m.parameters()]
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        split: dict[int, float] = {}
        res = measure_overheads(layers, [f"l{i}" for i in range(4)], x, micro_batches=[2, 8, 99], repeats=2,
                                tp_split=split)
        untouched = all(torch.equal(a, p) for a, p in zip(before, (p for m in layers for p in m.parameters())))
        no_grads = all(p.grad is None for m in layers for p in m.parameters())
        torch.save({"res": res, "untouched": untouched, "no_grads": no_grads, "split": split},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_measure_overheads_on_two_gloo_ranks(tmp_path):
    uniap_launch.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["res"] == r1["res"]  # the slowest rank's figures, identical everywhere
    assert r0["untouched"] and r0["no_grads"] and r1["untouched"] and r1["no_grads"]
    res = r0["res"]
    kinds = lambda i: sorted({(o.kind, o.degree) for o in res[i]})  # noqa: E731
    modes = [("dp", 2), ("fsdp", 2), ("zero1", 2), ("zero2", 2)]
    assert kinds(0) == sorted([*modes, ("tp", 2)])  # nn.Linear: column-parallel
    assert kinds(1) == sorted([*modes, ("tp", 2)])  # Linear-GELU-Linear: Megatron MLP
    assert res[2] == res[1]  # same structure: timed once
    assert kinds(3) == modes  # no TP plan for a LayerNorm
    assert sorted({o.micro_batch for o in res[1]}) == [2, 8]  # 99 > the sample's 8 rows: skipped
    assert all(o.seconds == o.seconds and abs(o.seconds) < 5 for i in res for o in res[i])
    # saved for backward per sample under TP 2: the column-parallel Linear keeps its whole input (16 floats), none
    # split; the MLP keeps its input whole (32 floats) and splits GELU's input and fc2's input (64 + 64 floats)
    assert r0["split"] == r1["split"] == {0: 0.0, 1: 128 * 4.0, 2: 128 * 4.0}


def test_attach_overheads_turns_split_bytes_into_the_fraction() -> None:
    from uniap_lightning.profiling.strategies import tp_split_bytes

    assert tp_split_bytes(640.0, 384.0, 2) == 512.0  # 128 of 640 whole, 512 halved: 128 + 256 = 384 kept
    assert tp_split_bytes(640.0, 700.0, 2) == 0.0 and tp_split_bytes(640.0, 0.0, 2) == 640.0  # clamped
    assert tp_split_bytes(0.0, 0.0, 4) == 0.0
    base = LayerProfile(name="l", forward_s=1e-3, backward_s=2e-3, params=10, activation_bytes=1000.0,
                        output_bytes=4.0, tp_degrees=(1, 2))
    prof = ModelProfile(model="m", layers=[base, replace(base, name="k")], source="measured")
    out = attach_overheads(prof, {}, {0: 500.0})
    assert out.layers[0].activation_tp_fraction == 0.5  # e.g. the loss's bytes, counted with the layer: not split
    assert out.layers[1].activation_tp_fraction == 1.0  # not measured: unchanged
