"""python-mip plumbing shared by every MILP: solver availability, model settings, cutoff, status and units.

Units inside a model are milliseconds and GiB (``MS``, ``GIB``): coefficient ranges of 1e-4..1e10 (seconds and
bytes) made CBC and HiGHS disagree by up to 60% on the same instance (see ``planner.md``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mip

MS = 1e3  # seconds -> milliseconds inside the model


def now_s() -> float:
    """The clock every time limit is measured on (monotonic; the tests replace it with a fake one)."""
    return time.monotonic()


@dataclass(frozen=True)
class Deadline:
    """The moment a whole ``solve`` must be done by. Passed down rather than re-derived from a duration, so the
    baselines' searches and the main search spend one budget instead of each starting a fresh one."""

    at_s: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(now_s() + seconds)

    def remaining_s(self) -> float:
        return max(0.0, self.at_s - now_s())

    def share(self, fraction: float) -> Deadline:
        """An earlier deadline: ``fraction`` of the time left from now."""
        return Deadline(now_s() + fraction * self.remaining_s())


@dataclass
class MilpResult:
    status: str  # "optimal" | "feasible" | "infeasible" | "no_solution"
    objective_s: float | None
    bound_s: float | None
    stage_of_layer: list[int] | None
    strategy_index: list[int] | None
    build_s: float
    solve_s: float
    num_vars: int
    num_constrs: int

    @property
    def gap(self) -> float | None:
        if self.objective_s is None or self.bound_s is None or self.objective_s <= 0:
            return None
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


@contextmanager
def no_gc() -> Iterator[None]:
    """python-mip's HiGHS backend frees models from cffi finalizers; a garbage-collection pass that runs one
    while cffi holds its lock deadlocked a spawned process. Collect before, not during, a solve: once, on the
    outermost entry, and only the youngest generation. Nothing is collected while collection is off, so what the
    previous solve left (its models among it) is all still in that generation; a full pass would also walk
    everything the process holds (a trainer, a model, a test session: 0.1-1 s each time), and the bounds enter
    here thousands of times per search."""
    enabled = gc.isenabled()
    if enabled:
        gc.collect(0)
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def solver_available(name: str) -> bool:
    try:
        m = mip.Model(solver_name=_mip_name(name))
        m.verbose = 0
        return True
    except Exception:  # python-mip raises various errors when a solver library cannot be loaded
        return False


def new_model(solver: str, threads: int = 1) -> mip.Model:
    """A silent minimization model with gaps tight enough for exact answers (the tests compare to 1e-6)."""
    m = mip.Model(sense=mip.MINIMIZE, solver_name=_mip_name(solver))
    m.verbose = 0
    m.threads = threads
    m.max_mip_gap = 1e-9
    m.max_mip_gap_abs = 1e-7
    return m


def _mip_name(name: str) -> str:
    return {"cbc": mip.CBC, "highs": "HiGHS", "gurobi": mip.GUROBI}[name]


def add_cutoff(model: mip.Model, tpi: mip.LinExpr, cutoff_s: float) -> None:
    """Only plans better than ``cutoff_s`` (the incumbent) are of interest: the solver prunes every node whose
    bound reaches it (CBC: ``cutoff``; HiGHS: its ``objective_bound`` option, which python-mip's ``cutoff`` sets).

    HiGHS may then report "optimal" with a solution *worse* than the cutoff (found before the cutoff pruned the
    rest): that means no plan better than the cutoff exists, and :func:`cutoff_result` says so. (An explicit
    objective row instead slowed HiGHS down 20x on a 256-device instance; the option prunes: a candidate whose
    optimum is worse than the incumbent closed in 0.13 s instead of 12 s.)
    """
    model.cutoff = cutoff_s * MS * (1 + 1e-9)


def beyond_cutoff(status: str, objective_s: float | None, cutoff_s: float | None) -> bool:
    """A finished solve whose best solution is no better than the cutoff: the candidate holds no better plan."""
    return (cutoff_s is not None and status == "optimal" and objective_s is not None
            and objective_s >= cutoff_s * (1 - 1e-12))


MIN_SOLVE_S = 0.05  # the least time a solver is given: it may overrun a deadline by this much


def optimize(model: mip.Model, time_limit_s: float) -> tuple[str, float | None, float | None, float]:
    """Run the solver; return (status, objective seconds or None, bound seconds or None, wall seconds)."""
    t0 = now_s()
    status = model.optimize(max_seconds=max(time_limit_s, MIN_SOLVE_S))
    solve_s = now_s() - t0
    names = {
        mip.OptimizationStatus.OPTIMAL: "optimal",
        mip.OptimizationStatus.FEASIBLE: "feasible",
        mip.OptimizationStatus.INFEASIBLE: "infeasible",
        mip.OptimizationStatus.INT_INFEASIBLE: "infeasible",
        mip.OptimizationStatus.NO_SOLUTION_FOUND: "no_solution",
    }
    name = names.get(status, status.name.lower())
    bound = model.objective_bound
    bound_s = bound / MS if bound is not None and abs(bound) < 1e20 else None
    ok = status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) and model.num_solutions > 0
    return name, (model.objective_value / MS if ok else None), bound_s, solve_s
