"""python-mip plumbing shared by every MILP: solver availability, model settings, cutoff, status and units.

Units inside a model are milliseconds and GiB (``MS``, ``GIB``): coefficient ranges of 1e-4..1e10 (seconds and
bytes) made CBC and HiGHS disagree by up to 60% on the same instance (see ``planner.md``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mip

from uniap_lightning.planner.cluster import GIB  # noqa: F401  (re-exported: the memory unit of every model)

MS = 1e3  # seconds -> milliseconds inside the model


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
    """Only plans better than ``cutoff_s`` (the incumbent) are of interest.

    CBC takes it natively (``Model.cutoff``) and prunes with it. python-mip's HiGHS backend ignores
    ``Model.cutoff`` (and then reported a worse incumbent as "optimal" in our tests), and an explicit objective
    row slowed HiGHS down 20x on a 256-device instance (70 s vs 2.8 s), so HiGHS solves the candidate in full;
    the search's own lower bounds do the pruning.
    """
    if model.solver_name.upper() == "CBC":
        model.cutoff = cutoff_s * MS * (1 + 1e-9)


def optimize(model: mip.Model, time_limit_s: float) -> tuple[str, float | None, float | None, float]:
    """Run the solver; return (status, objective seconds or None, bound seconds or None, wall seconds)."""
    t0 = time.perf_counter()
    status = model.optimize(max_seconds=max(time_limit_s, 0.1))
    solve_s = time.perf_counter() - t0
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
