"""From a solved :class:`~uniap_lightning.planner.solver.milp.GroupedMilp` to one plan: stage and strategy per layer.

The MILP knows, per run and stage, how many layers take each strategy, the first and last layer's strategy and
how often the level (batch split) changes; an Euler walk over the levels puts the layers in an order whose
resharding is exactly what the solver priced.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from uniap_lightning.planner.solver.milp import GroupedMilp


def decode(milp: GroupedMilp) -> tuple[list[int], list[int]]:
    """Stage index and strategy index (into ``CostTables.strategies[u]``) of every layer, in chain order."""
    stages: list[int] = []
    strategies: list[int] = []
    for g in range(milp.G):
        for i in milp.stage_range(g):
            counts = {k: round(v.x) for k, v in milp.n[g, i].items()}
            if sum(counts.values()) == 0:
                continue
            seq = _order_portion(milp, g, i, counts)
            stages += [i] * len(seq)
            strategies += seq
    assert len(stages) == milp.L, "decoded plan does not cover the chain"
    return stages, strategies


def _value(x) -> float:
    return float(x.x) if hasattr(x, "x") else float(x)


def _order_portion(milp: GroupedMilp, g: int, i: int, counts: dict[int, int]) -> list[int]:
    """Layers of one portion in an order whose level changes are exactly the solver's walk. The solver fixed the
    first and last layers' levels (batch splits); which strategy of that level stands there costs nothing more."""
    first_d = max(milp.f[g, i], key=lambda d: _value(milp.f[g, i][d]))
    last_d = max(milp.l[g, i], key=lambda d: _value(milp.l[g, i][d]))
    lvl = milp.level_of[g]
    edges = defaultdict(list)
    for (d, e), tv in milp.tau.get((g, i), {}).items():
        edges[d] += [e] * round(tv.x)
    walk = euler_walk(edges, first_d)
    pool = defaultdict(list)  # level -> strategies still to place (first/last reserved below)
    for k, c in sorted(counts.items()):
        pool[lvl[k]] += [k] * c
    first = pool[first_d].pop(0)
    total = sum(counts.values())
    last = pool[last_d].pop() if total > 1 else first
    visits = defaultdict(int)
    for d in walk:
        visits[d] += 1
    blocks: list[list[int]] = []
    seen = defaultdict(int)
    for pos, d in enumerate(walk):
        seen[d] += 1
        later = visits[d] - seen[d]  # each later visit of this level needs a layer of its own
        block = [first] if pos == 0 else []
        if pos == len(walk) - 1 and total > 1:
            block += pool[d] + [last]
            pool[d] = []
        else:
            take = max(0 if block else 1, len(pool[d]) - later)
            block += pool[d][:take]
            pool[d] = pool[d][take:]
        blocks.append(block)
    return [k for b in blocks for k in b]


def euler_walk(edges: dict[int, list[int]], start: int) -> list[int]:
    """Hierholzer's algorithm on a small multigraph; returns the sequence of visited levels."""
    adj = {d: list(es) for d, es in edges.items()}
    stack, walk = [start], []
    while stack:
        d = stack[-1]
        if adj.get(d):
            stack.append(adj[d].pop())
        else:
            walk.append(stack.pop())
    return walk[::-1]
