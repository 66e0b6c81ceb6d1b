"""Floors of partition problems (:mod:`.bounds`), plain arithmetic on weights: the least largest group sum when
weights are shared among groups (pigeonhole, evenly or by classes of groups), the least largest part of a sequence
cut into contiguous parts, with one weight list per part or one for all. Each is from below: a bound, never above
the exact optimum.
"""

from __future__ import annotations

from bisect import bisect_right

from uniap_lightning.planner.solver.fronts import least_holding

def pigeonhole_floor(weights: list[float], groups: int) -> float:
    """A lower bound on the largest group sum when ``weights`` (each >= 0) are shared among ``groups`` groups in any
    way: of the ``k groups + 1`` largest weights, some group holds ``k + 1``, so at least the ``k + 1`` smallest of
    them, for every ``k``; times ``1 - 1e-12`` (summed in another order a group's total may round lower)."""
    times = sorted(weights, reverse=True)
    best = 0.0
    for k in range(len(times) // groups + 1):
        top = times[: k * groups + 1]
        if len(top) < k * groups + 1:
            break
        best = max(best, sum(top[-(k + 1):]))
    return best * (1 - 1e-12)


def pigeonhole_floor_uneven(classes: list[tuple[int, list[float]]]) -> float:
    """:func:`pigeonhole_floor` for groups that price the same item differently: ``classes`` holds ``(number of
    groups, weight of every item on such a group)``; a lower bound on the largest group sum over every way to give
    each item to one group.

    For any set ``H`` of items and any ``X``: a group of class ``c`` that holds ``m`` items of ``H`` carries at least
    the ``m`` smallest of its weights in ``H``, so with all sums ``<= X`` it holds at most ``cap_c(X)`` of them; if
    the caps add up to fewer than ``|H|`` items, every assignment has a group above ``X``. ``H`` runs over the
    ``h`` items heaviest on the fastest class, for every ``h``; the least ``X`` the caps allow is a prefix sum, found
    by bisection. With one class this is :func:`pigeonhole_floor`."""
    if len(classes) == 1:
        return pigeonhole_floor(classes[0][1], classes[0][0])
    items = len(classes[0][1])
    order = sorted(range(items), key=lambda u: min(w[u] for _, w in classes), reverse=True)
    best = 0.0
    for h in range(1, items + 1):
        chosen = order[:h]
        prefixes = []
        for count, w in classes:
            acc, run = [], 0.0
            for x in sorted(w[u] for u in chosen):
                run += x
                acc.append(run)
            prefixes.append((count, acc))
        values = sorted({x for _, acc in prefixes for x in acc})

        def holds(X: float) -> bool:
            return sum(count * bisect_right(acc, X) for count, acc in prefixes) >= h

        best = max(best, least_holding(values, holds))
    return best * (1 - 1e-12)


def staged_partition_floor(weights: list[list[float]]) -> float:
    """The least ``C`` such that the chain splits into ``len(weights)`` contiguous parts in order, part ``i``
    pricing layer ``u`` at ``weights[i][u] >= 0``, with every part's sum at most ``C`` (parts may be empty: a
    relaxation, so a lower bound), from below. Filling each part as far as it goes is optimal for a given ``C`` (by
    induction, the greedy split ends each part no earlier than any feasible split does), so bisection on ``C``
    with that test; returns a refuted value times ``1 - 1e-12``."""
    L = len(weights[0]) if weights else 0

    def fits(limit: float) -> bool:
        u = 0
        for w in weights:
            acc = 0.0
            while u < L and acc + w[u] <= limit:
                acc += w[u]
                u += 1
            if u == L:
                return True
        return u == L

    hi = max(sum(w) for w in weights) if weights else 0.0
    lo = 0.0
    if hi <= 0.0 or fits(0.0):
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo * (1 - 1e-12)


def partition_floor(weights: list[float], parts: int) -> float:
    """The least, over splits of ``weights`` into ``parts`` contiguous non-empty parts, of the largest part's sum
    (the linear partition problem), from below: bisection with a greedy test, returning either the largest single
    weight (when that already admits a split: then it is the exact value) or a value the test refuted, times
    ``1 - 1e-12`` (a part's sum added up in another order may round lower)."""
    P = parts

    def count(limit: float) -> int:
        n, acc = 1, 0.0
        for a in weights:
            if acc + a > limit:
                n, acc = n + 1, a
            else:
                acc += a
        return n

    lo, hi = max(weights), sum(weights)
    if count(lo) <= P:
        return lo * (1 - 1e-12)
    for _ in range(60):
        mid = (lo + hi) / 2
        if count(mid) <= P:
            hi = mid
        else:
            lo = mid
    return lo * (1 - 1e-12)
