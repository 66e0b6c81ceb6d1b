"""Plan JSON round-trip and validation; profile files: loading and every bad field."""

from __future__ import annotations

import json

import pytest

from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import Plan
from uniap_lightning.profiling import load_profile, save_profile
from uniap_lightning.planner.solver import solve

REQUIRED_KEYS = {"pp", "microbatches", "schedule", "stages", "layers", "estimate", "solver", "baselines"}


@pytest.fixture(scope="module")
def solved():
    problem = build_problem(model="bert_huge", cluster="titanxp_2x4", global_batch_size=32)
    return problem, solve(problem, time_limit_s=60)


def test_plan_json_round_trip(solved, tmp_path):
    _, plan = solved
    path = tmp_path / "plan.json"
    plan.to_json(path)
    data = json.loads(path.read_text())
    assert REQUIRED_KEYS <= set(data)
    assert {"layers", "ranks"} <= set(data["stages"][0])
    assert {"name", "stage", "dp", "tp", "shard"} <= set(data["layers"][0])
    assert {"tpi_s", "samples_per_s", "stage_memory_bytes", "feasible"} <= set(data["estimate"])
    assert {"name", "status", "gap", "solve_s"} <= set(data["solver"])
    again = Plan.from_json(path)
    assert again.to_dict() == plan.to_dict()


def test_plan_validation_names_the_field(solved):
    _, plan = solved
    data = plan.to_dict()
    for mutate, match in [
        (lambda d: d.update(pp=3), "pp=3 does not divide"),
        (lambda d: d.update(pp=2 * d["pp"]), f"stages but pp={2 * plan.pp}"),
        (lambda d: d.update(schedule="zigzag"), "schedule"),
        (lambda d: d["layers"][0].update(dp=3), "dp\\*cp\\*tp"),
        (lambda d: d.update(microbatches=5), "microbatches"),
        (lambda d: d.pop("layers"), "missing"),
    ]:
        bad = json.loads(json.dumps(data))
        mutate(bad)
        with pytest.raises(UniAPError, match=match):
            Plan.from_dict(bad)


def test_profile_file_round_trip_gives_the_same_plan(tmp_path, solved):
    problem, plan = solved
    path = tmp_path / "profile.json"
    save_profile(problem.model, path)
    loaded = load_profile(path)
    assert loaded.fingerprint() == problem.model.fingerprint()
    again = solve(build_problem(profile=path, cluster="titanxp_2x4", global_batch_size=32), baselines=False)
    assert again.estimate.tpi_s == pytest.approx(plan.estimate.tpi_s, rel=1e-9)


LAYER = {"name": "l0", "forward_s": 1e-3, "backward_s": 2e-3, "params": 10, "activation_bytes": 1.0,
         "output_bytes": 1.0, "tp_degrees": [1, 2], "tp_allreduces": 2}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"forward_s": -1.0}, r"layers\[0\]\.forward_s must be >= 0"),
        ({"params": 1.5}, r"params must be an integer"),
        ({"tp_degrees": [2]}, r"tp_degrees must include 1"),
        ({"tp_degrees": "all"}, r"tp_degrees must be a non-empty list"),
        ({"output_bytes": float("nan")}, r"output_bytes must be a finite number"),
        ({"activation_tp_fraction": 2.0}, r"activation_tp_fraction must be in \[0, 1\]"),
        ({"timings": [{"micro_batch": 0, "forward_s": 1, "backward_s": 1}]}, r"micro_batch must be > 0"),
        ({"backward_peak_bytes": -1.0}, r"layers\[0\]\.backward_peak_bytes must be >= 0"),
        ({"backward_peak_bytes": "big"}, r"backward_peak_bytes must be a finite number"),
    ],
)
def test_profile_bad_values(tmp_path, change, match):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"layers": [{**LAYER, **change}]}))
    with pytest.raises(UniAPError, match=match):
        load_profile(path)


def test_profile_missing_field_and_bad_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"layers": [{k: v for k, v in LAYER.items() if k != "output_bytes"}]}))
    with pytest.raises(UniAPError, match=r"missing field\(s\) 'output_bytes'"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(UniAPError, match="not valid JSON"):
        load_profile(path)
    with pytest.raises(UniAPError, match="does not exist"):
        load_profile(tmp_path / "nope.json")
    path.write_text(json.dumps({"layers": []}))
    with pytest.raises(UniAPError, match="non-empty list"):
        load_profile(path)


def test_timings_interpolate_between_measured_batch_sizes(tmp_path):
    path = tmp_path / "p.json"
    timed = {**LAYER, "timings": [{"micro_batch": 2, "forward_s": 1.0, "backward_s": 1.0},
                                  {"micro_batch": 4, "forward_s": 1.5, "backward_s": 1.5}]}
    path.write_text(json.dumps({"layers": [timed]}))
    layer = load_profile(path).layers[0]
    assert layer.compute_s(3) == pytest.approx(2.5)
    assert layer.compute_s(8) == pytest.approx(5.0)  # extrapolated along the measured slope
    assert layer.compute_s(1) == pytest.approx(1.5)  # below: along the slope while that is dearer per sample ...
    steep = {**LAYER, "timings": [{"micro_batch": 2, "forward_s": 0.5, "backward_s": 0.5},
                                  {"micro_batch": 4, "forward_s": 2.0, "backward_s": 2.0}]}
    path.write_text(json.dumps({"layers": [steep]}))
    layer = load_profile(path).layers[0]
    assert layer.compute_s(1) == pytest.approx(0.5)  # ... never cheaper per sample than the smallest timed size


@pytest.mark.parametrize("value", [-1, 1.5, "3", None])
def test_bad_param_tensors_is_refused(value):
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.profiling.pricing import build_problem
    from uniap_lightning.planner.profile import ModelProfile

    doc = build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16).model.to_dict()
    doc["layers"][1]["param_tensors"] = value
    with pytest.raises(UniAPError, match=r"layers\[1\]\.param_tensors"):
        ModelProfile.from_dict(doc, origin="profile")
