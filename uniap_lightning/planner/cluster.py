"""Cluster descriptions: shape, memory, compute and links (units in the field names).

The :class:`Cluster` dataclass and the checks of its fields live here; reading a cluster file (the catalogue
device's facts, ``device_groups``) is :mod:`.cluster_read`, the measured link tables and their interpolation
:mod:`.cluster_links`. Their public names are re-exported: ``from uniap_lightning.planner.cluster import ...``
keeps working for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster_links import (  # noqa: F401 - re-exported
    COLLECTIVE_OPS, MAX_DEVICES, SCOPES, check_bandwidth_figures, checked_collective_tables, interpolate)
from uniap_lightning.planner.cluster_read import cluster_fields, unknown_device_message  # noqa: F401 - re-exported
from uniap_lightning.planner.devices import available_devices, lookup_device
from uniap_lightning.planner.fields import short

GIB = 1024**3
#: Analytic cost of compressing and decompressing one gradient element where the cluster has no measured figure,
#: in FLOP-times of the device (``seconds per element = value / flops_per_s``). These passes are memory-bound: an
#: accelerator does ~100-150 FLOPs in the time it moves one byte (H100: ~400 TFLOP/s used, 3.35 TB/s). bf16 reads
#: and writes ~12 bytes per element (cast down and back): ~1500; PowerSGD (per unit of rank) reads the gradient for
#: two thin matmuls and updates the error-feedback buffer, ~16 bytes: ~2000; top-k's selection is a partial sort,
#: measured ~10x a streaming pass: ~15000.
COMPRESSION_FLOP_EQUIVALENTS = {"bf16": 1500.0, "powersgd": 2000.0, "topk": 15000.0}
#: what a cluster's ``offload`` accepts: "off" (no layer offloads), "auto" (the planner chooses per layer)
OFFLOAD_CHOICES = ("off", "auto")
#: how analytic layer profiles are timed (:attr:`Cluster.compute_model`)
COMPUTE_MODELS = ("flat", "roofline")


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
        check_bandwidth_figures(self.bandwidth_tables, self.name)
        self._check_ranks()
        object.__setattr__(self, "compression_ns_per_param", self._checked_compression(self.compression_ns_per_param))
        # frozen: the validated, normalized copy (int group sizes, float figures) replaces the given one
        object.__setattr__(self, "collective_tables", checked_collective_tables(self.collective_tables, self.name))

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
            return interpolate({p: r["bw_gbps"] for p, r in rows.items()}, group_size) * 1e9
        table = self.bandwidth_tables.get(scope)
        if table:
            return interpolate({int(p): float(bw) for p, bw in table.items()}, group_size) * 1e9
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
            return interpolate({p: r["latency_us"] for p, r in rows.items()}, group_size) * 1e-6
        return (self.inter_latency_us if inter_node else self.intra_latency_us) * 1e-6

    @property
    def device_spec(self) -> Any:
        """The catalogue entry ``device`` names (:class:`~uniap_lightning.planner.devices.DeviceSpec`), or None."""
        return lookup_device(self.device)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        if not isinstance(d, Mapping):
            raise UniAPError(f"a cluster description must be a mapping of fields, got {type(d).__name__}")
        try:
            return cls(**cluster_fields(d, cls.__dataclass_fields__))
        except UniAPError:
            raise  # already says which field and why
        except (TypeError, ValueError, AttributeError, OverflowError) as err:
            raise UniAPError(f"cluster '{d.get('name', '?')}': a field has the wrong type or value ({err})") from err
