"""The sequence dimension in the planner: context parallelism (``cp``, Ulysses or ring attention) and sequence
parallelism (``sp``) as per-layer choices. The MILP's optimum equals brute force over every split and every
strategy (with the connectivity of layouts stated by subsets and by a flow), the cost terms follow the formulas of
``planner/cost/layer.py``, and the plan JSON (format 4) carries the fields and reads older files."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
from bruteforce_pipeline import assert_milp_equals_brute_force, brute_force_candidate
from planner_factories import random_problem, repeated_problem

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cost.comm import all_to_all_s
from uniap_lightning.planner.cost.layer import Pricing, cp_methods, layer_cost, reshard_s, strategies_for
from uniap_lightning.planner.cost.tables import CandidateCosts, CostTables
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan import PLAN_FORMAT_VERSION, Plan
from uniap_lightning.planner.profile import LayerProfile
from uniap_lightning.planner.solver import milp as milp_module
from uniap_lightning.planner.solver import search
from uniap_lightning.planner.solver.parallel import solve_candidate


def _sequence_problem(seed: int, layers: int, per_node: int, memory: float, *, ring: bool, batch: int = 2):
    """A random chain whose layers declare a sequence: the first and last token-wise, the others attention with
    2 or 4 heads, some with a sequence-parallel TP plan. A small batch, so data parallelism alone cannot use
    every device and the sequence has to be split for the wider grids."""
    rng = random.Random(1000 + seed)
    p = random_problem(seed, num_layers=layers, nodes=1, per_node=per_node, memory_gib=memory, batch=batch)
    model = []
    for u, lp in enumerate(p.model.layers):
        heads = 0 if u in (0, layers - 1) else rng.choice([2, 4])
        model.append(replace(lp, sequence_length=rng.choice([8, 16]), attention_heads=heads,
                             kv_heads=(heads // 2 if heads and rng.random() < 0.5 else None),
                             sequence_parallel=bool(heads) and rng.random() < 0.7))
    cluster = replace(p.cluster, ring_attention=ring)
    return replace(p, model=replace(p.model, layers=model), cluster=cluster)


def _repeated_sequence_problem(seed: int, memory: float, *, ring: bool, pattern: str = "ABBB"):
    """Identical attention blocks after a token-wise first layer: the MILP aggregates the run of blocks and walks
    over its layouts (where memory forces some blocks onto other layouts than the rest)."""
    p = repeated_problem(seed, pattern=pattern, nodes=1, per_node=4, batch=2, memory_gib=memory)
    layers = [replace(lp, sequence_length=16, attention_heads=0 if lp.name.startswith("A") else 4,
                      sequence_parallel=not lp.name.startswith("A")) for lp in p.model.layers]
    return replace(p, model=replace(p.model, layers=layers), cluster=replace(p.cluster, ring_attention=ring))


CASES = [(0, 3, 4, 40.0, False), (1, 4, 2, 40.0, True), (2, 3, 4, 2.0, True), (3, 4, 4, 8.0, False),
         (4, 3, 2, 3.0, False)]


def _candidates(problem):
    for pp in problem.pp_candidates():
        for c in problem.training.microbatch_candidates():
            yield pp, c


@pytest.mark.parametrize("cut_levels", [milp_module.SUBSET_CUT_LEVELS, 1], ids=["subsets", "flow"])
@pytest.mark.parametrize("case", [c if c[0] in (1, 3) else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=lambda c: f"seed{c[0]}-L{c[1]}-n{c[2]}-{c[3]}G-ring{int(c[4])}")
def test_milp_equals_brute_force_with_cp_and_sp(case, cut_levels, monkeypatch):
    monkeypatch.setattr(milp_module, "SUBSET_CUT_LEVELS", cut_levels)
    seed, layers, per_node, memory, ring = case
    problem = _sequence_problem(seed, layers, per_node, memory, ring=ring)
    problem = replace(problem, training=replace(problem.training, schedule="1f1b"))
    compared = 0
    for pp, c in _candidates(problem):
        if assert_milp_equals_brute_force(problem, pp, c, "1f1b", 1) is not None:
            compared += 1
    assert compared >= 1


# (larger tp choices make the brute force too large: seeds 0 and 1 draw blocks with tp 1 or 4; the default run
# checks seed 0 with the subset cuts, -m slow the rest)
REPEATED = [(seed, memory, ring) for seed in (0, 1) for memory, ring in ((0.6, False), (1.5, True), (4.0, False), (1.5, False))]


@pytest.mark.parametrize("cut_levels", [milp_module.SUBSET_CUT_LEVELS, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["subsets", "flow"])
@pytest.mark.parametrize("case", [c if c[0] == 0 else pytest.param(c, marks=pytest.mark.slow) for c in REPEATED], ids=lambda c: f"seed{c[0]}-{c[1]}G-ring{int(c[2])}")
def test_milp_equals_brute_force_on_runs_of_identical_blocks(case, cut_levels, monkeypatch):
    monkeypatch.setattr(milp_module, "SUBSET_CUT_LEVELS", cut_levels)
    seed, memory, ring = case
    problem = _repeated_sequence_problem(seed, memory, ring=ring)
    for pp, c in _candidates(problem):
        oracle = brute_force_candidate(problem, pp, c, "1f1b", 1)
        tables = CostTables(problem, pp, c, schedule="1f1b")
        if not tables.feasible_shape:
            assert oracle is None
            continue
        res = solve_candidate(tables, "cbc", 60.0, None)
        if oracle is None:
            assert res.objective_s is None, (pp, c)
            continue
        assert res.objective_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6, abs=1e-12), (pp, c)


def test_the_instances_exercise_cp_sp_and_many_layouts():
    """The oracle cases above are not vacuous: their tables offer cp (both methods where the cluster runs ring),
    sp, and more layouts than the subset cuts take (so the flow form is the one solving them by default)."""
    offered = set()
    most_layouts = 0
    for case in CASES:
        problem = _sequence_problem(*case[:4], ring=case[4])
        for pp, c in _candidates(problem):
            t = CostTables(problem, pp, c, schedule="1f1b", prune=False)
            for opts in t.strategies:
                offered |= {(s.cp > 1, s.cp_method, s.sp) for s in opts}
                most_layouts = max(most_layouts, len({s.layout for s in opts}))
    assert {(True, "ulysses", False), (True, "ring", False), (False, "none", True), (True, "ulysses", True)} <= offered
    assert most_layouts > milp_module.SUBSET_CUT_LEVELS


def test_search_chooses_cp_where_the_batch_is_too_small_for_data_parallelism():
    """One sample per iteration on 4 devices: data parallelism cannot use them; splitting the sequence can."""
    problem = _sequence_problem(0, 3, 4, 40.0, ring=False, batch=1)
    flat = replace(problem, model=replace(problem.model, layers=[
        replace(lp, sequence_length=None, sequence_parallel=False) for lp in problem.model.layers]))
    with_cp = search(problem, solver="cbc", time_limit_s=60, workers=1)
    assert with_cp.solver.status == "optimal"
    assert any(lp.strategy.cp > 1 for lp in with_cp.layers)
    # without a sequence to split, one sample cannot spread over 4 devices (not every layer has tp 4)
    with pytest.raises(UniAPError, match="no .pp, micro-batch count. candidate gives every layer a usable strategy"):
        search(flat, solver="cbc", time_limit_s=60, workers=1)


# ------------------------------------------------------------------ the cost terms

CLUSTER = random_problem(0, num_layers=2, nodes=1, per_node=8, memory_gib=40.0).cluster
ATTN = LayerProfile(name="attn", forward_s=1e-3, backward_s=2e-3, params=4_000_000, activation_bytes=4e6,
                    output_bytes=1e6, tp_degrees=(1, 2, 4), tp_allreduces=2, activation_tp_fraction=0.75,
                    sequence_length=1024, attention_heads=8, kv_heads=2, sequence_parallel=True)
TOKENWISE = replace(ATTN, name="mlp", attention_heads=0, kv_heads=None)


def _cost(layer, s, b=8, n=8):
    return layer_cost(layer, s, Pricing(b, n), cluster=CLUSTER, training=random_problem(
        0, num_layers=2, nodes=1, per_node=8).training)


def test_cp_divides_compute_and_activations_like_data_parallelism_but_keeps_the_batch():
    dp = _cost(ATTN, Strategy(4, 1, cp=1))
    cp = _cost(ATTN, Strategy(2, 1, cp=2, cp_method="ulysses"))
    assert cp.compute_s == pytest.approx(dp.compute_s)
    # Ulysses keeps attention's output twice (head-sharded, then sequence-sharded): one output more (measured,
    # benchmarks/memory_sequence.py)
    assert cp.activation_bytes == pytest.approx(dp.activation_bytes + ATTN.output_bytes * 8 / 4)
    assert cp.static_bytes == pytest.approx(dp.static_bytes)  # both: 4 ranks hold the same weights
    # the difference is the attention's all-to-alls: q and o of H bytes, k and v of H kv/a, forward and backward
    H = ATTN.output_bytes * (8 / 2) / 2
    want = 2 * (2 * all_to_all_s(CLUSTER, H, 2, False) + 2 * all_to_all_s(CLUSTER, H * 2 / 8, 2, False))
    assert cp.comm_s - dp.comm_s == pytest.approx(want)
    # a token-wise layer moves nothing when its sequence is split
    assert _cost(TOKENWISE, Strategy(2, 1, cp=2, cp_method="ulysses")).comm_s == pytest.approx(
        _cost(TOKENWISE, Strategy(4, 1)).comm_s)


def test_sequence_parallelism_splits_what_tensor_parallelism_leaves_whole_at_the_same_time():
    tp = _cost(ATTN, Strategy(4, 2))
    sp = _cost(ATTN, Strategy(4, 2, sp=True))
    assert tp.time_s == pytest.approx(sp.time_s)
    samples = 8 / 4
    assert tp.activation_bytes == pytest.approx(ATTN.activation_bytes * samples * (0.25 + 0.75 / 2))
    # everything split, but the all-gathered inputs of the column-parallel projections (one per all-reduce) whole
    # (measured, benchmarks/memory_sequence.py)
    whole = 2 * ATTN.output_bytes * samples / 2
    assert sp.activation_bytes == pytest.approx(ATTN.activation_bytes * samples / 2 + whole)


def test_the_methods_offered_follow_heads_sequence_and_cluster():
    assert cp_methods(ATTN, 1, 1, CLUSTER) == ("none",)
    assert cp_methods(ATTN, 4, 2, CLUSTER) == ("ulysses", "ring")  # 8 heads / tp 2 = 4, divisible by 4
    assert cp_methods(ATTN, 8, 2, CLUSTER) == ("ring",)  # 4 heads per TP rank cannot split 8 ways
    assert cp_methods(ATTN, 4, 2, replace(CLUSTER, ring_attention=False)) == ("ulysses",)
    assert cp_methods(replace(ATTN, sequence_length=None), 2, 1, CLUSTER) == ()
    assert cp_methods(replace(ATTN, sequence_length=1000), 16, 1, CLUSTER) == ()  # 1000 % 16
    assert cp_methods(TOKENWISE, 8, 1, replace(CLUSTER, ring_attention=False)) == ("ulysses",)
    # without a sequence the strategies are those of dp x tp alone
    plain = strategies_for(replace(ATTN, sequence_length=None, sequence_parallel=False), 8, CLUSTER, 8)
    assert {(s.cp, s.sp) for s in plain} == {(1, False)}
    full = strategies_for(ATTN, 8, CLUSTER, 8)
    assert {s.dp * s.cp * s.tp for s in full} == {8} and any(s.cp == 8 for s in full)
    assert all(not s.sp or s.tp > 1 for s in full)


def test_resharding_between_layouts():
    out_bytes, b = 1e6, 8
    assert reshard_s(CLUSTER, out_bytes, b, (4, 1), (4, 1)) == 0.0
    assert reshard_s(CLUSTER, out_bytes, b, 4, 2) == reshard_s(CLUSTER, out_bytes, b, (4, 1), (2, 1))
    # (2, 2) -> (4, 1): common coarsening (2, 1), each side gathers its 2 pieces
    from uniap_lightning.planner.cost.comm import all_gather_s

    want = 2 * all_gather_s(CLUSTER, out_bytes * b / 2, 2, False)
    assert reshard_s(CLUSTER, out_bytes, b, (2, 2), (4, 1)) == pytest.approx(want)
    assert reshard_s(CLUSTER, out_bytes, b, (2, 2), (2, 1)) == pytest.approx(all_gather_s(CLUSTER, out_bytes * b / 2,
                                                                                           2, False))


# ------------------------------------------------------------------ the record and the plan file


@pytest.mark.parametrize(("strategy", "match"), [
    (Strategy(2, 1, cp=2), r"cp=2 needs cp_method 'ulysses' or 'ring', got 'none'"),
    (Strategy(2, 1, cp_method="ulysses"), r"cp=1 needs cp_method 'none', got 'ulysses'"),
    (Strategy(2, 1, cp=2, cp_method="star"), r"cp_method='star' must be one of"),
    (Strategy(2, 1, sp=True), r"sp \(sequence parallelism\) needs tp > 1, got tp=1"),
])
def test_bad_records_are_refused_in_one_line(strategy, match):
    with pytest.raises(UniAPError, match=match) as err:
        strategy.check("layer 3")
    assert "\n" not in str(err.value)


def test_labels_and_canonical_records():
    assert Strategy.of(2, 2, cp=2, cp_method="ulysses", sp=True).label() == "dp2xcp2uxtp2+sp"
    assert Strategy.of(1, 1, "zero3", cp=4, cp_method="ring").label() == "fsdpxcp4r"
    assert Strategy.of(1, 1, "zero3", cp=1, cp_method="ring", sp=True) == Strategy(1, 1)
    assert Strategy(2, 1, cp=2, cp_method="ulysses").replicas == 4


def _sequence_plan() -> Plan:
    problem = _sequence_problem(0, 3, 4, 40.0, ring=True, batch=1)
    return search(problem, solver="cbc", time_limit_s=60, workers=1)


def test_plan_json_round_trips_the_sequence_fields_and_reads_older_versions():
    plan = _sequence_plan()
    doc = plan.to_dict()
    assert doc["format_version"] == PLAN_FORMAT_VERSION
    assert all({"cp", "cp_method", "sp"} <= set(layer) for layer in doc["layers"])
    assert any(layer["cp"] > 1 for layer in doc["layers"])
    again = Plan.from_dict(copy.deepcopy(doc))
    assert [lp.strategy for lp in again.layers] == [lp.strategy for lp in plan.layers]
    # a version-3 file had no sequence fields: they are ignored there and read as cp 1 (its grid must be dp x tp)
    old = search(random_problem(0, num_layers=3, nodes=1, per_node=2, memory_gib=40.0), solver="cbc",
                 workers=1).to_dict()
    old["format_version"] = 3
    for layer in old["layers"]:
        layer["cp"], layer["cp_method"], layer["sp"] = 7, "ring", True
    loaded = Plan.from_dict(old)
    assert all(lp.strategy.cp == 1 and lp.strategy.cp_method == "none" and not lp.strategy.sp
               for lp in loaded.layers)


def test_a_plan_whose_grid_does_not_cover_the_stage_is_refused():
    doc = _sequence_plan().to_dict()
    layer = next(x for x in doc["layers"] if x["cp"] > 1)
    layer["cp"] = layer["cp"] * 2
    with pytest.raises(UniAPError, match=r"dp\*cp\*tp = .* != devices per stage"):
        Plan.from_dict(doc)


def test_sequence_layouts_are_dropped_only_when_the_batch_can_take_every_rank():
    """When every micro-batch splits over all the ranks a sequence split would use, data parallelism gives each
    layer the same compute and memory without the attention's all-to-alls: the tables drop every cp > 1 strategy
    (exact, see ``CostTables._drop_dominated_sequence_layouts``); with one sample per micro-batch they stay."""
    wide = _sequence_problem(0, 3, 4, 40.0, ring=False, batch=8)
    t = CostTables(wide, 1, 1, schedule="1f1b")
    assert all(k.cp == 1 for ks in t.strategies for k in ks)
    assert any(k.cp > 1 for ks in CostTables(wide, 1, 1, schedule="1f1b", prune=False).strategies for k in ks)
    narrow = CostTables(_sequence_problem(0, 3, 4, 40.0, ring=False, batch=1), 1, 1, schedule="1f1b")
    assert any(k.cp > 1 for ks in narrow.strategies for k in ks)


def test_zero_bubble_schedules_refuse_zero_modes_over_context_ranks_too():
    """The split backward's refusals (planner.schedule_rules) count the ranks holding the same weights, data and
    context parallel: ZeRO-2 over cp ranks alone is refused like over data ranks."""
    from uniap_lightning.planner.schedule_rules import unsupported

    assert unsupported("zb_h1", Strategy(1, 1, "zero2", cp=2, cp_method="ulysses")) is not None
    assert unsupported("zb_h1", Strategy(1, 1, "replicate", cp=2, cp_method="ulysses")) is None


def test_the_last_layer_gathers_whole_sequences_for_the_loss():
    """The runtime computes the loss on whole sequences where the chain ends: a last layer with cp > 1 pays an
    all-gather of its output over its cp ranks and keeps the gathered output, less the loss input (this rank's
    chunk of the boundary layout: b / g samples, g = gcd(b, n); here b = 2 < n = 4, so one whole sample) that every
    plan holds; the same layer elsewhere does not."""
    from uniap_lightning.planner.cost.comm import all_gather_s

    problem = _repeated_sequence_problem(0, 40.0, ring=False)  # "ABBB": the last block equals the middle ones
    t = CandidateCosts(problem, 1, 1, schedule="1f1b")
    s = Strategy(1, 1, cp=4, cp_method="ulysses")
    middle, last = t.terms(1, s), t.terms(3, s)
    whole = problem.model.layers[3].output_bytes * t.b / s.dp
    assert last.time_s - middle.time_s == pytest.approx(all_gather_s(problem.cluster, whole, 4, False))
    assert (t.b, t.n, t.edge) == (2, 4, 2)
    loss_input = problem.model.layers[3].output_bytes * t.b / t.edge
    assert last.activation_bytes - middle.activation_bytes == pytest.approx(whole - loss_input)
    assert whole - loss_input > 0
    assert t.terms(3, Strategy(4, 1)) == t.terms(1, Strategy(4, 1))
    # a loss that runs on the sequence pieces (the profile's loss_on_pieces) gathers nothing: the last block then
    # costs what a middle one does
    layers = list(problem.model.layers)
    layers[3] = replace(layers[3], loss_on_pieces=True)
    pieces = replace(problem, model=replace(problem.model, layers=layers))
    tp = CandidateCosts(pieces, 1, 1, schedule="1f1b")
    assert tp.terms(3, s) == tp.terms(1, s)


def test_loss_on_pieces_round_trips_and_older_profiles_read_without_it(tmp_path):
    from uniap_lightning.planner.profile import load_profile, save_profile

    problem = _repeated_sequence_problem(0, 40.0, ring=False)
    layers = list(problem.model.layers)
    layers[-1] = replace(layers[-1], loss_on_pieces=True)
    model = replace(problem.model, layers=layers)
    save_profile(model, tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")
    assert loaded.layers[-1].loss_on_pieces and not loaded.layers[0].loss_on_pieces
    assert "loss_on_pieces" not in model.to_dict()["layers"][0]  # written only where it says something


@pytest.mark.parametrize(("fields", "match"), [
    ({"sequence_length": 0}, r"layers\[0\]\.sequence_length must be > 0, got 0"),
    ({"sequence_length": "long"}, r"layers\[0\]\.sequence_length must be a finite number"),
    ({"attention_heads": -1}, r"layers\[0\]\.attention_heads must be >= 0, got -1"),
    ({"attention_heads": 8, "kv_heads": 3}, r"layers\[0\]\.kv_heads=3 must divide attention_heads=8"),
    ({"kv_heads": 2}, r"layers\[0\]\.kv_heads=2 must divide attention_heads=0"),
    ({"sequence_parallel": "yes"}, r"layers\[0\]\.sequence_parallel must be true or false"),
    ({"loss_on_pieces": 1}, r"layers\[0\]\.loss_on_pieces must be true or false"),
])
def test_bad_sequence_fields_in_a_profile_are_refused_in_one_line(fields, match):
    from uniap_lightning.planner.profile import ModelProfile

    layer = {"name": "b", "forward_s": 1e-3, "backward_s": 2e-3, "params": 10, "activation_bytes": 1.0,
             "output_bytes": 1.0, "tp_degrees": [1], "tp_allreduces": 0, **fields}
    with pytest.raises(UniAPError, match=match) as err:
        ModelProfile.from_dict({"format_version": 1, "layers": [layer]})
    assert "\n" not in str(err.value)


def test_a_bad_ring_attention_flag_in_a_cluster_is_refused():
    from uniap_lightning.planner.cluster import Cluster

    with pytest.raises(UniAPError, match="ring_attention must be true or false"):
        Cluster.from_dict({"name": "c", "nodes": 1, "devices_per_node": 2, "memory_gib": 8, "peak_tflops": 1,
                           "ring_attention": "no"})
