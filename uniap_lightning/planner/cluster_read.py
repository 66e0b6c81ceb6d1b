"""Reading a cluster description (a YAML file's mapping) into :class:`~uniap_lightning.planner.cluster.Cluster`'s
fields: unknown and missing fields refused, the catalogue device's facts (:mod:`.devices`) filled in where the
file is silent, ``device_groups`` expanded to per-rank lists, bandwidth tables normalized.

Kept apart from the dataclass: this is what a file may say and how it is merged with the catalogue; the dataclass
checks the fields it ends up with, however they were built (a file, code, a running job's measurements).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster_links import MAX_DEVICES, checked_bandwidth_tables
from uniap_lightning.planner.devices import (HOST_LINK_EFFICIENCY, MEMORY_EFFICIENCY, NCCL_COMMUNICATOR_GIB,
                                             available_devices, lookup_device)
from uniap_lightning.planner.fields import short

#: the fields a cluster file must give (or, for memory and peak, take from the catalogue device it names)
REQUIRED_FIELDS = ("name", "nodes", "devices_per_node", "memory_gib", "peak_tflops")


def cluster_fields(d: Mapping[str, Any], known: Iterable[str]) -> dict[str, Any]:
    """The keyword arguments of the cluster ``d`` describes; ``known``: the dataclass's field names."""
    known = set(known) | {"device_groups"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise UniAPError(f"cluster config has unknown field(s) {unknown}; known fields: {sorted(known)}")
    d = dict(d)
    check_device_name(d)
    if "device_groups" in d:
        d.update(expand_device_groups(d.pop("device_groups"), d))
    d.update(device_defaults(d))
    missing = [k for k in REQUIRED_FIELDS if k not in d]
    if missing:
        raise UniAPError(f"cluster config is missing field(s) {missing}" + (
            "; or name a catalogue device (device: <name>) that gives memory_gib and peak_tflops"
            if {"memory_gib", "peak_tflops"} & set(missing) else ""))
    for key in ("bandwidth_tables", "collective_tables", "compression_ns_per_param"):
        table = d.pop(key, None)  # absent or null: none; false, 0, "" or a list: a damaged file, refused
        if table is not None and not isinstance(table, Mapping):
            raise UniAPError(f"cluster '{d['name']}': {key} must be a mapping, got {short(table)}")
        d[key] = table or {}
    d["bandwidth_tables"] = checked_bandwidth_tables(d["bandwidth_tables"], d["name"])
    # (collective_tables: keys and figures normalized on construction)
    return d


def unknown_device_message(name: str) -> str:
    """``name`` is no catalogue device: the nearest entries (case and ``-``/``_`` ignored) and the whole list."""
    names = available_devices()
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    # every word of the entry begins a word of the name ("H100-SXM5-80GB": h100_sxm), else the nearest spelling
    near = [n for n in names if all(any(w.startswith(part) for w in words) for part in n.split("_"))] or \
        difflib.get_close_matches("_".join(words), names, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    return f"{name!r} is no device of the catalogue (conf/device/); {hint}it has: {', '.join(names)}"


def check_device_name(d: Mapping[str, Any]) -> None:
    """A file's ``device`` names a catalogue entry, whose facts price the cluster. A device the catalogue lacks is
    a label only where the file says so: ``compute_model: flat`` with its own ``peak_tflops`` (and ``efficiency``,
    ``memory_gib``): a label alone would price every operation with flat defaults nobody chose."""
    name = d.get("device")
    if not isinstance(name, str) or not name.strip() or lookup_device(name) is not None:
        return  # no device (the file gives its own figures), a catalogue device, or a wrong type (checked later)
    if d.get("compute_model") == "flat":
        return
    raise UniAPError(f"cluster '{d.get('name', '?')}': device {unknown_device_message(name)}. For a device the "
                     f"catalogue lacks, add conf/device/<name>.yaml, or keep the name as a label with "
                     f"compute_model: flat and the device's own peak_tflops, efficiency and memory_gib")


def device_defaults(d: Mapping[str, Any]) -> dict[str, Any]:
    """What a catalogue device fills in where the cluster file is silent: memory, the framework's reserve, a
    reference peak (bf16, else fp32), the optimizer step's memory traffic, the host link (effective), and the
    roofline compute model when the
    file gives neither peak_tflops nor efficiency (a user who measured them keeps the flat model)."""
    name = d.get("device")
    spec = lookup_device(name) if isinstance(name, str) else None
    if spec is None:
        return {}
    out: dict[str, Any] = {}
    if "compute_model" not in d:
        out["compute_model"] = "flat" if "peak_tflops" in d or "efficiency" in d else "roofline"
    out.setdefault("memory_gib", d.get("memory_gib", spec.memory_gib))
    out.setdefault("memory_reserved_gib", d.get("memory_reserved_gib", spec.framework_reserve_gib))
    peak = spec.peak("bf16") or spec.peak("fp32")
    out.setdefault("peak_tflops", d.get("peak_tflops", peak / 1e12))
    # Adam-style step: reads weights, gradients and two moments, writes three (28 bytes per fp32 parameter), at
    # the streaming share of the memory bandwidth (GB/s = bytes per ns)
    out.setdefault("optimizer_ns_per_param", d.get("optimizer_ns_per_param",
                                                   28.0 / (spec.hbm_gbps * MEMORY_EFFICIENCY)))
    out.setdefault("host_link_gbps", d.get("host_link_gbps", spec.host_link_gbps * HOST_LINK_EFFICIENCY))
    out.setdefault("nccl_comm_gib", d.get("nccl_comm_gib", NCCL_COMMUNICATOR_GIB))
    return out


def expand_device_groups(groups: Any, d: Mapping[str, Any]) -> dict[str, Any]:
    """``device_groups`` (in rank order) -> per-rank ``rank_speed``, ``rank_memory_gib``, ``rank_device``; the
    reference ``memory_gib`` defaults to the first group's, ``device`` to its name."""
    where = f"cluster '{d.get('name', '?')}': device_groups"
    if not isinstance(groups, (list, tuple)) or not groups:
        raise UniAPError(f"{where} must be a non-empty list of {{name, count, memory_gib, speed}}")
    speed: list[float] = []
    memory: list[float] = []
    kind: list[str] = []
    reference = None  # the first group's catalogue device: the speeds of the others are its datasheet ratios
    for j, g in enumerate(groups):
        spec = lookup_device(g.get("device")) if isinstance(g, Mapping) and isinstance(g.get("device"), str) else None
        if isinstance(g, Mapping) and spec is not None:  # a catalogue device fills memory and speed
            reference = reference or spec
            peak = lambda d: d.peak("bf16") or d.peak("fp32")  # noqa: E731
            g = {"memory_gib": spec.memory_gib, "speed": peak(spec) / peak(reference), "name": spec.name, **g}
            g.pop("device")
        elif isinstance(g, Mapping) and "device" in g:
            raise UniAPError(f"{where}[{j}].device must name a catalogue device: "
                             f"{unknown_device_message(str(g['device']))}")
        if not isinstance(g, Mapping) or not {"count", "memory_gib"} <= set(g) or set(g) - {"name", "count",
                                                                                                "memory_gib", "speed"}:
            raise UniAPError(f"{where}[{j}] must be {{name, count, memory_gib, speed (default 1.0)}} or {{device, "
                             f"count}} (a catalogue device), got {g!r}")
        count = g["count"]
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES:
            raise UniAPError(f"{where}[{j}].count must be a positive integer, got {count!r}")
        speed += [g.get("speed", 1.0)] * count
        memory += [g["memory_gib"]] * count
        name = g.get("name", f"group{j}")
        if not isinstance(name, str):
            raise UniAPError(f"{where}[{j}].name must be a string, got {short(name)}")
        kind += [name] * count
    out: dict[str, Any] = {"rank_speed": speed, "rank_memory_gib": memory, "rank_device": kind,
                           "memory_gib": d.get("memory_gib", memory[0])}
    if not d.get("device"):
        # the first group's catalogue device is the reference the profile is timed on (speeds are relative to it)
        out["device"] = reference.name if reference is not None else "+".join(dict.fromkeys(kind))
    return out
