"""The plan: what the solver decides and what the runtime executes.

A :class:`Plan` is a plain dataclass tree that serializes to JSON (a public, versioned format documented in the
README) and prints as a readable table (see :mod:`uniap_lightning.planner.report`). It imports neither torch nor
Lightning.

Rank layout (fixed, so a plan is fully described by these fields): with ``n = num_devices // pp`` devices per
device group, group ``g`` owns ranks ``[g*n, (g+1)*n)`` and runs ``virtual_stages`` pipeline stages, placed by the
schedule (loop: stage ``k`` on group ``k % pp``; V: ``k`` on ``k`` for ``k < pp``, else on ``2 pp - 1 - k``); with
one virtual stage, stage ``i`` is group ``i``. The :class:`Plan` methods answer every layout question. Inside a stage a layer with strategy ``(dp, tp)`` uses the stage's
ranks as a ``(dp, tp)`` grid with ``tp`` innermost (consecutive ranks form a tensor-parallel group). ``dp_mode``
tells how the ``dp`` copies hold their state: ``replicate`` (DDP-style all-reduce), ``zero1`` (optimizer state
sharded), ``zero2`` (optimizer state and gradients sharded) or ``zero3`` (FSDP: parameters too). ``recompute``
runs the layer's forward again in backward instead of keeping its activations; ``compression`` is how a
``replicate`` / ``zero1`` layer's gradients travel (``none``, ``bf16``, ``powersgd``, ``topk``).

Format history: version 1 had ``shard: bool`` per layer (read as ``zero3`` / ``replicate``); version 2 replaced it
with ``dp_mode`` and added ``recompute``, ``compression`` and the plan-level ``compression_options``; version 3
added ``virtual_stages`` and the schedules beyond ``gpipe`` / ``1f1b`` (``stages`` then lists ``pp *
virtual_stages`` pipeline stages in chain order, each with the ranks of the device group the schedule places it
on; the estimate's per-stage lists are per device group, ``boundary_s`` per stage boundary). Versions 1 and 2 read
as version 3 with ``virtual_stages = 1``. Version 4 added the sequence dimension (``cp``, ``cp_method``, ``sp``) and
expert parallelism (``ep``: a mixture-of-experts layer's experts split over ``ep`` of its ``dp * cp`` replicas) per
layer; earlier versions read with ``cp = ep = 1``. Version 5 added ``offload`` per layer (activations kept in host
memory between forward and backward); earlier versions read with ``offload = false``. Version 6 added
``precision`` per layer (``"default"``, ``"fp8"``, ``"fp8_rowwise"``: float8 matmuls); earlier versions read with
``precision = "default"``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import parse_json, read_text, write_text_atomic
from uniap_lightning.planner import dimensions
from uniap_lightning.planner import fields as F
from uniap_lightning.planner.decision import COMPRESSIBLE_DP_MODES, COMPRESSIONS, DP_MODES, Strategy

__all__ = ["COMPRESSIBLE_DP_MODES", "COMPRESSIONS", "DP_MODES", "LayerPlan", "Plan", "StagePlan", "Strategy"]

PLAN_FORMAT_VERSION = 6
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6)
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


@dataclass(frozen=True)
class Plan:
    """A complete parallelization plan for one model on one cluster: what the runtime executes (frozen). What the
    search learned travels beside it in ``report`` (:class:`SolveReport`; ``plan.estimate`` etc. read it), and
    :meth:`with_report` gives the same plan with another report."""

    pp: int
    microbatches: int
    schedule: str
    global_batch_size: int
    num_devices: int
    stages: list[StagePlan]
    layers: list[LayerPlan]
    model: str = ""
    cluster: str = ""
    model_fingerprint: str = ""
    compression_options: dict[str, float] = field(default_factory=lambda: dict(COMPRESSION_DEFAULTS))
    #: pipeline stages per device group (chunks per device): 1 for gpipe / 1f1b / zb_h1, 2 for the V schedules
    virtual_stages: int = 1
    format_version: int = PLAN_FORMAT_VERSION
    report: SolveReport = field(default_factory=SolveReport, compare=False)

    # ------------------------------------------------------------------ the solve report
    @property
    def estimate(self) -> Estimate | None:
        return self.report.estimate

    @property
    def solver(self) -> SolverInfo | None:
        return self.report.solver

    @property
    def baselines(self) -> dict[str, float | None]:
        return self.report.baselines

    @property
    def search(self) -> tuple[dict[str, Any], ...]:
        return self.report.search

    def with_report(self, **changes: Any) -> Plan:
        """This plan with its report's fields replaced (``estimate=``, ``solver=``, ``baselines=``, ``search=``)."""
        if "search" in changes:
            changes["search"] = tuple(changes["search"])
        return replace(self, report=replace(self.report, **changes))

    # ------------------------------------------------------------------ derived
    @property
    def devices_per_stage(self) -> int:
        return self.num_devices // self.pp

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.microbatches

    @property
    def boundary_chunks(self) -> int:
        """Into how many chunks a micro-batch is cut where stages start and end (and at the loss):
        :func:`boundary_chunks` of the micro-batch and the devices per stage."""
        return boundary_chunks(self.micro_batch_size, self.devices_per_stage)

    # ------------------------------------------------------------------ layout: the one place it is computed
    # Every module asks these (meshes, pipeline, rebalance, monitor, cost tables); none works it out itself.
    # A *stage* is one pipeline stage in chain order (``num_stages = pp * virtual_stages`` of them, each a torch
    # PipelineStage); a *group* is the ``n`` devices that run ``virtual_stages`` stages (torch's pipeline rank).
    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def group_of_stage(self, stage: int) -> int:
        """The device group that runs ``stage`` (the schedule's placement: loop or V)."""
        return group_of_stage(stage, self.pp, self.virtual_stages, self.schedule)

    def stages_of_group(self, group: int) -> list[int]:
        """The stages device group ``group`` runs, in chain order."""
        return [k for k in range(self.num_stages) if self.group_of_stage(k) == group]

    def ranks_of_group(self, group: int) -> range:
        """The global ranks of device group ``group`` (consecutive)."""
        return stage_ranks(group, self.devices_per_stage)

    def group_of_rank(self, rank: int) -> int:
        """The device group (pipeline rank) ``rank`` belongs to."""
        return rank // self.devices_per_stage

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, in chain order (one per virtual stage)."""
        return self.stages_of_group(self.group_of_rank(rank))

    def ranks_of_stage(self, stage: int) -> range:
        """The global ranks that run ``stage``."""
        return self.ranks_of_group(self.group_of_stage(stage))

    def lane_of_rank(self, rank: int) -> int:
        """``rank``'s position inside its group; lane ``r`` is the pipeline ``r, n + r, 2n + r, ...``."""
        return rank % self.devices_per_stage

    def batch_chunk_of_rank(self, rank: int, dp: int) -> int:
        """Which of the ``dp`` batch chunks ``rank`` holds where a layer runs with ``dp`` data-parallel copies
        (``tp`` innermost: consecutive lanes share a chunk)."""
        return self.lane_of_rank(rank) // (self.devices_per_stage // dp)

    def layers_of_stage(self, stage: int) -> list[int]:
        """The chain indices of ``stage``'s layers (in order)."""
        first, last = self.stages[stage].layers
        return list(range(first, last + 1))

    def layers_of_group(self, group: int) -> list[int]:
        """The chain indices of the layers device group ``group`` holds (its stages', in chain order)."""
        return [u for k in self.stages_of_group(group) for u in self.layers_of_stage(k)]

    def layers_of_rank(self, rank: int) -> list[int]:
        """The chain indices of the layers ``rank`` holds."""
        return self.layers_of_group(self.group_of_rank(rank))

    def per_group(self, per_rank: list[Any], reduce: Any = max) -> list[Any]:
        """A per-rank list folded into one value per device group (``reduce`` over the group's ranks)."""
        return [reduce(per_rank[r] for r in self.ranks_of_group(g)) for g in range(self.pp)]

    # ------------------------------------------------------------------ build
    @classmethod
    def from_assignment(
        cls,
        *,
        stage_of_layer: list[int],
        strategies: list[Strategy],
        layer_names: list[str],
        pp: int,
        microbatches: int,
        schedule: str,
        global_batch_size: int,
        num_devices: int,
        **extra: Any,
    ) -> Plan:
        """Build a plan from per-layer stage indices (chain order, ``0 .. pp * virtual_stages - 1``) and
        :class:`Strategy` records (canonicalized: ``Strategy.of``)."""
        n = num_devices // pp
        v = int(extra.get("virtual_stages", 1))
        check_schedule(schedule, v)
        stages = []
        for i in range(pp * v):
            members = [u for u, s in enumerate(stage_of_layer) if s == i]
            if not members:
                raise UniAPError(f"stage {i} has no layers (pp={pp}, virtual_stages={v}, "
                                 f"stage_of_layer={stage_of_layer})")
            group = group_of_stage(i, pp, v, schedule)
            stages.append(StagePlan(i, (members[0], members[-1]), tuple(stage_ranks(group, n))))
        for u, strat in enumerate(strategies):
            if not isinstance(strat, Strategy):
                raise UniAPError(f"layer {u}: a strategy must be a Strategy record, got {strat!r}")
        layers = [LayerPlan(name, s, Strategy.of(*strat))
                  for name, s, strat in zip(layer_names, stage_of_layer, strategies, strict=True)]
        plan = cls(pp, microbatches, schedule, global_batch_size, num_devices, stages, layers, **extra)
        plan.validate()
        return plan

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check internal consistency; raise :class:`UniAPError` naming the first bad field."""
        if self.format_version != PLAN_FORMAT_VERSION:
            raise UniAPError(
                f"plan format_version={self.format_version} is not supported (expected {PLAN_FORMAT_VERSION}; "
                f"files of versions {READABLE_FORMAT_VERSIONS} are read and upgraded)"
            )
        check_compression_options(self.compression_options, "plan compression_options")
        for key in ("pp", "microbatches", "global_batch_size", "num_devices", "virtual_stages"):
            if getattr(self, key) < 1:
                raise UniAPError(f"plan field '{key}' must be >= 1, got {getattr(self, key)}")
        check_schedule(self.schedule, self.virtual_stages)
        if self.num_devices % self.pp:
            raise UniAPError(f"plan pp={self.pp} does not divide num_devices={self.num_devices}")
        if self.global_batch_size % self.microbatches:
            raise UniAPError(
                f"plan microbatches={self.microbatches} does not divide global_batch_size={self.global_batch_size}"
            )
        if len(self.stages) != self.num_stages:
            raise UniAPError(f"plan has {len(self.stages)} stages but pp={self.pp} x virtual_stages="
                             f"{self.virtual_stages} = {self.num_stages}")
        n = self.devices_per_stage
        expected_first = 0
        for i, st in enumerate(self.stages):
            first, last = st.layers
            if st.index != i or first != expected_first or last < first:
                raise UniAPError(f"plan stage {i} has layers {list(st.layers)}; stages must tile the chain in order")
            # the length first: a huge num_devices must not build a huge range to compare with
            g = self.group_of_stage(i)
            if len(st.ranks) != n or tuple(st.ranks) != tuple(stage_ranks(g, n)):
                raise UniAPError(f"plan stage {i} ranks must be {g * n}..{(g + 1) * n - 1} (device group {g})")
            expected_first = last + 1
        if expected_first != len(self.layers):
            raise UniAPError(f"plan stages cover {expected_first} layers but the plan lists {len(self.layers)}")
        # any pp: at stage boundaries the micro-batch is cut into gcd(mb, n) chunks, each held by n / gcd lanes
        # (:attr:`boundary_chunks`); only each layer's data ranks must split it (below)
        mb = self.micro_batch_size
        for u, lp in enumerate(self.layers):
            first, last = self.stages[lp.stage].layers if 0 <= lp.stage < self.num_stages else (-1, -1)
            if not first <= u <= last:
                raise UniAPError(f"plan layer {u} ({lp.name}) says stage {lp.stage}, but that stage does not hold it")
            lp.check(f"plan layer {u} ({lp.name})")
            dp, cp, tp = lp.strategy.dp, lp.strategy.cp, lp.strategy.tp
            if dp * cp * tp != n:
                raise UniAPError(f"plan layer {u} ({lp.name}): dp*cp*tp = {dp}*{cp}*{tp} != devices per stage {n}")
            if mb % dp:
                raise UniAPError(
                    f"plan layer {u} ({lp.name}): micro-batch size {mb} is not divisible by dp={dp}"
                )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        report = fields.pop("report")
        order = ("pp", "microbatches", "schedule", "global_batch_size", "num_devices", "stages", "layers", "model",
                 "cluster", "model_fingerprint")
        d = {k: fields[k] for k in order}  # the JSON keys in the order of format versions 1 and 2
        d["virtual_stages"] = self.virtual_stages  # format 3
        d.update(estimate=report["estimate"], solver=report["solver"], baselines=report["baselines"],
                 search=list(report["search"]), compression_options=fields["compression_options"],
                 format_version=fields["format_version"])
        d["stages"] = [{"index": s.index, "layers": list(s.layers), "ranks": list(s.ranks)} for s in self.stages]
        # each layer's strategy is written flat into its object (the JSON keys of versions 1 and 2)
        d["layers"] = [{"name": lp.name, "stage": lp.stage, **lp.strategy._asdict(),
                        "shard": lp.strategy.shard}  # derived from dp_mode; kept so version-1 readers see it
                       for lp in self.layers]
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            write_text_atomic(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, origin: str = "plan") -> Plan:
        """A plan from its JSON document, every field checked for its JSON type (``"shard": "false"`` is not
        false) and range, then :meth:`validate`; a :class:`UniAPError` names ``origin``, the layer and the field."""
        if not isinstance(d, dict):
            raise UniAPError(f"{origin}: a plan must be a JSON object, got {type(d).__name__}")
        try:
            plan = _plan_from_dict(cls, d)
            plan.validate()
            if d.get("estimate") is not None:  # after validate: its lists are checked against the (valid) stages
                plan = plan.with_report(estimate=_estimate_from_dict(d["estimate"], plan.pp, plan.num_stages - 1))
        except UniAPError as err:
            raise UniAPError(str(err) if origin == "plan" else f"{origin}: {err}") from None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
            raise UniAPError(f"{origin}: plan JSON is missing or has a malformed field: {err!r}") from err
        return plan

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        p = Path(text_or_path)
        if isinstance(text_or_path, Path) or (len(str(text_or_path)) < 4096 and p.suffix == ".json"):
            text, origin = read_text(p, "plan file"), f"plan file {str(p)!r}"
        else:
            text, origin = str(text_or_path), "plan"
        return cls.from_dict(parse_json(text, "plan file" if origin == "plan" else origin), origin=origin)

    def strategy_runs(self) -> list[tuple[int, int, LayerPlan]]:
        """Fold consecutive layers with the same stage and strategy into ``(first, last, layer)`` runs."""
        runs: list[tuple[int, int, LayerPlan]] = []
        for u, lp in enumerate(self.layers):
            if runs and (runs[-1][2].stage, runs[-1][2].strategy) == (lp.stage, lp.strategy):
                runs[-1] = (runs[-1][0], u, runs[-1][2])
            else:
                runs.append((u, u, lp))
        return runs


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


def _plan_from_dict(cls: type[Plan], d: dict[str, Any]) -> Plan:
    """The plan's fields, each read with its JSON type (see :mod:`uniap_lightning.planner.fields`)."""
    version = F.integer(d.get("format_version", PLAN_FORMAT_VERSION), "plan field 'format_version'")
    if version not in READABLE_FORMAT_VERSIONS:
        raise UniAPError(f"plan format_version={version} is not supported (this version reads {READABLE_FORMAT_VERSIONS})")
    counts = {key: F.integer(_top(d, key), f"plan field '{key}'", low=1, high=F.MAX_COUNT)
              for key in ("pp", "microbatches", "global_batch_size", "num_devices")}
    stages = [_stage_from_dict(s, i) for i, s in enumerate(F.array(_top(d, "stages"), "plan field 'stages'"))]
    layers = [_layer_from_dict(x, u, version)
              for u, x in enumerate(F.array(_top(d, "layers"), "plan field 'layers'"))]
    options = F.obj(d.get("compression_options", {}), "plan field 'compression_options'")
    # format 3 added virtual_stages; versions 1 and 2 had one stage per device group
    virtual = (F.integer(_top(d, "virtual_stages"), "plan field 'virtual_stages'", low=1, high=F.MAX_COUNT)
               if version >= 3 else 1)
    return cls(
        **counts,
        virtual_stages=virtual,
        schedule=F.string(_top(d, "schedule"), "plan field 'schedule'"),
        stages=stages,
        layers=layers,
        model=F.string(d.get("model", ""), "plan field 'model'"),
        cluster=F.string(d.get("cluster", ""), "plan field 'cluster'"),
        model_fingerprint=F.string(d.get("model_fingerprint", ""), "plan field 'model_fingerprint'"),
        compression_options={**COMPRESSION_DEFAULTS, **options},
        report=SolveReport(solver=_solver_from_dict(d["solver"]) if d.get("solver") is not None else None,
                           baselines=_baselines_from_dict(d.get("baselines", {})),
                           search=tuple(_search_from_dict(d.get("search", [])))),
    )


def _top(d: dict[str, Any], key: str) -> Any:
    """A required top-level field (the message keeps the wording earlier versions gave)."""
    if key not in d:
        raise UniAPError(f"plan JSON is missing or has a malformed field: '{key}' is missing")
    return d[key]


def _stage_from_dict(s: Any, i: int) -> StagePlan:
    where = f"plan stages[{i}]"
    s = F.obj(s, where)
    ranks = F.array(F.required(s, "ranks", where), f"{where}.ranks")
    return StagePlan(F.integer(F.required(s, "index", where), f"{where}.index", low=0, high=F.MAX_COUNT),
                     _int_pair(F.required(s, "layers", where), f"stages[{i}].layers"),
                     tuple(F.integer(r, f"{where}.ranks[{j}]", low=0, high=F.MAX_COUNT) for j, r in enumerate(ranks)))


def _layer_from_dict(x: Any, u: int, version: int) -> LayerPlan:
    """One layer: its name, stage and the decision record's fields, each read by its dimension (the format
    version that added it; older files read its default, version 1's ``shard`` a real boolean: ``"false"`` would
    be truthy, ZeRO-3)."""
    x = F.obj(x, f"plan layer {u}")
    name = F.string(F.required(x, "name", f"plan layer {u}"), f"plan layer {u}.name")
    where = f"plan layer {u} ({name})"
    stage = F.integer(F.required(x, "stage", where), f"{where}: stage", low=0, high=F.MAX_COUNT)
    return LayerPlan(name, stage, Strategy(*dimensions.read(x, where, version)))


def _numbers(value: Any, where: str, length: int, *, finite: bool = True) -> list[float]:
    values = F.array(value, where)
    if len(values) != length:
        raise UniAPError(f"{where} must list {length} numbers (one per stage / boundary), got {len(values)}")
    return [F.number(v, f"{where}[{i}]", low=0, finite=finite) for i, v in enumerate(values)]


def _estimate_from_dict(e: Any, pp: int, boundaries: int) -> Estimate:
    """The cost model's prediction saved with the plan: printed as is, so its lists must match the device groups
    (``pp``: time, memory, sync) and the stage boundaries (``boundaries``)."""
    w = "plan estimate"
    e = F.obj(e, w)
    unknown = set(e) - set(Estimate.__dataclass_fields__)
    if unknown:
        raise UniAPError(f"{w} has unknown field(s) {sorted(map(str, unknown))}")
    limits, devices = e.get("stage_memory_limit_bytes"), e.get("stage_device")
    return Estimate(
        tpi_s=F.number(F.required(e, "tpi_s", w), f"{w}.tpi_s", low=0),
        samples_per_s=F.number(F.required(e, "samples_per_s", w), f"{w}.samples_per_s", low=0, finite=False),
        stage_time_s=_numbers(F.required(e, "stage_time_s", w), f"{w}.stage_time_s", pp),
        stage_memory_bytes=_numbers(F.required(e, "stage_memory_bytes", w), f"{w}.stage_memory_bytes", pp),
        stage_sync_s=_numbers(F.required(e, "stage_sync_s", w), f"{w}.stage_sync_s", pp),
        boundary_s=_numbers(F.required(e, "boundary_s", w), f"{w}.boundary_s", boundaries),
        memory_limit_bytes=F.number(F.required(e, "memory_limit_bytes", w), f"{w}.memory_limit_bytes", low=0),
        feasible=F.boolean(F.required(e, "feasible", w), f"{w}.feasible"),
        stage_memory_limit_bytes=(None if limits is None else
                                  _numbers(limits, f"{w}.stage_memory_limit_bytes", pp)),
        stage_device=(None if devices is None else
                      [F.string(v, f"{w}.stage_device[{i}]") for i, v in enumerate(_sized(devices, f"{w}.stage_device", pp))]),
    )


def _sized(value: Any, where: str, length: int) -> list[Any]:
    values = F.array(value, where)
    if len(values) != length:
        raise UniAPError(f"{where} must list {length} entries (one per stage), got {len(values)}")
    return values


def _solver_from_dict(s: Any) -> SolverInfo:
    w = "plan solver"
    s = F.obj(s, w)
    unknown = set(s) - set(SolverInfo.__dataclass_fields__)
    if unknown:
        raise UniAPError(f"{w} has unknown field(s) {sorted(map(str, unknown))}")
    return SolverInfo(
        name=F.string(F.required(s, "name", w), f"{w}.name"),
        status=F.string(F.required(s, "status", w), f"{w}.status"),
        gap=F.optional_number(F.required(s, "gap", w), f"{w}.gap", low=0),
        solve_s=F.number(F.required(s, "solve_s", w), f"{w}.solve_s", low=0),
        candidates=F.integer(s.get("candidates", 0), f"{w}.candidates", low=0),
        solved=F.integer(s.get("solved", 0), f"{w}.solved", low=0),
        pruned=F.integer(s.get("pruned", 0), f"{w}.pruned", low=0),
        objective_s=F.optional_number(s.get("objective_s"), f"{w}.objective_s"),
    )


def _baselines_from_dict(b: Any) -> dict[str, float | None]:
    """Baseline name -> seconds per iteration, or null where it does not fit."""
    b = F.obj(b, "plan field 'baselines'")
    return {k: F.optional_number(v, f"plan baselines.{k}", low=0) for k, v in b.items()}


def _search_from_dict(records: Any) -> list[dict[str, Any]]:
    """The solver's trace, one record per (pp, micro-batches) candidate; bounds may be infinite."""
    out = []
    for i, r in enumerate(F.array(records, "plan field 'search'")):
        w = f"plan search[{i}]"
        r = dict(F.obj(r, w))
        for key in ("pp", "microbatches"):
            r[key] = F.integer(F.required(r, key, w), f"{w}.{key}", low=1, high=F.MAX_COUNT)
        r["outcome"] = F.string(F.required(r, "outcome", w), f"{w}.outcome")
        if "virtual_stages" in r:
            r["virtual_stages"] = F.integer(r["virtual_stages"], f"{w}.virtual_stages", low=1, high=F.MAX_COUNT)
        if "schedule" in r:
            r["schedule"] = F.string(r["schedule"], f"{w}.schedule")
        if "resolves" in r:
            r["resolves"] = F.integer(r["resolves"], f"{w}.resolves", low=0, high=F.MAX_COUNT)
        for key in ("tpi_s", "bound_s", "memory_bound_bytes", "solve_s", "bubble_s"):
            if key in r:
                r[key] = F.optional_number(r[key], f"{w}.{key}", finite=False)
        out.append(r)
    return out


def _int_pair(value: Any, where: str) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise UniAPError(f"plan field '{where}' must be [first, last] layer indices, got {F.short(value)}")
    return (F.integer(value[0], f"plan field '{where}[0]'", low=0, high=F.MAX_COUNT),
            F.integer(value[1], f"plan field '{where}[1]'", low=0, high=F.MAX_COUNT))
