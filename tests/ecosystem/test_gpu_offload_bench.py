"""``benchmarks/gpu_offload.py`` (issue 40's GPU proof, prepared): the plans it compares differ from the
strategy's only in the offload fields, and ``benchmarks/gpu.py --smoke --offload`` runs the whole section on the CPU
(the three plans trained, priced and tabled; the measured memory ``n/a`` there)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.plan_records import LayerPlan, StagePlan

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_offload_bench", ROOT / "benchmarks" / "gpu_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(strategies: list[Strategy]) -> Plan:
    n = len(strategies)
    return Plan(pp=1, microbatches=2, schedule="1f1b", global_batch_size=8, num_devices=1,
                stages=[StagePlan(0, (0, n - 1), (0,))],
                layers=[LayerPlan(f"chain.{u}", 0, s) for u, s in enumerate(strategies)])


def test_offload_plans_change_only_the_offload_fields_of_the_blocks():
    bench = _bench()
    plain, recomputed = Strategy.of(1, 1), Strategy.of(1, 1, recompute=True)
    # embedding, two blocks (one recomputed), a block offloading already, the head
    plan = _plan([plain, plain, recomputed, Strategy.of(1, 1, offload=True), plain])
    none, n0 = bench.derive(plan, "none")
    act, n1 = bench.derive(plan, "activations")
    state, n2 = bench.derive(plan, "state")
    assert (n0, n1, n2) == (0, 2, 3)  # the recomputed block cannot offload its activations: it keeps recompute
    assert [lp.strategy.offload for lp in none.layers] == [False] * 5
    assert [lp.strategy.offload for lp in act.layers] == [False, True, False, True, False]
    assert [lp.strategy.state_offload for lp in state.layers] == [False, True, True, True, False]
    assert not any(lp.strategy.state_offload for lp in act.layers)
    for derived in (none, act, state):
        assert derived.estimate is None  # priced again, never the strategy's estimate
        assert (derived.pp, derived.microbatches, derived.schedule, derived.stages) == (
            plan.pp, plan.microbatches, plan.schedule, plan.stages)
        for old, new in zip(plan.layers, derived.layers):
            assert (new.name, new.stage) == (old.name, old.stage)
            assert new.strategy._replace(offload=False, state_offload=False) == \
                old.strategy._replace(offload=False, state_offload=False)


def test_gpu_benchmark_smoke_offload_section(tmp_path):
    """The section end to end on the CPU through gpu.py (about 40 s on a free core)."""
    out = tmp_path / "gpu.json"
    env = {**os.environ, "UNIAP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--offload", "--runs", "1", "--steps", "4",
         "--warmup", "1", "--no-cli", "--offload-steps", "3", "--offload-warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("offload (issue 40) on cpu (--smoke)"):]
    for row in ("| no offload | 0 |", "| activation offload (every block) | 2 |", "| state offload (every block) | 2 |"):
        assert row in table, table
    assert "paired ratio activations / none: step median" in table
    assert "paired ratio state / none: step median" in table
    assert "equal to its plan re-priced with offload allowed" in table, table
    res = json.loads(out.read_text())["offload"]
    rows = {r["variant"]: r for r in res["runs"]}
    assert sorted(rows) == ["activations", "none", "state"] and len(res["runs"]) == 3
    for r in rows.values():
        assert r["step_s"] > 0 and r["peak_bytes"] is None  # no device memory on a CPU
        # offload moves tensors, not numbers: the same loss after the same steps
        assert r["loss"] == pytest.approx(rows["none"]["loss"], abs=1e-4)
    pred, own = res["predicted"], res["strategy_estimate"]
    assert pred["none"]["step_s"] == pytest.approx(own["step_s"], rel=1e-9)
    assert pred["none"]["bytes"] == pytest.approx(own["bytes"], rel=1e-9)
    # the blocks' parameters, gradients and optimizer state leave the device; their copies cost time
    assert pred["state"]["bytes"] < pred["none"]["bytes"]
    assert pred["state"]["step_s"] > pred["none"]["step_s"]
    assert pred["activations"]["step_s"] > pred["none"]["step_s"]
    assert [len(res["pairs"][v]["step"]) for v in ("activations", "state")] == [1, 1]
