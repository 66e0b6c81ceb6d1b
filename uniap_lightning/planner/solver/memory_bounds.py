"""Memory bounds per ``(pp, c)`` candidate (:mod:`.bounds`), in bytes: the least memory any stage must hold, and the
least largest stage memory over every split into stages, which explains a candidate that does not fit.
"""

from __future__ import annotations

from uniap_lightning.planner.cost.tables import CostTables

def memory_lower_bound_bytes(t: CostTables) -> float:
    """Cheap bound: the busiest stage holds at least its share of every layer's least memory, and at least the
    hungriest single layer (each on the stage with the fewest micro-batches in flight)."""
    lightest = min(range(t.stages), key=t.in_flight)
    least = [min(t.layer_memory_bytes(lightest, k) for k in costs) for costs in t.cost]
    return max(sum(least) / t.pp, max(least))


def least_memory_bytes(t: CostTables, *, rel_tol: float = 1e-9) -> float:
    """The least peak memory per device any plan of this candidate can have: the minimum over contiguous splits
    into ``pp`` non-empty stages of the largest stage, each layer at its least-memory strategy (the FSDP gather
    term bounded below by 0); to ``rel_tol``, from above.

    Bisection on the answer ``X`` with a greedy feasibility test from the last stage backwards: each stage takes
    the longest suffix of what is left that fits ``X``. That is exact because a layer costs no more on a later
    stage (``in_flight`` never grows with the stage index), so a greedy that is ahead never has to place a layer
    where it costs more than in any feasible split. ``O(L * F + iterations * P log L)`` for ``F`` distinct
    in-flight counts, where the dynamic program it replaces was ``O(P L^2)``.
    """
    if t.stages != t.pp:  # several stages per device: the cheap bound (still a lower bound)
        return memory_lower_bound_bytes(t)
    L, P = len(t.layers), t.pp
    prefix: dict[int, list[float]] = {}
    stage_prefix = []
    for i in range(P):
        F = t.in_flight(i)
        if F not in prefix:
            acc, run = [0.0], 0.0
            for costs in t.cost:
                run += min(t.layer_memory_bytes(i, k) for k in costs)
                acc.append(run)
            prefix[F] = acc
        stage_prefix.append(prefix[F])

    def split_max(limit: float) -> float | None:
        """Largest stage of the backward greedy split under ``limit``, or None if it does not fit."""
        end, worst = L, 0.0
        for i in range(P - 1, 0, -1):
            acc = stage_prefix[i]
            # smallest start s >= i (stages 0..i-1 keep a layer each) with acc[end] - acc[s] <= limit
            s = max(bisect_left_value(acc, acc[end] - limit, i, end - 1), i)
            if acc[end] - acc[s] > limit:
                return None
            worst, end = max(worst, acc[end] - acc[s]), s
        first = stage_prefix[0][end]
        return None if first > limit else max(worst, first)

    hi = max(stage_prefix[0][L], max(p[L] for p in stage_prefix))
    lo = 0.0
    best = split_max(hi)
    while best is not None and hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        got = split_max(mid)
        if got is None:
            lo = mid
        else:
            hi, best = got, got
    return best if best is not None else float("inf")


def bisect_left_value(acc: list[float], value: float, lo: int, hi: int) -> int:
    """First index ``s`` in ``[lo, hi]`` with ``acc[s] >= value`` (``acc`` non-decreasing), else ``hi``."""
    while lo < hi:
        mid = (lo + hi) // 2
        if acc[mid] >= value:
            hi = mid
        else:
            lo = mid + 1
    return lo
