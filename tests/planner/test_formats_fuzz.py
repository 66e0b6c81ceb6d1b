"""A standing guard over the three public formats (profile, plan, cluster): any generated or mutated document
either loads and validates, or is refused with one ``UniAPError`` - never another exception, never a hang."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import build_problem, cluster_from
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.profile import ModelProfile

SETTINGS = settings(max_examples=150, deadline=2000, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from([0, -1, 1, 2**63, 1e308, -0.0, "", "nan", [], {}]),
)
JSON = st.recursive(JSON_LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:6]):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw: Any, seed_doc: dict[str, Any]) -> Any:
    """``seed_doc`` with a few random edits: a value replaced, a key deleted or added, a list emptied."""
    doc = copy.deepcopy(seed_doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(JSON)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(JSON)
        else:
            parent.append(draw(JSON))
    return doc


def _problem() -> Any:
    return build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16)


PROFILE = _problem().model.to_dict()
CLUSTER = json.loads(json.dumps(cluster_from("a100_1x8").to_dict() if hasattr(Cluster, "to_dict") else
                                {k: v for k, v in vars(cluster_from("a100_1x8")).items()}, default=str))


def _plan_doc(schedule: str = "auto") -> dict[str, Any]:
    from dataclasses import replace

    from uniap_lightning.planner.solver import solve

    problem = _problem()
    problem = replace(problem, training=replace(problem.training, schedule=schedule))
    return solve(problem, time_limit_s=120, baselines=False).to_dict()


PLAN = _plan_doc()
#: what a version-1 file could hold: one stage per device (GPipe or 1F1B)
PLAN_1F1B = _plan_doc("1f1b")


def _only_clear_errors(load: Any, doc: Any) -> None:
    try:
        load(doc)
    except UniAPError as err:
        assert str(err).strip(), "an empty error message"


def _load_profile(doc: Any) -> None:
    profile = ModelProfile.from_dict(doc, origin="fuzzed profile")
    profile.fingerprint()


def _load_plan(doc: Any) -> None:
    Plan.from_dict(doc).to_json()


def _load_cluster(doc: Any) -> None:
    cluster = Cluster.from_dict(doc)
    cluster.num_devices  # noqa: B018 - derived figures must not raise either


@pytest.mark.parametrize("seed, load", [(PROFILE, _load_profile), (PLAN, _load_plan), (CLUSTER, _load_cluster)],
                         ids=["profile", "plan", "cluster"])
def test_seed_documents_load(seed: dict[str, Any], load: Any) -> None:
    load(copy.deepcopy(seed))


@SETTINGS
@given(st.data())
def test_mutated_profiles_load_or_fail_clearly(data: Any) -> None:
    _only_clear_errors(_load_profile, data.draw(mutated(PROFILE)))


@SETTINGS
@given(st.data())
def test_mutated_plans_load_or_fail_clearly(data: Any) -> None:
    _only_clear_errors(_load_plan, data.draw(mutated(PLAN)))


@SETTINGS
@given(st.data())
def test_mutated_clusters_load_or_fail_clearly(data: Any) -> None:
    _only_clear_errors(_load_cluster, data.draw(mutated(CLUSTER)))


@SETTINGS
@given(JSON)
def test_arbitrary_json_is_refused_clearly(doc: Any) -> None:
    for load in (_load_profile, _load_plan, _load_cluster):
        _only_clear_errors(load, doc)


def test_non_finite_numbers_are_named() -> None:
    doc = copy.deepcopy(CLUSTER)
    doc["memory_gib"] = math.inf
    with pytest.raises(UniAPError, match="memory_gib"):
        Cluster.from_dict(doc)


# ---------------------------------------------------------------- issue 12's fields: plan v2, profile, cluster
NEW_VALUES = st.one_of(JSON_LEAVES, st.sampled_from(["replicate", "zero1", "zero2", "zero3", "none", "bf16",
                                                     "powersgd", "topk", True, False, 0.5, 3]))


def _v2_plan_doc() -> dict[str, Any]:
    """A plan with every new field in use: modes, recomputation and compression differ between layers."""
    doc = copy.deepcopy(PLAN_1F1B)
    modes = ["replicate", "zero1", "zero2", "zero3"]
    for u, layer in enumerate(doc["layers"]):
        if layer["dp"] > 1:
            layer["dp_mode"] = modes[u % 4]
            layer["compression"] = ["none", "bf16", "powersgd", "topk"][(u // 4) % 4] if u % 4 < 2 else "none"
        layer["recompute"] = u % 2 == 1
        layer["shard"] = layer["dp"] > 1 and layer["dp_mode"] == "zero3"
    doc["compression_options"] = {"powersgd_rank": 2, "topk_ratio": 0.05}
    return doc


PLAN_V2 = _v2_plan_doc()


def test_plan_v2_round_trips_every_new_field() -> None:
    plan = Plan.from_dict(copy.deepcopy(PLAN_V2))
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert {lp.strategy.dp_mode for lp in plan.layers if lp.strategy.dp > 1} == {"replicate", "zero1", "zero2", "zero3"}
    assert any(lp.strategy.recompute for lp in plan.layers) and any(lp.strategy.compression == "topk" for lp in plan.layers)
    assert again.compression_options == {"powersgd_rank": 2, "topk_ratio": 0.05}


def test_plan_v1_files_load_as_replicate_or_zero3() -> None:
    doc = copy.deepcopy(PLAN_1F1B)
    doc.pop("virtual_stages")
    doc["format_version"] = 1
    doc.pop("compression_options", None)
    for u, layer in enumerate(doc["layers"]):
        for key in ("dp_mode", "recompute", "compression"):
            layer.pop(key, None)
        layer["shard"] = u % 2 == 0
    plan = Plan.from_dict(doc)
    assert plan.format_version == 4  # read and upgraded
    for u, lp in enumerate(plan.layers):
        assert lp.strategy.dp_mode == ("zero3" if u % 2 == 0 and lp.strategy.dp > 1 else "replicate")
        assert not lp.strategy.recompute and lp.strategy.compression == "none"


@st.composite
def _new_field_edits(draw: Any, doc: dict[str, Any], where: Any, keys: list[str]) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        target = where(doc, draw(st.integers(0, 10**6)))
        key = draw(st.sampled_from(keys))
        if draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = draw(NEW_VALUES)
    return doc


def _a_layer(doc: dict[str, Any], j: int) -> dict[str, Any]:
    return doc["layers"][j % len(doc["layers"])]


@SETTINGS
@given(st.data())
def test_fuzzed_new_plan_fields_load_or_fail_clearly(data: Any) -> None:
    doc = data.draw(_new_field_edits(PLAN_V2, _a_layer, ["dp_mode", "recompute", "compression", "shard"]))
    if data.draw(st.booleans()):
        doc["compression_options"] = data.draw(st.one_of(
            NEW_VALUES, st.dictionaries(st.sampled_from(["powersgd_rank", "topk_ratio", "x"]), NEW_VALUES, max_size=2)))
    _only_clear_errors(_load_plan, doc)


@SETTINGS
@given(st.data())
def test_fuzzed_new_profile_fields_load_or_fail_clearly(data: Any) -> None:
    doc = data.draw(_new_field_edits(PROFILE, _a_layer, ["matrix_dims", "vector_params", "param_tensors", "backward_peak_bytes"]))
    _only_clear_errors(lambda d: [lp.powersgd_dims() for lp in ModelProfile.from_dict(d).layers], doc)


@SETTINGS
@given(st.one_of(NEW_VALUES, st.dictionaries(st.sampled_from(["bf16", "powersgd", "topk", "zip"]), NEW_VALUES,
                                             max_size=3)))
def test_fuzzed_compression_figures_load_or_fail_clearly(figures: Any) -> None:
    doc = copy.deepcopy(CLUSTER)
    doc["compression_ns_per_param"] = figures

    def load(d: Any) -> None:
        cluster = Cluster.from_dict(d)
        for method in ("bf16", "powersgd", "topk"):
            assert cluster.compression_s_per_param(method) >= 0

    _only_clear_errors(load, doc)


@SETTINGS
@given(st.one_of(NEW_VALUES, st.lists(NEW_VALUES, max_size=3)))
def test_fuzzed_compression_option_is_refused_clearly(value: Any) -> None:
    from uniap_lightning.planner.problem import compression_methods

    _only_clear_errors(compression_methods, value)


# ---------------------------------------------------------------- strict JSON types: no coercion of look-alikes
def _look_alikes(value: Any) -> list[Any]:
    """Values a coercing reader would take for ``value`` (``bool("false")`` is True, ``int("2")`` is 2)."""
    if isinstance(value, bool):
        return [str(value).lower(), int(value), "yes" if value else "", None]
    return [str(value), True, value + 0.5, -value - 1, None]


@SETTINGS
@given(st.data())
def test_look_alike_values_in_plan_layers_are_refused(data: Any) -> None:
    version = data.draw(st.sampled_from([1, 2]))
    doc = copy.deepcopy(PLAN_V2)
    if version == 1:
        doc["format_version"] = 1
        for layer in doc["layers"]:
            layer["shard"] = layer["dp_mode"] == "zero3"
    layer = data.draw(st.sampled_from(doc["layers"]))
    key = data.draw(st.sampled_from(["dp", "tp", "stage", "shard" if version == 1 else "recompute"]))
    layer[key] = data.draw(st.sampled_from(_look_alikes(layer[key])))
    with pytest.raises(UniAPError, match=rf"plan layer \d+ \(.*\): {key} must be"):
        Plan.from_dict(doc)
