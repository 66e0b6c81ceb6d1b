"""Cluster descriptions: shape, memory, compute and links (units in the field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from uniap_lightning.errors import UniAPError

GIB = 1024**3


@dataclass(frozen=True, eq=False)  # identity hash: cost caches key on the object
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices.

    Bandwidths are bytes-per-second figures in GB/s (1e9 bytes/s) as seen by one device in a ring collective
    (bus bandwidth). ``bandwidth_tables`` optionally maps ``"intra"`` / ``"inter"`` to ``{group_size: GB/s}``
    measured tables that replace the flat figures (interpolated in log2 of the group size, clamped at the ends).
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
    device: str = ""
    bandwidth_tables: dict[str, dict[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("nodes", "devices_per_node"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UniAPError(f"cluster '{self.name}': {key} must be a positive integer, got {v!r}")
        for key in ("memory_gib", "peak_tflops", "efficiency", "intra_bw_gbps", "inter_bw_gbps"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise UniAPError(f"cluster '{self.name}': {key} must be > 0, got {v!r}")
        for key in ("intra_latency_us", "inter_latency_us", "memory_reserved_gib"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
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

    def bandwidth_bytes_per_s(self, group_size: int, inter_node: bool) -> float:
        scope = "inter" if inter_node else "intra"
        table = self.bandwidth_tables.get(scope)
        if table:
            pts = sorted((int(p), float(bw)) for p, bw in table.items())
            x = math.log2(max(group_size, 2))
            if x <= math.log2(pts[0][0]):
                return pts[0][1] * 1e9
            for (p0, b0), (p1, b1) in zip(pts, pts[1:]):
                x0, x1 = math.log2(p0), math.log2(p1)
                if x <= x1:
                    return (b0 + (b1 - b0) * (x - x0) / (x1 - x0)) * 1e9
            return pts[-1][1] * 1e9
        return (self.inter_bw_gbps if inter_node else self.intra_bw_gbps) * 1e9

    def latency_s(self, inter_node: bool) -> float:
        return (self.inter_latency_us if inter_node else self.intra_latency_us) * 1e-6

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cluster:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise UniAPError(f"cluster config has unknown field(s) {unknown}; known fields: {sorted(known)}")
        missing = [k for k in ("name", "nodes", "devices_per_node", "memory_gib", "peak_tflops") if k not in d]
        if missing:
            raise UniAPError(f"cluster config is missing field(s) {missing}")
        d = dict(d)
        tables = d.pop("bandwidth_tables", None) or {}
        d["bandwidth_tables"] = {str(s): {int(p): float(b) for p, b in t.items()} for s, t in tables.items()}
        return cls(**d)
