"""A planning problem: a model profile, a cluster and the training settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import COMPRESSION_DEFAULTS, COMPRESSIONS, SCHEDULES, Plan, check_compression_options
from uniap_lightning.planner.profile import ModelProfile


@dataclass(frozen=True)
class TrainingConfig:
    """Training settings the plan depends on.

    ``microbatches``: candidate micro-batch counts ``c`` (``None``: every divisor of the global batch up to
    ``max_microbatches``). Memory per parameter is ``weight_bytes + grad_bytes + optimizer_bytes`` (e.g. fp32 Adam:
    4 + 4 + 8; bf16 mixed precision with fp32 master weights and Adam: 2 + 2 + 12).
    """

    global_batch_size: int
    microbatches: tuple[int, ...] | None = None
    max_microbatches: int = 64
    schedule: str = "1f1b"
    weight_bytes: float = 4.0
    grad_bytes: float = 4.0
    optimizer_bytes: float = 8.0

    def __post_init__(self) -> None:
        b = self.global_batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise UniAPError(f"batch_size (global_batch_size) must be a positive integer, got {b!r}")
        if self.schedule not in SCHEDULES:
            raise UniAPError(f"schedule={self.schedule!r} must be one of {list(SCHEDULES)}")
        for key in ("weight_bytes", "grad_bytes", "optimizer_bytes"):
            if getattr(self, key) < 0:
                raise UniAPError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.microbatches is not None:
            bad = [c for c in self.microbatches if not isinstance(c, int) or c < 1 or b % c]
            if bad or not self.microbatches:
                raise UniAPError(
                    f"microbatches={list(self.microbatches)}: each candidate must be a positive integer dividing "
                    f"batch_size={b} (bad: {bad}); divisors of {b}: {divisors(b)}"
                )

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    def microbatch_candidates(self) -> list[int]:
        if self.microbatches is not None:
            return sorted(set(self.microbatches))
        return [c for c in divisors(self.global_batch_size) if c <= self.max_microbatches]


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order, in O(sqrt n): a batch size of 10**12 must not mean 10**12 trials."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass
class Problem:
    """Everything the cost model and the solver need.

    ``compression``: the gradient compression methods the solver may choose per replicated / ZeRO-1 layer besides
    ``"none"`` (opt-in: they change numerics); ``compression_options`` their parameters (``powersgd_rank``,
    ``topk_ratio``), stamped into every plan.
    """

    model: ModelProfile
    cluster: Cluster
    training: TrainingConfig
    meta: dict[str, Any] = field(default_factory=dict)
    compression: tuple[str, ...] = ("none",)
    compression_options: dict[str, float] = field(default_factory=lambda: dict(COMPRESSION_DEFAULTS))

    def __post_init__(self) -> None:
        self.compression = compression_methods(self.compression)
        self.compression_options = {**COMPRESSION_DEFAULTS, **dict(self.compression_options)}
        check_compression_options(self.compression_options, "compression_options")

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices

    def pp_candidates(self) -> list[int]:
        """Pipeline degrees whose stages tile nodes sensibly: ``n = N/pp`` divides or is a multiple of a node."""
        N, dpn, L = self.num_devices, self.cluster.devices_per_node, self.model.num_layers
        out = []
        for pp in divisors(N):
            n = N // pp
            if pp <= L and (dpn % n == 0 or n % dpn == 0):
                out.append(pp)
        if not out:
            raise UniAPError(
                f"no pipeline degree fits: {N} devices ({self.cluster.nodes} nodes x {dpn}) and {L} layers; "
                "a pipeline degree must divide the device count, leave at most one stage per layer, and give "
                "stages that divide a node or span whole nodes"
            )
        return out

    def plan_for(self, *, stage_of_layer: list[int], strategies: list, pp: int, microbatches: int) -> Plan:
        """A plan of this problem (its model, cluster, batch, schedule and compression options) from a stage and a
        strategy per layer (``(dp, tp, shard)`` or ``(dp, tp, dp_mode, recompute, compression)``): the one place
        the solver, the baselines and the tests stamp a plan's identity."""
        return Plan.from_assignment(
            stage_of_layer=stage_of_layer,
            strategies=[tuple(s) for s in strategies],
            layer_names=[lp.name for lp in self.model.layers],
            pp=pp,
            microbatches=microbatches,
            schedule=self.training.schedule,
            global_batch_size=self.training.global_batch_size,
            num_devices=self.num_devices,
            model=self.model.model,
            cluster=self.cluster.name,
            model_fingerprint=self.model.fingerprint(),
            compression_options=dict(self.compression_options),
        )


def compression_methods(value: Any) -> tuple[str, ...]:
    """The allowed compression methods as a tuple that always holds ``"none"``: from None / "none" (off), one
    method name, "auto" (every method), or a list of names. Refuses anything else, naming the field."""
    if value is None:
        return ("none",)
    if isinstance(value, str):
        value = list(COMPRESSIONS) if value == "auto" else [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise UniAPError(f"compression={value!r} must be None, 'auto', one of {list(COMPRESSIONS)} or a list of them")
    bad = [v for v in value if v not in COMPRESSIONS]
    if bad:
        raise UniAPError(f"compression: unknown method(s) {bad}; known: {list(COMPRESSIONS)} (or 'auto')")
    return tuple(m for m in COMPRESSIONS if m == "none" or m in value)
