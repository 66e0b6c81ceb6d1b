"""Cluster descriptions: shape, memory, compute and links (units in the field names)."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.fields import short

GIB = 1024**3
#: the most devices a cluster may have (planning enumerates the divisors of the device count)
MAX_DEVICES = 1 << 24
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")
SCOPES = ("intra", "inter")
#: Analytic cost of compressing and decompressing one gradient element where the cluster has no measured figure,
#: in FLOP-times of the device (``seconds per element = value / flops_per_s``). These passes are memory-bound: an
#: accelerator does ~100-150 FLOPs in the time it moves one byte (H100: ~400 TFLOP/s used, 3.35 TB/s). bf16 reads
#: and writes ~12 bytes per element (cast down and back): ~1500; PowerSGD (per unit of rank) reads the gradient for
#: two thin matmuls and updates the error-feedback buffer, ~16 bytes: ~2000; top-k's selection is a partial sort,
#: measured ~10x a streaming pass: ~15000.
COMPRESSION_FLOP_EQUIVALENTS = {"bf16": 1500.0, "powersgd": 2000.0, "topk": 15000.0}
#: what a cluster's ``offload`` accepts: "off" (no layer offloads), "auto" (the planner chooses per layer)
OFFLOAD_CHOICES = ("off", "auto")


@dataclass(frozen=True, eq=False)  # identity hash: cost caches key on the object
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices.

    Bandwidths are bytes-per-second figures in GB/s (1e9 bytes/s) as seen by one device in a ring collective
    (bus bandwidth). ``bandwidth_tables`` optionally maps ``"intra"`` / ``"inter"`` to ``{group_size: GB/s}``
    measured tables that replace the flat figures (interpolated in log2 of the group size, clamped at the ends).

    ``collective_tables`` optionally prices each collective with its own measured figures:
    ``{op: {"intra"|"inter": {group_size: {"bw_gbps": GB/s, "latency_us": us}}}}`` with ``op`` in
    :data:`COLLECTIVE_OPS` (``p2p`` is read at group size 2). Bandwidth and latency are interpolated like
    ``bandwidth_tables``. Where an op has no table for a scope, it is priced as before this table existed, with the
    all-reduce figures: ``collective_tables["all_reduce"]`` for that scope if present, else ``bandwidth_tables``
    and the flat latency, else the flat figures.

    Heterogeneous clusters: ``rank_speed`` (relative compute speed per global rank, 1.0 = the speed the profile's
    compute times were measured or derived at; 0.5 = twice as slow) and ``rank_memory_gib`` (per-rank memory) say
    where devices differ; ``rank_device`` names each rank's device kind (for the plan printout). In YAML, either
    list them per rank or give ``device_groups: [{name, count, memory_gib, speed}, ...]`` in rank order (counts
    summing to ``nodes * devices_per_node``). A pipeline stage's compute time follows the slowest device among its
    ranks and its memory limit the smallest (:meth:`stage_speed`, :meth:`stage_memory_bytes`); ``memory_gib`` and
    ``peak_tflops`` stay the reference device's. A running job's measured speeds enter through
    :meth:`with_rank_speed`.
    """

    name: str
    nodes: int
    devices_per_node: int
    memory_gib: float
    peak_tflops: float
    efficiency: float = 0.5
    intra_bw_gbps: float = 100.0
    inter_bw_gbps: float = 12.5
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    memory_reserved_gib: float = 0.0
    #: fixed cost of one pipeline slot (one micro-batch's forward + backward on one stage) beyond its compute and
    #: transfers: the schedule's bookkeeping and point-to-point handshakes (measured: ``measure_pipeline_slot``)
    pipeline_overhead_us: float = 0.0
    #: one optimizer step's time per parameter it updates (Adam-style: reads and writes weights, gradients and two
    #: moments), charged per iteration on the parameters each rank holds (measured: ``measure_optimizer_step``)
    optimizer_ns_per_param: float = 0.0
    #: and its fixed cost per parameter tensor (kernel launches, per-tensor bookkeeping: what small layers pay)
    optimizer_us_per_tensor: float = 0.0
    #: gradient compression compute (compress + decompress) in ns per gradient element, per method ("bf16",
    #: "powersgd" (per element and unit of rank), "topk"); methods not given use the analytic default
    #: (:data:`COMPRESSION_FLOP_EQUIVALENTS`); measured at setup (``profiling.collectives.measure_compression``)
    compression_ns_per_param: dict[str, float] = field(default_factory=dict)
    device: str = ""
    #: whether the planner may choose ring attention (the runtime's own, :mod:`uniap_lightning.runtime.ring`, runs on
    #: any device; a cluster file may turn it off); Ulysses runs anywhere
    ring_attention: bool = True
    rank_speed: tuple[float, ...] | None = None
    rank_memory_gib: tuple[float, ...] | None = None
    rank_device: tuple[str, ...] | None = None
    bandwidth_tables: dict[str, dict[int, float]] = field(default_factory=dict)
    collective_tables: dict[str, dict[str, dict[int, dict[str, float]]]] = field(default_factory=dict)
    #: how analytic layer profiles are timed: ``"flat"`` (FLOPs / (peak_tflops x efficiency)) or ``"roofline"``
    #: (each operation on the catalogue device ``device`` names: :mod:`uniap_lightning.profiling.roofline`). A
    #: cluster file that names a catalogue device and gives no peak_tflops / efficiency gets ``"roofline"``.
    compute_model: str = "flat"
    #: the roofline model's least time of one eager operation on this cluster's hosts (dispatch, autograd, launch):
    #: what a small micro-batch is bound by. The default is a fast x86 host's eager PyTorch; a software stack with
    #: more Python per operation (or a slower host CPU) has more: measure it there and set it
    kernel_floor_us: float = 10.0
    #: device <-> host memory, one direction, effective GB/s (what pinned-memory copies reach): the catalogue
    #: device's link x :data:`~uniap_lightning.planner.devices.HOST_LINK_EFFICIENCY` unless the cluster gives its
    #: own; 0: none known (no activation offload is offered)
    host_link_gbps: float = 0.0
    #: whether the planner may offload a layer's activations to host memory (opt-in, like compression): "off"
    #: (default) or "auto" (per layer, where it pays; :mod:`uniap_lightning.planner.dimensions.offload`)
    offload: str = "off"
    #: GPU memory of one NCCL communicator a rank uses (its buffers, GiB): a layer's tensor-, data-, context- and
    #: expert-parallel groups, the world group and a pipeline stage's two send/recv pairs each hold one set on every
    #: rank (:mod:`uniap_lightning.planner.cost.buffers`). The catalogue device's
    #: :data:`~uniap_lightning.planner.devices.NCCL_COMMUNICATOR_GIB` where the file names one and is silent; 0
    #: where it names none (a CPU cluster runs gloo; a file of its own figures may give its own)
    nccl_comm_gib: float = 0.0

    def __post_init__(self) -> None:
        for key in ("nodes", "devices_per_node"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UniAPError(f"cluster '{self.name}': {key} must be a positive integer, got {short(v)}")
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise UniAPError(f"cluster '{self.name}': nodes * devices_per_node = {short(self.nodes * self.devices_per_node)}"
                             f" devices; at most {MAX_DEVICES:,} are planned for")
        if not isinstance(self.name, str):
            raise UniAPError(f"cluster name must be a string, got {short(self.name)}")
        if not isinstance(self.ring_attention, bool):
            raise UniAPError(f"cluster '{self.name}': ring_attention must be true or false, got {short(self.ring_attention)}")
        if not isinstance(self.device, str):
            raise UniAPError(f"cluster '{self.name}': device must be a string (the device's name), got {short(self.device)}")
        if self.compute_model not in COMPUTE_MODELS:
            raise UniAPError(f"cluster '{self.name}': compute_model must be one of {list(COMPUTE_MODELS)}, got "
                             f"{short(self.compute_model)}")
        if self.compute_model == "roofline" and self.device_spec is None:
            from uniap_lightning.planner.devices import available_devices

            raise UniAPError(f"cluster '{self.name}': compute_model 'roofline' needs device to name a catalogue "
                             f"device ({', '.join(available_devices())}), got {short(self.device)}")
        for key in ("memory_gib", "peak_tflops", "efficiency", "intra_bw_gbps", "inter_bw_gbps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise UniAPError(f"cluster '{self.name}': {key} must be > 0, got {v!r}")
        if self.offload not in OFFLOAD_CHOICES:
            raise UniAPError(f"cluster '{self.name}': offload must be one of {list(OFFLOAD_CHOICES)} ('auto': the "
                             f"planner may offload activations to host memory per layer), got {short(self.offload)}")
        for key in ("intra_latency_us", "inter_latency_us", "memory_reserved_gib", "pipeline_overhead_us",
                    "optimizer_ns_per_param", "optimizer_us_per_tensor", "kernel_floor_us", "host_link_gbps",
                    "nccl_comm_gib"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UniAPError(f"cluster '{self.name}': {key} must be >= 0, got {v!r}")
        if self.efficiency > 1:
            raise UniAPError(f"cluster '{self.name}': efficiency must be in (0, 1], got {self.efficiency}")
        if self.memory_reserved_gib >= self.memory_gib:
            raise UniAPError(
                f"cluster '{self.name}': memory_reserved_gib={self.memory_reserved_gib} leaves no memory of "
                f"memory_gib={self.memory_gib}"
            )
        for scope, table in self.bandwidth_tables.items():
            if scope not in ("intra", "inter"):
                raise UniAPError(f"cluster '{self.name}': bandwidth_tables keys must be 'intra'/'inter', got {scope!r}")
            for p, bw in table.items():
                if int(p) < 2 or not bw > 0:
                    raise UniAPError(
                        f"cluster '{self.name}': bandwidth_tables.{scope}[{p}]={bw}: group sizes >= 2, GB/s > 0"
                    )
        self._check_ranks()
        object.__setattr__(self, "compression_ns_per_param", self._checked_compression(self.compression_ns_per_param))
        # frozen: the validated, normalized copy (int group sizes, float figures) replaces the given one
        object.__setattr__(self, "collective_tables", self._checked_collective_tables(self.collective_tables))

    def _check_ranks(self) -> None:
        n = self.nodes * self.devices_per_node
        for key in ("rank_speed", "rank_memory_gib", "rank_device"):
            v = getattr(self, key)
            if v is None:
                continue
            if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__len__"):
                raise UniAPError(f"cluster '{self.name}': {key} must be a list with one entry per rank, got {v!r}")
            v = tuple(v)
            if len(v) != n:
                raise UniAPError(f"cluster '{self.name}': {key} lists {len(v)} ranks but the cluster has "
                                 f"nodes * devices_per_node = {n}")
            if key == "rank_device":
                bad = next((x for x in v if not isinstance(x, str)), None)
                if bad is not None:
                    raise UniAPError(f"cluster '{self.name}': rank_device entries must be strings, got {short(bad)}")
                object.__setattr__(self, key, v)
                continue
            for r, x in enumerate(v):
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
                    raise UniAPError(f"cluster '{self.name}': {key}[{r}] must be a number > 0, got {x!r}")
                if key == "rank_memory_gib" and x <= self.memory_reserved_gib:
                    raise UniAPError(f"cluster '{self.name}': rank_memory_gib[{r}]={x} leaves no memory after "
                                     f"memory_reserved_gib={self.memory_reserved_gib}")
            object.__setattr__(self, key, tuple(float(x) for x in v))

    @property
    def heterogeneous(self) -> bool:
        """Some rank's speed or memory differs from the reference device's."""
        return any(x != 1.0 for x in self.rank_speed or ()) or any(
            x != self.memory_gib for x in self.rank_memory_gib or ())

    def stage_speed(self, ranks: range | tuple[int, ...]) -> float:
        """Relative compute speed of a stage on ``ranks``: its slowest device's."""
        return min(self.rank_speed[r] for r in ranks) if self.rank_speed else 1.0

    def stage_memory_bytes(self, ranks: range | tuple[int, ...]) -> float:
        """Usable memory per device of a stage on ``ranks``: its smallest device's."""
        if not self.rank_memory_gib:
            return self.memory_bytes
        return (min(self.rank_memory_gib[r] for r in ranks) - self.memory_reserved_gib) * GIB

    @property
    def fastest_speed(self) -> float:
        return max(self.rank_speed) if self.rank_speed else 1.0

    @property
    def largest_memory_bytes(self) -> float:
        """The most memory any one device has (lower bounds on memory compare against it)."""
        if not self.rank_memory_gib:
            return self.memory_bytes
        return (max(self.rank_memory_gib) - self.memory_reserved_gib) * GIB

    def stage_device(self, ranks: range | tuple[int, ...]) -> str:
        """The device kind(s) of ``ranks`` ("A100-80GB", or "A100-80GB+V100-32GB" for a mixed stage)."""
        if not self.rank_device:
            return self.device
        return "+".join(dict.fromkeys(self.rank_device[r] for r in ranks))

    def with_rank_speed(self, speeds: Any) -> Cluster:
        """A copy with these per-rank relative speeds (e.g. measured in a running job)."""
        from dataclasses import replace

        return replace(self, rank_speed=tuple(float(x) for x in speeds))

    def _checked_compression(self, figures: Any) -> dict[str, float]:
        where = f"cluster '{self.name}': compression_ns_per_param"
        if not isinstance(figures, Mapping):
            raise UniAPError(f"{where} must be a mapping {{method: ns per element}} with methods "
                             f"{list(COMPRESSION_FLOP_EQUIVALENTS)}, got {type(figures).__name__}")
        out = {}
        for method, v in figures.items():
            if method not in COMPRESSION_FLOP_EQUIVALENTS:
                raise UniAPError(f"{where}: unknown method {method!r}; known: {list(COMPRESSION_FLOP_EQUIVALENTS)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UniAPError(f"{where}.{method} must be a number >= 0 (ns per element), got {v!r}")
            out[method] = float(v)
        return out

    def compression_s_per_param(self, method: str) -> float:
        """Seconds to compress and decompress one gradient element with ``method`` (PowerSGD: per unit of rank):
        the measured figure, else the analytic default."""
        if method in self.compression_ns_per_param:
            return self.compression_ns_per_param[method] * 1e-9
        return COMPRESSION_FLOP_EQUIVALENTS[method] / self.flops_per_s

    def _checked_collective_tables(self, tables: Any) -> dict[str, dict[str, dict[int, dict[str, float]]]]:
        where = f"cluster '{self.name}': collective_tables"
        if not isinstance(tables, Mapping):
            raise UniAPError(f"{where} must be a mapping {{op: {{scope: {{group_size: {{bw_gbps, latency_us}}}}}}}}, "
                             f"got {type(tables).__name__}")
        out: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
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
                rows: dict[int, dict[str, float]] = {}
                for p, rec in table.items():
                    size = _group_size(p)
                    if size is None:
                        raise UniAPError(f"{where}.{op}.{scope}: group sizes must be integers >= 2, got {short(p)}")
                    if not isinstance(rec, Mapping) or set(rec) != {"bw_gbps", "latency_us"}:
                        raise UniAPError(
                            f"{where}.{op}.{scope}[{size}] must be {{bw_gbps: GB/s, latency_us: us}}, got {rec!r}"
                        )
                    bw, lat = rec["bw_gbps"], rec["latency_us"]
                    if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
                        raise UniAPError(f"{where}.{op}.{scope}[{size}].bw_gbps must be > 0, got {bw!r}")
                    if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not math.isfinite(lat) or lat < 0:
                        raise UniAPError(f"{where}.{op}.{scope}[{size}].latency_us must be >= 0, got {lat!r}")
                    if size in rows:
                        raise UniAPError(f"{where}.{op}.{scope}: group size {size} given twice")
                    rows[size] = {"bw_gbps": float(bw), "latency_us": float(lat)}
                if rows:
                    out[op][scope] = rows
            if not out[op]:
                del out[op]
        return out

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> float:
        """Usable memory per device."""
        return (self.memory_gib - self.memory_reserved_gib) * GIB

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency

    def _op_table(self, op: str, scope: str) -> dict[int, dict[str, float]] | None:
        """The measured table pricing ``op`` in ``scope``: its own, else all-reduce's, else None."""
        if op not in COLLECTIVE_OPS:
            raise UniAPError(f"unknown collective {op!r}; known: {list(COLLECTIVE_OPS)}")
        return self.collective_tables.get(op, {}).get(scope) or self.collective_tables.get("all_reduce", {}).get(scope)

    def measured_links(self, op: str, inter_node: bool) -> bool:
        """Whether ``op`` in that scope is priced from measurements (a collective or bandwidth table): they
        already hold whatever algorithm the library ran, so no other algorithm is priced beside them."""
        scope = "inter" if inter_node else "intra"
        return bool(self._op_table(op, scope) or self.bandwidth_tables.get(scope))

    def bandwidth_bytes_per_s(self, group_size: int, inter_node: bool, op: str = "all_reduce") -> float:
        """Bus bandwidth of ``op`` over ``group_size`` devices (bytes/s)."""
        scope = "inter" if inter_node else "intra"
        rows = self._op_table(op, scope)
        if rows:
            return _interpolate({p: r["bw_gbps"] for p, r in rows.items()}, group_size) * 1e9
        table = self.bandwidth_tables.get(scope)
        if table:
            return _interpolate({int(p): float(bw) for p, bw in table.items()}, group_size) * 1e9
        return (self.inter_bw_gbps if inter_node else self.intra_bw_gbps) * 1e9

    @property
    def pipeline_overhead_s(self) -> float:
        return self.pipeline_overhead_us * 1e-6

    @property
    def optimizer_s_per_param(self) -> float:
        return self.optimizer_ns_per_param * 1e-9

    @property
    def optimizer_s_per_tensor(self) -> float:
        return self.optimizer_us_per_tensor * 1e-6

    def latency_s(self, inter_node: bool, op: str = "all_reduce", group_size: int = 2) -> float:
        """Per-step latency (alpha) of ``op`` over ``group_size`` devices (seconds)."""
        rows = self._op_table(op, "inter" if inter_node else "intra")
        if rows:
            return _interpolate({p: r["latency_us"] for p, r in rows.items()}, group_size) * 1e-6
        return (self.inter_latency_us if inter_node else self.intra_latency_us) * 1e-6

    @property
    def device_spec(self) -> Any:
        """The catalogue entry ``device`` names (:class:`~uniap_lightning.planner.devices.DeviceSpec`), or None."""
        from uniap_lightning.planner.devices import lookup_device

        return lookup_device(self.device)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        if not isinstance(d, Mapping):
            raise UniAPError(f"a cluster description must be a mapping of fields, got {type(d).__name__}")
        try:
            return cls._from_mapping(d)
        except UniAPError:
            raise  # already says which field and why
        except (TypeError, ValueError, AttributeError, OverflowError) as err:
            raise UniAPError(f"cluster '{d.get('name', '?')}': a field has the wrong type or value ({err})") from err

    @classmethod
    def _from_mapping(cls, d: Mapping[str, Any]) -> Cluster:
        known = set(cls.__dataclass_fields__) | {"device_groups"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UniAPError(f"cluster config has unknown field(s) {unknown}; known fields: {sorted(known)}")
        d = dict(d)
        _check_device_name(d)
        if "device_groups" in d:
            d.update(_expand_device_groups(d.pop("device_groups"), d))
        d.update(_device_defaults(d))
        missing = [k for k in ("name", "nodes", "devices_per_node", "memory_gib", "peak_tflops") if k not in d]
        if missing:
            raise UniAPError(f"cluster config is missing field(s) {missing}" + (
                "; or name a catalogue device (device: <name>) that gives memory_gib and peak_tflops"
                if {"memory_gib", "peak_tflops"} & set(missing) else ""))
        for key in ("bandwidth_tables", "collective_tables", "compression_ns_per_param"):
            table = d.pop(key, None)  # absent or null: none; false, 0, "" or a list: a damaged file, refused
            if table is not None and not isinstance(table, Mapping):
                raise UniAPError(f"cluster '{d['name']}': {key} must be a mapping, got {short(table)}")
            d[key] = table or {}
        d["bandwidth_tables"] = _bandwidth_tables(d["bandwidth_tables"], d["name"])
        # (collective_tables: keys and figures normalized on construction)
        return cls(**d)


COMPUTE_MODELS = ("flat", "roofline")


def unknown_device_message(name: str) -> str:
    """``name`` is no catalogue device: the nearest entries (case and ``-``/``_`` ignored) and the whole list."""
    from uniap_lightning.planner.devices import available_devices

    names = available_devices()
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    # every word of the entry begins a word of the name ("H100-SXM5-80GB": h100_sxm), else the nearest spelling
    near = [n for n in names if all(any(w.startswith(part) for w in words) for part in n.split("_"))] or \
        difflib.get_close_matches("_".join(words), names, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    return f"{name!r} is no device of the catalogue (conf/device/); {hint}it has: {', '.join(names)}"


def _check_device_name(d: Mapping[str, Any]) -> None:
    """A file's ``device`` names a catalogue entry, whose facts price the cluster. A device the catalogue lacks is
    a label only where the file says so: ``compute_model: flat`` with its own ``peak_tflops`` (and ``efficiency``,
    ``memory_gib``): a label alone would price every operation with flat defaults nobody chose."""
    from uniap_lightning.planner.devices import lookup_device

    name = d.get("device")
    if not isinstance(name, str) or not name.strip() or lookup_device(name) is not None:
        return  # no device (the file gives its own figures), a catalogue device, or a wrong type (checked later)
    if d.get("compute_model") == "flat":
        return
    raise UniAPError(f"cluster '{d.get('name', '?')}': device {unknown_device_message(name)}. For a device the "
                     f"catalogue lacks, add conf/device/<name>.yaml, or keep the name as a label with "
                     f"compute_model: flat and the device's own peak_tflops, efficiency and memory_gib")


def _device_defaults(d: Mapping[str, Any]) -> dict[str, Any]:
    """What a catalogue device fills in where the cluster file is silent: memory, the framework's reserve, a
    reference peak (bf16, else fp32), the optimizer step's memory traffic, the host link (effective), and the
    roofline compute model when the
    file gives neither peak_tflops nor efficiency (a user who measured them keeps the flat model)."""
    from uniap_lightning.planner.devices import (HOST_LINK_EFFICIENCY, MEMORY_EFFICIENCY, NCCL_COMMUNICATOR_GIB,
                                                 lookup_device)

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


def _bandwidth_tables(tables: Any, name: Any) -> dict[str, dict[int, float]]:
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
            size = _group_size(p)
            if size is None:
                raise UniAPError(f"{where}.{scope}: group sizes must be integers >= 2, got {short(p)}")
            if isinstance(bw, bool) or not isinstance(bw, (int, float)):
                raise UniAPError(f"{where}.{scope}[{size}] must be a number (GB/s), got {short(bw)}")
            rows[size] = float(bw)
        out[str(scope)] = rows
    return out


def _group_size(p: Any) -> int | None:
    """A group size given as an int, an integral float or a string of digits (a JSON key); None otherwise."""
    if isinstance(p, bool):
        return None
    if isinstance(p, str) and p.strip().isdigit() and len(p.strip()) <= 10:
        p = int(p.strip())
    if isinstance(p, float) and p.is_integer():
        p = int(p)
    return p if isinstance(p, int) and 2 <= p <= MAX_DEVICES else None


def _expand_device_groups(groups: Any, d: Mapping[str, Any]) -> dict[str, Any]:
    """``device_groups`` (in rank order) -> per-rank ``rank_speed``, ``rank_memory_gib``, ``rank_device``; the
    reference ``memory_gib`` defaults to the first group's, ``device`` to its name."""
    where = f"cluster '{d.get('name', '?')}': device_groups"
    if not isinstance(groups, (list, tuple)) or not groups:
        raise UniAPError(f"{where} must be a non-empty list of {{name, count, memory_gib, speed}}")
    from uniap_lightning.planner.devices import lookup_device

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


def _interpolate(table: dict[int, float], group_size: int) -> float:
    """Piecewise-linear in log2 of the group size through ``table``'s points, clamped at both ends."""
    pts = sorted(table.items())
    x = math.log2(max(group_size, 2))
    if x <= math.log2(pts[0][0]):
        return pts[0][1]
    for (p0, v0), (p1, v1) in zip(pts, pts[1:]):
        x0, x1 = math.log2(p0), math.log2(p1)
        if x <= x1:
            return v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    return pts[-1][1]
