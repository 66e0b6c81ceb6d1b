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
``precision = "default"``. A later version is a per-layer field's ``since`` in its dimension's module
(:mod:`.dimensions`), which says what it added; :data:`PLAN_FORMAT_VERSION` is the newest.

The plan's parts (format version, schedules, compression options, the records it holds) are
:mod:`.plan_records`, its reading from JSON :mod:`.plan_read`; their names are importable from here too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import parse_json, read_text, write_text_atomic
from uniap_lightning.planner.decision import COMPRESSIBLE_DP_MODES, COMPRESSIONS, DP_MODES, Strategy
from uniap_lightning.planner.plan_read import _estimate_from_dict, _plan_from_dict
from uniap_lightning.planner.plan_records import (
    COMPRESSION_DEFAULTS,
    COMPRESSION_RUNTIME_DEFAULTS,
    MAX_POWERSGD_RANK,
    MAX_START_ITER,
    PLAN_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    SCHEDULE_LAYOUTS,
    SCHEDULES,
    Estimate,
    LayerPlan,
    SolveReport,
    SolverInfo,
    StagePlan,
    boundary_chunks,
    check_compression_options,
    check_schedule,
    group_of_stage,
    placed_group,
    stage_ranks,
)

__all__ = [
    "COMPRESSIBLE_DP_MODES", "COMPRESSIONS", "COMPRESSION_DEFAULTS", "COMPRESSION_RUNTIME_DEFAULTS", "DP_MODES",
    "MAX_POWERSGD_RANK", "MAX_START_ITER", "PLAN_FORMAT_VERSION", "READABLE_FORMAT_VERSIONS", "SCHEDULES",
    "SCHEDULE_LAYOUTS", "Estimate", "LayerPlan", "Plan", "SolveReport", "SolverInfo", "StagePlan", "Strategy",
    "boundary_chunks", "check_compression_options", "check_schedule", "group_of_stage", "placed_group", "stage_ranks",
]


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
