"""Every cost term against numbers computed by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.cost import all_gather_s, all_reduce_s, evaluate, layer_cost, p2p_s, reduce_scatter_s
from uniap_lightning.planner.cost.layer import Strategy, boundary_inter_node, reshard_s, strategies_for
from uniap_lightning.planner.cost.pipeline import pipeline_shape
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem, TrainingConfig
from uniap_lightning.planner.profile import LayerProfile, ModelProfile

# 10 GB/s and 5 us inside a node, 1 GB/s and 50 us across nodes.
CL = Cluster(name="hand", nodes=2, devices_per_node=4, memory_gib=16, peak_tflops=1, intra_bw_gbps=10,
             inter_bw_gbps=1, intra_latency_us=5, inter_latency_us=50)
TR = TrainingConfig(global_batch_size=8, weight_bytes=2, grad_bytes=2, optimizer_bytes=12)
LAYER = LayerProfile(name="l", forward_s=1e-3, backward_s=2e-3, params=1_000_000, activation_bytes=1e6,
                     output_bytes=1e5, tp_degrees=(1, 2, 4), tp_allreduces=2, activation_tp_fraction=1.0)


def test_collectives_alpha_beta():
    assert all_reduce_s(CL, 1e9, 4, False) == pytest.approx(2 * 3 * 5e-6 + 2 * 3 / 4 * 1e9 / 1e10)
    assert all_gather_s(CL, 1e9, 4, False) == pytest.approx(3 * 5e-6 + 3 / 4 * 1e9 / 1e10)
    assert reduce_scatter_s(CL, 1e9, 4, True) == pytest.approx(3 * 50e-6 + 3 / 4 * 1e9 / 1e9)
    assert p2p_s(CL, 1e6, True) == pytest.approx(50e-6 + 1e6 / 1e9)
    assert all_reduce_s(CL, 1e9, 1, False) == 0.0


def test_measured_bandwidth_table_replaces_flat_figure():
    cl = Cluster(name="t", nodes=1, devices_per_node=8, memory_gib=8, peak_tflops=1,
                 bandwidth_tables={"intra": {2: 20.0, 8: 5.0}})
    assert cl.bandwidth_bytes_per_s(2, False) == pytest.approx(20e9)
    assert cl.bandwidth_bytes_per_s(4, False) == pytest.approx(12.5e9)  # halfway in log2(p)
    assert cl.bandwidth_bytes_per_s(16, False) == pytest.approx(5e9)  # clamped
    assert cl.bandwidth_bytes_per_s(4, True) == pytest.approx(cl.inter_bw_gbps * 1e9)  # no inter table


def test_replicated_tensor_parallel_layer():
    c = layer_cost(LAYER, Strategy(2, 2), 8, 4, CL, TR)
    assert c.compute_s == pytest.approx(3e-3 * 4 / 2)  # b/d = 4 samples, split over t = 2
    tp = 2 * 2 * (2 * 1 * 5e-6 + 2 * 1 / 2 * 4e5 / 1e10)  # 2 all-reduces x (fwd + bwd) of 4 samples x 1e5 B
    assert c.comm_s == pytest.approx(tp)
    assert c.time_s == pytest.approx(6e-3 + tp)
    assert c.sync_s == pytest.approx(2 * 5e-6 + 1 * 1e6 / 1e10)  # grads: 5e5 params x 2 B over d = 2
    assert c.static_bytes == pytest.approx(5e5 * 16 + 5e5 * 2)  # + the all-reduce bucket: one more copy of grads
    assert c.activation_bytes == pytest.approx(1e6 * 4 / 2)
    assert c.transient_bytes == 0


def test_sharded_layer():
    c = layer_cost(LAYER, Strategy(2, 2, "zero3"), 8, 4, CL, TR)
    fsdp = 2 * (5e-6 + 0.5 * 1e6 / 1e10) + (5e-6 + 0.5 * 1e6 / 1e10)  # AG fwd + AG bwd + RS, 1e6 B over 2
    tp = 2 * 2 * (2 * 1 * 5e-6 + 2 * 1 / 2 * 4e5 / 1e10)
    assert c.comm_s == pytest.approx(fsdp + tp)
    assert c.sync_s == 0
    assert c.static_bytes == pytest.approx(5e5 * 16 / 2)
    assert c.transient_bytes == pytest.approx(5e5 * 2)  # the gathered copy, beside the kept shard


def test_replicated_layers_count_their_gradient_buckets():
    """The runtime's all-reduce buckets (runtime.data_parallel.ReplicatedGrads) persist and hold one more copy of a
    replicated layer's local gradients: 1e6 params / t x 2 B; sharded and single-copy layers have none."""
    assert TR.bytes_per_param == 16
    assert layer_cost(LAYER, Strategy(4, 1), 8, 4, CL, TR).static_bytes == pytest.approx(1e6 * (16 + 2))
    assert layer_cost(LAYER, Strategy(2, 2), 8, 4, CL, TR).static_bytes == pytest.approx(5e5 * (16 + 2))
    assert layer_cost(LAYER, Strategy(4, 1, "zero3"), 8, 4, CL, TR).static_bytes == pytest.approx(1e6 * 16 / 4)
    assert layer_cost(LAYER, Strategy(1, 4), 8, 4, CL, TR).static_bytes == pytest.approx(1e6 / 4 * 16)


def test_data_parallel_group_across_nodes_uses_inter_node_link():
    c = layer_cost(LAYER, Strategy(8, 1), 8, 8, CL, TR)
    assert c.sync_s == pytest.approx(2 * 7 * 50e-6 + 2 * 7 / 8 * 2e6 / 1e9)


def test_activation_fraction_not_split_by_tensor_parallelism():
    layer = LayerProfile(**{**LAYER.__dict__, "activation_tp_fraction": 0.25})
    c = layer_cost(layer, Strategy(1, 4), 8, 4, CL, TR)
    assert c.activation_bytes == pytest.approx(1e6 * 8 * (0.75 + 0.25 / 4))


def test_strategies_respect_tp_degrees_node_and_micro_batch():
    got = strategies_for(LAYER, 4, CL, 8)
    assert sorted({(s.dp, s.tp) for s in got}) == [(1, 4), (2, 2), (4, 1)]
    assert len(got) == 2 * 4 + 2 * 4 + 2  # (mode x recompute) for d > 1, recompute only for d = 1
    assert Strategy(4, 1) not in strategies_for(LAYER, 4, CL, 2)  # 2 samples cannot split 4 ways


def test_resharding_and_boundaries():
    assert reshard_s(CL, 1e5, 8, 4, 2) == pytest.approx(5e-6 + 0.5 * 4e5 / 1e10)
    assert reshard_s(CL, 1e5, 8, 2, 4) == reshard_s(CL, 1e5, 8, 4, 2)
    assert reshard_s(CL, 1e5, 8, 2, 2) == 0
    assert not boundary_inter_node(CL, 2, 0, 1)  # ranks 0-1 -> 2-3, one node
    assert boundary_inter_node(CL, 2, 1, 2)  # ranks 2-3 -> 4-5 cross
    assert boundary_inter_node(CL, 4, 0, 1)
    assert pipeline_shape("1f1b", 4, 1, 8)[1][1] == 3
    assert pipeline_shape("gpipe", 4, 1, 8)[1][1] == 8
    assert pipeline_shape("1f1b", 4, 1, 2)[1][3] == 2  # fewer micro-batches than stages: torch runs it as GPipe


def test_evaluate_two_stage_pipeline_by_hand():
    cl = Cluster(name="two", nodes=1, devices_per_node=2, memory_gib=1, peak_tflops=1, intra_bw_gbps=10,
                 intra_latency_us=5)
    layers = [
        LayerProfile("a", 1e-3, 2e-3, 1000, 1e3, 1e6, (1,), 0),
        LayerProfile("b", 2e-3, 4e-3, 2000, 2e3, 4.0, (1,), 0),
    ]
    tr = TrainingConfig(global_batch_size=8, schedule="1f1b", weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    problem = Problem(ModelProfile("m", layers), cl, tr)
    plan = Plan.from_assignment(stage_of_layer=[0, 1], strategies=[Strategy(1, 1)] * 2, layer_names=["a", "b"],
                                pp=2, microbatches=2, schedule="1f1b", global_batch_size=8, num_devices=2)
    est = evaluate(problem, plan)
    p0, p1 = 3e-3 * 4, 6e-3 * 4
    o0 = 2 * (5e-6 + 1e6 * 4 / 1e10)
    assert est.stage_time_s == pytest.approx([p0, p1])
    assert est.boundary_s == pytest.approx([o0])
    assert est.tpi_s == pytest.approx(p0 + p1 + o0 + (2 - 1) * max(p0, p1, o0))
    assert est.samples_per_s == pytest.approx(8 / est.tpi_s)
    # 1F1B: stage 0 holds min(c, pp - 0) = 2 micro-batches of activations, stage 1 holds 1
    assert est.stage_memory_bytes == pytest.approx([1000 * 16 + 2 * 4e3, 2000 * 16 + 1 * 8e3])
    # a measured pipeline slot overhead h: every stage pays it per micro-batch, (pp + c - 1) h in all
    h = 500e-6
    slow = evaluate(Problem(ModelProfile("m", layers), replace(cl, pipeline_overhead_us=500), tr), plan)
    assert slow.stage_time_s == pytest.approx([p0 + h, p1 + h])
    assert slow.tpi_s == pytest.approx(est.tpi_s + (2 + 2 - 1) * h)
    # without pipeline stages there is no schedule to pay for
    flat = Plan.from_assignment(stage_of_layer=[0, 0], strategies=[Strategy(2, 1)] * 2, layer_names=["a", "b"],
                                pp=1, microbatches=2, schedule="1f1b", global_batch_size=8, num_devices=2)
    assert evaluate(Problem(ModelProfile("m", layers), replace(cl, pipeline_overhead_us=500), tr), flat).tpi_s == \
        pytest.approx(evaluate(problem, flat).tpi_s)
    assert est.feasible
    # a measured optimizer step: once per iteration, on the parameters each rank holds (replicated: all of them
    # over dp; sharded: its 1/d), after the gradient sync
    k = 2e-9  # s per parameter
    with_opt = Problem(ModelProfile("m", layers), replace(cl, optimizer_ns_per_param=k * 1e9), tr)
    assert evaluate(with_opt, plan).tpi_s == pytest.approx(est.tpi_s + k * 2000)  # slower stage: 2000 parameters
    sharded = Plan.from_assignment(stage_of_layer=[0, 0], strategies=[Strategy(2, 1, "zero3")] * 2, layer_names=["a", "b"],
                                   pp=1, microbatches=2, schedule="1f1b", global_batch_size=8, num_devices=2)
    assert evaluate(with_opt, sharded).tpi_s == pytest.approx(evaluate(problem, sharded).tpi_s + k * 3000 / 2)


# ---------------------------------------------------------------- issue 12: ZeRO modes, recomputation, compression
from uniap_lightning.planner.cost.layer import Pricing  # noqa: E402

P4 = Pricing(8, 4)  # micro-batch 8 on a 4-device stage, one micro-batch per step
P4_ACC = Pricing(8, 4, accumulate=True)


def test_zero_modes_memory_and_collectives_by_hand():
    """1e6 parameters, d = 4, 2 B weights, 2 B gradients, 12 B optimizer state."""
    ar, ag, rs = all_reduce_s(CL, 2e6, 4, False), all_gather_s(CL, 2e6, 4, False), reduce_scatter_s(CL, 2e6, 4, False)
    z1 = layer_cost(LAYER, Strategy(4, 1, "zero1"), P4, cluster=CL, training=TR)
    # the formula P (w + g) + P o / d, plus what the runtime holds beside it (measured, runtime.zero): FSDP2's
    # parameter shard, the sharded gradient the optimizer reads, the all-reduce bucket
    assert z1.static_bytes == pytest.approx(1e6 * (2 + 2) + 1e6 * 12 / 4 + 1e6 * (2 + 2) / 4 + 1e6 * 2)
    assert z1.sync_s == pytest.approx(ar + ag) and z1.comm_s == 0
    z2 = layer_cost(LAYER, Strategy(4, 1, "zero2"), P4, cluster=CL, training=TR)
    assert z2.static_bytes == pytest.approx(1e6 * 2 + 1e6 * (2 + 12) / 4 + 1e6 * 2 / 4)  # + the parameter shard
    assert z2.sync_s == pytest.approx(rs + ag) and z2.comm_s == 0
    # accumulating over micro-batches, FSDP2 holds the unsharded gradient until the last one
    z2acc = layer_cost(LAYER, Strategy(4, 1, "zero2"), P4_ACC, cluster=CL, training=TR)
    assert z2acc.static_bytes == pytest.approx(1e6 * 2 + 1e6 * (2 + 12) / 4 + 1e6 * 2 / 4 + 1e6 * 2)
    z3 = layer_cost(LAYER, Strategy(4, 1, "zero3"), P4, cluster=CL, training=TR)
    assert z3.static_bytes == pytest.approx(1e6 * 16 / 4) and z3.sync_s == 0
    assert z3.comm_s == pytest.approx(2 * ag + rs) and z3.transient_bytes == pytest.approx(2e6)
    assert Strategy(4, 1, "zero3") == Strategy(4, 1, "zero3") and Strategy(4, 1, "zero3").shard


def test_optimizer_step_runs_on_the_shard_a_mode_holds():
    cl = replace(CL, optimizer_ns_per_param=2.0)
    for mode, held in (("replicate", 1e6), ("zero1", 2.5e5), ("zero2", 2.5e5), ("zero3", 2.5e5)):
        c = layer_cost(LAYER, Strategy(4, 1, mode), P4, cluster=cl, training=TR)
        base = layer_cost(LAYER, Strategy(4, 1, mode), P4, cluster=CL, training=TR)
        assert c.sync_s - base.sync_s == pytest.approx(2e-9 * held), mode


def test_recomputation_keeps_the_input_and_adds_a_forward():
    s = Strategy(4, 1, "replicate", True)
    c = layer_cost(LAYER, s, P4, cluster=CL, training=TR, input_bytes=3e5)
    plain = layer_cost(LAYER, Strategy(4, 1), P4, cluster=CL, training=TR, input_bytes=3e5)
    assert c.compute_s == pytest.approx(plain.compute_s * (1 + 1 / 3))  # forward is 1 of 3 ms
    assert c.activation_bytes == pytest.approx(3e5 * 2)  # 2 samples per device keep only their input
    assert c.transient_bytes == pytest.approx(1e6 * 2)  # one micro-batch's activations while it recomputes
    assert (c.sync_s, c.static_bytes) == (plain.sync_s, plain.static_bytes)
    # with tensor parallelism the forward's all-reduces run again too: half the TP communication
    tp = layer_cost(LAYER, Strategy(2, 2, "replicate", True), P4, cluster=CL, training=TR)
    tp_plain = layer_cost(LAYER, Strategy(2, 2), P4, cluster=CL, training=TR)
    assert tp.comm_s == pytest.approx(tp_plain.comm_s * 1.5)


def test_the_backward_peak_is_transient_and_split_like_activations():
    """The profile's backward peak (bytes per sample) joins a layer's transient, once per micro-batch on a device:
    with recomputation on top of the recomputed activations, with tensor parallelism split like activations."""
    peaky = replace(LAYER, backward_peak_bytes=4e5, activation_tp_fraction=0.75)
    for s in (Strategy(4, 1), Strategy(4, 1, "replicate", True), Strategy(2, 2), Strategy(4, 1, "zero3")):
        c = layer_cost(peaky, s, P4, cluster=CL, training=TR, input_bytes=3e5)
        plain = layer_cost(replace(peaky, backward_peak_bytes=0.0), s, P4, cluster=CL, training=TR, input_bytes=3e5)
        samples = P4.micro_batch / s.dp
        assert c.transient_bytes - plain.transient_bytes == pytest.approx(4e5 * samples * (0.25 + 0.75 / s.tp)), s
        assert (c.activation_bytes, c.static_bytes, c.time_s) == (plain.activation_bytes, plain.static_bytes,
                                                                  plain.time_s)


def test_compressed_gradient_sync_by_hand():
    flops = CL.flops_per_s  # 5e11: analytic compression compute in FLOP-times per element
    bf16 = layer_cost(LAYER, Strategy(4, 1, "replicate", False, "bf16"), P4, cluster=CL, training=TR)
    assert bf16.sync_s == pytest.approx(all_reduce_s(CL, 2e6, 4, False) + 1500 / flops * 1e6)
    # PowerSGD rank 2: no measured dimensions, one tensor taken as a 1000 x 1000 matrix: 4 * 2 * 2000 bytes
    psgd = layer_cost(LAYER, Strategy(4, 1, "zero1", False, "powersgd"), Pricing(8, 4, powersgd_rank=2),
                      cluster=CL, training=TR)
    low_rank = 4 * 2 * 2000
    assert psgd.sync_s == pytest.approx(2 * all_reduce_s(CL, low_rank / 2, 4, False) + all_gather_s(CL, 2e6, 4, False)
                                        + 2 * 2000 / flops * 1e6)
    # zero1 (with shard, sharded gradient and bucket, as above) + error feedback and the P, Q factors
    assert psgd.static_bytes == pytest.approx(1e6 * 4 + 1e6 * 12 / 4 + 1e6 * 4 / 4 + 1e6 * 2 + 4e6 + low_rank)
    measured = replace(LAYER, matrix_dims=3000.0, vector_params=1000)
    cl = replace(CL, compression_ns_per_param={"powersgd": 0.5, "topk": 4.0})
    psgd = layer_cost(measured, Strategy(4, 1, "replicate", False, "powersgd"), P4, cluster=cl, training=TR)
    assert psgd.sync_s == pytest.approx(2 * all_reduce_s(cl, 6000, 4, False) + all_reduce_s(cl, 4000, 4, False)
                                        + 0.5e-9 * 1e6)
    # top-k 1%: 10,000 values + indices per rank, all-gathered over 4 ranks
    topk = layer_cost(LAYER, Strategy(4, 1, "replicate", False, "topk"), P4, cluster=cl, training=TR)
    assert topk.sync_s == pytest.approx(all_gather_s(cl, 8 * 10_000 * 4, 4, False) + 4e-9 * 1e6)
    assert topk.static_bytes == pytest.approx(1e6 * 16 + 1e6 * 2 + 4e6)


def test_stage_memory_holds_the_largest_transient_once():
    """Two layers on one stage, one recomputed, one ZeRO-3: static + in-flight activations + the larger of the
    recomputed activations and the gathered weights (not their sum)."""
    layers = [replace(LAYER, name="a"), replace(LAYER, name="b")]
    problem = Problem(ModelProfile("m", layers), replace(CL, nodes=1), TrainingConfig(global_batch_size=8, weight_bytes=2,
                      grad_bytes=2, optimizer_bytes=12, schedule="gpipe"))
    plan = problem.plan_for(stage_of_layer=[0, 0], strategies=[Strategy(4, 1, "replicate", True, "none"), Strategy(4, 1, "zero3", False, "none")],
                            pp=1, microbatches=2)
    est = evaluate(problem, plan)
    b = Pricing(4, 4, accumulate=True)
    a = layer_cost(layers[0], Strategy(4, 1, "replicate", True), b, cluster=problem.cluster, training=problem.training)
    z = layer_cost(layers[1], Strategy(4, 1, "zero3"), b, cluster=problem.cluster, training=problem.training,
                   input_bytes=1e5)
    assert a.activation_bytes == 0  # the first layer's input (token ids) is free
    expected = a.static_bytes + z.static_bytes + 2 * (a.activation_bytes + z.activation_bytes) + max(
        a.transient_bytes, z.transient_bytes)
    assert est.stage_memory_bytes[0] == pytest.approx(expected)


def test_strategies_per_layer_cover_every_mode_and_the_allowed_compression():
    ks = strategies_for(LAYER, 4, CL, 8, compression=("none", "topk"))
    assert {k.dp_mode for k in ks if k.dp > 1} == {"replicate", "zero1", "zero2", "zero3"}
    assert {k.compression for k in ks if k.dp_mode in ("replicate", "zero1") and k.dp > 1} == {"none", "topk"}
    assert all(k.compression == "none" for k in ks if k.dp_mode in ("zero2", "zero3") or k.dp == 1)
    assert {k.recompute for k in ks} == {False, True}
    assert all(k.dp_mode == "replicate" for k in ks if k.dp == 1)


@pytest.mark.parametrize("split_time", [False, True])
def test_undominated_keeps_exactly_the_strategies_no_other_of_the_same_layout_dominates(split_time):
    """The sorted, kept-only scan equals the definition (every pair compared), ties keeping the first index, on
    random cost vectors with many exact ties and dominations."""
    import random

    from uniap_lightning.planner.cost.layer import LayerCost, Strategy
    from uniap_lightning.planner.cost.tables import _vector, undominated

    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(1, 40)
        ks = [Strategy.of(dp=rng.choice([1, 2]), tp=1, recompute=bool(j % 2)) for j in range(n)]
        cs = []
        for _j in range(n):
            v = [rng.choice([1.0, 2.0, 3.0]) for _ in range(7)]
            cs.append(LayerCost(time_s=v[0] + v[1], compute_s=v[0], comm_s=v[1], sync_s=v[2], static_bytes=v[3],
                                activation_bytes=v[4], transient_bytes=v[5], weight_grad_s=v[6] / 4))
        vec = [_vector(c, split_time) for c in cs]
        expected = [j for j in range(n) if not any(
            i != j and ks[i].layout == ks[j].layout and all(a <= b for a, b in zip(vec[i], vec[j]))
            and (vec[i] != vec[j] or i < j) for i in range(n))]
        assert undominated(ks, cs, split_time=split_time) == expected


def test_across_nodes_the_all_reduce_is_the_faster_of_ring_and_tree() -> None:
    from uniap_lightning.planner.cost.comm import tree_all_reduce_s

    cl = Cluster(name="c", nodes=64, devices_per_node=1, memory_gib=80, peak_tflops=100, inter_bw_gbps=25,
                 inter_latency_us=50)
    # 1 MB over 64 nodes: ring 2 x 63 x 50 us + 2 x 63/64 x 1e6 / 25e9 = 6.3 ms + 78.75 us; tree 2 x 6 x 50 us +
    # 2 x 1e6 / 25e9 = 600 us + 80 us
    assert all_reduce_s(cl, 1e6, 64, True) == pytest.approx(680e-6)
    assert tree_all_reduce_s(cl, 1e6, 64) == pytest.approx(680e-6)
    # 10 GB over 4 nodes: the ring's (p - 1) / p share wins: 2 x 3 x 50 us + 2 x 3/4 x 1e10 / 25e9 = 0.6003 s
    assert all_reduce_s(cl, 1e10, 4, True) == pytest.approx(0.6003)
    assert all_reduce_s(cl, 1e6, 64, False) == pytest.approx(2 * 63 * 5e-6 + 2 * 63 / 64 * 1e6 / 100e9)  # in a node
    measured = Cluster(name="m", nodes=64, devices_per_node=1, memory_gib=80, peak_tflops=100, inter_bw_gbps=25,
                       inter_latency_us=50, bandwidth_tables={"inter": {2: 25.0, 64: 25.0}})
    assert all_reduce_s(measured, 1e6, 64, True) == pytest.approx(2 * 63 * 50e-6 + 2 * 63 / 64 * 1e6 / 25e9)
