"""Strict field readers for the public JSON formats (plan, profile, cluster).

JSON has real booleans, integers and floats; a reader that coerces (``bool("false")`` is True, ``int("2")`` is 2,
``int(2.7)`` is 2) turns a typo into a different run, e.g. a version-1 plan's ``"shard": "false"`` ran as ZeRO-3.
These readers accept only the JSON type the format documents and name the field (``where``) otherwise.
Integral floats (``2.0``) pass as integers: JSON does not tell the two apart and other writers emit them.
"""

from __future__ import annotations

import math
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.values import short  # noqa: F401 - re-exported: one way to print a value in a message

#: integers beyond this are refused (no count in the formats comes near it, and arithmetic on them would not be
#: exact in floats or would build huge ranges)
MAX_INTEGER = 2**53
#: the largest count of devices, stages, layers, micro-batches or samples a plan may name
MAX_COUNT = 2**31 - 1


def boolean(value: Any, where: str) -> bool:
    """A real JSON boolean (``true`` / ``false``); not ``"false"``, not 0 or 1."""
    if not isinstance(value, bool):
        raise UniAPError(f"{where} must be true or false (a JSON boolean), got {short(value)}")
    return value


def integer(value: Any, where: str, *, low: int | None = None, high: int = MAX_INTEGER) -> int:
    """An integer in ``[low, high]``: a JSON integer (or an integral float), not a boolean, not a string."""
    ok = not isinstance(value, bool) and (isinstance(value, int) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer()))
    if not ok:
        raise UniAPError(f"{where} must be an integer, got {short(value)}")
    if abs(value) > MAX_INTEGER:
        raise UniAPError(f"{where} is out of range (got {short(value)})")
    value = int(value)
    if low is not None and value < low:
        raise UniAPError(f"{where} must be >= {low}, got {value}")
    if value > high:
        raise UniAPError(f"{where} must be <= {high}, got {value}")
    return value


def number(value: Any, where: str, *, low: float | None = None, finite: bool = True) -> float:
    """A float (a JSON number, not a boolean or string), finite unless ``finite=False`` (then only NaN is
    refused: bounds and rates may be infinite), and ``>= low`` when given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UniAPError(f"{where} must be a number, got {short(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise UniAPError(f"{where} is out of range (got {short(value)})") from None
    if math.isnan(value) or (finite and math.isinf(value)):
        raise UniAPError(f"{where} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise UniAPError(f"{where} must be >= {low}, got {value!r}")
    return value


def optional_number(value: Any, where: str, **kw: Any) -> float | None:
    return None if value is None else number(value, where, **kw)


def string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise UniAPError(f"{where} must be a string, got {short(value)}")
    return value


def obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UniAPError(f"{where} must be an object, got {type(value).__name__}")
    return value


def array(value: Any, where: str) -> list[Any]:
    """A JSON list (a tuple too: Python callers pass documents they built)."""
    if not isinstance(value, (list, tuple)):
        raise UniAPError(f"{where} must be a list, got {type(value).__name__}")
    return list(value)


def required(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise UniAPError(f"{where} is missing the field '{key}'")
    return d[key]
