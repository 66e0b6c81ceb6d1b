"""Cheap bounds per ``(pp, c)`` candidate: a time lower bound to prune the search, memory to explain failure."""

from __future__ import annotations

from bisect import bisect_right

from uniap_lightning.planner.cost.comm import p2p_s
from uniap_lightning.planner.cost.layer import CostTables, boundary_inter_node, runs_of


def time_lower_bound_s(t: CostTables) -> float:
    """A valid lower bound on the candidate's TPI, from per-layer minima (no solver).

    With ``P`` stages, ``sum_i p_i + (c - 1) max_i p_i >= (1 + (c - 1) / P) sum_i p_i`` and
    ``max_i sync_i >= sum_i sync_i / P``, so each layer contributes at least
    ``min_k A_uk (1 + (c - 1) / P) + S_uk / P``; also ``max_i p_i >= max_u min_k A_uk``. Each of the ``P - 1``
    boundaries costs at least the cheapest point-to-point transfer of any layer's output.
    """
    P, c = t.pp, t.c
    spread = sum(min(k.time_s * (1 + (c - 1) / P) + k.sync_s / P for k in costs) for costs in t.cost)
    cheapest = [min(k.time_s for k in costs) for costs in t.cost]
    runs = runs_of(t)
    floor = max(run_bottleneck_s(t, a, e) for a, e in runs)
    peak = sum(cheapest) + (c - 1) * max(max(cheapest), floor)
    boundaries = 0.0
    if P > 1:
        inter = all(boundary_inter_node(t.problem.cluster, t.n, j) for j in range(P - 1))
        smallest = min(lp.output_bytes for lp in t.layers[:-1])
        boundaries = (P - 1) * 2 * p2p_s(t.problem.cluster, smallest * t.b / t.n, inter)
    # every stage's time carries the same slot overhead: exactly (P + c - 1) of it in any plan
    return max(spread, peak) + boundaries + (P + c - 1) * t.slot_overhead_s


def run_bottleneck_s(t: CostTables, first: int, last: int) -> float:
    """A lower bound on the bottleneck stage time forced by a run of ``R`` identical layers ``first..last``.

    For stage ``i`` let ``h_i(T)`` be the most of these layers that fit on it within time ``T`` and memory ``M``
    (strategy mixes relaxed to fractions: the cheapest time for ``x`` layers is a two-strategy LP, solved in
    closed form). Every layer must go somewhere, so the bottleneck is at least the least ``T`` with
    ``sum_i h_i(T) >= R``. Ignores every other layer, which can only raise the true value; ``inf`` if the run
    cannot fit at all.
    """
    R = last - first + 1
    costs = t.cost[first]
    limit = t.problem.cluster.memory_bytes
    lo, hi = max(0, t.pp - len(t.layers) + first), min(last, t.pp - 1)
    per_f: dict[int, list[float]] = {}
    tables = []
    for i in range(lo, hi + 1):
        F = t.in_flight(i)
        if F not in per_f:
            opts = [(k.time_s, k.static_bytes + F * k.activation_bytes) for k in costs]
            per_f[F] = [_least_time(opts, x, limit) for x in range(1, R + 1)]
        tables.append(per_f[F])
    values = sorted({v for tab in tables for v in tab if v < float("inf")})
    if not values:
        return float("inf")

    def fits(T: float) -> bool:
        return sum(bisect_right(tab, T) for tab in tables) >= R

    if not fits(values[-1]):
        return float("inf")
    lo_i, hi_i = 0, len(values) - 1
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if fits(values[mid]):
            hi_i = mid
        else:
            lo_i = mid + 1
    return values[lo_i]


def _least_time(opts: list[tuple[float, float]], x: int, limit: float) -> float:
    """min sum a_k n_k  s.t.  sum n_k = x, sum m_k n_k <= limit, n >= 0 (fractional): at most two strategies."""
    best = float("inf")
    for a1, m1 in opts:
        if x * m1 <= limit:
            best = min(best, x * a1)
    for a1, m1 in opts:  # m1 small (fits), m2 large (faster): as much of the fast one as memory allows
        for a2, m2 in opts:
            if m2 > m1 and a2 < a1 and x * m1 <= limit:
                n2 = min(x, (limit - x * m1) / (m2 - m1))
                best = min(best, a1 * (x - n2) + a2 * n2)
    return best


def memory_lower_bound_bytes(t: CostTables) -> float:
    """Cheap bound: the busiest stage holds at least its share of every layer's least memory, and at least the
    hungriest single layer (each at the fewest micro-batches in flight on any stage)."""
    F = min(t.in_flight(i) for i in range(t.pp))
    least = [min(k.static_bytes + F * k.activation_bytes for k in costs) for costs in t.cost]
    return max(sum(least) / t.pp, max(least))


def least_memory_bytes(t: CostTables) -> float:
    """The least peak memory per device any plan of this candidate can have (exact minimum over contiguous
    splits, each layer at its least-memory strategy; the FSDP gather term is bounded below by 0)."""
    L, P = len(t.layers), t.pp
    INF = float("inf")

    def layer_mem(u: int, i: int) -> float:
        F = t.in_flight(i)
        return min(c.static_bytes + F * c.activation_bytes for c in t.cost[u])

    # f[i][u]: least max-stage memory placing layers 0..u on stages 0..i, stage i ending at u.
    f = [[INF] * L for _ in range(P)]
    prefix = [[0.0] * (L + 1) for _ in range(P)]
    for i in range(P):
        for u in range(L):
            prefix[i][u + 1] = prefix[i][u] + layer_mem(u, i)
    for u in range(L):
        f[0][u] = prefix[0][u + 1]
    for i in range(1, P):
        for u in range(i, L):
            best = INF
            for v in range(i - 1, u):  # stage i holds layers v+1..u
                cand = max(f[i - 1][v], prefix[i][u + 1] - prefix[i][v + 1])
                best = min(best, cand)
            f[i][u] = best
    return f[P - 1][L - 1]
