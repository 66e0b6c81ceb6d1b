"""Which splits of a run's layers over a device group's stages a plan better than the incumbent can have
(:func:`surviving_splits`): once the search has an incumbent, rows of a candidate's MILP that restrict each group's
per-stage counts to them.

Why: with ``v`` stages per device group, or memory that forces recomputation on the stages holding the most
micro-batches, *which* stage of a group takes the extra layer decides the plan, and the LP relaxation spreads layers
evenly (3.33 blocks a stage) where every real plan puts 4 on some. LLaMA-70B on 8,192 devices (pp 8, interleaved
1F1B, v 3, 80 blocks on 24 stages): the MILP's bound stayed 0.3% below the optimum after 120 s; with each group's
stages restricted to the few splits that can still beat the incumbent (one or two per group, 1.3 s to find) it
proves the optimum in 9 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver.backend import MS, no_gc
from uniap_lightning.planner.solver.fronts import frontier
from uniap_lightning.planner.solver.group_floor import (FreeSplitValue, GroupMemoryFloor, cheapest_stage_sum_s,
                                                       run_ends)

#: the programs' time for one table (past it, groups not finished get no rows: rows are optional, never partial)
SPLIT_BUDGET_S = 4.0
#: a group with more surviving splits than this gets no rows (one binary per split)
MAX_GROUP_SPLITS = 400


@dataclass(frozen=True)
class GroupSplits:
    """The splits of run ``run`` (an index into ``CostTables.runs()``) over device group ``group``'s stages that can
    hold it (``stages``, ascending) that a plan better than the cutoff can have: counts per stage, in that order."""

    run: int
    group: int
    stages: tuple[int, ...]
    splits: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class SplitTable:
    """Every group's surviving splits for plans better than ``cutoff_s``; groups the budget did not finish are
    absent."""

    cutoff_s: float
    groups: tuple[GroupSplits, ...]

    @property
    def hopeless(self) -> bool:
        """Some group holds no split that beats the cutoff: the candidate has no better plan."""
        return any(not gs.splits for gs in self.groups)


def split_table(t: CostTables, cutoff_s: float | None) -> SplitTable | None:
    """The table computed for these tables, where its rows hold for plans better than ``cutoff_s`` (computed for
    a cutoff at least as large); None otherwise."""
    table = t.bound_cache.get("group_splits")
    if table is None or cutoff_s is None or cutoff_s > table.cutoff_s * (1 + 1e-12):
        return None
    return table


def surviving_splits(t: CostTables, cutoff_s: float, *, budget_s: float | None = None) -> SplitTable:
    """For each run of two or more interchangeable layers and each device group, the splits of the run's layers
    over the group's stages that a plan with ``TPI < cutoff_s`` can have; cached in ``t.bound_cache`` (the MILP
    reads it from there, also in a worker process).

    Proof that a dropped split holds no such plan. ``TPI >= a_p sum_i p_i + a_w W + b_T T + Y`` (the other terms
    are ``>= 0``; ``a_w <= 0``, zero-bubble schedules only, and the weight-gradient sum ``W`` is at most every
    layer's largest at the slowest device's speed), ``p_k >=`` its layers' times plus the slot, ``T >= x p_k`` for every stage ``k`` (``x = max(1,
    stage_weight)``), ``Y >=`` the group's summed sync. So a plan whose group ``g`` holds counts ``s`` of the run on
    its stages has ``TPI >= a_p (cheapest_stage_sum_s - the cheapest times of g's counted layers) + a_w W_max +
    b_T x slot + phi_g(s)``, where ``phi_g(s)`` is the least ``b_T x max_k A_k + sum_k (a_p A_k + S_k)`` over the group's
    strategy mixes holding ``s`` (and its end layers) within the group's memory (other runs' layers left out: only
    lower). :class:`~.group_floor.GroupMemoryFloor` solves it exactly (or gives its bound when its node limit stops
    it: also a floor). ``phi_g`` grows with every count, so the enumeration climbs each stage's count from its least
    and stops where the least completion is dropped."""
    budget = SPLIT_BUDGET_S if budget_s is None else budget_s
    start = time.perf_counter()
    S = t.stages
    x = max(1.0, t.shape.stage_weight)
    a_p = t.shape.a_p
    slot_term = t.tpi_s(0.0, 0.0, x * t.stage_time_s(0.0), 0.0)
    # a_p times every layer's cheapest time and every slot; zero-bubble schedules subtract the weight-gradient sum
    # (a_w < 0): at most every layer's largest, at the slowest device's speed
    slowest = min(t.stage_speed(k) for k in range(S))
    weights = sum(max(c.weight_grad_s for c in costs) / slowest for costs in t.cost)
    everything = t.tpi_s(cheapest_stage_sum_s(t), 0.0, 0.0, 0.0) + min(0.0, t.shape.a_w) * weights
    cheapest = {}

    def cheap(u: int) -> float:
        if u not in cheapest:
            cheapest[u] = min(t.fastest_layer_time_s(c) for c in t.cost[u])
        return cheapest[u]

    found: list[GroupSplits] = []
    runs = sorted((r for r, (a, e) in enumerate(t.runs()) if e > a), key=lambda r: t.runs()[r][0] - t.runs()[r][1])
    with no_gc():
        for r in runs:
            if time.perf_counter() >= start + budget:
                break
            found += _run_splits(t, r, cutoff_s, start + budget, everything, slot_term, cheap)
    table = SplitTable(cutoff_s, tuple(found))
    t.bound_cache["group_splits"] = table
    return table


def _run_splits(t: CostTables, r: int, cutoff_s: float, until: float, everything: float, slot_term: float,
                cheap) -> list[GroupSplits]:
    """:func:`surviving_splits` for run ``r``: (1) per group, the splits whose value without memory keeps them
    (monotone climb, cheap); (2) the largest count each group can hold within its memory (the count-level program,
    from the largest of those sums down); (3) the groups hold the run's ``R`` layers: a group holds at least ``R``
    less the others' largest; (4) the memory program on the splits left in that range; then (3) again on what
    survived, until nothing changes."""
    S, L = t.stages, len(t.layers)
    first, last = t.runs()[r]
    R = last - first + 1
    lo, hi = max(0, S - L + first), min(last, S - 1)
    ends = run_ends(t, first, last)
    x = max(1.0, t.shape.stage_weight)
    a_p = t.shape.a_p
    program = GroupMemoryFloor(t, first, last, ends, t.shape.b_T * x, a_p,
                               budget_s=max(0.0, until - time.perf_counter()))
    free = FreeSplitValue(t, first, ends, t.shape.b_T * x, a_p, merge=frontier)  # exact: monotone
    info, xmax = {}, {}
    for grp in range(t.pp):
        reachable = [k for k in t.stages_of(grp) if lo <= k <= hi]
        if not reachable:
            xmax[grp] = 0
            continue
        outside = [k for k in t.stages_of(grp) if k in ends and k not in reachable]
        held = sum(cheap(u) for k in reachable + outside for u in ends.get(k, []))

        def cut_ms(X: int, held=held) -> float:  # a group value at or past it: no plan below the cutoff
            return (cutoff_s * (1 + 1e-9) - (everything - a_p * (X * cheap(first) + held) + slot_term)) * MS

        least = [1 if program.must_hold(k) else 0 for k in reachable]

        def free_keep(split, rc=reachable, out=outside, cut=cut_ms) -> bool | None:
            if time.perf_counter() > until:
                return None
            return free.value_s(rc + out, tuple(split) + (0,) * len(out)) * MS < cut(sum(split))

        cands = _climb(free_keep, least, R, limit=4 * MAX_GROUP_SPLITS)
        xmax[grp] = R
        if cands is None:  # too many to price: no rows for this group
            continue
        info[grp] = (reachable, outside, cut_ms, cands)
        for X in sorted({sum(c) for c in cands}, reverse=True):
            ms = program.value_ms(grp, reachable, outside, X, cut_ms(X))
            if ms is None or ms < cut_ms(X):
                xmax[grp] = X
                break
        else:
            xmax[grp] = -1  # no count fits below the cutoff
    kept: dict[int, list[tuple[int, ...]]] = {}
    for grp, (reachable, outside, cut_ms, cands) in info.items():
        xlo = R - sum(v for h, v in xmax.items() if h != grp)
        mine = []
        for split in cands:
            if not xlo <= sum(split) <= xmax[grp]:
                continue
            ms = program.split_value_ms(grp, reachable, outside, split, cut_ms(sum(split)))
            if ms is None:
                mine = None
                break
            if ms < cut_ms(sum(split)):
                mine.append(split)
        if mine is not None:
            kept[grp] = mine
    while True:  # (3) again on what survived
        for grp, splits in kept.items():
            xmax[grp] = max((sum(s) for s in splits), default=-1)
        changed = False
        for grp, splits in kept.items():
            xlo = R - sum(v for h, v in xmax.items() if h != grp)
            left = [s for s in splits if sum(s) >= xlo]
            changed |= len(left) < len(splits)
            kept[grp] = left
        if not changed:
            break
    return [GroupSplits(r, grp, tuple(info[grp][0]), tuple(splits)) for grp, splits in sorted(kept.items())
            if len(splits) <= MAX_GROUP_SPLITS]


def _climb(keep, least: list[int], total: int, *, limit: int = MAX_GROUP_SPLITS) -> list[tuple[int, ...]] | None:
    """Every split (one count per stage, at least ``least``, summing to at most ``total``) that ``keep`` accepts,
    where ``keep`` is monotone (a split it rejects, it rejects with any count raised); None when ``keep`` gives up
    (its budget) or more than ``limit`` are accepted."""
    n = len(least)
    out: list[tuple[int, ...]] = []
    memo: dict[tuple[int, ...], bool | None] = {}

    def ok(split: tuple[int, ...]) -> bool | None:
        if split not in memo:
            memo[split] = keep(split)
        return memo[split]

    def walk(prefix: tuple[int, ...]) -> bool:
        j = len(prefix)
        if j == n:
            out.append(prefix)
            return len(out) <= limit
        c = least[j]
        while True:
            split = prefix + (c,) + tuple(least[j + 1:])
            if sum(split) > total:
                return True
            verdict = ok(split)
            if verdict is None:
                return False
            if not verdict:
                return True
            if not walk(prefix + (c,)):
                return False
            c += 1

    if sum(least) > total:
        return []
    return out if walk(()) else None


def split_floor_s(table: SplitTable | None) -> float:
    """A candidate whose table is hopeless has no plan below its cutoff: that cutoff is then its floor."""
    return table.cutoff_s if table is not None and table.hopeless else 0.0

