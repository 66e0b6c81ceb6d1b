"""Brute force for one device group's program (:class:`~uniap_lightning.planner.solver.group_floor.GroupMemoryFloor`):
every split of a run's layers over the group's stages and every strategy mix, within the group's memory."""

from __future__ import annotations

import itertools
import math


def group_value_brute(t, program, grp, reachable, outside, X, counts=None) -> float:
    """The least ``b_T x max_k A_k + sum_k (a_p A_k + S_k)`` (ms) over every way the group's stages hold ``X`` run
    layers (each stage a multiset of strategies) and their end layers, within the group's memory: brute force.
    ``counts`` (one per stage of ``reachable``) fixes each stage's count instead."""
    first, R = program.first, program.last - program.first + 1
    stages = reachable + outside
    per_stage = []  # per stage: {count: [(time, sync, static, activation, transient)]}
    for k in stages:
        ends = [[(t.layer_time_s(k, c), c.sync_s, c.static_bytes, c.activation_bytes, c.transient_bytes)
                 for c in t.cost[u]] for u in program.ends.get(k, [])]
        run = [(t.layer_time_s(k, c), c.sync_s, c.static_bytes, c.activation_bytes, c.transient_bytes)
               for c in t.cost[first]]
        options = {}
        if counts is not None:
            sizes = [counts[reachable.index(k)]] if k in reachable else [0]
        else:
            sizes = range(0, min(X, R) + 1 if k in reachable else 1)
        for n in sizes:
            if n == 0 and k in reachable and program.must_hold(k):
                continue
            combos = []
            for mix in itertools.combinations_with_replacement(run, n):
                for tail in itertools.product(*ends):
                    items = list(mix) + list(tail)
                    combos.append((sum(i[0] for i in items), sum(i[1] for i in items), sum(i[2] for i in items),
                                   sum(i[3] for i in items), max((i[4] for i in items), default=0.0)))
            options[n] = combos
        per_stage.append(options)
    best = math.inf
    limit = t.memory_limit_bytes(min(t.stages_of(grp))) * (1 + 1e-9)
    for counts in itertools.product(*[list(o) for o in per_stage]):
        if sum(counts) != X:
            continue
        for pick in itertools.product(*[o[n] for o, n in zip(per_stage, counts)]):
            static, act = [0.0] * t.stages, [0.0] * t.stages
            for k, p in zip(stages, pick):
                static[k], act[k] = p[2], p[3]
            if t.group_memory_bytes(grp, static, act, max(p[4] for p in pick)) > limit:
                continue
            best = min(best, program.weight * max(p[0] for p in pick) * 1e3
                       + sum(program.a_p * p[0] + p[1] for p in pick) * 1e3)
    return best
