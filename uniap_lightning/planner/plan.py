"""The plan: what the solver decides and what the runtime executes.

A :class:`Plan` is a plain dataclass tree that serializes to JSON (a public, versioned format documented in the
README) and prints as a readable table (see :mod:`uniap_lightning.planner.report`). It imports neither torch nor
Lightning.

Rank layout (fixed, so a plan is fully described by these fields): with ``n = num_devices // pp`` devices per
stage, stage ``i`` owns ranks ``[i*n, (i+1)*n)``. Inside a stage a layer with strategy ``(dp, tp)`` uses the stage's
ranks as a ``(dp, tp)`` grid with ``tp`` innermost (consecutive ranks form a tensor-parallel group). ``dp_mode``
tells how the ``dp`` copies hold their state: ``replicate`` (DDP-style all-reduce), ``zero1`` (optimizer state
sharded), ``zero2`` (optimizer state and gradients sharded) or ``zero3`` (FSDP: parameters too). ``recompute``
runs the layer's forward again in backward instead of keeping its activations; ``compression`` is how a
``replicate`` / ``zero1`` layer's gradients travel (``none``, ``bf16``, ``powersgd``, ``topk``).

Format history: version 1 had ``shard: bool`` per layer (read as ``zero3`` / ``replicate``); version 2 replaced it
with ``dp_mode`` and added ``recompute``, ``compression`` and the plan-level ``compression_options``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import read_text, write_text_atomic

PLAN_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
SCHEDULES = ("gpipe", "1f1b")
DP_MODES = ("replicate", "zero1", "zero2", "zero3")
COMPRESSIONS = ("none", "bf16", "powersgd", "topk")
# modes whose gradients are all-reduced whole, so a compressor can stand in for the all-reduce
COMPRESSIBLE_DP_MODES = ("replicate", "zero1")
# parameters of the compressors, plan-wide (the plan JSON carries them so a plan runs as it was priced)
COMPRESSION_DEFAULTS: dict[str, float] = {"powersgd_rank": 1, "topk_ratio": 0.01}
# the compressors' run-time options (not priced: the cost model prices steady-state compression); absent from a
# plan's compression_options means these values (see uniap_lightning.runtime.compression)
COMPRESSION_RUNTIME_DEFAULTS: dict[str, float] = {"start_iter": 0, "start_fraction": 0.02, "dgc_momentum": 0.0}


@dataclass(frozen=True)
class LayerPlan:
    """Strategy of one layer: its stage, its intra-layer split ``dp * tp == devices per stage``, how the ``dp``
    copies hold state (``dp_mode``), whether it recomputes activations, and how its gradients are compressed."""

    name: str
    stage: int
    dp: int
    tp: int
    dp_mode: str = "replicate"
    recompute: bool = False
    compression: str = "none"

    @property
    def shard(self) -> bool:
        """Parameters sharded across the ``dp`` copies (ZeRO-3 / FSDP); the version-1 field."""
        return self.dp > 1 and self.dp_mode == "zero3"

    def check(self, where: str) -> None:
        if self.dp_mode not in DP_MODES:
            raise UniAPError(f"{where}: dp_mode={self.dp_mode!r} must be one of {DP_MODES}")
        if self.compression not in COMPRESSIONS:
            raise UniAPError(f"{where}: compression={self.compression!r} must be one of {COMPRESSIONS}")
        if not isinstance(self.recompute, bool):
            raise UniAPError(f"{where}: recompute must be true or false, got {self.recompute!r}")
        if self.dp == 1 and (self.dp_mode != "replicate" or self.compression != "none"):
            raise UniAPError(
                f"{where}: dp=1 has no data-parallel copies, so dp_mode must be 'replicate' and compression 'none' "
                f"(got {self.dp_mode!r}, {self.compression!r})"
            )
        if self.compression != "none" and self.dp_mode not in COMPRESSIBLE_DP_MODES:
            raise UniAPError(
                f"{where}: compression={self.compression!r} needs dp_mode in {COMPRESSIBLE_DP_MODES} "
                f"(gradients all-reduced whole), got {self.dp_mode!r}"
            )


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
    compression_options: dict[str, float] = field(default_factory=lambda: dict(COMPRESSION_DEFAULTS))
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
        strategies: list[tuple[Any, ...]],
        layer_names: list[str],
        pp: int,
        microbatches: int,
        schedule: str,
        global_batch_size: int,
        num_devices: int,
        **extra: Any,
    ) -> Plan:
        """Build a plan from per-layer stage indices and strategies, each ``(dp, tp, shard)`` (version-1 shape)
        or ``(dp, tp, dp_mode, recompute, compression)``."""
        n = num_devices // pp
        stages = []
        for i in range(pp):
            members = [u for u, s in enumerate(stage_of_layer) if s == i]
            if not members:
                raise UniAPError(f"stage {i} has no layers (pp={pp}, stage_of_layer={stage_of_layer})")
            stages.append(StagePlan(i, (members[0], members[-1]), tuple(range(i * n, (i + 1) * n))))
        layers = [_layer_plan(name, s, strat) for name, s, strat in zip(layer_names, stage_of_layer, strategies, strict=True)]
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
            lp.check(f"plan layer {u} ({lp.name})")
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
        for x, lp in zip(d["layers"], self.layers, strict=True):
            x["shard"] = lp.shard  # derived from dp_mode; kept so version-1 readers still see it
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
            version = int(d.get("format_version", PLAN_FORMAT_VERSION))
            if version not in READABLE_FORMAT_VERSIONS:
                raise UniAPError(
                    f"plan format_version={version} is not supported (this version reads {READABLE_FORMAT_VERSIONS})"
                )
            layers = [_layer_from_dict(x, version) for x in d["layers"]]
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
                compression_options={**COMPRESSION_DEFAULTS, **dict(d.get("compression_options", {}))},
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
            if runs and _choice(runs[-1][2]) == _choice(lp):
                runs[-1] = (runs[-1][0], u, runs[-1][2])
            else:
                runs.append((u, u, lp))
        return runs


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
    if (isinstance(start, bool) or not isinstance(start, (int, float)) or not math.isfinite(start)
            or int(start) != start or start < 0):
        raise UniAPError(f"{where}.start_iter must be an integer >= 0, got {start!r}")
    for key, value in (("start_fraction", fraction), ("dgc_momentum", dgc)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise UniAPError(f"{where}.{key} must be a number in [0, 1), got {value!r}")
    rank = options.get("powersgd_rank", 1)
    ratio = options.get("topk_ratio", 0.01)
    if isinstance(rank, bool) or not isinstance(rank, (int, float)) or not math.isfinite(rank) or int(rank) != rank or rank < 1:
        raise UniAPError(f"{where}.powersgd_rank must be an integer >= 1, got {rank!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise UniAPError(f"{where}.topk_ratio must be in (0, 1], got {ratio!r}")


def _choice(lp: LayerPlan) -> tuple[Any, ...]:
    return (lp.stage, lp.dp, lp.tp, lp.dp_mode, lp.recompute, lp.compression)


def _layer_plan(name: str, stage: int, strategy: Any) -> LayerPlan:
    if hasattr(strategy, "dp_mode"):  # a cost-model Strategy or a LayerPlan
        d, t = (strategy.dp, strategy.tp) if hasattr(strategy, "dp") else (strategy.d, strategy.t)
        mode, rec, comp = strategy.dp_mode, bool(strategy.recompute), strategy.compression
    elif len(strategy) == 3:
        d, t, sh = strategy
        mode, rec, comp = ("zero3" if sh else "replicate"), False, "none"
    else:
        d, t, mode, rec, comp = strategy
    if d == 1:  # one copy: nothing to shard or compress
        mode, comp = "replicate", "none"
    return LayerPlan(name, stage, int(d), int(t), str(mode), bool(rec), str(comp))


def _layer_from_dict(x: dict[str, Any], version: int) -> LayerPlan:
    d, t = int(x["dp"]), int(x["tp"])
    if version == 1:
        mode = "zero3" if bool(x["shard"]) and d > 1 else "replicate"
        return LayerPlan(str(x["name"]), int(x["stage"]), d, t, mode)
    rec = x.get("recompute", False)
    if not isinstance(rec, bool):
        raise UniAPError(f"plan layer {x.get('name')!r}: recompute must be true or false, got {rec!r}")
    return LayerPlan(str(x["name"]), int(x["stage"]), d, t, str(x["dp_mode"]), rec, str(x.get("compression", "none")))


def _int_pair(value: Any, where: str) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise UniAPError(f"plan field '{where}' must be [first, last] layer indices, got {value!r}")
    return int(value[0]), int(value[1])
