"""A plan read from its JSON (:meth:`Plan.from_dict <uniap_lightning.planner.plan.Plan.from_dict>`): every field
with its JSON type (:mod:`uniap_lightning.planner.fields`), each layer's decision through the dimension registry,
and the version history's defaults (see :mod:`.plan`). Every failure is one
:class:`~uniap_lightning.errors.UniAPError` naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner import dimensions
from uniap_lightning.planner import fields as F
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan_records import (
    COMPRESSION_DEFAULTS,
    PLAN_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    Estimate,
    LayerPlan,
    SolveReport,
    SolverInfo,
    StagePlan,
)

if TYPE_CHECKING:
    from uniap_lightning.planner.plan import Plan

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
