"""The parts of a :class:`~uniap_lightning.planner.plan.Plan` (:mod:`.plan`): the format version, the schedules and
their placement of stages on device groups, the compression options and their check, and the records a plan holds
(each layer's decision, each stage's layers and ranks, the cost model's estimate, how the solver found it). Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner import fields as F
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.dimensions import NEWEST_FIELD_SINCE

#: the newest format a change beyond the per-layer record made (3: virtual stages and the schedules)
_PLAN_LEVEL_VERSION = 3
#: the format written: the newest per-layer field's ``since`` (each field of :mod:`.dimensions` says the version
#: that added it), so a new dimension's field raises it from its own module; earlier versions all read
PLAN_FORMAT_VERSION = max(_PLAN_LEVEL_VERSION, NEWEST_FIELD_SINCE)
READABLE_FORMAT_VERSIONS = tuple(range(1, PLAN_FORMAT_VERSION + 1))
#: pipeline schedules (torch.distributed.pipelining runs each): name -> (placement of chunks, allowed virtual stages)
#: "loop": stage ``k`` on device group ``k % pp``; "v": stage ``k`` on ``k`` for ``k < pp``, else ``2 pp - 1 - k``
SCHEDULE_LAYOUTS: dict[str, tuple[str, str]] = {
    "gpipe": ("loop", "1"), "1f1b": ("loop", "1"), "zb_h1": ("loop", "1"),
    "interleaved_1f1b": ("loop", ">=2"), "interleaved_zb": ("loop", ">=2"),
    "zb_v": ("v", "2"), "dualpipe_v": ("v", "2"),
}
SCHEDULES = tuple(SCHEDULE_LAYOUTS)
# parameters of the compressors, plan-wide (the plan JSON carries them so a plan runs as it was priced)
COMPRESSION_DEFAULTS: dict[str, float] = {"powersgd_rank": 1, "topk_ratio": 0.01}
# the compressors' run-time options (not priced: the cost model prices steady-state compression); absent from a
# plan's compression_options means these values (see uniap_lightning.runtime.compression)
COMPRESSION_RUNTIME_DEFAULTS: dict[str, float] = {"start_iter": 0, "start_fraction": 0.02, "dgc_momentum": 0.0}
#: the largest PowerSGD rank a plan or the strategy takes: far beyond any matrix side of a real layer (a rank at
#: or above the smaller side sends more than the uncompressed gradient), and small enough to price as a number
MAX_POWERSGD_RANK = 65_536
#: the latest optimizer step the uncompressed warm-up may last to (``start_iter``): trainer.max_steps's bound
MAX_START_ITER = 1_000_000_000


def stage_ranks(group: int, devices_per_stage: int) -> range:
    """The rank layout: device group ``g`` of ``n`` devices runs ranks ``[g*n, (g+1)*n)``. Plans answer it through
    :meth:`Plan.ranks_of_group`; the cost tables of a candidate (no plan yet) through this."""
    return range(group * devices_per_stage, (group + 1) * devices_per_stage)


def boundary_chunks(micro_batch: int, devices_per_stage: int) -> int:
    """The boundary layout (any ``pp``): a stage starts and ends with its micro-batch cut into ``g = gcd(b, n)``
    chunks of ``b / g`` whole samples, chunk ``r // (n / g)`` on lane ``r`` (``n / g`` consecutive lanes hold each;
    ``g = n`` when ``n`` divides ``b``), so lane ``r`` sends its chunk to lane ``r`` of the next stage. The runtime
    (:func:`~uniap_lightning.runtime.mesh.boundary_layout`) and the cost tables read it from here."""
    return math.gcd(micro_batch, devices_per_stage)


def check_schedule(schedule: str, virtual_stages: int, where: str = "plan") -> None:
    """``schedule`` is known and ``virtual_stages`` is one it runs with; UniAPError naming both else."""
    if schedule not in SCHEDULE_LAYOUTS:
        raise UniAPError(f"{where} schedule={schedule!r} must be one of {SCHEDULES}")
    rule = SCHEDULE_LAYOUTS[schedule][1]
    ok = virtual_stages >= 2 if rule == ">=2" else virtual_stages == int(rule)
    if not ok:
        raise UniAPError(f"{where} schedule={schedule!r} runs with virtual_stages {rule}, got {virtual_stages}")


def placed_group(stage: int, pp: int, placement: str) -> int:
    """The device group of pipeline stage ``stage`` under a placement: "loop" (``stage % pp``) or "v" (``stage``
    for ``stage < pp``, else ``2 pp - 1 - stage``)."""
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def group_of_stage(stage: int, pp: int, virtual_stages: int, schedule: str) -> int:
    """The device group that runs pipeline stage ``stage`` (chain order) under ``schedule``'s placement."""
    return placed_group(stage, pp, SCHEDULE_LAYOUTS[schedule][0])


@dataclass(frozen=True)
class LayerPlan:
    """One layer of the plan: its name, its pipeline stage and its :class:`Strategy` (the one decision record;
    ``strategy.dp * strategy.tp`` is the stage's device count)."""

    name: str
    stage: int
    strategy: Strategy

    def check(self, where: str) -> None:
        self.strategy.check(where)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: an inclusive layer range and the global ranks that run it."""

    index: int
    layers: tuple[int, int]
    ranks: tuple[int, ...]


@dataclass
class Estimate:
    """What the cost model predicts for a plan (filled by ``evaluate``)."""

    tpi_s: float
    samples_per_s: float
    stage_time_s: list[float]
    stage_memory_bytes: list[float]
    stage_sync_s: list[float]
    boundary_s: list[float]
    memory_limit_bytes: float  # the smallest stage limit
    feasible: bool
    #: per stage, where devices differ (heterogeneous clusters); None: every stage has ``memory_limit_bytes``
    stage_memory_limit_bytes: list[float] | None = None
    #: per stage, the device kind(s) of its ranks, where the cluster names them per rank
    stage_device: list[str] | None = None


@dataclass
class SolverInfo:
    """How the plan was found."""

    name: str
    status: str
    gap: float | None
    solve_s: float
    candidates: int = 0
    solved: int = 0
    pruned: int = 0
    objective_s: float | None = None


@dataclass(frozen=True)
class SolveReport:
    """What the search learned about a plan, kept beside its decisions: the cost model's ``estimate``, how it was
    found (``solver``), the ``baselines``' predicted times per iteration, and one ``search`` record per (pp, c)
    candidate (outcome: "optimal", "pruned by bound", "does not fit", ...; ``tpi_s``, ``bound_s``)."""

    estimate: Estimate | None = None
    solver: SolverInfo | None = None
    baselines: dict[str, float | None] = field(default_factory=dict)
    search: tuple[dict[str, Any], ...] = ()


def _finite(value: int | float) -> bool:
    """A finite number (an integer too long for a float, e.g. 10**400, is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_compression_options(options: Any, where: str) -> None:
    """``{"powersgd_rank": int >= 1, "topk_ratio": (0, 1]}`` and the run-time ``start_iter`` (int >= 0),
    ``start_fraction`` and ``dgc_momentum`` (in [0, 1)); any may be absent; UniAPError naming the key."""
    if not isinstance(options, dict):
        raise UniAPError(f"{where} must be an object {{powersgd_rank, topk_ratio}}, got {options!r}")
    known = {**COMPRESSION_DEFAULTS, **COMPRESSION_RUNTIME_DEFAULTS}
    unknown = set(options) - set(known)
    if unknown:
        raise UniAPError(f"{where} has unknown keys {sorted(map(str, unknown))} (known: {sorted(known)})")
    start, fraction, dgc = (options.get(k, COMPRESSION_RUNTIME_DEFAULTS[k]) for k in COMPRESSION_RUNTIME_DEFAULTS)
    if (isinstance(start, bool) or not isinstance(start, (int, float)) or not _finite(start)
            or int(start) != start or not 0 <= start <= MAX_START_ITER):
        raise UniAPError(f"{where}.start_iter must be an integer >= 0 and at most {MAX_START_ITER:,} (the optimizer "
                         f"step compression starts at), got {F.short(start)}")
    for key, value in (("start_fraction", fraction), ("dgc_momentum", dgc)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise UniAPError(f"{where}.{key} must be a number in [0, 1), got {value!r}")
    rank = options.get("powersgd_rank", 1)
    ratio = options.get("topk_ratio", 0.01)
    if isinstance(rank, bool) or not isinstance(rank, (int, float)) or not _finite(rank) or int(rank) != rank or rank < 1:
        raise UniAPError(f"{where}.powersgd_rank must be an integer >= 1, got {F.short(rank)}")
    if rank > MAX_POWERSGD_RANK:
        raise UniAPError(f"{where}.powersgd_rank must be an integer >= 1 and at most {MAX_POWERSGD_RANK:,} (the rank "
                         f"of PowerSGD's low-rank gradient factors), got {F.short(rank)}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise UniAPError(f"{where}.topk_ratio must be in (0, 1], got {ratio!r}")
