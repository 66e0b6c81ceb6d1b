"""The device catalogue and the per-operation model: datasheet facts load, traced operations agree with hand
formulas (FLOPs, activation bytes by dtype and attention implementation), the roofline's shape effects hold
(wave quantization, the per-kernel floor), and plans priced with it are still the brute-force optimum."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from bruteforce import brute_force  # noqa: E402

from uniap_lightning.errors import UniAPError  # noqa: E402
from uniap_lightning.planner.analytic import ModelSpec  # noqa: E402
from uniap_lightning.profiling.pricing import analytic_profile  # noqa: E402
from uniap_lightning.planner.cluster import Cluster  # noqa: E402
from uniap_lightning.planner.config import cluster_from, model_spec_from  # noqa: E402
from uniap_lightning.planner.cost import evaluate  # noqa: E402
from uniap_lightning.planner.devices import (MEMORY_EFFICIENCY, SOFTMAX_LONG_ROW_EFFICIENCY,  # noqa: E402
                                              available_devices, lookup_device)
from uniap_lightning.planner.problem import Problem, TrainingConfig  # noqa: E402
from uniap_lightning.planner.solver import solve  # noqa: E402
from uniap_lightning.profiling import roofline as R  # noqa: E402

SHIPPED = {"a100_40gb", "a100_80gb", "h100_sxm", "h200", "gh200", "v100_16gb", "v100_32gb", "rtx3090", "rtx2080ti",
           "titan_rtx", "titan_xp"}


def _shape(**kw: object) -> R.BlockShape:
    base = dict(seq_len=256, hidden=128, heads=4, kv_heads=4, ffn=512, attended=256, cross_attention=False,
                gated_mlp=False, bias=True, flash_attention=False, dropout=0.0, dtype=torch.float32)
    if "dropout" in kw and "attention_dropout" not in kw:
        kw["attention_dropout"] = kw["dropout"]
    return R.BlockShape(**{**base, **kw})


# ================================================================================ the catalogue
def test_every_shipped_device_loads_and_fp8_is_only_where_the_datasheet_has_it() -> None:
    assert SHIPPED <= set(available_devices())
    for name in available_devices():
        spec = lookup_device(name)
        assert spec is not None and spec.memory_gib > 0 and spec.hbm_gbps > 0 and spec.peak("fp32")
    assert {n for n in available_devices() if lookup_device(n).has("fp8")} == {"h100_sxm", "h200", "gh200"}
    assert lookup_device("H100-SXM") == lookup_device("h100_sxm")  # case and -/_ do not matter
    assert lookup_device("H100-SXM5-80GB") is None  # a free-text name of an older cluster file: no entry


def test_a_cluster_naming_a_catalogue_device_takes_its_facts_unless_it_gives_its_own() -> None:
    base = {"name": "c", "device": "h200", "nodes": 1, "devices_per_node": 8}
    cluster = Cluster.from_dict(base)
    assert cluster.compute_model == "roofline" and cluster.memory_gib == 141
    assert cluster.memory_reserved_gib == lookup_device("h200").framework_reserve_gib
    assert cluster.peak_tflops == pytest.approx(989.5) and cluster.optimizer_ns_per_param > 0
    measured = Cluster.from_dict({**base, "peak_tflops": 700, "efficiency": 0.6, "memory_gib": 120})
    assert measured.compute_model == "flat" and measured.memory_gib == 120 and measured.flops_per_s == 420e12
    with pytest.raises(UniAPError, match="device 'mystery-gpu' is no device of the catalogue"):
        Cluster.from_dict({**base, "device": "mystery-gpu", "peak_tflops": 1, "memory_gib": 8,
                           "compute_model": "roofline"})
    with pytest.raises(UniAPError, match="compute_model 'roofline' needs device to name a catalogue device"):
        Cluster(name="c", nodes=1, devices_per_node=1, memory_gib=8, peak_tflops=1, device="mystery-gpu",
                compute_model="roofline")
    with pytest.raises(UniAPError, match="compute_model must be one of"):
        Cluster.from_dict({**base, "compute_model": "guess"})


@pytest.mark.parametrize(("label", "meant"), [("H100-SXM5-80GB", "h100_sxm"), ("A100-SXM4-40GB", "a100_40gb"),
                                               ("TITAN Xp 12GB", "titan_xp"), ("V100-SXM2-32GB", "v100_32gb")])
def test_a_free_text_device_is_refused_with_the_entry_it_likely_means(label: str, meant: str) -> None:
    base = {"name": "c", "nodes": 1, "devices_per_node": 8, "peak_tflops": 989, "efficiency": 0.4, "memory_gib": 80}
    with pytest.raises(UniAPError, match=rf"device '{label}' is no device of the catalogue .*did you mean {meant}\? "
                                         r"it has: a100_40gb, .*compute_model: flat"):
        Cluster.from_dict({**base, "device": label})
    # said outright, the label stays a label and the file's own figures price it
    labelled = Cluster.from_dict({**base, "device": label, "compute_model": "flat"})
    assert labelled.device == label and labelled.flops_per_s == pytest.approx(989e12 * 0.4)


def test_every_shipped_cluster_names_its_catalogue_device_per_group() -> None:
    from uniap_lightning.planner.config import available

    for name in available("cluster"):
        cluster = cluster_from(name)
        if name == "local_cpu":  # a CPU is no catalogue entry: a label, priced flat by the file's own figures
            assert cluster.device == "cpu" and cluster.compute_model == "flat"
            continue
        assert cluster.compute_model == "roofline" and lookup_device(cluster.device) is not None, name
        assert all(lookup_device(d) is not None for d in cluster.rank_device or ()), name
    mixed = cluster_from("a100_v100_4x8")
    assert mixed.rank_device == ("a100_80gb",) * 16 + ("v100_32gb",) * 16
    assert mixed.rank_memory_gib == (80.0,) * 16 + (32.0,) * 16


# ================================================================================ the trace against hand formulas
def test_a_blocks_traced_matmul_flops_are_megatrons_formula_and_backward_is_twice_forward() -> None:
    s, h, f = 256, 128, 512
    tr = R.trace(R.block_forward(_shape(), 1, 1))
    forward = sum(op.flops for op in tr.forward)
    # Narayanan et al. SC'21: QKV 6 s h^2, scores + context 4 s^2 h, output 2 s h^2, MLP 4 s h f
    assert forward == 6 * s * h * h + 4 * s * s * h + 2 * s * h * h + 4 * s * h * f
    assert sum(op.flops for op in tr.backward) == 2 * forward
    half = R.trace(R.block_forward(_shape(), 1, 2))  # a tensor-parallel rank does half the matmuls
    assert sum(op.flops for op in half.forward) == forward / 2


def test_activation_bytes_follow_the_dtype_and_the_attention_implementation() -> None:
    s, h, a = 256, 128, 4
    fp32 = R.trace(R.block_forward(_shape(), 1, 1)).saved_bytes
    bf16 = R.trace(R.block_forward(_shape(dtype=torch.bfloat16), 1, 1)).saved_bytes
    # the causal mask (bool) and the two layer norms' statistics (mean and 1/std, fp32) do not follow the dtype
    fixed = s * s + 2 * 2 * s * 4
    assert bf16 - fixed == pytest.approx((fp32 - fixed) / 2, rel=1e-12)
    flash = R.trace(R.block_forward(_shape(flash_attention=True), 1, 1)).saved_bytes
    # materialized attention keeps the a x s x s probabilities (fp32) that flash attention recomputes
    assert fp32 - flash >= a * s * s * 4
    # flash attention's activations are linear in the sequence; materialized ones grow with its square
    long_flash = R.trace(R.block_forward(_shape(flash_attention=True, seq_len=2 * s, attended=2 * s), 1, 1)).saved_bytes
    long_fp32 = R.trace(R.block_forward(_shape(seq_len=2 * s, attended=2 * s), 1, 1)).saved_bytes
    assert long_flash / flash == pytest.approx(2.0, rel=0.02) and long_fp32 / fp32 > 2.5
    assert h  # (the shape above: h = 128)


def test_dropout_adds_its_masks_and_one_kernel_each_way() -> None:
    plain = R.trace(R.block_forward(_shape(), 1, 1))
    dropped = R.trace(R.block_forward(_shape(dropout=0.1), 1, 1))
    names = [op.name for op in dropped.forward]
    assert names.count("aten.native_dropout") == 3 and "aten.bernoulli_" not in names
    assert dropped.saved_bytes > plain.saved_bytes
    outputs_only = R.trace(R.block_forward(_shape(dropout=0.1, attention_dropout=0.0), 1, 1))
    assert [op.name for op in outputs_only.forward].count("aten.native_dropout") == 2
    # the probabilities' dropout keeps a mask and a dropped copy of the a x s x s scores
    assert dropped.saved_bytes - outputs_only.saved_bytes >= 4 * 256 * 256 * (1 + 4)


def test_traces_at_larger_micro_batches_extend_linearly_and_exactly() -> None:
    key = (_shape(dropout=0.1),)
    direct = R.trace(R.block_forward(key[0], 5, 2))
    extended = R.cached_trace("block", key, 5, 2)
    assert [(o.flops, o.bytes, o.shape) for o in extended.forward + extended.backward] == \
        [(o.flops, o.bytes, o.shape) for o in direct.forward + direct.backward]
    assert extended.saved_bytes == direct.saved_bytes


# ================================================================================ the roofline
def test_wave_quantization_and_the_reduction_fill() -> None:
    dev = lookup_device("h100_sxm")
    full = R.matmul_efficiency((1, 128 * dev.sms, 128, 4096), dev)
    one_more = R.matmul_efficiency((1, 128 * (dev.sms + 1), 128, 4096), dev)
    assert full == pytest.approx(R.MATMUL_EFFICIENCY * 4096 / (4096 + 128))
    assert one_more == pytest.approx(full * (dev.sms + 1) / (2 * dev.sms))  # a second, nearly empty wave
    assert R.matmul_efficiency((1, 128 * dev.sms, 128, 64), dev) < full / 2  # a short K pays the fill


def test_a_micro_batch_of_eight_is_not_eight_times_one_and_tf32_beats_fp32() -> None:
    dev = lookup_device("gh200")
    key = (_shape(),)
    one = sum(R.trace_seconds(R.cached_trace("block", key, 1, 1), dev, "tf32"))
    eight = sum(R.trace_seconds(R.cached_trace("block", key, 8, 1), dev, "tf32"))
    assert eight < 8 * one * 0.8  # the kernel floor binds small calls
    ops = len(R.cached_trace("block", key, 1, 1).forward) + len(R.cached_trace("block", key, 1, 1).backward)
    assert one >= ops * R.KERNEL_FLOOR_S
    big = (_shape(seq_len=2048, hidden=2048, heads=16, kv_heads=16, ffn=8192, attended=2048),)
    tf32 = sum(R.trace_seconds(R.cached_trace("block", big, 4, 1), dev, "tf32"))
    fp32 = sum(R.trace_seconds(R.cached_trace("block", big, 4, 1), dev, "fp32"))
    assert fp32 > 2 * tf32


def test_the_matmul_unit_follows_dtype_tf32_and_the_device() -> None:
    assert R.matmul_dtype("fp32", True, lookup_device("a100_80gb")) == "tf32"
    assert R.matmul_dtype("fp32", False, lookup_device("a100_80gb")) == "fp32"
    assert R.matmul_dtype("fp32", True, lookup_device("v100_16gb")) == "fp32"  # no TF32 units on Volta
    assert R.matmul_dtype("bf16", False, lookup_device("h200")) == "bf16"


# ================================================================================ the profile and the planner
def _opt_like(layers: int = 3) -> ModelSpec:
    return model_spec_from({"name": "small", "family": "gpt2", "layers": layers, "hidden": 256, "heads": 4, "ffn": 1024,
                            "seq_len": 512, "vocab": 4096, "dtype": "bf16", "flash_attention": True})


def test_the_roofline_profile_keeps_the_chain_and_times_it_on_the_device() -> None:
    spec = _opt_like()
    roof = cluster_from({"name": "r", "device": "h100_sxm", "nodes": 1, "devices_per_node": 4})
    flat = dataclasses.replace(roof, compute_model="flat")
    a, b = analytic_profile(spec, roof), analytic_profile(spec, flat)
    assert [lp.name for lp in a.layers] == [lp.name for lp in b.layers]
    assert [lp.params for lp in a.layers] == [lp.params for lp in b.layers]
    assert a.meta["compute_model"] == "roofline" and a.meta["matmul_dtype"] == "bf16"
    block = a.layers[1]
    assert len(block.timings) == len(R.MICRO_BATCHES) and {o.degree for o in block.overheads} == {2, 4}
    assert block.compute_s(8) < 8 * block.compute_s(1)


@pytest.mark.parametrize("nodes_per", [(1, 2), (1, 4)])
def test_the_milp_equals_brute_force_on_roofline_profiles(nodes_per: tuple[int, int]) -> None:
    nodes, per = nodes_per
    # small: memory binds, so sharding and pipelining are in play; NCCL's buffers scaled down with it (a transient
    # per strategy that differs with its communicators: the program and the brute force must agree on it too)
    cluster = cluster_from({"name": "r", "device": "a100_40gb", "nodes": nodes, "devices_per_node": per,
                            "memory_gib": 2, "nccl_comm_gib": 0.02})
    profile = analytic_profile(_opt_like(layers=1), cluster)  # the brute force is exponential in the layers
    problem = Problem(model=profile, cluster=cluster, training=TrainingConfig(global_batch_size=8,
                                                                              schedule="1f1b"))
    oracle = brute_force(problem)
    plan = solve(problem, time_limit_s=60)
    assert oracle is not None and plan.estimate.tpi_s == pytest.approx(evaluate(problem, oracle).tpi_s, rel=1e-6)


def test_a_mixed_pool_names_a_catalogue_device_per_group() -> None:
    cluster = Cluster.from_dict({"name": "mixed", "nodes": 2, "devices_per_node": 4, "device_groups": [
        {"device": "a100_80gb", "count": 4}, {"device": "v100_16gb", "count": 4}]})
    assert cluster.device == "a100_80gb" and cluster.compute_model == "roofline"
    assert cluster.rank_memory_gib == (80.0,) * 4 + (16.0,) * 4
    # V100's bf16 runs at its fp32 rate: 15.7 of the A100's 312 TFLOP/s
    assert cluster.rank_speed[4] == pytest.approx(15.7 / 312) and cluster.rank_speed[0] == 1.0
    assert cluster.rank_device == ("a100_80gb",) * 4 + ("v100_16gb",) * 4
    with pytest.raises(UniAPError, match=r"device_groups\[1\]\.device must name a catalogue device"):
        Cluster.from_dict({"name": "m", "nodes": 1, "devices_per_node": 2, "device_groups": [
            {"device": "a100_80gb", "count": 1}, {"device": "tpu", "count": 1}]})


def test_a_clusters_kernel_floor_binds_small_micro_batches() -> None:
    spec = _opt_like()
    base = {"name": "r", "device": "h100_sxm", "nodes": 1, "devices_per_node": 2}
    fast = analytic_profile(spec, cluster_from(base)).layers[1]
    slow = analytic_profile(spec, cluster_from({**base, "kernel_floor_us": 40})).layers[1]
    assert slow.compute_s(1) > 2 * fast.compute_s(1)  # bound by the number of operations
    # a cost per call, not per sample: it weighs less as the calls grow
    assert 0 <= slow.compute_s(64) - fast.compute_s(64) <= slow.compute_s(1) - fast.compute_s(1)
    assert slow.compute_s(64) / fast.compute_s(64) < slow.compute_s(1) / fast.compute_s(1)
    with pytest.raises(UniAPError, match="kernel_floor_us must be >= 0"):
        cluster_from({**base, "kernel_floor_us": -1})


def test_a_softmax_over_rows_longer_than_1024_runs_at_the_block_kernels_bandwidth() -> None:
    """Rows up to 1024 take torch's warp softmax (at MEMORY_EFFICIENCY); rows of 1025-4096 the block kernels,
    latency bound, at SOFTMAX_LONG_ROW_EFFICIENCY of the bandwidth, forward and backward (the row recorded on the
    traced op); longer rows amortize the block's phases (MEMORY_EFFICIENCY again)."""
    gh200 = lookup_device("gh200")
    for seq, efficiency in ((1024, MEMORY_EFFICIENCY), (2048, SOFTMAX_LONG_ROW_EFFICIENCY),
                            (8192, MEMORY_EFFICIENCY)):
        tr = R.cached_trace("block", (_shape(seq_len=seq, attended=seq),), 8, 1)
        softmaxes = [op for op in tr.forward + tr.backward if op.row]
        assert {op.name for op in softmaxes} == {"aten._softmax", "aten._softmax_backward_data"}
        assert all(op.row == seq for op in softmaxes)
        for op in softmaxes:
            want = max(op.bytes / (gh200.hbm_bytes_per_s * efficiency), R.KERNEL_FLOOR_S)
            assert R.op_seconds(op, gh200, "tf32") == pytest.approx(want)


# ================================================================================ the planner is handed the pricer
def test_the_planner_prices_a_roofline_cluster_with_the_pricer_it_is_handed_and_refuses_one_without() -> None:
    """The planner imports no torch: a roofline cluster's layers are priced by the pricer the layers above hand it
    (``profiling.pricing.roofline``, what ``uniap_lightning.build_problem`` and ``uniap plan`` pass); without one
    it says what to do instead of tracing behind the caller's back."""
    import uniap_lightning
    from uniap_lightning.planner import analytic, config
    from uniap_lightning.profiling import pricing

    spec, cluster = model_spec_from("gpt2_small"), cluster_from("a100_1x8")
    why = (r"cluster 'a100_1x8' prices layers with the roofline model \(compute_model: roofline, device a100_80gb\), "
           r"which traces each layer with torch .*pass roofline=uniap_lightning.profiling.pricing.roofline .*or give "
           r"the cluster peak_tflops and efficiency with compute_model: flat")
    with pytest.raises(UniAPError, match=why):
        analytic.analytic_profile(spec, cluster)
    with pytest.raises(UniAPError, match=why):
        config.build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16)
    seen = []

    def recording(s: ModelSpec, c: Cluster, flat: object) -> object:
        seen.append((s, c, flat))
        return flat

    flat = analytic.analytic_profile(spec, cluster, recording)  # the hook gets the spec, the cluster, the flat profile
    assert seen == [(spec, cluster, flat)] and "compute_model" not in flat.meta
    priced = pricing.analytic_profile(spec, cluster)
    assert priced == analytic.analytic_profile(spec, cluster, R.roofline_profile)
    assert priced.meta["compute_model"] == "roofline" and priced.layers != flat.layers
    assert uniap_lightning.build_problem is pricing.build_problem
    assert pricing.build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16).model == priced
    local = cluster_from("local_cpu")  # priced flat: no pricer needed
    assert analytic.analytic_profile(spec, local) == pricing.analytic_profile(spec, local)


def test_planning_a_flat_cluster_through_the_public_api_loads_no_torch() -> None:
    """``uniap_lightning.build_problem`` hands the planner the roofline pricer, which loads torch on its first call
    only: a cluster priced flat plans without it."""
    import subprocess
    import sys

    code = ("import sys\nfrom uniap_lightning import build_problem\n"
            "problem = build_problem(model='tiny_gpt', cluster='local_cpu', global_batch_size=8)\n"
            "assert problem.model.layers\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\nassert not heavy, heavy[:5]\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
