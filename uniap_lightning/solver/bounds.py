"""Cheap bounds per ``(pp, c)`` candidate: a time lower bound to prune the search, memory to explain failure."""

from __future__ import annotations

from uniap_lightning.cost.model import CostTables


def time_lower_bound_s(t: CostTables) -> float:
    """``TPI >= W + (c - 1) max(W / pp, max_u a_u)`` with ``a_u`` the layer's cheapest per-micro-batch time and
    ``W = sum_u a_u``: every stage time is at least the sum of its layers' cheapest times (transfers >= 0)."""
    cheapest = [min(c.time_s for c in costs) for costs in t.cost]
    w = sum(cheapest)
    return w + (t.c - 1) * max(w / t.pp, max(cheapest))


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
