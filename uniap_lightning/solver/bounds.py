"""Cheap bounds per ``(pp, c)`` candidate: a time lower bound to prune the search, memory to explain failure."""

from __future__ import annotations

from uniap_lightning.cost.comm import p2p_s
from uniap_lightning.cost.model import CostTables, boundary_inter_node


def _runs(t: CostTables) -> list[tuple[int, int]]:
    from uniap_lightning.solver.grouped import runs_of

    return runs_of(t)


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
    runs = _runs(t)
    floor = max(run_bottleneck_s(t, a, e) for a, e in runs)
    peak = sum(cheapest) + (c - 1) * max(max(cheapest), floor)
    boundaries = 0.0
    if P > 1:
        inter = all(boundary_inter_node(t.problem.cluster, t.n, j) for j in range(P - 1))
        smallest = min(lp.output_bytes for lp in t.layers[:-1])
        boundaries = (P - 1) * 2 * p2p_s(t.problem.cluster, smallest * t.b / t.n, inter)
    return max(spread, peak) + boundaries


def run_bottleneck_s(t: CostTables, first: int, last: int) -> float:
    """Least bottleneck a run of identical layers ``first..last`` forces: some stage holds at least ``x`` of them,
    where ``x`` is the least count with ``sum_i min(cap_i, x) >= R`` and ``cap_i`` is how many of these layers fit
    in stage i's memory on their own (least-memory strategy, ``F_i`` micro-batches in flight). Each costs at
    least its cheapest per-micro-batch time."""
    R = last - first + 1
    costs = t.cost[first]
    cheapest = min(k.time_s for k in costs)
    limit = t.problem.cluster.memory_bytes
    lo, hi = max(0, t.pp - len(t.layers) + first), min(last, t.pp - 1)
    caps = []
    for i in range(lo, hi + 1):
        need = min(k.static_bytes + t.in_flight(i) * k.activation_bytes for k in costs)
        caps.append(R if need <= 0 else min(R, int(limit // need)))
    if sum(caps) < R:
        return float("inf")  # the run cannot fit at all
    x = max(1, -(-R // len(caps)))
    while sum(min(cap, x) for cap in caps) < R:
        x += 1
    return x * cheapest


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
