"""Whole layers on each device group's stages: the floor of ``b_T T + Y`` (and of ``a_p sum p + b_T T + Y``) from
how many of a run's interchangeable layers each group holds, where a group runs ``v`` stages and shares its memory
among them (:func:`group_stage_floor_s`, a row of every candidate's MILP and part of its refined bound).

Per group and count ``X``, the least of ``b_T x max_k A_k + sum_k (a_p A_k + S_k)`` first without memory, exactly
from each stage's (time, sync) staircase; then, where the group's memory decides which mixes fit, exactly with it by
a small integer program over the group's own stages (:class:`GroupMemoryFloor`, :mod:`.group_memory`). A pigeonhole
over the groups turns these into the floor."""

from __future__ import annotations

import math
from bisect import bisect_right

from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver.backend import MS, no_gc
from uniap_lightning.planner.solver.fronts import least_holding, staircase
from uniap_lightning.planner.solver.group_memory import MEMORY_BUDGET_S, MEMORY_NODES, GroupMemoryFloor

__all__ = ["GROUP_SPLITS", "MEMORY_BUDGET_S", "MEMORY_NODES", "FreeSplitValue", "GroupMemoryFloor",
           "cheapest_stage_sum_s", "group_memory_floor_s", "group_stage_floor_s", "run_ends", "run_group_stage_floor_s"]


def group_stage_floor_s(t: CostTables, *, stage_sum: bool = False) -> float:
    """Whole layers on the stages of each device group: a lower bound on ``b_T T + Y``, or with ``stage_sum`` on
    ``a_p sum_i p_i + b_T T + Y`` beyond ``a_p`` :func:`cheapest_stage_sum_s` (so ``tpi_s(cheapest_stage_sum_s,
    0, 0, 0)`` plus it bounds ``tpi_s(sum p, 0, T, Y)``). The largest of :func:`run_group_stage_floor_s` over the
    runs of two or more interchangeable layers, memory left out (hundredths of a second), raised to
    :func:`group_memory_floor_s` where the search computed it for these tables. Both are MILP rows: the LP
    relaxation meets each on its own."""
    if t.v == 1:  # one stage per group: its best mix is each layer's own, which group_sync_floor_s already sees
        return 0.0
    key = ("group_stage_floor", stage_sum)
    cached = t.bound_cache.get(key)
    if cached is None:
        cached = t.bound_cache[key] = max(
            (run_group_stage_floor_s(t, a, e, stage_sum=stage_sum, memory=False) for a, e in t.runs() if e > a),
            default=0.0)
    # with memory, b_T T + Y alone: a_p sum p >= a_p cheapest_stage_sum_s makes it a floor of the stage_sum form too
    return max(cached, group_memory_floor_s(t, compute=False))


def group_memory_floor_s(t: CostTables, *, compute: bool = True) -> float:
    """:func:`run_group_stage_floor_s` with each group's memory (a lower bound on ``b_T T + Y``), the largest over
    the runs; computed once per tables (up to :data:`MEMORY_BUDGET_S` a run), and only where ``compute`` (the search
    asks for it for a candidate its first time slice did not close; 0 until then)."""
    if t.v == 1:
        return 0.0
    cached = t.bound_cache.get("group_memory_floor")
    if cached is None:
        if not compute:
            return 0.0
        with no_gc():  # one collection before the group programs, none during them
            cached = t.bound_cache["group_memory_floor"] = max(
                (run_group_stage_floor_s(t, a, e) for a, e in t.runs() if e > a), default=0.0)
    return cached


def cheapest_stage_sum_s(t: CostTables) -> float:
    """What every plan's ``sum_i p_i`` holds at least: each layer at its cheapest time on the fastest device and
    every stage's slot."""
    return sum(min(t.fastest_layer_time_s(k) for k in costs) for costs in t.cost) + t.stages * t.stage_time_s(0.0)


def run_ends(t: CostTables, first: int, last: int) -> dict[int, list[int]]:
    """The chain's end layers outside the run ``first..last``, by the stage they sit on in every plan (the first
    layer on the first stage, the last on the last)."""
    S, L = t.stages, len(t.layers)
    ends: dict[int, list[int]] = {}
    if first > 0:
        ends[0] = [0]
    if last < L - 1:
        ends.setdefault(S - 1, []).append(L - 1)
    return ends


class FreeSplitValue:
    """The least ``weight x max_k A_k + sum_k (a_p A_k + S_k)`` of a split of the run starting at ``first`` over some
    stages (each stage's count, its end layers with it), memory left out: for every candidate largest stage time
    ``theta``, each stage's least ``a_p A + S`` among its mixes within ``theta``, from the (time, sync) front of
    ``n`` run layers and the stage's end layers. ``merge`` reduces each front: :func:`~.fronts.staircase` (merged
    past ``FRONT_POINTS``, optimistic: a floor) or :func:`~.fronts.frontier` (exact, so the value grows with every
    count)."""

    def __init__(self, t: CostTables, first: int, ends: dict[int, list[int]], weight: float, a_p: float, *,
                 merge=staircase) -> None:
        self.t, self.first, self.ends, self.weight, self.a_p, self.merge = t, first, ends, weight, a_p, merge
        self.fronts: dict[tuple, list[tuple[float, float]]] = {}
        self.least: dict[tuple, tuple[list[float], list[float]]] = {}

    def _front(self, speed: float, n: int, ends: tuple[int, ...]) -> list[tuple[float, float]]:
        key = (speed, n, ends)
        if key not in self.fronts:
            t = self.t
            if n == 0:
                pts = [(0.0, 0.0)]
                for u in ends:
                    pts = self.merge([(a + t._time_at(c, speed), b + c.sync_s) for a, b in pts for c in t.cost[u]])
            else:
                pts = self.merge([(a + t._time_at(c, speed), b + c.sync_s) for a, b in self._front(speed, n - 1, ends)
                                  for c in t.cost[self.first]])
            self.fronts[key] = pts
        return self.fronts[key]

    def _within(self, k: int, n: int) -> tuple[list[float], list[float]]:
        """Stage k's front times (rising) and the least ``a_p A + S`` among the points up to each."""
        key = (self.t.stage_speed(k), n, tuple(self.ends.get(k, [])))
        if key not in self.least:
            run, acc = math.inf, []
            pts = self._front(*key)
            for a, b in pts:
                run = min(run, self.a_p * a + b)
                acc.append(run)
            self.least[key] = ([a for a, _ in pts], acc)
        return self.least[key]

    def value_s(self, stages: list[int], split: tuple[int, ...]) -> float:
        """The split's value (seconds); ``split`` gives every stage of ``stages`` its count."""
        stairs = [self._within(k, n) for k, n in zip(stages, split)]
        best = math.inf
        for theta in sorted({a for times, _ in stairs for a in times}):
            total = 0.0
            for times, acc in stairs:
                i = bisect_right(times, theta) - 1
                if i < 0:
                    break
                total += acc[i]
            else:
                best = min(best, self.weight * theta + total)
        return best


#: run_group_stage_floor_s enumerates the splits of a group's layers over its stages up to this many per count
GROUP_SPLITS = 200


def run_group_stage_floor_s(t: CostTables, first: int, last: int, *, stage_sum: bool = False,
                            memory: bool = True) -> float:
    """A lower bound on ``a_p sum_i p_i + b_T T + Y - a_p cheapest_stage_sum_s`` (``a_p`` taken as 0 without
    ``stage_sum``: then on ``b_T T + Y``) from the run ``first..last`` of ``R`` interchangeable layers and the
    chain's first and last layer (on the first and last stage in every plan).

    Proof. Let ``x = max(1, stage_weight)``: ``T >= x p_k`` for every stage ``k`` (``x = v`` with ``v`` stages per
    group) and ``Y >= sync_g``, the summed sync of group ``g``'s layers, so for every group ``g``: ``a_p sum_i p_i
    + b_T T + Y >= a_p (sum of the other groups' layers' cheapest times + every slot) + [a_p sum_{k in g} A_k +
    b_T x (slot + max_k A_k) + sync_g]`` (``A_k``: stage ``k``'s layer time; resharding ``>= 0``; ``a_p, b_T >=
    0``). For a split ``x_k`` of ``X`` run layers over the group's stages (each end layer where it sits) the
    bracket's least over strategies is exact from each stage's (time, sync) staircase: for every candidate largest
    time ``theta``, each stage's least ``a_p A + S`` within it (memory and other runs' layers left out, which only
    lowers it). ``phi_g(X)``, the least over splits less ``a_p`` times those layers' cheapest times, bounds the
    left side less ``a_p cheapest_stage_sum_s`` (beyond :data:`GROUP_SPLITS` splits per count, the weaker ``b_T T
    >= mean_k b_T x p_k``, which needs no split). It holds for every group, so for the largest; the groups hold all
    ``R``: the bound is the least ``C`` with ``sum_g max{X : phi_g(X) <= C} >= R`` (``phi_g`` grows with ``X``;
    beyond the counts computed a group is taken to hold any number, which only lowers the bound).

    Why it matters: :func:`group_sync_floor_s` spreads ``T`` over a group's summed stage times, but with ``v``
    stages per group ``T >= v max_k p_k``: seven blocks on a group of two stages put four on one of them, eight
    blocks' time. Qwen-MoE on 8,192 devices (pp 4, interleaved 1F1B, v 2, 24 blocks): the group holding the LM
    head takes fewer blocks, so another takes seven."""
    S, L, R = t.stages, len(t.layers), last - first + 1
    lo, hi = max(0, S - L + first), min(last, S - 1)
    speed_of = [t.stage_speed(k) for k in range(S)]
    bT, x, a_p = t.shape.b_T, max(1.0, t.shape.stage_weight), t.shape.a_p if stage_sum else 0.0
    slot = t.tpi_s(0.0, 0.0, x * t.stage_time_s(0.0), 0.0)
    least: dict[tuple, float] = {}

    def g(u: int, k: int, mu: float) -> float:  # min over u's strategies of (mu + a_p) A_u(k) + S_u, less a_p A_min
        key = (u if u in (0, L - 1) else first, speed_of[k], mu)
        if key not in least:
            least[key] = (min((mu + a_p) * t._time_at(c, key[1]) + c.sync_s for c in t.cost[key[0]])
                          - a_p * cheapest(key[0]))
        return least[key]

    fastest: dict[int, float] = {}

    def cheapest(u: int) -> float:  # what time_lower_bound_s counts for the layer in a_p sum p
        if u not in fastest:
            fastest[u] = min(t.fastest_layer_time_s(c) for c in t.cost[u])
        return fastest[u]

    ends = run_ends(t, first, last)
    free = FreeSplitValue(t, first, ends, bT * x, a_p, merge=staircase)

    def bound(stages: list[int], split: tuple[int, ...]) -> float:
        """min over strategies of b_T x max_k A_k + sum_k (a_p A_k + S_k) for this split (memory left out), less
        a_p times those layers' cheapest times."""
        excess = sum(split) * cheapest(first) + sum(cheapest(u) for k in stages for u in ends.get(k, []))
        return free.value_s(stages, split) - a_p * excess

    groups = [[k for k in t.stages_of(grp) if lo <= k <= hi or k in ends] for grp in range(t.pp)]
    reach = [[k for k in mine if lo <= k <= hi] for mine in groups]
    spread = -(-R // max(1, sum(1 for r in reach if r)))  # an even share: computed counts go past it
    phis, members = [], []
    alike: dict[tuple, list[float]] = {}  # groups whose stages price alike (speed, ends, reach) share phi
    for grp, (mine, reachable) in enumerate(zip(groups, reach)):
        outside = [k for k in mine if k not in reachable]  # hold an end but none of the run
        members.append((grp, reachable, outside))
        if not mine:  # holds neither the run nor an end here
            phis.append([slot])
            continue
        sig = tuple((speed_of[k], tuple(ends.get(k, [])), k in reachable) for k in reachable + outside)
        if sig in alike:
            phis.append(alike[sig])
            continue
        phi = alike[sig] = []
        for X in range(0, min(R, 2 * spread + 2) + 1):
            if X and not reachable:
                break
            stages = reachable + outside
            n = len(reachable)
            if n and math.comb(X + n - 1, n - 1) > GROUP_SPLITS:  # the same with x p_k >= the group's mean
                mu = bT * x / max(1, len(stages))
                val = (X * min(g(first, k, mu) for k in reachable)
                       + sum(g(u, k, mu) for k in stages for u in ends.get(k, [])))
            else:
                val = min((bound(stages, split + (0,) * len(outside)) for split in _splits(X, n)), default=0.0)
            phi.append(slot + val)
        phis.append(phi)

    def holds(C: float) -> bool:
        total = 0
        for phi in phis:
            if phi[0] > C:
                return False
            if phi[-1] <= C and 1 < len(phi) <= R:  # beyond the counts computed: any number
                total += R
            else:
                total += max(X for X, v in enumerate(phi) if v <= C)
        return total >= R

    values = sorted({v for phi in phis for v in phi})
    if not values or not holds(values[-1]):
        return 0.0  # no bound rather than a wrong one (every group is empty of the run: cannot happen)
    free = least_holding(values, holds)
    if not memory:
        return free * (1 - 1e-9)

    # each group's memory raises its value at the count it holds at that floor (exact, or the solver's bound), and
    # at one more (only whether it stays within the first count's largest value matters: a cutoff); counts below keep
    # the value without memory, counts above the raised value of the one more (phi_g grows with X)
    program = GroupMemoryFloor(t, first, last, ends, bT * x, a_p)
    excess = lambda i, X: X * cheapest(first) + sum(cheapest(u) for k in members[i][1] + members[i][2]  # noqa: E731
                                                    for u in ends.get(k, []))
    least = [sum(program.must_hold(k) for k in reachable) for _, reachable, _ in members]  # below: phi_g = inf
    held = {i: max(X for X, v in enumerate(phi) if v <= free) for i, phi in enumerate(phis)
            if members[i][1] and max(X for X, v in enumerate(phi) if v <= free) >= max(1, least[i])}
    raised = [list(phi) for phi in phis]
    for i, X in held.items():
        ms = program.value_ms(*members[i], X)
        if ms is not None:
            raised[i][X] = max(raised[i][X], slot + ms / MS - a_p * excess(i, X))
    # every group holding its count costs at most the largest raised value: past it, no count matters here
    cutoff = max((raised[i][X] for i, X in held.items()), default=math.inf)
    for i, X in held.items():
        if X + 1 >= len(raised[i]):
            continue
        ms = program.value_ms(*members[i], X + 1, cutoff_ms=(cutoff - slot + a_p * excess(i, X + 1)) * MS)
        if ms is not None:
            raised[i][X + 1] = max(raised[i][X + 1], min(cutoff, slot + ms / MS - a_p * excess(i, X + 1)))
        for Y in range(X + 2, len(raised[i])):
            raised[i][Y] = max(raised[i][Y], raised[i][X + 1])
    phis[:] = raised
    values = sorted({v for phi in phis for v in phi})
    return least_holding(values, holds) * (1 - 1e-7)


def _splits(X: int, n: int):
    """Every way to write ``X`` as ``n`` ordered non-negative parts."""
    if n == 0:
        if X == 0:
            yield ()
        return
    if n == 1:
        yield (X,)
        return
    for first in range(X + 1):
        for rest in _splits(X - first, n - 1):
            yield (first, *rest)
