"""A cluster's links: the measured bandwidth and collective tables, their checks, and how a group size reads them.

:class:`~uniap_lightning.planner.cluster.Cluster` prices a collective from these tables (its own, else the
all-reduce's, else the flat figures); this module holds what the tables may contain and the interpolation, so
that the cluster file's reader (:mod:`.cluster_read`) and the cluster share one definition of a group size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.fields import short

#: the most devices a cluster may have (planning enumerates the divisors of the device count), so also the largest
#: group size a table may name
MAX_DEVICES = 1 << 24
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")
SCOPES = ("intra", "inter")

#: ``{op: {scope: {group_size: {"bw_gbps": GB/s, "latency_us": us}}}}``
CollectiveTables = dict[str, dict[str, dict[int, dict[str, float]]]]


def group_size(p: Any) -> int | None:
    """A group size given as an int, an integral float or a string of digits (a JSON key); None otherwise."""
    if isinstance(p, bool):
        return None
    if isinstance(p, str) and p.strip().isdigit() and len(p.strip()) <= 10:
        p = int(p.strip())
    if isinstance(p, float) and p.is_integer():
        p = int(p)
    return p if isinstance(p, int) and 2 <= p <= MAX_DEVICES else None


def interpolate(table: dict[int, float], size: int) -> float:
    """Piecewise-linear in log2 of the group size through ``table``'s points, clamped at both ends."""
    pts = sorted(table.items())
    x = math.log2(max(size, 2))
    if x <= math.log2(pts[0][0]):
        return pts[0][1]
    for (p0, v0), (p1, v1) in zip(pts, pts[1:]):
        x0, x1 = math.log2(p0), math.log2(p1)
        if x <= x1:
            return v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def checked_bandwidth_tables(tables: Any, name: Any) -> dict[str, dict[int, float]]:
    """``{"intra"|"inter": {group_size: GB/s}}`` with real numbers (group sizes may be strings of digits: JSON
    object keys are strings); a string or boolean where a figure belongs is refused, not converted."""
    where = f"cluster '{name}': bandwidth_tables"
    if not isinstance(tables, Mapping):
        raise UniAPError(f"{where} must be a mapping {{intra|inter: {{group_size: GB/s}}}}, got {short(tables)}")
    out: dict[str, dict[int, float]] = {}
    for scope, table in tables.items():
        if not isinstance(table, Mapping):
            raise UniAPError(f"{where}.{scope} must be a mapping {{group_size: GB/s}}, got {short(table)}")
        rows: dict[int, float] = {}
        for p, bw in table.items():
            size = group_size(p)
            if size is None:
                raise UniAPError(f"{where}.{scope}: group sizes must be integers >= 2, got {short(p)}")
            if isinstance(bw, bool) or not isinstance(bw, (int, float)):
                raise UniAPError(f"{where}.{scope}[{size}] must be a number (GB/s), got {short(bw)}")
            rows[size] = float(bw)
        out[str(scope)] = rows
    return out


def check_bandwidth_figures(tables: Mapping[str, Mapping[Any, Any]], name: str) -> None:
    """Scopes are ``intra`` / ``inter``, group sizes >= 2, bandwidths > 0 (a cluster built in code, not read)."""
    for scope, table in tables.items():
        if scope not in SCOPES:
            raise UniAPError(f"cluster '{name}': bandwidth_tables keys must be 'intra'/'inter', got {scope!r}")
        for p, bw in table.items():
            if int(p) < 2 or not bw > 0:
                raise UniAPError(f"cluster '{name}': bandwidth_tables.{scope}[{p}]={bw}: group sizes >= 2, GB/s > 0")


def checked_collective_tables(tables: Any, name: str) -> CollectiveTables:
    """The validated, normalized copy of ``collective_tables`` (int group sizes, float figures; empty ops dropped)."""
    where = f"cluster '{name}': collective_tables"
    if not isinstance(tables, Mapping):
        raise UniAPError(f"{where} must be a mapping {{op: {{scope: {{group_size: {{bw_gbps, latency_us}}}}}}}}, "
                         f"got {type(tables).__name__}")
    out: CollectiveTables = {}
    for op, scopes in tables.items():
        if op not in COLLECTIVE_OPS:
            raise UniAPError(f"{where}: unknown op {op!r}; known ops: {list(COLLECTIVE_OPS)}")
        if not isinstance(scopes, Mapping):
            raise UniAPError(f"{where}.{op} must be a mapping of 'intra'/'inter' to tables, got {scopes!r}")
        out[op] = {}
        for scope, table in scopes.items():
            if scope not in SCOPES:
                raise UniAPError(f"{where}.{op} keys must be 'intra'/'inter', got {scope!r}")
            if not isinstance(table, Mapping):
                raise UniAPError(f"{where}.{op}.{scope} must be a mapping {{group_size: {{bw_gbps, latency_us}}}}, "
                                 f"got {table!r}")
            rows = _collective_rows(table, f"{where}.{op}.{scope}")
            if rows:
                out[op][scope] = rows
        if not out[op]:
            del out[op]
    return out


def _collective_rows(table: Mapping[Any, Any], where: str) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for p, rec in table.items():
        size = group_size(p)
        if size is None:
            raise UniAPError(f"{where}: group sizes must be integers >= 2, got {short(p)}")
        if not isinstance(rec, Mapping) or set(rec) != {"bw_gbps", "latency_us"}:
            raise UniAPError(f"{where}[{size}] must be {{bw_gbps: GB/s, latency_us: us}}, got {rec!r}")
        bw, lat = rec["bw_gbps"], rec["latency_us"]
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
            raise UniAPError(f"{where}[{size}].bw_gbps must be > 0, got {bw!r}")
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not math.isfinite(lat) or lat < 0:
            raise UniAPError(f"{where}[{size}].latency_us must be >= 0, got {lat!r}")
        if size in rows:
            raise UniAPError(f"{where}: group size {size} given twice")
        rows[size] = {"bw_gbps": float(bw), "latency_us": float(lat)}
    return rows
