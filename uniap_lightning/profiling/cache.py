"""On-disk cache of measured profiles (model and cluster), and the check that a profile belongs to a model.

A measured model profile is keyed by everything its numbers depend on: the model's structure (layer names,
module classes, parameter shapes and dtypes), the source code of every module class in the chain, the answers of
its ``uniap_*`` methods (tensor-parallel degrees and all-reduces), the precision, the sample micro-batch's shape
and dtype, the device type (and GPU name), the world layout (nodes x devices per node: other processes share the
machine while profiling), the torch / lightning / uniap versions and the profiler's settings. A measured cluster
is keyed by the world layout, device type, backend and versions. Entries are profile-format JSON files
(``profile-<key>.json``) or cluster JSON files (``cluster-<key>.json``), written atomically. An unreadable or
invalid entry is discarded with a warning naming the file, then measured again and replaced.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import (  # noqa: F401 - CORRUPT_ENTRY_ERRORS, foreign_entry, why: also from here
    CORRUPT_ENTRY_ERRORS,
    cache_root,
    foreign_entry,
    read_json,
    remove_if_not_regular,
    why,
    write_json_atomic,
)
from uniap_lightning.planner import fields as F
from uniap_lightning.planner.profile import ModelProfile, load_profile, save_profile


def default_profile_cache_dir() -> Path:
    return cache_root() / "profiles"


#: what the profiler measures and records, revised when a release would otherwise reuse entries that lack fields
#: the planner now needs (2: the sequence fields, ``loss_on_pieces`` and the mixture-of-experts fields; entries
#: cached before them are measured again instead of hiding cp / sp / ep from the search)
PROFILER_REVISION = "2"


def versions() -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "profiler": PROFILER_REVISION}
    try:
        import lightning

        out["lightning"] = lightning.__version__
    except ImportError:  # pragma: no cover
        pass
    try:  # a Hugging Face model's layers run the library's code: another version may time (or split) differently
        # (without importing it: cheap for every model)
        out["transformers"] = importlib.metadata.version("transformers")
    except Exception:  # noqa: BLE001 - not installed
        pass
    try:
        out["uniap_lightning"] = importlib.metadata.version("uniap_lightning")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        out["uniap_lightning"] = "dev"
    return out


def _hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def model_structure(layers: Sequence[Any], names: Sequence[str]) -> list[Any]:
    """Names, classes and parameter shapes / dtypes of the chain (no values)."""
    return [
        [name, type(layer).__name__, [[n, list(p.shape), str(p.dtype)] for n, p in layer.named_parameters()]]
        for layer, name in zip(layers, names)
    ]


def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # defined in a REPL or a C extension: the name is all we can key on
        return f"{cls.__module__}.{cls.__qualname__}"


def model_code(layers: Sequence[Any]) -> dict[str, str]:
    """Hash of the source of every distinct module class in the chain (layers and their submodules): changing a
    layer's code, or adding a ``uniap_*`` method to it, changes what the profile would measure."""
    classes = {type(m) for layer in layers for m in layer.modules()}
    return {f"{c.__module__}.{c.__qualname__}": hashlib.sha256(_class_source(c).encode()).hexdigest()[:16]
            for c in classes}


def loss_code(fn: Any) -> str:
    """Hash of the loss's source (the last layer's profile includes the loss): a bound ``uniap_loss`` by its
    module's class, a loss module by its class, a function by its own source."""
    owner = getattr(fn, "__self__", None)  # a bound method's module
    if owner is None and not hasattr(fn, "__code__"):
        owner = fn  # a loss module or another callable object
    if owner is not None:
        cls = type(owner)
        name, src = f"{cls.__module__}.{cls.__qualname__}", _class_source(cls)
    else:
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            src = name
    return f"{name}:{hashlib.sha256(src.encode()).hexdigest()[:16]}"


def profile_key(*, layers: Sequence[Any], names: Sequence[str], input_shape: Sequence[int], input_dtype: str,
                device: str, nodes: int, devices_per_node: int, settings: dict[str, Any], precision: str,
                tp_degrees: Sequence[Sequence[int]], tp_allreduces: Sequence[int]) -> str:
    """Everything a measured profile depends on: the chain's structure and code, the answers of its ``uniap_*``
    methods, the sample's shape, the device and world layout, the precision, the library versions and the
    profiler's settings."""
    return _hash({
        "structure": model_structure(layers, names),
        "code": model_code(layers),
        "uniap": [[list(t) for t in tp_degrees], list(tp_allreduces)],
        "input": [list(input_shape), input_dtype],
        "device": device,
        "layout": [nodes, devices_per_node],
        "precision": precision,
        "versions": versions(),
        "settings": settings,
        "kind": "model-profile", "fields": 8,  # 2: param_tensors; 3: "dp" overheads; 4: matrix_dims; 5: zero1/zero2;
        # 6: memory by storage + backward peak; 7: layers timed from cold caches, the loss with the last layer;
        # 8: weight_grad_fraction
    })


def cluster_key(*, device: str, backend: str, nodes: int, devices_per_node: int) -> str:
    return _hash({"device": device, "backend": backend, "layout": [nodes, devices_per_node],
                  "versions": versions(), "kind": "cluster", "ops": 5})  # 5: FSDP2's calls; pipeline slot; optimizer


def _discard(path: Path, why: str) -> None:
    warnings.warn(f"UniAP: ignoring the cache entry {path} ({why}); it is rebuilt", stacklevel=3)
    remove_if_not_regular(path)


def load_cached_profile(cache_dir: Path, key: str) -> ModelProfile | None:
    """The cached profile, or ``None`` when absent; an unreadable or invalid entry (of any shape: a FIFO,
    binary junk, truncated or deeply nested JSON, a wrong type in a field) is discarded with a warning."""
    path = cache_dir / f"profile-{key}.json"
    if not os.path.lexists(path):
        return None
    if (foreign := foreign_entry(path)) is not None:
        _discard(path, foreign)
        return None
    try:
        return load_profile(path)
    except CORRUPT_ENTRY_ERRORS as err:
        _discard(path, why(err))
        return None


def save_cached_profile(cache_dir: Path, key: str, profile: ModelProfile) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"profile-{key}.json"
    save_profile(profile, path)  # atomic
    return path


def load_cached_json(cache_dir: Path, name: str) -> dict[str, Any] | None:
    """A cached JSON object, or ``None`` when absent; an unreadable entry is discarded with a warning."""
    path = cache_dir / name
    if not os.path.lexists(path):
        return None
    if (foreign := foreign_entry(path)) is not None:
        _discard(path, foreign)
        return None
    try:
        data = read_json(path, "cache entry")
    except CORRUPT_ENTRY_ERRORS as err:
        _discard(path, why(err))
        return None
    if not isinstance(data, dict):
        _discard(path, f"a JSON {type(data).__name__}, not an object")
        return None
    return data


def save_cached_json(cache_dir: Path, name: str, data: dict[str, Any]) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(cache_dir / name, data)


def check_cluster_entry(data: dict[str, Any]) -> dict[str, Any]:
    """A cached cluster measurement (``cluster-<key>.json``, as ``measure_collectives`` returns it) with every
    figure of its JSON type: a string or boolean where a number belongs is a damaged entry, not a figure."""
    where = "cluster entry"
    ops = F.obj(F.required(data, "ops", where), f"{where}.ops")
    for op, recs in ops.items():
        for p, rec in F.obj(recs, f"{where}.ops.{op}").items():
            w = f"{where}.ops.{op}[{p}]"
            rec = F.obj(rec, w)
            F.number(F.required(rec, "bw_gbps", w), f"{w}.bw_gbps", low=0)
            F.number(F.required(rec, "latency_us", w), f"{w}.latency_us", low=0)
            F.boolean(F.required(rec, "inter_node", w), f"{w}.inter_node")
    for key in ("pipeline_slot_us", "optimizer_ns_per_param", "optimizer_us_per_tensor"):
        F.optional_number(data.get(key), f"{where}.{key}", low=0)
    for method, v in F.obj(data.get("compression_ns_per_param") or {}, f"{where}.compression_ns_per_param").items():
        F.number(v, f"{where}.compression_ns_per_param.{method}", low=0)
    return data


def check_profile_matches(profile: ModelProfile, names: Sequence[str], params: Sequence[int], *,
                          origin: str = "the profile") -> None:
    """Refuse a profile made for another model: layer count, names and parameter counts must agree."""
    if profile.num_layers != len(names):
        raise UniAPError(
            f"{origin} describes {profile.num_layers} layers but the model's chain has {len(names)} "
            f"({', '.join(list(names)[:4])}{' ...' if len(names) > 4 else ''}); the profile is for another model "
            f"('{profile.model}')"
        )
    for u, (lp, name, n) in enumerate(zip(profile.layers, names, params)):
        if lp.name != name:
            raise UniAPError(
                f"{origin}: layer {u} is '{lp.name}' but the model's layer {u} is '{name}'; the profile is for "
                f"another model ('{profile.model}')"
            )
        if lp.params != n:
            raise UniAPError(
                f"{origin}: layer {u} ('{name}') has {lp.params} parameters in the profile but {n} in the model; "
                f"the profile is for another model ('{profile.model}') or another size of it"
            )
