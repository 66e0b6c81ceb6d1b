"""Micro-batches smaller than a stage with pp > 1 (issue 39): tp and cp ranks share a micro-batch, so a plan is valid
whenever every layer's data ranks split it. Stage boundaries cut it into ``g = gcd(b, n)`` chunks, each held by
``n / g`` lanes; each lane sends its chunk (``b / g`` samples) to the same lane of the next stage, and the cost
tables price exactly that. The runtime parity runs are in ``tests/runtime/test_equivalence.py`` (pp2 x tp2 with one
sample; 8 ranks: pp2 x dp2 x tp2 with two samples) and ``test_sequence_plans.py`` (cp2 / tp2 with one sample)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from planner_factories import random_problem

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cost.comm import p2p_s
from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.cost.layer import boundary_inter_node, reshard_s
from uniap_lightning.planner.cost.tables import CandidateCosts, CostTables
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan import Plan

ROOT = Path(__file__).resolve().parents[2]


def _plan(strategies, stages, *, pp, microbatches, batch, devices) -> Plan:
    return Plan.from_assignment(stage_of_layer=stages, strategies=strategies, layer_names=["a", "b", "c", "d"],
                                pp=pp, microbatches=microbatches, schedule="1f1b", global_batch_size=batch,
                                num_devices=devices)


@pytest.mark.parametrize(("strategy", "pp", "devices", "batch", "microbatches", "chunks"), [
    (Strategy.of(1, 2), 2, 4, 2, 2, 1),     # pp 2, stages of tp 2, one sample per micro-batch
    (Strategy.of(1, 4), 4, 16, 4, 4, 1),    # the measured pp 4 x tp 4 run: one sample on 4 lanes
    (Strategy.of(2, 4), 2, 16, 4, 2, 2),    # the measured pp 2 x dp 2 x tp 4 run: 2 samples on 8 lanes
    (Strategy.of(1, 1, cp=2, cp_method="ulysses"), 2, 4, 2, 2, 1),  # cp ranks share it too
    (Strategy.of(2, 1), 2, 4, 4, 2, 2),     # b = n: one sample per lane, as before
])
def test_a_micro_batch_smaller_than_a_stage_is_a_plan(strategy, pp, devices, batch, microbatches, chunks):
    plan = _plan([strategy] * 4, [0, 0, 1, 1] if pp == 2 else [0, 1, 2, 3], pp=pp, microbatches=microbatches,
                 batch=batch, devices=devices)
    assert plan.boundary_chunks == chunks == math.gcd(plan.micro_batch_size, plan.devices_per_stage)
    assert Plan.from_json(plan.to_json()) == plan


def test_data_ranks_must_still_split_the_micro_batch():
    with pytest.raises(UniAPError, match=r"micro-batch size 1 is not divisible by dp=2"):
        _plan([Strategy.of(2, 1)] * 4, [0, 0, 1, 1], pp=2, microbatches=2, batch=2, devices=4)


def test_boundary_costs_price_the_chunks_each_lane_sends():
    """2 nodes x 4, batch 8, pp 2, c 4: b = 2 < n = 4, g = 2: a lane sends b / 2 samples; a dp 2 layer already holds
    the boundary layout (no reshard), a tp 4 layer (dp 1) gathers the two chunks in forward."""
    problem = random_problem(12, num_layers=3, nodes=2, per_node=4, batch=8)
    cl = problem.cluster
    t = CandidateCosts(problem, 2, 4)
    assert (t.b, t.n, t.edge) == (2, 4, 2)
    out = problem.model.layers[0].output_bytes
    inter = boundary_inter_node(cl, 4, 0, 1)
    assert t.send_s(0, 0) == pytest.approx(2 * p2p_s(cl, out * 2 / 2, inter))
    assert t.boundary_out_s(0, (2, 1), 0) == pytest.approx(t.send_s(0, 0))
    assert t.boundary_in_s(0, (2, 1)) == 0.0
    gather = reshard_s(cl, out, 2, 2, 1)
    assert gather > 0
    assert t.boundary_in_s(0, (1, 1)) == pytest.approx(gather)
    assert t.boundary_s(0, (1, 1), (1, 1), 0) == pytest.approx(2 * gather + t.send_s(0, 0))
    # b divisible by n: the boundary layout is one chunk per lane, as before
    whole = CandidateCosts(problem, 2, 1)
    assert (whole.b, whole.edge) == (8, 4)
    assert whole.send_s(0, 0) == pytest.approx(2 * p2p_s(cl, out * 8 / 4, inter))


def test_the_search_offers_and_evaluates_such_candidates():
    problem = random_problem(12, num_layers=3, nodes=2, per_node=4, batch=8, memory_gib=1.0)
    tables = CostTables(problem, 2, 4)
    assert tables.feasible_shape
    assert all(s.dp in (1, 2) for row in tables.strategies for s in row)
    plan = problem.plan_for(stage_of_layer=[0, 1, 1], strategies=[Strategy.of(2, 2), Strategy.of(1, 4),
                                                                  Strategy.of(2, 2)], pp=2, microbatches=4)
    est = evaluate(problem, plan)
    assert est.boundary_s == [pytest.approx(tables.boundary_s(0, (2, 1), (1, 1), 0))]


def _measured():
    spec = importlib.util.spec_from_file_location("measured_benchmark", ROOT / "benchmarks" / "measured.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_measured_configuration_is_a_plan():
    """pp 4 x tp 4 with one sample per micro-batch, pp 2 x dp 2 x tp 4 with two (and the rest) price (flat model:
    no tracing, fast)."""
    from uniap_lightning.planner.config import load_group

    measured = _measured()
    small = 0
    for csv_name, (model, cluster_name) in measured.SETS.items():
        cluster_cfg = load_group("cluster", cluster_name)
        for point in measured.read_points(measured.DATA / csv_name):
            got = measured.predict(point, model, cluster_cfg, flat=True)
            assert not isinstance(got, str), (csv_name, point.name, got)
            n = point.dp * point.tp
            small += point.pp > 1 and (point.gbs // point.microbatches) % n != 0
    assert small >= 2
