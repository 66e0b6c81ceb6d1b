"""A standing guard over the three public formats (profile, plan, cluster): any generated or mutated document
either loads and validates, or is refused with one ``UniAPError`` - never another exception, never a hang. A
document that loads holds what it says (every field written back equals the one written, :func:`_agrees`) and
round-trips (written back and loaded again: equal)."""

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
from uniap_lightning.planner.config import cluster_from
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.plan import PLAN_FORMAT_VERSION, Plan
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


def _only_clear_errors(load: Any, doc: Any, check: Any = None) -> Any:
    """``load(doc)`` is refused with one non-empty ``UniAPError``, or returns what ``doc`` says: ``check(written,
    loaded)`` (by default the check of the loaded type, :data:`_CHECKS`) on a copy of ``doc`` taken before the load.
    Returns what loaded (None when refused)."""
    written = copy.deepcopy(doc)
    try:
        loaded = load(doc)
    except UniAPError as err:
        assert str(err).strip(), "an empty error message"
        return None
    (check or _CHECKS[type(loaded)])(written, loaded)
    return loaded


def _same(a: Any, b: Any) -> bool:
    """JSON values equal (NaN equals NaN; a list equals a tuple with the same items)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                            and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def _agrees(written: Any, loaded: Any, where: str = "", skip: tuple[str, ...] = ()) -> None:
    """Every field of ``loaded`` (what the loaded object writes back) that ``written`` also has holds the value
    written: objects key by key, lists item by item."""
    if where.rsplit(".", 1)[-1] in skip:
        return
    if isinstance(written, dict) and isinstance(loaded, dict):
        for key in loaded.keys() & written.keys():
            _agrees(written[key], loaded[key], f"{where}.{key}", skip)
    elif isinstance(written, list) and isinstance(loaded, (list, tuple)):
        assert len(written) == len(loaded), f"{where}: {len(written)} items written, {len(loaded)} loaded"
        for i, (w, v) in enumerate(zip(written, loaded)):
            _agrees(w, v, f"{where}[{i}]", skip)
    else:
        assert _same(written, loaded), f"{where}: written {written!r}, loaded {loaded!r}"


LABELS = ("model", "source", "device")


def _check_profile(written: Any, profile: ModelProfile) -> None:
    again = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())), origin="round trip")
    assert again == profile
    assert _same(again.to_dict(), profile.to_dict())
    loaded = profile.to_dict()
    # the labels model / source / device load only as strings, kept as written
    assert all(isinstance(written.get(k, ""), str) for k in LABELS)
    # 'meta' left null is empty (any other non-object is refused)
    assert written.get("meta") is None or isinstance(written["meta"], dict)
    _agrees({**written, "meta": written.get("meta") or {}}, loaded, skip=("tp_degrees",))
    for w, lp in zip(written["layers"], profile.layers):
        assert list(lp.tp_degrees) == sorted(set(w["tp_degrees"]))


def _check_plan(written: Any, plan: Plan) -> None:
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert _same(again.to_dict(), plan.to_dict())
    # version 2 on: a layer's "shard" is derived from its dp_mode (written for version-1 readers), not read
    _agrees(written, plan.to_dict(), skip=("shard",) if plan.format_version >= 2 and written.get("format_version",
                                                                                                   2) != 1 else ())


def _cluster_fields(cluster: Cluster) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(cluster, f.name) for f in fields(cluster)}


TABLES = ("bandwidth_tables", "collective_tables", "compression_ns_per_param")


def _check_cluster(written: Any, cluster: Cluster) -> None:
    again = Cluster.from_dict(json.loads(json.dumps(_cluster_fields(cluster))))
    assert _same(_cluster_fields(again), _cluster_fields(cluster))
    # as JSON writes the loaded fields (table keys as strings, tuples as lists); an optional table left null is
    # empty, and only null: any other non-mapping (false, 0, "", []) is refused
    assert all(written.get(k) is None or isinstance(written[k], dict) for k in TABLES)
    loaded = json.loads(json.dumps(_cluster_fields(cluster)))
    _agrees({k: {} if k in TABLES and v is None else v for k, v in written.items()}, loaded)


_CHECKS = {ModelProfile: _check_profile, Plan: _check_plan, Cluster: _check_cluster}


def _load_profile(doc: Any) -> ModelProfile:
    profile = ModelProfile.from_dict(doc, origin="fuzzed profile")
    profile.fingerprint()
    return profile


def _load_plan(doc: Any) -> Plan:
    plan = Plan.from_dict(doc)
    plan.to_json()
    return plan


def _load_cluster(doc: Any) -> Cluster:
    cluster = Cluster.from_dict(doc)
    cluster.num_devices  # noqa: B018 - derived figures must not raise either
    return cluster


@pytest.mark.parametrize("seed, load", [(PROFILE, _load_profile), (PLAN, _load_plan), (CLUSTER, _load_cluster)],
                         ids=["profile", "plan", "cluster"])
def test_seed_documents_load(seed: dict[str, Any], load: Any) -> None:
    """The unmutated documents load, hold what they say field by field, and write back what loads again."""
    assert _only_clear_errors(load, copy.deepcopy(seed)) is not None, "the seed document was refused"


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
    assert plan.format_version == PLAN_FORMAT_VERSION  # read and upgraded
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
    def load(d: Any) -> ModelProfile:
        profile = ModelProfile.from_dict(d)
        for lp in profile.layers:
            lp.powersgd_dims()
        return profile

    _only_clear_errors(load, doc)


@SETTINGS
@given(st.one_of(NEW_VALUES, st.dictionaries(st.sampled_from(["bf16", "powersgd", "topk", "zip"]), NEW_VALUES,
                                             max_size=3)))
def test_fuzzed_compression_figures_load_or_fail_clearly(figures: Any) -> None:
    doc = copy.deepcopy(CLUSTER)
    doc["compression_ns_per_param"] = figures

    def load(d: Any) -> Cluster:
        cluster = Cluster.from_dict(d)
        for method in ("bf16", "powersgd", "topk"):
            assert cluster.compression_s_per_param(method) >= 0
        return cluster

    _only_clear_errors(load, doc)


@SETTINGS
@given(st.one_of(NEW_VALUES, st.lists(NEW_VALUES, max_size=3)))
def test_fuzzed_compression_option_is_refused_clearly(value: Any) -> None:
    from uniap_lightning.planner.problem import compression_methods

    from uniap_lightning.planner.problem import COMPRESSIONS

    def check(written: Any, methods: tuple[str, ...]) -> None:
        named = {"none"} if written is None else set(COMPRESSIONS) if written == "auto" else (
            {written} if isinstance(written, str) else set(written))
        assert methods == tuple(m for m in COMPRESSIONS if m == "none" or m in named), (written, methods)

    _only_clear_errors(compression_methods, value, check)


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
