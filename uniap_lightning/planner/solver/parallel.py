"""Solving independent ``(pp, c)`` candidates in parallel processes.

Each candidate's MILP is independent of the others; only the incumbent (for pruning and CBC's cutoff) is shared,
and the search reads it whenever a solve finishes. A worker is a fresh interpreter (``python -m`` this module:
spawned, never forked, since python-mip's solver libraries and cffi locks do not survive a fork, and unlike
``multiprocessing``'s spawn it does not re-import the caller's ``__main__``, which for a training script means
torch and Lightning, seconds per worker, or an unguarded script run again). It reads the candidate's pickled cost
table on stdin, so it recomputes nothing, and writes the pickled result; threads of a
``concurrent.futures.ThreadPoolExecutor`` wait on the workers. A worker gets the time left on the search's one
deadline when its candidate is handed out, and is killed shortly after that time if it has not answered.

Parallel solving pays only when solves are long: a worker imports python-mip and the planner (about half a
second), so :func:`worker_count` keeps small problems in-process.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver import backend
from uniap_lightning.planner.solver.backend import MilpResult, no_gc
from uniap_lightning.planner.solver.milp import GroupedMilp

#: a problem whose devices x layers is below this is solved in-process (its candidates take well under a second)
PARALLEL_MIN_WORK = 64 * 32


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_count(workers: int | None, num_devices: int, num_layers: int, candidates: int) -> int:
    """Processes to solve ``candidates`` with: ``workers`` if given (1: in-process), else one per core (at most 8)
    when the problem is big enough for spawning to pay, else 1."""
    if workers is not None:
        return max(1, min(int(workers), candidates))
    if num_devices * num_layers < PARALLEL_MIN_WORK or candidates < 2:
        return 1
    return max(1, min(available_cores(), 8, candidates))


def solve_candidate(tables: CostTables, solver: str, time_limit_s: float, cutoff_s: float | None) -> MilpResult:
    """Build and solve one candidate's MILP (in this process or a worker) within ``time_limit_s`` from now,
    building included."""
    t0 = backend.now_s()
    with no_gc():
        milp = GroupedMilp(tables, solver=solver)
        left = time_limit_s - (backend.now_s() - t0)
        return milp.solve(time_limit_s=max(left, 0.0), cutoff_s=cutoff_s)


WORKER_GRACE_S = 10.0  # beyond its time limit: python-mip may overrun it a little, and the worker must start


def solve_in_worker(tables: CostTables, solver: str, time_limit_s: float, cutoff_s: float | None) -> MilpResult:
    """:func:`solve_candidate` in a fresh interpreter; raises RuntimeError if the worker fails."""
    # the worker's clock starts now: what it spends starting up and reading the table comes off its limit
    started = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process of this machine
    payload = pickle.dumps((tables, solver, time_limit_s, cutoff_s, started), protocol=pickle.HIGHEST_PROTOCOL)
    proc = subprocess.run([sys.executable, "-m", __name__], input=payload, capture_output=True, check=False,
                          timeout=time_limit_s + WORKER_GRACE_S)
    if proc.returncode != 0:
        raise RuntimeError(f"solver worker exited with {proc.returncode}: {proc.stderr.decode(errors='replace')[-500:]}")
    return pickle.loads(proc.stdout)  # noqa: S301 - our own child's answer


class Pool:
    """``size`` workers (``size == 1``: everything runs in this process, synchronously)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ex: ThreadPoolExecutor | None = None

    def submit(self, tables: CostTables, solver: str, time_limit_s: float, cutoff_s: float | None) -> Future:
        if self.size <= 1:
            fut: Future = Future()
            fut.set_result(solve_candidate(tables, solver, time_limit_s, cutoff_s))
            return fut
        if self._ex is None:
            self._ex = ThreadPoolExecutor(self.size, thread_name_prefix="uniap-solver")
        return self._ex.submit(solve_in_worker, tables, solver, time_limit_s, cutoff_s)

    def close(self) -> None:
        if self._ex is not None:
            # workers still solving stop at their own time limit, which ends by the search's deadline
            self._ex.shutdown(wait=False, cancel_futures=True)
            self._ex = None


def _worker_main() -> None:
    tables, solver, time_limit_s, cutoff_s, started = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 - parent's
    result = solve_candidate(tables, solver, time_limit_s - (time.monotonic() - started), cutoff_s)
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    _worker_main()
