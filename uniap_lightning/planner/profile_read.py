"""Reading a profile's layers from JSON: every field checked against a sane range, so the planner's programs never
see a coefficient no solver takes, and each error names the file, the layer and the field. The format is
:mod:`uniap_lightning.planner.profile`'s docstring; the records are :mod:`uniap_lightning.planner.profile_layer`."""

from __future__ import annotations

import math
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.fields import MAX_COUNT, array, short
from uniap_lightning.planner.profile_layer import OVERHEAD_KINDS, LayerProfile, Overhead, Timing

#: the largest magnitude of any number in a profile (seconds, bytes, counts): far beyond any real figure, and
#: small enough that the cost model's sums and products stay finite floats
MAX_PROFILE_NUMBER = 1e30
#: each field's sane range, checked when a profile is read, so the planner's programs never see a coefficient no
#: solver takes (a profile with ``tp_allreduces`` of 1e18 made HiGHS fail): a second per sample or call at most a
#: million, a layer's bytes per sample at most a pebibyte, its parameters at most ten trillion, a count of
#: collectives, tensors, heads or experts at most a million, a sequence at most a billion tokens
MAX_PROFILE_SECONDS = 1e6
MAX_PROFILE_BYTES = float(2**50)
MAX_PROFILE_PARAMS = 10**13
MAX_PROFILE_COUNT = 10**6
MAX_PROFILE_TOKENS = 10**9
#: micro-batch sizes a timing or overhead is measured at (the planner's largest global batch)
MAX_PROFILE_MICRO_BATCH = 10**9
#: ``capacity_factor`` and ``backward_split_overhead`` are ratios near 1
MAX_PROFILE_RATIO = 1e3
_REQUIRED = ("name", "forward_s", "backward_s", "params", "activation_bytes", "output_bytes", "tp_degrees", "tp_allreduces")


def _finite(value: Any) -> bool:
    """A real JSON number (not a boolean or string) that is finite as a float (a 400-digit integer is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(item: dict[str, Any], key: str, where: str, *, integer: bool = False, positive: bool = False,
            high: float, unit: str) -> Any:
    """``item[key]``: a finite number >= 0 (> 0 when ``positive``), an integer when ``integer``, at most ``high``
    (``unit`` says what it counts, in the message)."""
    value = item[key]
    if not _finite(value) or abs(value) > MAX_PROFILE_NUMBER:
        raise UniAPError(f"{where}.{key} must be a finite number, got {short(value)}")
    if value < 0 or (positive and value == 0):
        raise UniAPError(f"{where}.{key} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    if value > high:
        limit = f"{int(high):,}" if float(high).is_integer() and high < 1e16 else f"{high:g}"
        raise UniAPError(f"{where}.{key} must be at most {limit} ({unit}), got {short(value)}: no real layer comes "
                         "near it; measure the profile again or fix the field")
    if integer:
        if int(value) != value:
            raise UniAPError(f"{where}.{key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def _fraction(item: dict[str, Any], key: str, where: str) -> float:
    value = item[key]
    if not _finite(value):
        raise UniAPError(f"{where}.{key} must be a finite number, got {short(value)}")
    if not 0 <= value <= 1:
        raise UniAPError(f"{where}.{key} must be in [0, 1], got {value!r}")
    return float(value)


def _optional_list(item: dict[str, Any], key: str, where: str) -> list[Any]:
    """An optional list field: absent or null reads as empty; anything else but a list is refused."""
    value = item.get(key)
    return [] if value is None else array(value, f"{where}.{key}")


def layer_from_dict(item: Any, where: str) -> LayerProfile:
    """One entry of a profile's ``layers`` list, checked (``where``: the file and the entry, for the errors)."""
    if not isinstance(item, dict):
        raise UniAPError(f"{where} must be an object")
    missing = [k for k in _REQUIRED if k not in item]
    if missing:
        raise UniAPError(f"{where} is missing field(s) {', '.join(repr(m) for m in missing)}")
    degrees = item["tp_degrees"]
    if not isinstance(degrees, list) or not degrees or any(
        isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_COUNT for t in degrees
    ):
        raise UniAPError(f"{where}.tp_degrees must be a non-empty list of positive integers, got {short(degrees)}")
    if 1 not in degrees:
        raise UniAPError(f"{where}.tp_degrees must include 1, got {degrees!r}")
    frac = _fraction(item, "activation_tp_fraction", where) if "activation_tp_fraction" in item else 1.0
    wgrad = _fraction(item, "weight_grad_fraction", where) if item.get("weight_grad_fraction") is not None else None
    timings = []
    for j, t in enumerate(_optional_list(item, "timings", where)):
        tw = f"{where}.timings[{j}]"
        if not isinstance(t, dict) or any(k not in t for k in ("micro_batch", "forward_s", "backward_s")):
            raise UniAPError(f"{tw} needs 'micro_batch', 'forward_s' and 'backward_s'")
        timings.append(
            Timing(
                _number(t, "micro_batch", tw, integer=True, positive=True, high=MAX_PROFILE_MICRO_BATCH,
                        unit="samples"),
                _number(t, "forward_s", tw, high=MAX_PROFILE_SECONDS, unit="seconds per call"),
                _number(t, "backward_s", tw, high=MAX_PROFILE_SECONDS, unit="seconds per call"),
            )
        )
    if len({t.micro_batch for t in timings}) != len(timings):
        raise UniAPError(f"{where}.timings lists a micro_batch size twice")
    overheads = []
    for j, o in enumerate(_optional_list(item, "overheads", where)):
        ow = f"{where}.overheads[{j}]"
        if not isinstance(o, dict) or any(k not in o for k in ("kind", "degree", "micro_batch", "seconds")):
            raise UniAPError(f"{ow} needs 'kind', 'degree', 'micro_batch' and 'seconds'")
        if o["kind"] not in OVERHEAD_KINDS:
            raise UniAPError(f"{ow}.kind must be one of {list(OVERHEAD_KINDS)}, got {o['kind']!r}")
        sec = o["seconds"]
        if not _finite(sec) or abs(sec) > MAX_PROFILE_NUMBER:
            raise UniAPError(f"{ow}.seconds must be a finite number, got {short(sec)}")
        if abs(sec) > MAX_PROFILE_SECONDS:
            raise UniAPError(f"{ow}.seconds must be between -{MAX_PROFILE_SECONDS:,.0f} and {MAX_PROFILE_SECONDS:,.0f} "
                             f"(seconds per micro-batch), got {short(sec)}: no real layer comes near it; measure the "
                             "profile again or fix the field")
        degree = _number(o, "degree", ow, integer=True, positive=True, high=MAX_COUNT, unit="devices")
        if degree < 2:
            raise UniAPError(f"{ow}.degree must be >= 2, got {degree}")
        overheads.append(Overhead(o["kind"], degree, _number(o, "micro_batch", ow, integer=True, positive=True,
                                                           high=MAX_PROFILE_MICRO_BATCH, unit="samples"),
                                  float(sec)))
    if len({(o.kind, o.degree, o.micro_batch) for o in overheads}) != len(overheads):
        raise UniAPError(f"{where}.overheads lists a (kind, degree, micro_batch) twice")
    name = item["name"]
    if not isinstance(name, str) or not name:
        raise UniAPError(f"{where}.name must be a non-empty string")
    return LayerProfile(
        name=name,
        forward_s=_number(item, "forward_s", where, high=MAX_PROFILE_SECONDS, unit="seconds per sample"),
        backward_s=_number(item, "backward_s", where, high=MAX_PROFILE_SECONDS, unit="seconds per sample"),
        params=_number(item, "params", where, integer=True, high=MAX_PROFILE_PARAMS, unit="parameters"),
        activation_bytes=_number(item, "activation_bytes", where, high=MAX_PROFILE_BYTES, unit="bytes per sample"),
        output_bytes=_number(item, "output_bytes", where, high=MAX_PROFILE_BYTES, unit="bytes per sample"),
        tp_degrees=tuple(sorted(set(degrees))),
        tp_allreduces=_number(item, "tp_allreduces", where, integer=True, high=MAX_PROFILE_COUNT,
                              unit="all-reduces per pass"),
        activation_tp_fraction=frac,
        timings=tuple(timings),
        overheads=tuple(overheads),
        param_tensors=_number(item, "param_tensors", where, integer=True, high=MAX_PROFILE_COUNT,
                              unit="tensors") if "param_tensors" in item else 0,
        matrix_dims=_number(item, "matrix_dims", where, high=MAX_PROFILE_PARAMS, unit="elements") if item.get("matrix_dims") is not None else None,
        vector_params=(_number(item, "vector_params", where, integer=True, high=MAX_PROFILE_PARAMS, unit="parameters")
                       if item.get("vector_params") is not None else None),
        backward_peak_bytes=(_number(item, "backward_peak_bytes", where, high=MAX_PROFILE_BYTES, unit="bytes per sample")
                             if item.get("backward_peak_bytes") is not None else 0.0),
        weight_grad_fraction=wgrad,
        backward_split_overhead=(_number(item, "backward_split_overhead", where, positive=True, high=MAX_PROFILE_RATIO,
                                          unit="a ratio of times")
                                 if item.get("backward_split_overhead") is not None else None),
        **_sequence_fields(item, where),
        **_expert_fields(item, where),
    )


_SEQUENCE_BOUNDS: dict[str, dict[str, Any]] = {
    "sequence_length": {"high": MAX_PROFILE_TOKENS, "unit": "tokens"},
    "attention_heads": {"high": MAX_PROFILE_COUNT, "unit": "heads"},
    "kv_heads": {"high": MAX_PROFILE_COUNT, "unit": "heads"},
}
_EXPERT_BOUNDS: dict[str, dict[str, Any]] = {
    "experts": {"high": MAX_PROFILE_COUNT, "unit": "experts"},
    "top_k": {"high": MAX_PROFILE_COUNT, "unit": "experts per token"},
    "expert_params": {"high": MAX_PROFILE_PARAMS, "unit": "parameters"},
}


def _sequence_fields(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The optional sequence fields (see :mod:`uniap_lightning.planner.profile`), checked against each other."""
    out: dict[str, Any] = {}
    for key in ("sequence_length", "attention_heads", "kv_heads"):
        if item.get(key) is not None:
            out[key] = _number(item, key, where, integer=True, positive=key != "attention_heads",
                               **_SEQUENCE_BOUNDS[key])
    for key in ("sequence_parallel", "loss_on_pieces"):
        if item.get(key) is not None:
            if not isinstance(item[key], bool):
                raise UniAPError(f"{where}.{key} must be true or false, got {short(item[key])}")
            out[key] = item[key]
    heads, kv = out.get("attention_heads", 0), out.get("kv_heads")
    if kv is not None and (heads == 0 or heads % kv):
        raise UniAPError(f"{where}.kv_heads={kv} must divide attention_heads={heads} (grouped-query attention)")
    return out


def _expert_fields(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The optional expert fields (see :mod:`uniap_lightning.planner.profile`), checked against each other and
    ``params``."""
    out: dict[str, Any] = {}
    for key in ("experts", "top_k", "expert_params"):
        if item.get(key) is not None:
            out[key] = _number(item, key, where, integer=True, positive=key == "top_k", **_EXPERT_BOUNDS[key])
    if item.get("capacity_factor") is not None:
        out["capacity_factor"] = _number(item, "capacity_factor", where, positive=True, high=MAX_PROFILE_RATIO,
                                          unit="a ratio of tokens")
    experts = out.get("experts", 0)
    if experts and out.get("top_k", 1) > experts:
        raise UniAPError(f"{where}.top_k={out['top_k']} must be at most experts={experts}")
    if out.get("expert_params", 0) > item["params"]:
        raise UniAPError(f"{where}.expert_params={out['expert_params']} must be at most params={item['params']} "
                         "(the experts' parameters are part of the layer's)")
    if not experts and (out.get("expert_params") or "capacity_factor" in out or out.get("top_k", 1) != 1):
        raise UniAPError(f"{where}: top_k, expert_params and capacity_factor need 'experts' > 0 (a mixture-of-experts "
                         "layer)")
    return out
