"""The strategy's options that setup reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import cluster_from
from uniap_lightning.planner.dimensions import OPT_INS, opt_ins
from uniap_lightning.planner.dimensions.compression import compression_methods
from uniap_lightning.planner.search_options import (DEFAULT_SCHEDULE, DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S,
                                                   check_pipeline_degrees, check_schedule_name, check_solver,
                                                   check_time_limit, check_virtual_stages)
from uniap_lightning.planner.plan import (COMPRESSION_DEFAULTS, COMPRESSION_RUNTIME_DEFAULTS, Plan,
                                         check_compression_options)
from uniap_lightning.profiling.cache import default_profile_cache_dir
from uniap_lightning.runtime.planning import default_cache_dir


@dataclass(frozen=True)
class SetupOptions:
    """The strategy's options that setup reads (see ``UniAPStrategy``'s docstring for each)."""

    cluster: Cluster | None = None
    pinned_plan: Plan | None = None
    schedule: str = DEFAULT_SCHEDULE
    #: pipeline stages per device (None: searched with the schedule)
    virtual_stages: int | None = None
    #: the pipeline degrees the search may use (``None``: all that divide the world size)
    pp: tuple[int, ...] | None = None
    solver: str = DEFAULT_SOLVER
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    profile_path: Path | None = None
    cache_dir: Path | None = None
    measure_cluster: bool = True
    profile_cache: bool = True
    profile_repeats: int = 3
    profile_micro_batches: tuple[int, ...] | None = None
    #: gradient compression methods the planner may choose per replicated / ZeRO-1 layer (always with "none")
    compression: tuple[str, ...] = ("none",)
    #: the compressors' parameters the planner prices and stamps into the plan (``powersgd_rank``, ``topk_ratio``)
    compression_options: tuple[tuple[str, float], ...] = tuple(sorted(COMPRESSION_DEFAULTS.items()))
    #: each opt-in dimension's allowed per-layer values, as (option, values) pairs (values empty: off), from the
    #: strategy's keywords (:data:`~uniap_lightning.planner.dimensions.OPT_INS`)
    opt_ins: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def from_arguments(cls, *, cluster: Any, plan: Any, schedule: str, solver: str, time_limit: float, profile: Any,
                       cache_dir: Any, measure_cluster: bool, profile_cache: bool, profile_repeats: int,
                       profile_micro_batches: Any, compression: Any = None,
                       compression_options: Any = None, pp: Any = None,
                       virtual_stages: Any = None, **opt_in: Any) -> SetupOptions:
        """Check and normalize ``UniAPStrategy``'s arguments (clear errors when the strategy is built); ``opt_in``:
        the opt-in dimensions' options by name (:data:`~uniap_lightning.planner.dimensions.OPT_INS`)."""
        methods = compression_methods(compression)  # the check `uniap plan` and the problem run: the same line
        # the checks `uniap plan` runs too (planner.search_options): the same verdict and line on both
        schedule = check_schedule_name(schedule)
        virtual_stages = check_virtual_stages(virtual_stages, schedule)
        solver = check_solver(solver)
        time_limit = check_time_limit(time_limit)
        if isinstance(cluster, (str, Mapping)):
            cluster = cluster_from(cluster if isinstance(cluster, str) else dict(cluster))
        elif cluster is not None and not isinstance(cluster, Cluster):
            raise UniAPError(f"cluster must be a Cluster, a dict, a conf/cluster name or None, got "
                             f"{type(cluster).__name__}")
        degrees = check_pipeline_degrees(pp)
        allowed = opt_ins(opt_in)
        if plan is not None:
            _refuse_search_options(schedule=schedule, virtual_stages=virtual_stages, pp=pp,
                                   compression=None if methods == ("none",) else compression,
                                   compression_options=compression_options, **opt_in)
        if plan is not None and not isinstance(plan, Plan):
            plan = Plan.from_json(Path(plan))
        if plan is not None and cluster is not None:
            for o in OPT_INS.values():
                if o.check_plan is not None:
                    o.check_plan(plan, cluster)
        return cls(
            cluster=cluster, pinned_plan=plan, schedule=schedule, virtual_stages=virtual_stages, pp=degrees,
            solver=solver,
            time_limit_s=time_limit,
            profile_path=Path(profile) if profile is not None else None,
            cache_dir=Path(cache_dir) if cache_dir is not None else None, measure_cluster=bool(measure_cluster),
            profile_cache=bool(profile_cache), profile_repeats=max(int(profile_repeats), 1),
            profile_micro_batches=tuple(profile_micro_batches) if profile_micro_batches else None,
            compression=methods,
            compression_options=tuple(sorted(_compression_options(compression_options).items())),
            opt_ins=tuple(allowed.items()),
        )

    @property
    def compression_options_dict(self) -> dict[str, float]:
        return dict(self.compression_options)

    @property
    def opt_ins_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.opt_ins)

    def profile_cache_dir(self) -> Path:
        return self.cache_dir / "profiles" if self.cache_dir is not None else default_profile_cache_dir()

    def plan_cache_dir(self) -> Path:
        return self.cache_dir or default_cache_dir()


#: the options that only steer the planner's search, with their "not given" values: a pinned plan fixes each
#: (its own schedule, virtual_stages, pp, per-layer compression and compression_options, and what each opt-in
#: dimension chose per layer), so none may come with one
SEARCH_OPTIONS: dict[str, tuple[Any, ...]] = {"schedule": ("auto",), "virtual_stages": (None,), "pp": (None,),
                                              "compression": (None, "none"), "compression_options": (None, {}),
                                              **{name: o.off for name, o in OPT_INS.items()}}


def _refuse_search_options(**given: Any) -> None:
    """With a pinned plan, an option of :data:`SEARCH_OPTIONS` other than its default would be ignored: refused,
    as ``pp`` always was, in one line naming it."""
    for key, defaults in SEARCH_OPTIONS.items():
        value = given.get(key)
        if not any(value is d or (d is not None and value == d) for d in defaults):
            fixed = ("its own compression_options (edit the plan file's)" if key == "compression_options" else
                     "each layer's compression" if key == "compression" else
                     f"its own {OPT_INS[key].pinned}" if key in OPT_INS else f"its own {key}")
            raise UniAPError(f"{key}={value!r} steers the planner's search; a pinned plan (plan=) is not searched and "
                             f"has {fixed}: give one of them (drop {key}= to run the plan, or plan= to solve)")



def _compression_options(value: Any) -> dict[str, float]:
    """``compression_options`` checked: a mapping of known keys, ``powersgd_rank`` an integer >= 1, ``topk_ratio`` in
    (0, 1]; missing keys take the plan defaults."""
    if value is None:
        return dict(COMPRESSION_DEFAULTS)
    if not isinstance(value, Mapping):
        raise UniAPError(f"compression_options must be a dict like {{'powersgd_rank': 4, 'topk_ratio': 0.1}}, got "
                         f"{value!r}")
    known = {**COMPRESSION_DEFAULTS, **COMPRESSION_RUNTIME_DEFAULTS}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise UniAPError(f"compression_options has unknown key(s) {unknown}; known: {sorted(known)}")
    out = {**COMPRESSION_DEFAULTS, **dict(value)}
    rank, ratio = out["powersgd_rank"], out["topk_ratio"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UniAPError(f"compression_options.powersgd_rank must be an integer >= 1, got {rank!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise UniAPError(f"compression_options.topk_ratio must be a number in (0, 1], got {ratio!r}")
    check_compression_options(dict(value), "compression_options")  # the run-time keys (start_iter, ...)
    runtime = {k: type(COMPRESSION_RUNTIME_DEFAULTS[k])(v) for k, v in value.items() if k in COMPRESSION_RUNTIME_DEFAULTS}
    return {"powersgd_rank": int(rank), "topk_ratio": float(ratio), **runtime}
