"""A planning problem: a model profile, a cluster and the training settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions import opt_ins as allowed_opt_ins
from uniap_lightning.planner.dimensions.compression import compression_methods  # re-exported: the one check
from uniap_lightning.planner.plan import (COMPRESSION_DEFAULTS, COMPRESSIONS, SCHEDULE_LAYOUTS, SCHEDULES, Plan,
                                          check_compression_options)
from uniap_lightning.planner.profile import ModelProfile
# why torch cannot run a schedule with a shape (one line) or None (torch-free, below the cost model)
from uniap_lightning.planner.schedule_rules import unusable as schedule_unusable
from uniap_lightning.planner.search_options import (DEFAULT_SCHEDULE, MAX_VIRTUAL_STAGES, check_schedule_name,
                                                   check_virtual_stages)
from uniap_lightning.values import as_int, flag, integer, number, short


#: the largest global batch (samples per optimizer step) the planner takes: far above any real run (a 4M-token batch
#: of 128-token samples is 32,768), and small enough that enumerating its divisors stays instant
MAX_GLOBAL_BATCH_SIZE = 10**9
#: the most micro-batches one step may be split into
MAX_MICROBATCHES = 10**6
#: the most bytes per parameter for each of weights, gradients and optimizer state
MAX_BYTES_PER_PARAM = 1024


def adam_bytes(param_bytes: float) -> tuple[float, float, float]:
    """Bytes per parameter (weights, gradients, optimizer state) of Adam on parameters of ``param_bytes`` bytes:
    gradients in the parameters' dtype and two moments of the same size (what UniAPStrategy prices for the module
    it trains, whose dtype the precision plugin chose)."""
    return float(param_bytes), float(param_bytes), 2.0 * param_bytes


#: the one place of the bytes-per-parameter numbers (weights, gradients, optimizer state), by training:
#: ``fp32_adam`` is ``TrainingConfig``'s default and what UniAPStrategy prices for fp32 parameters (Lightning's
#: ``32-true`` and ``bf16-mixed`` both keep them); ``bf16_adam`` is bf16 weights and gradients with fp32 master
#: weights and moments (Megatron's mixed precision), what ``uniap plan`` plans for by default
#: (``conf/train/default.yaml``; each shipped ``conf/train`` file is one of these, checked by
#: ``tests/ecosystem/test_option_agreement.py``)
BYTES_PER_PARAM: dict[str, tuple[float, float, float]] = {"fp32_adam": adam_bytes(4.0), "bf16_adam": (2.0, 2.0, 12.0)}


@dataclass(frozen=True)
class TrainingConfig:
    """Training settings the plan depends on.

    ``global_batch_size``: samples per optimizer step, 1 to :data:`MAX_GLOBAL_BATCH_SIZE`.
    ``microbatches``: candidate micro-batch counts ``c`` (``None``: every divisor of the global batch up to
    ``max_microbatches``). Memory per parameter is ``weight_bytes + grad_bytes + optimizer_bytes`` (e.g. fp32 Adam:
    4 + 4 + 8; bf16 mixed precision with fp32 master weights and Adam: 2 + 2 + 12), each at most
    :data:`MAX_BYTES_PER_PARAM`. Integral floats (``32.0``) are taken as integers.
    """

    global_batch_size: int
    microbatches: tuple[int, ...] | None = None
    max_microbatches: int = 64
    #: a pipeline schedule (:data:`~uniap_lightning.planner.plan.SCHEDULES`) or "auto": the search chooses among
    #: every schedule torch runs, with ``virtual_stages`` (None: searched, 1 to ``max_virtual_stages``)
    schedule: str = DEFAULT_SCHEDULE
    virtual_stages: int | None = None
    max_virtual_stages: int = 4
    weight_bytes: float = BYTES_PER_PARAM["fp32_adam"][0]
    grad_bytes: float = BYTES_PER_PARAM["fp32_adam"][1]
    optimizer_bytes: float = BYTES_PER_PARAM["fp32_adam"][2]
    #: the runtime's pipeline hand-offs block both stages (GPipe / 1F1B only): each device group's time per
    #: micro-batch is its stages' time plus the hand-offs on both of its sides (``T >= sum p + o_in + o_out``), as
    #: DeepSpeed's PipelineEngine runs them: its p2p ``send``/``recv`` refuse ``async_op`` (deepspeed/runtime/pipe/
    #: p2p.py, ``assert async_op == False``) and its TrainSchedule issues them between the passes. False (torch's
    #: pipelining: batched ``isend``/``irecv`` on NCCL's stream): a hand-off only bounds ``T`` on its own
    blocking_handoffs: bool = False

    def __post_init__(self) -> None:
        b = as_int(self.global_batch_size)
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_GLOBAL_BATCH_SIZE:
            raise UniAPError(f"batch_size (global_batch_size) must be a positive integer up to "
                             f"{MAX_GLOBAL_BATCH_SIZE:,}, got {short(self.global_batch_size)}")
        object.__setattr__(self, "global_batch_size", b)  # frozen: the checked, normalized value
        object.__setattr__(self, "max_microbatches", integer(self.max_microbatches, "max_microbatches", low=1,
                                                             high=MAX_MICROBATCHES))
        check_schedule_name(self.schedule)  # the strategy's check too (planner.search_options)
        object.__setattr__(self, "max_virtual_stages", integer(self.max_virtual_stages, "max_virtual_stages", low=1,
                                                               high=MAX_VIRTUAL_STAGES))
        object.__setattr__(self, "virtual_stages", check_virtual_stages(self.virtual_stages, self.schedule))
        for key in ("weight_bytes", "grad_bytes", "optimizer_bytes"):
            number(getattr(self, key), key, low=0, high=MAX_BYTES_PER_PARAM, unit="bytes per parameter")
        flag(self.blocking_handoffs, "blocking_handoffs")  # "no" would read as true
        if self.microbatches is not None:
            object.__setattr__(self, "microbatches", self._checked_microbatches(b))

    def _checked_microbatches(self, b: int) -> tuple[int, ...]:
        given = self.microbatches if isinstance(self.microbatches, (list, tuple)) else (self.microbatches,)
        counts = tuple(as_int(c) for c in given)
        bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, int) or c < 1 or b % c]
        if bad or not counts:
            usable = [d for d in divisors(b) if d <= self.max_microbatches]
            listed = lambda values: "[" + ", ".join(map(short, values)) + "]"  # noqa: E731
            raise UniAPError(
                f"microbatches={listed(given)}: each candidate must be a positive integer dividing batch_size={b} "
                f"(bad: {listed(bad)}); divisors of {b} up to max_microbatches={self.max_microbatches}: {usable}"
            )
        return counts

    @property
    def concrete_schedule(self) -> str:
        """The schedule of plans built with one stage per device group and no search over schedules (the
        baselines, a table's starting point): the pinned schedule where it runs with ``virtual_stages = 1``, else
        1F1B (``auto``, and the multi-chunk schedules, whose plans the search builds with their own ``v``)."""
        if self.schedule == "auto" or SCHEDULE_LAYOUTS[self.schedule][1] != "1":
            return "1f1b"
        return self.schedule

    def schedule_candidates(self, pp: int, c: int, num_layers: int) -> list[tuple[str, int]]:
        """The ``(schedule, virtual_stages)`` pairs the search prices for ``pp`` device groups and ``c``
        micro-batches: the pinned schedule, or under "auto" every schedule but GPipe (1F1B holds fewer
        activations for the same time) whose torch class runs this shape (:func:`schedule_unusable`), each
        with every allowed ``v`` up to ``max_virtual_stages`` and one layer per stage at least."""
        if pp == 1:  # one stage: nothing to schedule
            pinned = self.schedule if self.schedule != "auto" else "1f1b"
            return [(pinned, 1)] if SCHEDULE_LAYOUTS[pinned][1] == "1" else [("1f1b", 1)]
        names = [self.schedule] if self.schedule != "auto" else [s for s in SCHEDULES if s != "gpipe"]
        out = []
        for name in names:
            rule = SCHEDULE_LAYOUTS[name][1]
            vs = [1] if rule == "1" else [2] if rule == "2" else range(2, self.max_virtual_stages + 1)
            for v in vs:
                if self.virtual_stages is not None and v != self.virtual_stages:
                    continue
                if pp * v <= num_layers and schedule_unusable(name, pp, v, c) is None:
                    out.append((name, v))
        return out

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    def microbatch_candidates(self) -> list[int]:
        if self.microbatches is not None:
            return sorted(set(self.microbatches))
        return [c for c in divisors(self.global_batch_size) if c <= self.max_microbatches]


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order, built from its prime factors.

    Trial division stops at the square root of what is left once a factor is divided out, so a smooth number is
    instant (10**18 = 2**18 * 5**18: a few steps, 361 divisors); only a large prime factor costs its square root.
    Callers keep ``n`` bounded (batch sizes by :data:`MAX_GLOBAL_BATCH_SIZE`: at most ~16,000 steps; device counts
    by the cluster's shape)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"divisors of a positive integer, got {n!r}")
    found = [1]
    for prime, power in _prime_factors(n):
        found = [d * prime**e for d in found for e in range(power + 1)]
    return sorted(found)


def _prime_factors(n: int) -> list[tuple[int, int]]:
    """``[(prime, power), ...]`` of ``n`` by trial division up to the square root of the part not yet factored."""
    out = []
    p = 2
    while p * p <= n:
        if n % p == 0:
            power = 0
            while n % p == 0:
                n //= p
                power += 1
            out.append((p, power))
        p += 1 if p == 2 else 2
    if n > 1:
        out.append((n, 1))
    return out


@dataclass
class Problem:
    """Everything the cost model and the solver need.

    ``compression``: the gradient compression methods the solver may choose per replicated / ZeRO-1 layer besides
    ``"none"`` (opt-in: they change numerics); ``compression_options`` their parameters (``powersgd_rank``,
    ``topk_ratio``), stamped into every plan. ``opt_ins``: what the user allowed each opt-in dimension, by its
    option (:data:`~uniap_lightning.planner.dimensions.OPT_INS`): the per-layer values the solver may choose besides
    the dimension's default (they change numerics); given as the strategy's options or as already allowed values,
    held as :func:`~uniap_lightning.planner.dimensions.opt_ins` returns them (every option; ``()``: off).
    """

    model: ModelProfile
    cluster: Cluster
    training: TrainingConfig
    meta: dict[str, Any] = field(default_factory=dict)
    compression: tuple[str, ...] = ("none",)
    compression_options: dict[str, float] = field(default_factory=lambda: dict(COMPRESSION_DEFAULTS))
    opt_ins: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.compression = compression_methods(self.compression)
        self.opt_ins = allowed_opt_ins(self.opt_ins)
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

    def plan_for(self, *, stage_of_layer: list[int], strategies: list, pp: int, microbatches: int,
                 schedule: str | None = None, virtual_stages: int = 1) -> Plan:
        """A plan of this problem (its model, cluster, batch, schedule and compression options) from a stage and a
        strategy per layer (:class:`~uniap_lightning.planner.decision.Strategy`): the one place
        the solver, the baselines and the tests stamp a plan's identity."""
        return Plan.from_assignment(
            stage_of_layer=stage_of_layer,
            strategies=list(strategies),
            layer_names=[lp.name for lp in self.model.layers],
            pp=pp,
            microbatches=microbatches,
            schedule=schedule or self.training.concrete_schedule,
            virtual_stages=virtual_stages,
            global_batch_size=self.training.global_batch_size,
            num_devices=self.num_devices,
            model=self.model.model,
            cluster=self.cluster.name,
            model_fingerprint=self.model.fingerprint(),
            compression_options=dict(self.compression_options),
        )
