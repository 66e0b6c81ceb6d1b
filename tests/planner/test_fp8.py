"""Float8 matmuls (``uniap_lightning.planner.dimensions.precision``): the record's field, the opt-in and the device
check, the price and memory terms, the plan format, MILP == brute force with fp8 in the space, a device without fp8
never planned with it, and a pinned fp8 plan on such a device refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache

import pytest
from bruteforce import assert_search_matches, brute_force
from planner_factories import fp8_problem, random_problem

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.cost.layer import Pricing, layer_cost, strategies_for
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.dimensions.precision import fp8_precisions, gemm_shape
from uniap_lightning.planner.plan import PLAN_FORMAT_VERSION, Plan
from uniap_lightning.planner.problem import TrainingConfig
from uniap_lightning.planner.profile import LayerProfile
from uniap_lightning.planner.report import make_console, print_plan
from uniap_lightning.planner.solver import search

# one 4096 x 4096 matrix (16.8M parameters) over 2048 tokens per sample: 206 GFLOP per sample in matmuls
LAYER = LayerProfile(name="l", forward_s=1e-4, backward_s=2e-4, params=4096 * 4096, activation_bytes=1e8,
                     output_bytes=2048 * 4096 * 2, sequence_length=2048, matrix_dims=8192, vector_params=0)


def _cluster(device: str = "h100_sxm", **kw) -> Cluster:
    return Cluster(name="c", nodes=1, devices_per_node=2, memory_gib=80.0, peak_tflops=989, efficiency=0.75,
                   device=device, **kw)


def test_the_record_label_and_check():
    s = Strategy(2, 1, "zero3", precision="fp8")
    assert s.label() == "fsdp2+fp8" and "precision" in Strategy._fields
    assert Strategy(1, 1, precision="fp8_rowwise").label() == "single+fp8r"
    s.check("w")
    with pytest.raises(UniAPError, match="precision='fp4' must be one of"):
        Strategy(1, 1, precision="fp4").check("w")
    assert fp8_precisions("auto") == fp8_precisions("tensorwise") == ("fp8",) and fp8_precisions(None) == ()
    with pytest.raises(UniAPError, match="fp8='on' must be one of"):
        fp8_precisions("on")


def test_candidates_only_where_allowed_and_the_device_has_fp8():
    plain = strategies_for(LAYER, 2, _cluster(), 2)
    assert not any(s.precision != "default" for s in plain)  # not allowed: none
    both = strategies_for(LAYER, 2, _cluster(), 2, fp8=("fp8",))
    assert [s for s in both if s.precision == "default"] == plain
    assert [s._replace(precision="default") for s in both if s.precision == "fp8"] == plain  # each one's fp8 twin
    for device in ("a100_80gb", "v100_16gb", "rtx3090", "H100-SXM5-80GB", ""):  # no fp8 peak, or no catalogue entry
        assert strategies_for(LAYER, 2, _cluster(device), 2, fp8=("fp8", "fp8_rowwise")) == plain, device
    assert strategies_for(replace(LAYER, params=0), 2, _cluster(), 2, fp8=("fp8",)) == \
        strategies_for(replace(LAYER, params=0), 2, _cluster(), 2)  # nothing to multiply


def test_price_and_memory_terms():
    """Micro-batch 8 on one H100 (989.5 / 1979 TFLOP/s, 3350 GB/s): matmuls 6 x 16.8M x 2048 x 8 = 1.65 PFLOP...
    at 742 TFLOP/s 2.22 ms, compute priced at 2.4 ms: fp8 saves half the matmuls, 1.11 ms. Casts: X + Y =
    16384 tokens x 8192 dims, bytes (4h+2 + 2h+2) / 2 per element with h = 2, plus W = 16.8M x (4h+2), at
    2680 GB/s; six kernels at 10 us for the one matrix."""
    cl, train = _cluster(), TrainingConfig(global_batch_size=8, weight_bytes=2, grad_bytes=2)
    pr = Pricing(8, 1)
    base = layer_cost(LAYER, Strategy(1, 1), pr, cluster=cl, training=train)
    fp8 = layer_cost(LAYER, Strategy(1, 1, precision="fp8"), pr, cluster=cl, training=train)
    assert gemm_shape(LAYER, 2) == (4096 * 4096, 8192, 1)
    gemm = 6 * 4096 * 4096 * 2048 * 8 / (989.5e12 * 0.75)
    xy, w = 16384 * 8192, 4096 * 4096
    cast = (xy / 2 * 10 + xy / 2 * 6 + w * 10) / (3350e9 * 0.8) + 6 * 10e-6
    assert fp8.compute_s - base.compute_s == pytest.approx(cast - gemm / 2, rel=1e-9)
    assert fp8.compute_s < base.compute_s  # a large matmul wins
    assert fp8.transient_bytes - base.transient_bytes == pytest.approx(2 * w)  # the float8 weight and its transpose
    assert (fp8.static_bytes, fp8.activation_bytes, fp8.sync_s) == (base.static_bytes, base.activation_bytes,
                                                                     base.sync_s)
    # a small matmul loses: the same layer at 16 tokens per sample
    small = replace(LAYER, sequence_length=16, forward_s=1e-6, backward_s=2e-6, output_bytes=16 * 4096 * 2)
    assert layer_cost(small, Strategy(1, 1, precision="fp8"), pr, cluster=cl, training=train).time_s > \
        layer_cost(small, Strategy(1, 1), pr, cluster=cl, training=train).time_s
    # an embedding (a lookup priced far below the matmul its table would make) gains nothing but pays the kernels
    embed = replace(LAYER, forward_s=1e-7, backward_s=2e-7)
    e0 = layer_cost(embed, Strategy(2, 1, "zero3"), Pricing(8, 2), cluster=_cluster(), training=train)
    e8 = layer_cost(embed, Strategy(2, 1, "zero3", precision="fp8"), Pricing(8, 2), cluster=_cluster(),
                    training=train)
    assert e8.time_s > e0.time_s and e8.comm_s == pytest.approx(e0.comm_s, rel=1e-3)


def test_zero3_gathers_float8_weights_under_tensorwise_scales_only():
    cl, train, pr = _cluster(), TrainingConfig(global_batch_size=8, weight_bytes=2, grad_bytes=2), Pricing(8, 2)
    z3 = layer_cost(LAYER, Strategy(2, 1, "zero3"), pr, cluster=cl, training=train)
    tw = layer_cost(LAYER, Strategy(2, 1, "zero3", precision="fp8"), pr, cluster=cl, training=train)
    rw = layer_cost(LAYER, Strategy(2, 1, "zero3", precision="fp8_rowwise"), pr, cluster=cl, training=train)
    assert tw.comm_s < z3.comm_s and rw.comm_s == pytest.approx(z3.comm_s)  # one byte per parameter on the wire
    P = 4096 * 4096
    # the gathered copy is float8 (P bytes, not 2P), besides the float8 weight and its transpose
    assert tw.transient_bytes - z3.transient_bytes == pytest.approx(2 * P - P)
    assert rw.transient_bytes - z3.transient_bytes == pytest.approx(2 * P)


def test_plan_json_writes_precision_and_older_versions_read_default():
    problem = fp8_problem(3, num_layers=3, nodes=1, per_node=2, memory_gib=40.0)
    plan = problem.plan_for(stage_of_layer=[0, 0, 0], strategies=[Strategy(2, 1, precision="fp8"), Strategy(2, 1),
                                                                    Strategy(1, 2, precision="fp8_rowwise")], pp=1,
                            microbatches=1)
    doc = json.loads(plan.to_json())
    assert doc["format_version"] == PLAN_FORMAT_VERSION >= 6
    assert [x["precision"] for x in doc["layers"]] == ["fp8", "default", "fp8_rowwise"]
    assert [lp.strategy for lp in Plan.from_dict(json.loads(json.dumps(doc))).layers] == \
        [lp.strategy for lp in plan.layers]
    old = dict(doc, format_version=5)
    assert {lp.strategy.precision for lp in Plan.from_dict(old).layers} == {"default"}  # version 5: none
    with pytest.raises(UniAPError, match="precision"):
        Plan.from_dict({**doc, "layers": [{**doc["layers"][0], "precision": "int8"}, *doc["layers"][1:]]})
    assert " precision " in _printed(plan) and " fp8_rowwise " in _printed(plan)
    plain = problem.plan_for(stage_of_layer=[0, 0, 0], strategies=[Strategy(2, 1)] * 3, pp=1, microbatches=1)
    assert " precision " not in _printed(plain)


def _printed(plan: Plan) -> str:
    console = make_console(record=True)
    print_plan(plan, console=console)
    return console.export_text()


# (seed, layers, nodes, per node, memory GiB)
CASES = [(1, 3, 1, 2, 8.0), (2, 3, 1, 4, 4.0), (3, 3, 2, 2, 16.0), (5, 3, 1, 2, 2.0), (6, 3, 2, 1, 1.0),
         (7, 3, 1, 2, 4.0), (8, 3, 2, 2, 2.0), (9, 3, 1, 4, 16.0), (11, 4, 1, 2, 8.0), (12, 3, 1, 2, 40.0),
         (13, 3, 2, 2, 4.0), (14, 3, 1, 2, 1.0)]


@lru_cache(maxsize=None)
def _oracle(case):
    return brute_force(fp8_problem(case[0], num_layers=case[1], nodes=case[2], per_node=case[3],
                                   memory_gib=case[4]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}-L{c[1]}-{c[2]}x{c[3]}-{c[4]}G")
def test_milp_matches_brute_force_with_fp8(case):
    problem = fp8_problem(case[0], num_layers=case[1], nodes=case[2], per_node=case[3], memory_gib=case[4])
    assert_search_matches(problem, _oracle(case))


def test_oracle_optima_use_fp8_somewhere_and_not_everywhere():
    """The comparison covers the space: some optima run a layer in fp8 (under ZeRO-3 among them), some none, and
    some keep a layer in the default precision beside an fp8 one."""
    best = [b for b in map(_oracle, CASES) if b is not None]
    fp8 = [[lp.strategy.precision != "default" for lp in b.layers] for b in best]
    assert sum(map(any, fp8)) >= 3 and not all(map(any, fp8)), fp8
    assert any(any(f) and not all(f) for f in fp8), fp8
    assert any(lp.strategy.precision == "fp8" and lp.strategy.shard for b in best for lp in b.layers)


def test_a_device_without_fp8_never_gets_an_fp8_plan():
    for seed in (3, 9):
        for device in ("a100_80gb", "H100-SXM5-80GB"):  # no fp8 peak; a free-text name (no catalogue entry)
            problem = fp8_problem(seed, num_layers=3, nodes=1, per_node=2, memory_gib=16.0, device=device)
            plan = search(problem, solver="cbc", time_limit_s=60)
            assert {lp.strategy.precision for lp in plan.layers} == {"default"}, (seed, device)


def test_fp8_off_leaves_the_problem_as_it_was():
    """Not allowed (the default), the planner plans exactly as before on an fp8 device."""
    problem = fp8_problem(3, num_layers=3, nodes=2, per_node=2, memory_gib=16.0, fp8=())
    plan = search(problem, solver="cbc")
    assert {lp.strategy.precision for lp in plan.layers} == {"default"}
    assert plan.estimate.tpi_s == search(problem, solver="cbc", allowed=lambda s: s.precision == "default"
                                         ).estimate.tpi_s
    base = random_problem(3, num_layers=3, nodes=2, per_node=2, memory_gib=16.0)
    assert [s for s in strategies_for(base.model.layers[0], 2, base.cluster, 4, fp8=("fp8",))] == \
        strategies_for(base.model.layers[0], 2, base.cluster, 4)  # the random clusters name no device


def test_a_pinned_fp8_plan_on_a_device_without_fp8_is_refused_in_one_line():
    problem = fp8_problem(3, num_layers=3, nodes=1, per_node=2, memory_gib=16.0)
    plan = problem.plan_for(stage_of_layer=[0, 0, 0], strategies=[Strategy(2, 1, precision="fp8"), Strategy(2, 1),
                                                                    Strategy(2, 1)], pp=1, microbatches=1)
    evaluate(problem, plan)  # on the H100 it scores
    a100 = replace(problem, cluster=replace(problem.cluster, device="a100_80gb"))
    with pytest.raises(UniAPError) as err:
        evaluate(a100, plan)
    assert "\n" not in str(err.value) and "precision='fp8' needs a device with float8 matmuls" in str(err.value)
    from uniap_lightning.setup.options import SetupOptions

    with pytest.raises(UniAPError) as err:
        SetupOptions.from_arguments(cluster=a100.cluster, plan=plan, schedule="auto", solver="auto", time_limit=60,
                                    profile=None, cache_dir=None, measure_cluster=False, profile_cache=False,
                                    profile_repeats=1, profile_micro_batches=None)
    assert "\n" not in str(err.value) and "has no fp8 matmuls" in str(err.value)
    with pytest.raises(UniAPError, match="fp8='auto' steers the planner's search"):
        SetupOptions.from_arguments(cluster=None, plan=plan, schedule="auto", solver="auto", time_limit=60,
                                    profile=None, cache_dir=None, measure_cluster=False, profile_cache=False,
                                    profile_repeats=1, profile_micro_batches=None, fp8="auto")


def test_a_local_cuda_device_is_named_by_its_catalogue_entry():
    """The local cluster (no ``cluster=``) names its device by the catalogue entry its CUDA name says, so
    ``fp8="auto"`` finds the fp8 peak on the machine it runs on; a name that does not say which part stays as is."""
    from uniap_lightning.planner.devices import catalogue_name

    assert catalogue_name("NVIDIA H100 80GB HBM3") == catalogue_name("NVIDIA H100 SXM5 80GB") == "h100_sxm"
    assert catalogue_name("NVIDIA H200") == "h200" and catalogue_name("NVIDIA GH200 480GB") == "gh200"
    assert catalogue_name("NVIDIA H100 PCIe") is None and catalogue_name("NVIDIA A100-SXM4-80GB") is None
    assert strategies_for(LAYER, 2, _cluster("h200"), 2, fp8=("fp8",)) != strategies_for(LAYER, 2, _cluster("h200"), 2)


class _SolvesWithoutFp8Only:
    """A search where every MILP with a float8 strategy in its space runs out of the time it is given (time moves
    only then: a fake clock) and the others solve as usual: the 15.85%-gap run of BENCHMARKS.md, in miniature."""

    def __init__(self, real) -> None:
        self.real, self.now_s = real, 1000.0

    def clock(self) -> float:
        return self.now_s

    def solve(self, tables, solver, time_limit_s, cutoff_s):
        from uniap_lightning.planner.solver.backend import MIN_SOLVE_S, MilpResult

        if any(k.precision != "default" for row in tables.strategies for k in row):
            self.now_s += max(time_limit_s, MIN_SOLVE_S)
            return MilpResult("no_solution", None, None, None, None, 0.0, time_limit_s, 1, 1)
        return self.real(tables, solver, time_limit_s, cutoff_s)


@pytest.mark.parametrize("case", [(2, 3, 1, 4, 4.0), (11, 4, 1, 2, 8.0)], ids=["seed2", "seed11"])
def test_a_starved_fp8_search_is_never_worse_than_the_fp8_free_optimum(monkeypatch, case):
    """fp8 allowed, a 2 s budget, and no MILP with fp8 in its space finishes: the search still returns the
    fp8-free optimum, found first and kept as the wide search's incumbent. Without that first search (the search
    as it was), the same budget returns a plan slower than that optimum, which is in its space."""
    import sys

    from uniap_lightning.planner.solver import backend, parallel

    search_module = sys.modules["uniap_lightning.planner.solver.search"]
    problem = fp8_problem(case[0], num_layers=case[1], nodes=case[2], per_node=case[3], memory_gib=case[4])
    fp8_free = search(replace(problem, opt_ins={"fp8": ()}), solver="cbc", time_limit_s=60, workers=1)
    assert fp8_free.solver.status == "optimal"
    fake = _SolvesWithoutFp8Only(parallel.solve_candidate)
    monkeypatch.setattr(backend, "now_s", fake.clock)
    monkeypatch.setattr(parallel, "solve_candidate", fake.solve)
    plan = search(problem, solver="cbc", time_limit_s=2.0, workers=1)
    assert plan.estimate.tpi_s <= fp8_free.estimate.tpi_s * (1 + 1e-9)
    assert plan.solver.status == "time_limit" and plan.solver.gap > 0  # the fp8 space stayed open
    monkeypatch.setattr(search_module, "default_precision_problem", lambda _problem: None)
    assert search(problem, solver="cbc", time_limit_s=2.0, workers=1).estimate.tpi_s > fp8_free.estimate.tpi_s


def test_without_fp8_the_search_is_one_search():
    """fp8 off, or a device without it: no first search (nothing changes when fp8 is off)."""
    from uniap_lightning.planner.dimensions.precision import default_precision_problem

    assert default_precision_problem(fp8_problem(3, num_layers=3, nodes=1, per_node=2, memory_gib=16.0)) is not None
    assert default_precision_problem(fp8_problem(3, num_layers=3, nodes=1, per_node=2, memory_gib=16.0,
                                                 fp8=())) is None
    assert default_precision_problem(fp8_problem(3, num_layers=3, nodes=1, per_node=2, memory_gib=16.0,
                                                 device="a100_80gb")) is None


def test_fp8_is_an_opt_in_carried_by_name():
    """The precision dimension declares its permission (``fp8``: option, vocabulary, "off" values, the pinned plan's
    check); the setup, ``build_problem`` and the command line carry it by name, resolved by the dimension."""
    from uniap_lightning.profiling.pricing import build_problem
    from uniap_lightning.planner.dimensions import OPT_INS, opt_ins
    from uniap_lightning.setup.options import SetupOptions

    assert list(OPT_INS) == ["fp8"] and OPT_INS["fp8"].off == (None, "off")
    assert opt_ins() == {"fp8": ()} and opt_ins({"fp8": "rowwise"}) == {"fp8": ("fp8_rowwise",)}
    with pytest.raises(UniAPError, match="unknown opt-in option"):
        opt_ins({"fp4": "auto"})
    kw = dict(cluster=None, plan=None, schedule="auto", solver="auto", time_limit=60, profile=None, cache_dir=None,
              measure_cluster=False, profile_cache=False, profile_repeats=1, profile_micro_batches=None)
    assert SetupOptions.from_arguments(**kw, fp8="auto").opt_ins_dict == {"fp8": ("fp8",)}
    assert SetupOptions.from_arguments(**kw).opt_ins_dict == {"fp8": ()}
    with pytest.raises(UniAPError, match="fp8='on' must be one of"):
        SetupOptions.from_arguments(**kw, fp8="on")
    assert build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16, fp8="auto").opt_ins == {"fp8": ("fp8",)}
    assert build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16).opt_ins == {"fp8": ()}
