"""Cheap bounds per ``(pp, c)`` candidate: a time lower bound to prune the search, memory to explain failure.

The partition floors on plain weights are :mod:`.partition`, the memory bounds in bytes :mod:`.memory_bounds`
(their names are importable from here too).
"""

from __future__ import annotations

import math
from bisect import bisect_right

from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver.fronts import frontier, least_holding, staircase
from uniap_lightning.planner.solver.group_floor import group_memory_floor_s, group_stage_floor_s
from uniap_lightning.planner.solver.memory_bounds import bisect_left_value, least_memory_bytes, memory_lower_bound_bytes
from uniap_lightning.planner.solver.partition import (
    partition_floor,
    pigeonhole_floor,
    pigeonhole_floor_uneven,
    staged_partition_floor,
)

__all__ = [
    "FLOOR_WORK", "bisect_left_value", "chain_bottleneck_s", "chain_sync_floor_s", "group_floor_s",
    "group_sync_floor_s", "least_memory_bytes", "memory_chain_floor_s", "memory_chain_sync_floor_s",
    "memory_lower_bound_bytes", "memory_partition_floor", "partition_floor", "pigeonhole_floor",
    "pigeonhole_floor_uneven", "run_bottleneck_s", "stage_memory_allowance_bytes", "staged_partition_floor",
    "time_lower_bound_s",
]


def time_lower_bound_s(t: CostTables, *, refined: bool = False, group_memory: bool = False) -> float:
    """A valid lower bound on the candidate's TPI, from per-layer minima (no solver); ``refined`` adds the floors
    that take a tenth of a second or so on a large chain, so the search asks for them only for the candidates it is
    about to solve: the memory-aware :func:`memory_chain_floor_s` and :func:`memory_chain_sync_floor_s` (tighter
    where memory forces slower strategies; ``inf`` when they show that nothing fits) and
    :func:`group_stage_floor_s` (whole layers on a device group's stages); ``group_memory`` adds
    :func:`group_memory_floor_s` (the same within each group's memory: up to seconds, for a candidate whose first
    solve did not close it).

    ``tpi_s`` is linear in (sum of stage times, sum of weight-gradient times, sum of hand-offs, bottleneck, largest
    weight-gradient time, largest sync), with a non-negative coefficient on all but the weight-gradient sum
    (zero-bubble schedules subtract it). With ``pp`` device groups, ``T >= sum_i p_i / pp`` and
    ``Y >= sum sync / pp``, so each layer contributes at least ``min_k tpi_s(A_uk, 0, A_uk / pp, S_uk / pp,
    W_uk)``; also ``T >= max_u min_k A_uk`` and the run floors. Or, term by term: the sum of stage times is at least
    every layer's cheapest time, and bottleneck plus sync together at least :func:`chain_sync_floor_s`. Times are
    taken at the fastest device's speed and weight-gradient times at the slowest's (the subtracted term at its
    largest). What every stage pays with no layer at all (``stage_time_s(0)``, the slot overhead; a group pays it
    for each of its ``v`` stages) and the cheapest transfer over each of the ``S - 1`` boundaries come on top.
    """
    S, pp, v = t.stages, t.pp, t.v
    # on a heterogeneous cluster every layer is taken at the fastest device's speed (a lower bound anywhere)
    fast = t.fastest_layer_time_s
    slowest = min(t.stage_speed(i) for i in range(S))
    most_w = lambda k: k.weight_grad_s / slowest  # noqa: E731 - the weight-gradient time at its largest
    spread = sum(min(t.tpi_s(fast(k), 0.0, fast(k) / pp, k.sync_s / pp, most_w(k)) for k in costs)
                 for costs in t.cost)
    cheapest = [min(fast(k) for k in costs) for costs in t.cost]
    weights = sum(max(most_w(k) for k in costs) for costs in t.cost)
    floor = max(run_bottleneck_s(t, a, e) for a, e in t.runs())
    # T >= v p_k where a group runs several stages (PipelineShape.stage_weight): v times the chain's partition floor
    chunked = t.shape.stage_weight * chain_bottleneck_s(t) if S > 1 else 0.0
    sync_floor = max(chain_sync_floor_s(t), group_sync_floor_s(t))
    stage_sum_floor = 0.0
    if refined:  # T >= x p_k with x = max(1, stage_weight): one stage per group, or v times the longest stage
        if math.isinf(memory_chain_floor_s(t)):
            return math.inf
        chunked = max(chunked, max(1.0, t.shape.stage_weight) * memory_chain_floor_s(t))
        sync_floor = max(sync_floor, memory_chain_sync_floor_s(t), group_stage_floor_s(t))
        stage_sum_floor = group_stage_floor_s(t, stage_sum=True)
    if group_memory:
        sync_floor = max(sync_floor, group_memory_floor_s(t))
        stage_sum_floor = max(stage_sum_floor, group_memory_floor_s(t))
    peak = t.tpi_s(sum(cheapest), 0.0, max(max(cheapest), floor, group_floor_s(t), chunked), 0.0, weights)
    boundaries = 0.0
    if S > 1:
        smallest = min(range(len(t.layers) - 1), key=lambda u: t.layers[u].output_bytes)
        boundaries = (S - 1) * min(t.send_s(smallest, j) for j in range(S - 1))
    empty = t.stage_time_s(0.0)
    # chain_sync_floor_s already holds the empty stage's share of the bottleneck
    combined = t.tpi_s(sum(cheapest) + S * empty, boundaries, 0.0, 0.0, weights) + max(sync_floor, stage_sum_floor)
    return max(max(spread, peak) + t.tpi_s(S * empty, boundaries, v * empty, 0.0), combined)


def group_floor_s(t: CostTables) -> float:
    """A lower bound on the busiest device group's layer time, wherever the layers go (contiguity and memory
    ignored): of the ``k pp + 1`` slowest layers (each at its cheapest strategy, at the fastest device's speed), some
    group holds ``k + 1``, so at least the ``k + 1`` cheapest of them (pigeonhole), for every ``k``. With several
    stages per device, where the partition floors see single stages, this is what sees that 32 blocks and a head on
    4 groups put 9 blocks on one of them."""
    return pigeonhole_floor([min(t.fastest_layer_time_s(k) for k in costs) for costs in t.cost], t.pp)


def group_sync_floor_s(t: CostTables) -> float:
    """A lower bound on ``tpi_s(0, 0, T, Y)`` (``b_T T + Y``: the bottleneck and the largest sync together) from the
    device groups: :func:`pigeonhole_floor` of ``w_u(g) = min_k tpi_s(0, 0, A_uk(g), S_uk)`` (the layer's time at
    group ``g``'s speed), plus what a group pays for its ``v`` empty stages.

    Proof. For every group ``g``, ``T >= P_g`` (its stages' summed times) and ``Y >= Sync_g`` (its layers' syncs),
    so ``b_T T + Y >= b_T P_g + Sync_g >= b_T v stage_time_s(0) + sum_{u on g} w_u(g)`` (``b_T >= 0``; a stage's time
    is its slot overhead plus its layers' times plus resharding, ``>= 0``). The largest group sum of ``w`` is at
    least the pigeonhole floor.

    Why it matters: :func:`chain_sync_floor_s` splits the chain into ``S = pp v`` contiguous stages, but with
    ``v > 1`` a group holds ``v`` of them; and the LP relaxation spreads layers fractionally over the groups (34
    layers on 8 groups: 4.25 each, when some group must hold 4 blocks and the head). LLaMA-7B on 8,192 devices,
    pp = 8, interleaved 1F1B with v = 3: the candidate's bound stayed at 695 ms after 120 s of branching, where its
    plans cost 745 ms. On a heterogeneous cluster each group's layers are priced at its own speed (a slowed node's
    group holds fewer)."""
    classes: dict[float, list] = {}
    for g in range(t.pp):
        speed = t.stage_speed(t.stages_of(g)[0])
        if speed not in classes:
            classes[speed] = [0, [min(t.tpi_s(0.0, 0.0, t._time_at(k, speed), k.sync_s) for k in costs)
                                  for costs in t.cost]]
        classes[speed][0] += 1
    return (pigeonhole_floor_uneven([(n, w) for n, w in classes.values()])
            + t.tpi_s(0.0, 0.0, t.stage_time_s(0.0) * t.v, 0.0))


def chain_bottleneck_s(t: CostTables) -> float:
    """A lower bound on the largest stage's layer time: the least, over splits of the chain into ``P`` contiguous
    stages, of the largest stage sum of each layer's cheapest time (:func:`partition_floor`; where devices differ,
    each stage prices its layers at its own devices' speed: :func:`staged_partition_floor`).

    Unlike the LP relaxation, which can put a fraction of a block next to the embedding or the head, this sees
    that whole layers share stages."""
    if t.problem.cluster.rank_speed is not None:  # each stage at its own devices' speed
        return staged_partition_floor(_per_stage(t, lambda k, speed: t._time_at(k, speed)))
    return partition_floor([min(t.fastest_layer_time_s(k) for k in costs) for costs in t.cost], t.stages)


def _per_stage(t: CostTables, price) -> list[list[float]]:
    """Per pipeline stage, each layer's least ``price(cost, speed)`` over its strategies at that stage's speed (the
    lists are shared between stages of one speed)."""
    by_speed: dict[float, list[float]] = {}
    out = []
    for i in range(t.stages):
        speed = t.stage_speed(i)
        if speed not in by_speed:
            by_speed[speed] = [min(price(k, speed) for k in costs) for costs in t.cost]
        out.append(by_speed[speed])
    return out


def chain_sync_floor_s(t: CostTables) -> float:
    """A lower bound on ``tpi_s(0, 0, T, Y) = (c - 1) T + Y``, the part of the time per iteration that the
    bottleneck ``T`` and the largest sync ``Y`` make up.

    Proof. For every stage ``i``, ``T >= x p_i`` (``x = 1``, or ``v`` where a group runs several stages:
    ``PipelineShape.stage_weight``) and ``Y >= sync_i`` (the same ``i`` for both), so
    ``(c - 1) T + Y >= (c - 1) x p_i + sync_i = tpi_s(0, 0, x p_i, sync_i)``. That is linear in the stage's terms:
    ``p_i`` is the slot overhead plus its layers' times plus resharding (``>= 0``), ``sync_i`` its layers' syncs,
    so it is at least ``tpi_s(0, 0, x stage_time_s(0), 0) + sum_{u on i} w_u`` with
    ``w_u = min_k tpi_s(0, 0, x A_uk, S_uk)`` (``A_uk`` at the stage's speed: the fastest device's on equal
    devices). Maximizing over ``i`` and minimizing over every split into ``P`` contiguous stages gives the bound:
    :func:`partition_floor` of ``w`` (:func:`staged_partition_floor` where stages differ in speed).

    Why it matters: the LP relaxation spreads layers fractionally (34 layers on 16 stages: 2.125 each), so its
    ``Y`` is the sync of 2.125 layers when some stage must hold 3; this sees the 3 (BERT-Huge on 1024 devices: the
    candidate's LP bound went from 31.1 ms to its optimum's 34.9 ms).
    """
    x = max(1.0, t.shape.stage_weight)  # T >= x p_i: with several stages per group, x = v (PipelineShape)
    empty = t.tpi_s(0.0, 0.0, x * t.stage_time_s(0.0), 0.0)
    if t.problem.cluster.rank_speed is not None:  # A_uk at stage i's own speed: staged_partition_floor
        price = lambda k, speed: t.tpi_s(0.0, 0.0, x * t._time_at(k, speed), k.sync_s)  # noqa: E731
        return staged_partition_floor(_per_stage(t, price)) + empty
    w = [min(t.tpi_s(0.0, 0.0, x * t.fastest_layer_time_s(k), k.sync_s) for k in costs) for costs in t.cost]
    return partition_floor(w, t.stages) + empty


def memory_chain_floor_s(t: CostTables) -> float:
    """:func:`chain_bottleneck_s` where memory decides strategies: a lower bound on the largest stage's layer time
    over the plans that fit, from :func:`memory_partition_floor` of each layer's time at its stage's speed
    (``inf``: no plan of this candidate fits)."""
    return _memory_floors(t)[0]


def memory_chain_sync_floor_s(t: CostTables) -> float:
    """:func:`chain_sync_floor_s` where memory decides strategies: a lower bound on ``tpi_s(0, 0, T, Y)`` over the
    plans that fit, from :func:`memory_partition_floor` of ``tpi_s(0, 0, x A_uk, S_uk)`` (the same proof: the
    stage that attains the partition's largest part holds those layers at some strategy mix that fits its memory)
    plus the empty stage's share (``inf``: nothing fits)."""
    return _memory_floors(t)[1]


def _memory_floors(t: CostTables) -> tuple[float, float]:
    """The memory-aware floors, computed once per table (they take a tenth of a second or more on an 82-layer
    chain over 32 stages, so the search computes them for the candidates it is about to solve, not for all)."""
    cached = t.bound_cache.get("memory_floors")
    if cached is None:
        x = max(1.0, t.shape.stage_weight)
        empty = t.tpi_s(0.0, 0.0, x * t.stage_time_s(0.0), 0.0)
        time_floor = memory_partition_floor(t, lambda speed, k: t._time_at(k, speed))
        sync_floor = memory_partition_floor(t, lambda speed, k: t.tpi_s(0.0, 0.0, x * t._time_at(k, speed), k.sync_s))
        cached = t.bound_cache["memory_floors"] = (time_floor, sync_floor + empty)
    return cached


def stage_memory_allowance_bytes(t: CostTables, stage: int) -> float:
    """The most memory stage ``stage``'s layers may take in a plan that fits: its device group's usable memory less
    what each other stage of the group holds at least (every stage holds a layer; stage ``j`` can hold layers
    ``j .. L - S + j`` only, the chain being split in order into non-empty stages), with the MILP's tolerance."""
    S, L = t.stages, len(t.layers)
    mine = t.stages_of(t.group_of(stage))
    allowance = t.memory_limit_bytes(min(mine)) * (1 + 1e-9)
    least: dict[tuple[int, int], float] = {}  # (distinct layer, in-flight count) -> its least memory
    kinds = _layer_kinds(t)
    for j in mine:
        if j != stage:
            F = t.in_flight(j)
            for u in range(j, L - S + j + 1):
                if (kinds[u], F) not in least:
                    least[kinds[u], F] = min(t.layer_memory_bytes(j, k) for k in t.cost[u])
            allowance -= min(least[kinds[u], F] for u in range(j, L - S + j + 1))
    return allowance


def _layer_kinds(t: CostTables) -> list[int]:
    """Per layer, a small integer shared by interchangeable layers (equal :meth:`~CostTables.layer_key`)."""
    kinds = t.bound_cache.get("layer_kinds")
    if kinds is None:
        ids: dict = {}
        kinds = t.bound_cache["layer_kinds"] = [ids.setdefault(t.layer_key(u), len(ids)) for u in range(len(t.layers))]
    return kinds


#: front points one floor may grow in all before it settles for the floor without memory (the work stays bounded
#: on chains with many layers per stage, where the memory floor adds little to the MILP's own relaxation)
FLOOR_WORK = 50_000


def memory_partition_floor(t: CostTables, price) -> float:
    """A lower bound on ``max_i sum_{u on i} price(speed_i, k_u)`` over the plans of ``t`` that fit memory
    (``price >= 0``; ``speed_i``: :meth:`~CostTables.stage_speed`): the least ``C`` such that the chain splits into
    the ``S`` stages in order (parts may be empty: a relaxation) with each stage's layers at some strategies whose
    summed price is at most ``C`` and whose memory (static plus in-flight activations, plus the largest transient)
    fits :func:`stage_memory_allowance_bytes`.
    ``inf`` when no ``C`` does (nothing fits).

    Unlike :func:`chain_bottleneck_s`, which takes every layer at its cheapest strategy, this sees that a stage
    holding many micro-batches in flight cannot keep three blocks' activations and must recompute one (LLaMA-70B
    on 8,192 devices, ZB-V over 32 stages: 191 ms instead of 172 ms for the largest stage, which raised that
    candidate's root bound from 12.7 s to 13.87 s against a 13.99 s optimum).

    For a given ``C`` the stages take, in order, the longest run of the remaining layers they can; that is optimal
    (a stage's least price and memory only grow with its layers, so by induction the greedy ends every stage no
    earlier than any feasible split does). Whether a run of layers fits: the Pareto front of (price, memory) over
    its strategy mixes within ``C`` and the allowance, per largest transient, grown a layer at a time; exact while
    a front has at most :data:`~.fronts.FRONT_POINTS` points (a few layers per stage, where integrality matters), optimistic
    beyond (merged points dominate every mix they replace, so a run that fits is never refused). ``C`` is
    bracketed from the floor without memory upwards and bisected to a relative 1e-5; returns a refuted value times
    ``1 - 1e-12``, or the floor without memory where the fronts would grow beyond :data:`FLOOR_WORK` points."""
    S, L = t.stages, len(t.layers)
    allowance = [stage_memory_allowance_bytes(t, i) for i in range(S)]
    speeds = [t.stage_speed(i) for i in range(S)]
    kinds = _layer_kinds(t)
    options: dict[tuple, list[tuple[float, float, float]]] = {}  # per (layer kind, speed, in-flight count)
    at: dict[tuple[int, int], list[tuple[float, float, float]]] = {}  # per (layer, stage)

    def opts(u: int, i: int) -> list[tuple[float, float, float]]:
        got = at.get((u, i))
        if got is None:
            key = (kinds[u], speeds[i], t.in_flight(i))
            if key not in options:
                options[key] = _pareto([(price(speeds[i], k), t.layer_memory_bytes(i, k), k.transient_bytes)
                                        for k in t.cost[u]])
            got = at[u, i] = options[key]
        return got

    work = [0]

    def fits(limit: float) -> bool:
        u = 0
        for i in range(S):
            fronts, room = {0.0: [(0.0, 0.0)]}, allowance[i]
            while u < L:
                grown: dict[float, list[tuple[float, float]]] = {}
                for top, points in fronts.items():
                    work[0] += len(points)
                    for pa, pm, pt in opts(u, i):
                        big = max(top, pt)
                        keep = [(a + pa, m + pm) for a, m in points if a + pa <= limit and m + pm + big <= room]
                        if keep:
                            grown.setdefault(big, []).extend(keep)
                if work[0] > FLOOR_WORK:
                    raise _OutOfWork
                if not grown:
                    break
                fronts = {top: staircase(points) for top, points in grown.items()}
                u += 1
            if u == L:
                return True
        return False

    # from below: the same split with every layer at its cheapest price, memory ignored (a lower bound already)
    cheapest = {v: [min(price(v, k) for k in costs) for costs in t.cost] for v in set(speeds)}
    base = staged_partition_floor([cheapest[v] for v in speeds])
    top = sum(max(price(v, k) for v in cheapest for k in costs) for costs in t.cost)  # any split's largest stage
    try:
        if fits(base * (1 + 1e-9) + 1e-15):
            return base
        lo, step = base, max(base * 0.01, top * 1e-6)
        while lo + step < top and not fits(lo + step):  # the least C that fits: bracketed, doubling the step
            lo, step = lo + step, 2 * step
        hi = lo + step
        if hi >= top:
            if not fits(top):
                return float("inf")  # nothing fits at any price
            hi = top
        while hi - lo > 1e-5 * hi:
            mid = (lo + hi) / 2
            if fits(mid):
                hi = mid
            else:
                lo = mid
    except _OutOfWork:  # many layers per stage: integrality matters little there, the LP relaxation sees the rest
        return base
    return lo * (1 - 1e-12)


class _OutOfWork(Exception):
    pass


def _pareto(points: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """The points no other point beats in every coordinate (ties keep one)."""
    out: list[tuple[float, float, float]] = []
    for p in sorted(set(points)):
        if not any(q[1] <= p[1] and q[2] <= p[2] for q in out):
            out.append(p)
    return out


def run_bottleneck_s(t: CostTables, first: int, last: int) -> float:
    """A lower bound on the bottleneck stage time forced by a run of ``R`` identical layers ``first..last``.

    For device group ``g`` let ``h_g(T)`` be the most of these layers that fit on it within time ``T`` and memory
    ``M_g`` (at the group's own speed and memory limit; a group's stages share both)
    (strategy mixes relaxed to fractions: the cheapest time for ``x`` layers is a two-strategy LP, solved in
    closed form). Every layer must go somewhere, so the bottleneck is at least the least ``T`` with
    ``sum_i h_i(T) >= R``. Ignores every other layer, which can only raise the true value; ``inf`` if the run
    cannot fit at all.
    """
    R = last - first + 1
    costs = t.cost[first]
    lo, hi = max(0, t.stages - len(t.layers) + first), min(last, t.stages - 1)
    per_f: dict[tuple[int, float, float], list[float]] = {}
    tables = []
    # a device group's stages share its time T and its memory: one bin per group, each layer priced on the group's
    # stage (within reach of the run) that holds the fewest micro-batches in flight (a relaxation)
    for g in sorted({t.group_of(i) for i in range(lo, hi + 1)}):
        i = min((k for k in t.stages_of(g) if lo <= k <= hi), key=t.in_flight)
        key = (t.in_flight(i), t.stage_speed(i), t.memory_limit_bytes(i))
        if key not in per_f:
            opts = [(t.layer_time_s(i, k), t.layer_memory_bytes(i, k)) for k in costs]
            per_f[key] = [_least_time(opts, x, key[2]) for x in range(1, R + 1)]
        tables.append(per_f[key])
    values = sorted({v for tab in tables for v in tab if v < float("inf")})
    if not values:
        return float("inf")

    def fits(T: float) -> bool:
        return sum(bisect_right(tab, T) for tab in tables) >= R

    if not fits(values[-1]):
        return float("inf")
    return least_holding(values, fits)


def _least_time(opts: list[tuple[float, float]], x: int, limit: float) -> float:
    """min sum a_k n_k  s.t.  sum n_k = x, sum m_k n_k <= limit, n >= 0 (fractional): at most two strategies."""
    opts = frontier(opts)
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
