"""UniAP's outer search: enumerate ``(pp, c)``, prune by bound, solve the rest best-bound first.

For every candidate ``(pp, c)`` (pipeline degree, micro-batch count) the MILP of :mod:`.milp` chooses the stage
split and per-layer strategies. Candidates are visited in order of a cheap lower bound on their time per
iteration (:mod:`.bounds`); a candidate whose bound cannot beat the best plan found so far is pruned without a
solve, and every solve gets the incumbent (at first the best uniform plan or baseline) as a cutoff. The result
is exact when every solve reports optimal (``SolverInfo.status == "optimal"``); when the deadline stops the
search, the plan carries the remaining MIP gap.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, replace

from uniap_lightning.planner.cluster import GIB
from uniap_lightning.planner.cost.evaluate import bubble_s, evaluate
from uniap_lightning.planner.cost.layer import Strategy, cost_cache
from uniap_lightning.planner.cost.tables import CostTables, TabulationStopped
from uniap_lightning.planner.dimensions.precision import default_precision_problem
from uniap_lightning.errors import InfeasibleError, UniAPError
from uniap_lightning.planner.plan import Plan, SolverInfo
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.search_options import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, check_solver
from uniap_lightning.planner.schedule_rules import SPLIT_BACKWARD, unsupported
from uniap_lightning.planner.solver.bounds import least_memory_bytes, memory_lower_bound_bytes, time_lower_bound_s
from uniap_lightning.planner.solver.group_splits import SPLIT_BUDGET_S, split_floor_s, surviving_splits
from uniap_lightning.planner.solver.parallel import Pool, solve_candidate, worker_count
from uniap_lightning.planner.solver.backend import Deadline, no_gc, now_s, solver_available
from uniap_lightning.planner.solver.uniform import best_uniform

#: a candidate's first solve gets this share of the search's time (at least SLICE_MIN_S) while other candidates
#: wait; one that runs out goes back into the queue, behind the candidates tried fewer times, with twice the time
SLICE_FRACTION = 0.1
SLICE_MIN_S = 2.0
Progress = Callable[[str], None]


def resolve_solver(name: str) -> str:
    check_solver(name)
    if name == "auto":
        return "highs" if solver_available("highs") else "cbc"
    if not solver_available(name):
        hint = " (pip install 'uniap-lightning[highs]', which installs highsbox)" if name == "highs" else ""
        raise UniAPError(f"solver={name!r} is not available in this environment{hint}")
    return name


@dataclass
class Candidate:
    pp: int
    c: int
    tables: CostTables  # priced under the candidate's schedule and virtual stages (tables.schedule, tables.v)
    bound_s: float
    warm: Plan | None = None
    trace_record: dict | None = None  # its record in the search trace, once handed out (one, also when solved again)
    slice_s: float | None = None  # the time slice of its next solve
    refined: bool = False  # its bound holds the refined floors (computed when it first reaches the front)
    group_memory: bool = False  # ... and each device group's memory (when it first comes back after a slice ran out)
    resolves: int = 0  # how often its slice ran out and it went back into the queue
    split_cutoff_s: float = float("inf")  # the incumbent its group splits were computed for (group_splits)

    @property
    def record(self) -> dict:
        """The candidate's identity in the search trace."""
        return {"pp": self.pp, "microbatches": self.c, "schedule": self.tables.schedule,
                "virtual_stages": self.tables.v}

    def label(self) -> str:
        t = self.tables
        return f"pp={self.pp} c={self.c} {t.schedule}" + (f" v={t.v}" if t.v > 1 else "")


def _order(cand: Candidate) -> tuple[int, float]:
    """The queue's order: candidates tried fewer times first, then by bound."""
    return cand.resolves, cand.bound_s


def _candidates(
    problem: Problem, pp: list[int] | None, allowed, trace: list[dict], deadline: Deadline
) -> tuple[list[Candidate], bool]:
    """The candidates that may fit memory, with their bounds; and whether the deadline cut the enumeration
    short (a 10,000-layer chain takes seconds per candidate to tabulate). One table per ``(pp, c)``, priced under
    each ``(schedule, virtual_stages)`` of :meth:`TrainingConfig.schedule_candidates` (the per-layer terms do not
    depend on the schedule; its in-flight counts and time formula do)."""
    pps = problem.pp_candidates() if pp is None else pp
    bad = [p for p in pps if p not in problem.pp_candidates()]
    if bad:
        raise UniAPError(f"pp={bad} is not a usable pipeline degree here; usable: {problem.pp_candidates()}")
    out, skipped = [], []
    shapes = [(p, c) for p in pps for c in problem.training.microbatch_candidates()]
    for n_done, (p, c) in enumerate(shapes):
        if deadline.remaining_s() <= 0:
            trace += [{"pp": q, "microbatches": d, "outcome": "not considered (time limit)", "tpi_s": None,
                       "bound_s": None} for q, d in shapes[n_done:]]
            if not out:
                raise UniAPError(_out_of_time(problem, f"after {n_done} of {len(shapes)} (pp, c) candidates"))
            return out, True
        try:
            t = CostTables(problem, p, c, allowed=allowed, stop=lambda: deadline.remaining_s() <= 0)
        except TabulationStopped:
            trace += [{"pp": q, "microbatches": d, "outcome": "not considered (time limit)", "tpi_s": None,
                       "bound_s": None} for q, d in shapes[n_done:]]
            if not out:
                raise UniAPError(_out_of_time(problem, f"after {n_done} of {len(shapes)} (pp, c) candidates")) from None
            return out, True
        split_tables = None  # the table the zero-bubble schedules may use (the runtime's rules, planner.schedule_rules)
        for schedule, v in problem.training.schedule_candidates(p, c, len(t.layers)):
            if schedule in SPLIT_BACKWARD:
                if split_tables is None:
                    split_tables = _split_backward_tables(problem, t, p, c, allowed, schedule)
                ts = split_tables.with_schedule(schedule, v)
            else:
                ts = t.with_schedule(schedule, v)
            if not ts.feasible_shape:
                continue
            mem = memory_lower_bound_bytes(ts)
            if mem > problem.cluster.largest_memory_bytes:
                skipped.append(ts)  # cannot fit: no solve needed
                trace.append({"pp": p, "microbatches": c, "schedule": schedule, "virtual_stages": v,
                              "outcome": "does not fit", "tpi_s": None, "bound_s": None, "memory_bound_bytes": mem})
                continue
            out.append(Candidate(p, c, ts, time_lower_bound_s(ts)))
    if not out and skipped:
        raise InfeasibleError(_no_fit(problem, skipped, deadline))
    if not out:
        B = problem.training.global_batch_size
        raise UniAPError(
            f"batch_size={B}: no (pp, micro-batch count) candidate gives every layer a usable strategy on "
            f"{problem.num_devices} devices; each micro-batch must split over the data-parallel ranks (try a "
            f"batch size that is a multiple of {problem.num_devices})"
        )
    return out, False


def _split_backward_tables(problem: Problem, t: CostTables, pp: int, c: int, allowed, schedule: str) -> CostTables:
    """``t`` without the strategies a split-backward (zero-bubble) schedule does not run; ``t`` itself when it has
    none of them."""
    if all(unsupported(schedule, k) is None for row in t.strategies for k in row):
        return t
    keep = lambda k: (allowed is None or allowed(k)) and unsupported(schedule, k) is None  # noqa: E731
    return CostTables(problem, pp, c, allowed=keep)


def _out_of_time(problem: Problem, where: str) -> str:
    return (f"the time limit ran out {where} without a plan that fits for '{problem.model.model}' on "
            f"'{problem.cluster.name}'; give the planner more time (time_limit)")


def _no_fit(problem: Problem, tables: list[CostTables], deadline: Deadline) -> str:
    """The message for "nothing fits", with the least memory any plan needs: exact per candidate while time
    remains, the cheap bound after that (both are lower bounds)."""
    least_bytes = min(
        least_memory_bytes(t) if deadline.remaining_s() > 0 else memory_lower_bound_bytes(t) for t in tables
    )
    return (
        f"no plan fits in memory: the least memory per device any plan needs is {least_bytes / GIB:.2f} GiB "
        f"(lower bound), but '{problem.cluster.name}' devices have {problem.cluster.largest_memory_bytes / GIB:.2f} GiB "
        "usable (memory_gib - memory_reserved_gib); use more devices, devices with more memory, a smaller batch "
        "size or a smaller model"
    )


def _warm_starts(problem: Problem, cands: list[Candidate], deadline: Deadline) -> Plan | None:
    """Give each candidate its best memory-feasible uniform plan (strategies every layer allows here); return the
    best overall."""
    for cand in cands:
        ks = cand.tables.strategies
        uniform = [k for k in dict.fromkeys(s for row in ks for s in row) if all(k in row for row in ks)]
        cand.warm = best_uniform(problem, ((cand.pp, cand.c, k) for k in uniform), deadline=deadline,
                                 schedule=cand.tables.schedule, virtual_stages=cand.tables.v)
    return min((cd.warm for cd in cands if cd.warm is not None), key=lambda p: p.estimate.tpi_s, default=None)


def _from_milp(problem: Problem, cand: Candidate, stages: list[int], ks: list[int]) -> Plan:
    t = cand.tables
    return problem.plan_for(stage_of_layer=stages, strategies=[t.strategies[u][k] for u, k in enumerate(ks)],
                            pp=cand.pp, microbatches=cand.c, schedule=t.schedule, virtual_stages=t.v)


@no_gc()  # also when called directly (tests, baselines): see no_gc
@cost_cache()  # the cost model's cache: this search's (or the enclosing solve's), cleared when it ends
def search(
    problem: Problem,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    pp: list[int] | None = None,
    allowed: Callable[[Strategy], bool] | None = None,
    incumbent: Plan | None = None,
    progress: Progress | None = None,
    deadline: Deadline | None = None,
    workers: int | None = None,
) -> Plan:
    """Exact search over ``(pp, c)`` and the MILP; ``allowed`` restricts strategies (for baselines).

    ``workers``: processes solving candidates at once (None: one per core when the problem is big enough to pay
    for spawning them, :func:`~.parallel.worker_count`; 1: in this process).

    Everything (tables, bounds, warm starts, solves) ends by ``deadline``, or ``time_limit_s`` from now when no
    deadline is given; a solver is never given less than ``backend.MIN_SOLVE_S``.

    Where the problem allows precisions beyond the run's own that the device runs, the space without them is
    searched first, as if they were not allowed (the same deadline), and the whole space then gets the time left
    with that plan as its incumbent (a cutoff for every solve, a bound that prunes): the result is never slower than
    the plan the same call finds with them off. Without them nothing changes, nor in a search restricted by
    ``allowed`` (the baselines', which rule them out themselves).
    """
    deadline = deadline if deadline is not None else Deadline.after(time_limit_s)
    narrow = default_precision_problem(problem) if allowed is None else None
    if narrow is None:
        return _search(problem, solver=solver, pp=pp, allowed=allowed, incumbent=incumbent, progress=progress,
                       deadline=deadline, workers=workers)
    t_start, say = now_s(), progress or (lambda _msg: None)
    say("first the space in the run's own precision")
    try:
        first = _search(narrow, solver=solver, pp=pp, allowed=allowed, incumbent=incumbent, progress=progress,
                        deadline=deadline, workers=workers)
    except UniAPError:  # nothing fits in the run's precision (ZeRO-3's low-precision gathers take less): search on
        first = None
    if first is not None:  # the narrow search's best, the given incumbent among what it compared
        incumbent = first
    say("then the whole space: " + (f"{first.estimate.tpi_s * 1e3:.2f} ms to beat" if first else "no plan yet"))
    try:
        plan = _search(problem, solver=solver, pp=pp, allowed=allowed, incumbent=incumbent, progress=progress,
                       deadline=deadline, workers=workers)
    except UniAPError:
        if first is None:
            raise
        # no time left for the whole space (the first search took it): its plan, with the whole space open
        plan = first.with_report(solver=replace(first.solver, status="time_limit", gap=None))
    return plan.with_report(solver=replace(plan.solver, solve_s=now_s() - t_start))


def _search(
    problem: Problem,
    *,
    solver: str,
    pp: list[int] | None,
    allowed: Callable[[Strategy], bool] | None,
    incumbent: Plan | None,
    progress: Progress | None,
    deadline: Deadline,
    workers: int | None,
) -> Plan:
    """:func:`search` over one space."""
    t_start = now_s()
    say = progress or (lambda _msg: None)
    name = resolve_solver(solver)
    trace: list[dict] = []
    cands, cut_short = _candidates(problem, pp, allowed, trace, deadline)
    best = _warm_starts(problem, cands, deadline)
    if incumbent is not None and incumbent.estimate and incumbent.estimate.feasible and (pp is None or incumbent.pp in pp):
        if best is None or incumbent.estimate.tpi_s < best.estimate.tpi_s:
            best = incumbent
    say(f"{len(cands)} (pp, c, schedule) candidates; best uniform plan: "
        + (f"{best.estimate.tpi_s * 1e3:.2f} ms" if best else "none fits memory"))
    cands.sort(key=lambda cd: cd.bound_s)
    solved = pruned = 0
    all_optimal = not cut_short
    open_bounds: list[float] = [0.0] if cut_short else []  # candidates never tabulated: nothing is known of them
    pool = Pool(worker_count(workers, problem.num_devices, problem.model.num_layers, len(cands)))
    queue = list(cands)
    pending: dict = {}  # future -> (candidate, trace record, cutoff, whether the solve was given a time slice)
    first_slice = max(SLICE_MIN_S, SLICE_FRACTION * deadline.remaining_s())
    try:
        while queue or pending:
            while queue and len(pending) < pool.size:  # hand out candidates, best bound first
                cand = queue.pop(0)
                if cand.trace_record is None:
                    cand.trace_record = {**cand.record, "outcome": "", "tpi_s": None, "bound_s": cand.bound_s}
                    trace.append(cand.trace_record)
                record = cand.trace_record
                # past the deadline no costlier floor (each takes up to a second, and a hundred candidates may
                # wait): each is pruned by, or reported with, the bound it already has
                past = deadline.remaining_s() <= 0
                # the costlier floors, for the candidates that get this far only; the costliest (seconds) for those
                # a first slice did not close (its MILP, built again, gets them as rows)
                if not past and (not cand.refined or (cand.resolves and not cand.group_memory)):
                    cand.refined, cand.group_memory = True, cand.resolves > 0
                    floor = time_lower_bound_s(cand.tables, refined=True, group_memory=cand.group_memory)
                    cand.bound_s = record["bound_s"] = max(cand.bound_s, floor)
                    if queue and _order(queue[0]) < _order(cand):  # no longer the most promising: back in order
                        insort(queue, cand, key=_order)
                        continue
                # and, for one a slice did not close, each device group's splits that can still beat the incumbent
                # (again when the incumbent improved): its MILP gets them as rows; none for some group: pruned
                if (not past and cand.resolves and best is not None
                        and best.estimate.tpi_s < cand.split_cutoff_s * (1 - 1e-9)):
                    cand.split_cutoff_s = best.estimate.tpi_s
                    table = surviving_splits(cand.tables, cand.split_cutoff_s,
                                             budget_s=min(SPLIT_BUDGET_S, 0.25 * deadline.remaining_s()))
                    cand.bound_s = record["bound_s"] = max(cand.bound_s, split_floor_s(table))
                if best is not None and cand.bound_s >= best.estimate.tpi_s * (1 - 1e-9):
                    pruned += 1
                    record["outcome"] = "pruned by bound"
                    continue
                remaining = deadline.remaining_s()
                if remaining <= 0:
                    all_optimal = False
                    open_bounds.append(cand.bound_s)
                    # (a candidate back in the queue keeps what its last solve found: "feasible", "no_solution")
                    record["outcome"] = record["outcome"] or "not solved (time limit)"
                    continue
                # a time slice while other candidates wait, so one hard candidate cannot starve the rest; the
                # last ones get what is left
                cand.slice_s = cand.slice_s or first_slice
                limit = min(remaining, cand.slice_s) if queue else remaining
                cutoff = best.estimate.tpi_s if best else None
                pending[pool.submit(cand.tables, name, limit, cutoff)] = (cand, record, cutoff, limit < remaining)
            if not pending:
                continue
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in done:
                cand, record, cutoff, sliced = pending.pop(fut)
                try:
                    res = fut.result()
                except Exception:  # noqa: BLE001 - a worker that died (memory, signal): solve it here instead
                    res = solve_candidate(cand.tables, name, max(deadline.remaining_s(), 0.0), cutoff)
                    sliced = False
                solved += 1
                say(f"{cand.label()}: {res.status} in {res.solve_s:.2f} s "
                    f"({res.num_vars} vars, {res.num_constrs} rows)"
                    + (f", {res.objective_s * 1e3:.3f} ms" if res.objective_s is not None else ""))
                record.update(outcome=res.status if res.status != "infeasible" else "no better plan (infeasible)",
                              tpi_s=res.objective_s, solve_s=record.get("solve_s", 0.0) + res.solve_s)
                if res.bound_s is not None:
                    cand.bound_s = max(cand.bound_s, res.bound_s)
                    record["bound_s"] = cand.bound_s
                unfinished = res.status not in ("optimal", "infeasible")
                if unfinished and sliced and deadline.remaining_s() > 0:
                    # its slice ran out: back into the queue behind every candidate not tried as often (by bound
                    # among those tried as often), with twice the time next turn
                    cand.slice_s *= 2
                    cand.resolves += 1
                    record["resolves"] = cand.resolves
                    insort(queue, cand, key=_order)
                elif unfinished:
                    all_optimal = False
                    open_bounds.append(cand.bound_s)
                if res.stage_of_layer is None:
                    continue
                plan = _from_milp(problem, cand, res.stage_of_layer, res.strategy_index)
                plan = plan.with_report(estimate=evaluate(problem, plan))
                record["bubble_s"] = bubble_s(plan)
                if plan.estimate.feasible and (best is None or plan.estimate.tpi_s < best.estimate.tpi_s):
                    best = plan.with_report(solver=SolverInfo(name, res.status, res.gap, 0.0,
                                                              objective_s=res.objective_s))
    finally:
        pool.close()
    if best is None and not all_optimal:
        raise UniAPError(_out_of_time(problem, "before any candidate was solved"))
    if best is None:
        raise InfeasibleError(_no_fit(problem, [cd.tables for cd in cands], deadline))
    gap = 0.0
    if not all_optimal and open_bounds:
        gap = max(0.0, (best.estimate.tpi_s - min(open_bounds)) / best.estimate.tpi_s)
    objective = best.solver.objective_s if best.solver else best.estimate.tpi_s
    return best.with_report(solver=SolverInfo(
        name=name,
        status="optimal" if all_optimal or gap == 0 else "time_limit",
        gap=gap,
        solve_s=now_s() - t_start,
        candidates=len(cands),
        solved=solved,
        pruned=pruned,
        objective_s=objective,
    ), search=trace)
