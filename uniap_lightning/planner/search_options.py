"""The search options ``UniAPStrategy`` and the planning commands (``uniap plan`` / ``evaluate`` / ``explain``)
share: each one's default and its one check, so the strategy and the command line say the same of the same value.

Defaults: ``UniAPStrategy.__init__``'s signature is the one place (read from its source, without importing torch,
by :func:`~uniap_lightning.planner.config_schema.strategy_arguments`); the Hydra schemas, :func:`~.solver.solve`,
``SetupOptions`` and ``TrainingConfig`` take theirs from it through :func:`strategy_default`.

Checks: one function per option, each raising a one-line :class:`~uniap_lightning.errors.UniAPError` that names the
option and the value as given. ``SetupOptions.from_arguments`` (the strategy, and so ``uniap train``) and the
planning commands (``uniap_lightning.cli.apps``) call the same function: ``time_limit=inf`` used to pass the
strategy's check (``> 0``) and fail the command's (finite, at most :data:`MAX_TIME_LIMIT_S`); both refuse it now,
with the same line. What only one side has (a pinned plan, the command's output files) stays with that side.
"""

from __future__ import annotations

import math
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.config_schema import strategy_arguments
from uniap_lightning.planner.plan import SCHEDULES, check_schedule
from uniap_lightning.values import integer, short

#: the MILP backends: "auto" takes HiGHS when installed, else CBC
SOLVERS = ("auto", "cbc", "highs", "gurobi")
#: the longest search accepted, in seconds (about four months): a finite deadline every backend takes
MAX_TIME_LIMIT_S = 1e7
#: the largest pipeline degree and stages per device accepted (far above any cluster; keeps numbers printable)
MAX_PIPELINE_DEGREE = 2**24
MAX_VIRTUAL_STAGES = 64


def strategy_default(name: str) -> Any:
    """``UniAPStrategy``'s default for argument ``name`` (``strategy_default("time_limit") == 60.0``)."""
    for arg in strategy_arguments():
        if arg.name == name:
            return arg.default
    raise KeyError(f"UniAPStrategy has no argument {name!r}")


#: the defaults the planner's own entry points use where the strategy's option reaches them
DEFAULT_TIME_LIMIT_S: float = float(strategy_default("time_limit"))
DEFAULT_SCHEDULE: str = strategy_default("schedule")
DEFAULT_SOLVER: str = strategy_default("solver")


def check_time_limit(value: Any) -> float:
    """Seconds for the whole search: a finite number > 0 and at most :data:`MAX_TIME_LIMIT_S`."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
            or value > MAX_TIME_LIMIT_S):
        raise UniAPError(f"time_limit={short(value)}: give the search's time limit in seconds, a number > 0 and <= "
                         f"{MAX_TIME_LIMIT_S:g}")
    return float(value)


def check_solver(value: Any) -> str:
    """One of :data:`SOLVERS`."""
    if not isinstance(value, str) or value not in SOLVERS:
        raise UniAPError(f"solver={short(value)} must be one of {list(SOLVERS)}")
    return value


def check_schedule_name(value: Any) -> str:
    """``"auto"`` (the planner chooses) or one of :data:`~uniap_lightning.planner.plan.SCHEDULES`."""
    options = ("auto", *SCHEDULES)
    if not isinstance(value, str) or value not in options:
        raise UniAPError(f"schedule={short(value)} must be one of {', '.join(map(repr, options))} ('auto': the "
                         "planner chooses)")
    return value


def check_virtual_stages(value: Any, schedule: str = "auto") -> int | None:
    """Pipeline stages per device: ``None`` (searched) or an integer from 1 to :data:`MAX_VIRTUAL_STAGES`, one the
    schedule runs with when a schedule is named."""
    if value is None:
        return None
    found = integer(value, "virtual_stages", low=1, high=MAX_VIRTUAL_STAGES, unit="stages per device; None: searched")
    if schedule != "auto":
        check_schedule(schedule, found, "pipeline")
    return found


def check_pipeline_degrees(value: Any) -> tuple[int, ...] | None:
    """``pp=4`` or ``pp=[2, 4]`` as a sorted tuple of distinct degrees (``None``: every degree). Whether a degree
    suits the world size and the chain is checked where both are known."""
    if value is None:
        return None
    values = [value] if isinstance(value, (int, str, float)) else list(value) if hasattr(value, "__iter__") else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_PIPELINE_DEGREE
                         for v in values):
        raise UniAPError(f"pp={short(value if isinstance(value, (int, str, float)) else values)} must be a pipeline "
                         f"degree from 1 to {MAX_PIPELINE_DEGREE:,} or a non-empty list of them (None: any)")
    return tuple(sorted(set(values)))
