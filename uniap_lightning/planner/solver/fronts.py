"""Small exact helpers the floors share: Pareto fronts of (price, memory) pairs and a least-value bisection."""

from __future__ import annotations

#: a stage's front of strategy mixes keeps at most this many (price, memory) points per largest transient; beyond,
#: neighbours merge into their componentwise minimum (optimistic, so the floor stays a lower bound)
FRONT_POINTS = 24


def frontier(opts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (time, memory) pairs no other pair beats in both: the only ones an optimal mix uses."""
    out: list[tuple[float, float]] = []
    for a, m in sorted(set(opts)):
        if not out or m < out[-1][1]:
            out.append((a, m))
    return out


def staircase(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (price, memory) points no other beats in both, by rising price; beyond :data:`FRONT_POINTS`, runs of
    neighbours become their componentwise minimum (the first's price, the last's memory)."""
    out = frontier(points)
    if len(out) > FRONT_POINTS:
        step = -(-len(out) // FRONT_POINTS)
        out = [(out[j][0], out[min(j + step, len(out)) - 1][1]) for j in range(0, len(out), step)]
    return out


def least_holding(values: list[float], holds) -> float:
    """The least of the sorted ``values`` for which ``holds`` (monotone: false, then true) is true; the last
    must hold."""
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return values[lo]
