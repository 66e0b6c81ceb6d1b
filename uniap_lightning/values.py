"""Checks of single values from configs, command-line overrides and the Python API.

Overrides arrive typed by Hydra's grammar: ``layers=nan`` is a float NaN, ``layers=abc`` a string,
``layers=1e400`` infinity, a 5,000-digit number a Python int. Every reader here refuses what the field cannot
take, with one line that names the field (``name``, prefixed by ``where``), the value, and what is accepted.
Integral floats (``2.0``) pass as integers: YAML and overrides do not always tell the two apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from uniap_lightning.errors import UniAPError


def short(value: Any) -> str:
    """A value for an error message, at most ~60 characters (a 5,000-digit integer is not printed whole)."""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**12:
        if abs(value) < 10**300:
            return f"{float(value):.6g}"
        digits = int(math.log10(abs(value))) + 1  # math.log10 takes big ints; str() refuses over 4,300 digits
        if 10 ** (digits - 1) > abs(value):  # log10 of 99...9 rounds up to the next power
            digits -= 1
        return f"an integer of about {digits:,} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_int(value: Any) -> Any:
    """``value`` as an int when it is an integral, finite float; anything else unchanged (for the checks to refuse)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def integer(value: Any, name: str, *, low: int, high: int, where: str = "", unit: str = "") -> int:
    """An integer in ``[low, high]`` (not a boolean, a string, NaN or a fraction)."""
    value = as_int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        what = f" ({unit})" if unit else ""
        raise UniAPError(f"{where}{name}={short(value)} must be an integer from {low:,} to {high:,}{what}")
    return value


def number(value: Any, name: str, *, low: float, high: float, low_open: bool = False, where: str = "",
           unit: str = "") -> float:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``low_open``); ints of any size are compared
    exactly before they are converted."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        what = f" ({unit})" if unit else ""
        raise UniAPError(f"{where}{name}={short(value)} must be a finite number {bound} and <= {high:g}{what}")
    return float(value)


def flag(value: Any, name: str, *, where: str = "") -> bool:
    """A real boolean (``true`` / ``false``), not ``"false"`` or 0."""
    if not isinstance(value, bool):
        raise UniAPError(f"{where}{name}={short(value)} must be true or false")
    return value


def choice(value: Any, name: str, options: Iterable[Any], *, where: str = "") -> Any:
    """One of ``options`` (compared as given: ``"1f1b"`` is not ``1``; lists and dicts are refused, not hashed)."""
    options = list(options)
    if isinstance(value, (list, dict, set)) or not any(value == o and type(value) is type(o) for o in options):
        raise UniAPError(f"{where}{name}={short(value)} must be one of {', '.join(map(repr, options))}")
    return value


def text(value: Any, name: str, *, where: str = "", empty: bool = True) -> str:
    """A string (non-empty unless ``empty``)."""
    if not isinstance(value, str) or (not empty and not value):
        raise UniAPError(f"{where}{name}={short(value)} must be a {'' if empty else 'non-empty '}string")
    return value
