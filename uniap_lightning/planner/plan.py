"""The plan: what the solver decides and what the runtime executes.

A :class:`Plan` is a plain dataclass tree that serializes to JSON (a public, versioned format documented in the
README) and prints as a readable table (see :mod:`uniap_lightning.planner.report`). It imports neither torch nor
Lightning.

Rank layout (fixed, so a plan is fully described by these fields): with ``n = num_devices // pp`` devices per
stage, stage ``i`` owns ranks ``[i*n, (i+1)*n)``. Inside a stage a layer with strategy ``(dp, tp)`` uses the stage's
ranks as a ``(dp, tp)`` grid with ``tp`` innermost (consecutive ranks form a tensor-parallel group). ``shard``
tells whether the ``dp`` copies are replicated (DDP-style all-reduce) or sharded (FSDP / ZeRO-3).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import read_text, write_text_atomic

PLAN_FORMAT_VERSION = 1
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class LayerPlan:
    """Strategy of one layer: its stage and its intra-layer split ``dp * tp == devices per stage``."""

    name: str
    stage: int
    dp: int
    tp: int
    shard: bool


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
    memory_limit_bytes: float
    feasible: bool


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


@dataclass
class Plan:
    """A complete parallelization plan for one model on one cluster."""

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
    estimate: Estimate | None = None
    solver: SolverInfo | None = None
    baselines: dict[str, float | None] = field(default_factory=dict)
    # one record per (pp, c) candidate: outcome ("optimal", "pruned by bound", "does not fit", ...), tpi_s, bound_s
    search: list[dict[str, Any]] = field(default_factory=list)
    format_version: int = PLAN_FORMAT_VERSION

    # ------------------------------------------------------------------ derived
    @property
    def devices_per_stage(self) -> int:
        return self.num_devices // self.pp

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.microbatches

    def stage_of_rank(self, rank: int) -> int:
        return rank // self.devices_per_stage

    def layers_of_stage(self, stage: int) -> list[int]:
        first, last = self.stages[stage].layers
        return list(range(first, last + 1))

    # ------------------------------------------------------------------ build
    @classmethod
    def from_assignment(
        cls,
        *,
        stage_of_layer: list[int],
        strategies: list[tuple[int, int, bool]],
        layer_names: list[str],
        pp: int,
        microbatches: int,
        schedule: str,
        global_batch_size: int,
        num_devices: int,
        **extra: Any,
    ) -> Plan:
        """Build a plan from per-layer stage indices and ``(dp, tp, shard)`` strategies."""
        n = num_devices // pp
        stages = []
        for i in range(pp):
            members = [u for u, s in enumerate(stage_of_layer) if s == i]
            if not members:
                raise UniAPError(f"stage {i} has no layers (pp={pp}, stage_of_layer={stage_of_layer})")
            stages.append(StagePlan(i, (members[0], members[-1]), tuple(range(i * n, (i + 1) * n))))
        layers = [
            LayerPlan(name, s, d, t, bool(sh) and d > 1)
            for name, s, (d, t, sh) in zip(layer_names, stage_of_layer, strategies, strict=True)
        ]
        plan = cls(pp, microbatches, schedule, global_batch_size, num_devices, stages, layers, **extra)
        plan.validate()
        return plan

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check internal consistency; raise :class:`UniAPError` naming the first bad field."""
        if self.format_version != PLAN_FORMAT_VERSION:
            raise UniAPError(
                f"plan format_version={self.format_version} is not supported (expected {PLAN_FORMAT_VERSION})"
            )
        if self.schedule not in SCHEDULES:
            raise UniAPError(f"plan schedule={self.schedule!r} must be one of {SCHEDULES}")
        for key in ("pp", "microbatches", "global_batch_size", "num_devices"):
            if getattr(self, key) < 1:
                raise UniAPError(f"plan field '{key}' must be >= 1, got {getattr(self, key)}")
        if self.num_devices % self.pp:
            raise UniAPError(f"plan pp={self.pp} does not divide num_devices={self.num_devices}")
        if self.global_batch_size % self.microbatches:
            raise UniAPError(
                f"plan microbatches={self.microbatches} does not divide global_batch_size={self.global_batch_size}"
            )
        if len(self.stages) != self.pp:
            raise UniAPError(f"plan has {len(self.stages)} stages but pp={self.pp}")
        n = self.devices_per_stage
        expected_first = 0
        for i, st in enumerate(self.stages):
            first, last = st.layers
            if st.index != i or first != expected_first or last < first:
                raise UniAPError(f"plan stage {i} has layers {list(st.layers)}; stages must tile the chain in order")
            if tuple(st.ranks) != tuple(range(i * n, (i + 1) * n)):
                raise UniAPError(f"plan stage {i} ranks must be {i * n}..{(i + 1) * n - 1}")
            expected_first = last + 1
        if expected_first != len(self.layers):
            raise UniAPError(f"plan stages cover {expected_first} layers but the plan lists {len(self.layers)}")
        mb = self.micro_batch_size
        if self.pp > 1 and mb % n:
            raise UniAPError(
                f"plan micro-batch size {mb} is not divisible by the {n} devices per stage: with pp > 1 every rank "
                "of a stage holds micro_batch_size / devices_per_stage samples at stage boundaries"
            )
        for u, lp in enumerate(self.layers):
            first, last = self.stages[lp.stage].layers if 0 <= lp.stage < self.pp else (-1, -1)
            if not first <= u <= last:
                raise UniAPError(f"plan layer {u} ({lp.name}) says stage {lp.stage}, but that stage does not hold it")
            if lp.dp * lp.tp != n:
                raise UniAPError(f"plan layer {u} ({lp.name}): dp*tp = {lp.dp}*{lp.tp} != devices per stage {n}")
            if mb % lp.dp:
                raise UniAPError(
                    f"plan layer {u} ({lp.name}): micro-batch size {mb} is not divisible by dp={lp.dp}"
                )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [{"index": s.index, "layers": list(s.layers), "ranks": list(s.ranks)} for s in self.stages]
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            write_text_atomic(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise UniAPError(f"a plan must be a JSON object, got {type(d).__name__}")
        try:
            stages = [StagePlan(int(s["index"]), _int_pair(s["layers"], f"stages[{i}].layers"),
                                tuple(int(r) for r in s["ranks"])) for i, s in enumerate(d["stages"])]
            layers = [
                LayerPlan(str(x["name"]), int(x["stage"]), int(x["dp"]), int(x["tp"]), bool(x["shard"]))
                for x in d["layers"]
            ]
            est = Estimate(**d["estimate"]) if d.get("estimate") else None
            sol = SolverInfo(**d["solver"]) if d.get("solver") else None
            plan = cls(
                pp=int(d["pp"]),
                microbatches=int(d["microbatches"]),
                schedule=str(d["schedule"]),
                global_batch_size=int(d["global_batch_size"]),
                num_devices=int(d["num_devices"]),
                stages=stages,
                layers=layers,
                model=d.get("model", ""),
                cluster=d.get("cluster", ""),
                model_fingerprint=d.get("model_fingerprint", ""),
                estimate=est,
                solver=sol,
                baselines=dict(d.get("baselines", {})),
                search=list(d.get("search", [])),
                format_version=int(d.get("format_version", PLAN_FORMAT_VERSION)),
            )
            plan.validate()
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
            if isinstance(err, UniAPError):
                raise
            raise UniAPError(f"plan JSON is missing or has a malformed field: {err!r}") from err
        return plan

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        p = Path(text_or_path)
        if isinstance(text_or_path, Path) or (len(str(text_or_path)) < 4096 and p.suffix == ".json"):
            text = read_text(p, "plan file")
        else:
            text = str(text_or_path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UniAPError(f"plan file is not valid JSON: {err}") from err
        return cls.from_dict(data)

    def strategy_runs(self) -> list[tuple[int, int, LayerPlan]]:
        """Fold consecutive layers with the same stage and strategy into ``(first, last, layer)`` runs."""
        runs: list[tuple[int, int, LayerPlan]] = []
        for u, lp in enumerate(self.layers):
            if runs and (runs[-1][2].stage, runs[-1][2].dp, runs[-1][2].tp, runs[-1][2].shard) == (
                lp.stage,
                lp.dp,
                lp.tp,
                lp.shard,
            ):
                runs[-1] = (runs[-1][0], u, runs[-1][2])
            else:
                runs.append((u, u, lp))
        return runs


def _int_pair(value: Any, where: str) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise UniAPError(f"plan field '{where}' must be [first, last] layer indices, got {value!r}")
    return int(value[0]), int(value[1])
