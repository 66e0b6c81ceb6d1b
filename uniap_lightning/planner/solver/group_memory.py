"""A device group's memory in the group floor (:mod:`.group_floor`): per group and count, the least value of its
stages' layers within the group's memory, by a small integer program over the group's own stages, with work limits
(past them, the value without memory stands).
"""

from __future__ import annotations

import math
import time

import mip

from uniap_lightning.planner.cluster import GIB
from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver.backend import MS, new_model, no_gc, solver_available

#: the group programs' work limits: branch-and-bound nodes per solve (a solve the limit stops gives its bound, still a
#: lower bound) and seconds per floor (past them, counts keep the value without memory)
MEMORY_NODES = 50
MEMORY_BUDGET_S = 3.0


class GroupMemoryFloor:
    """Per device group and count ``X``: the least ``b_T x max_k A_k + sum_k (a_p A_k + S_k)`` (milliseconds) over the
    ways the group's stages hold ``X`` layers of the run ``first..last`` and the chain's end layers where they sit,
    *within the group's memory* (``sum_k (static_k + in_flight(k) activation_k) + the largest transient <= M``, the
    formula of :meth:`~CostTables.group_memory_bytes`).

    A small integer program: ``n[k, s]`` layers with strategy ``s`` on stage ``k``, a binary per end layer's strategy,
    ``theta >= A_k``, a binary per transient size (``gmax`` at least each size in use). A stage that can hold run
    layers only holds one at least (the chain is split into non-empty stages); other runs' layers are left out
    (dropping layers only lowers the value). Exact when solved; when :data:`MEMORY_NODES` stops it first, its bound.

    Why it matters: each stage's own allowance (what the group's other stages leave it at least) lets every stage
    take its fastest mix at once; together they may not fit. Qwen-MoE on 8,192 devices (pp 4, interleaved 1F1B,
    v 2): seven blocks on a group cost 628 ms of ``b_T T + Y`` without memory and 644 ms with it."""

    def __init__(self, t: CostTables, first: int, last: int, ends: dict[int, list[int]], weight: float,
                 a_p: float, *, budget_s: float | None = None) -> None:
        self.t, self.first, self.last, self.ends, self.weight, self.a_p = t, first, last, ends, weight, a_p
        self.solver = "highs" if solver_available("highs") else "cbc"
        self.budget_s = MEMORY_BUDGET_S if budget_s is None else budget_s
        self.spent_s = 0.0
        self.memo: dict[tuple, float | None] = {}

    def must_hold(self, k: int) -> bool:
        """Stage k can hold layers of the run only (no end layer is there): it holds one at least."""
        t, S, L = self.t, self.t.stages, len(self.t.layers)
        return k not in self.ends and all(self.first <= u <= self.last for u in range(k, L - S + k + 1))

    def value_ms(self, grp: int, reachable: list[int], outside: list[int], X: int,
                 cutoff_ms: float = math.inf) -> float | None:
        """A lower bound on the group's least value in milliseconds, exact where the program is solved (``inf``:
        nothing fits; ``cutoff_ms`` where nothing is below it); None once :data:`MEMORY_BUDGET_S` is spent."""
        return self._value(grp, reachable, outside, X, None, cutoff_ms)

    def split_value_ms(self, grp: int, reachable: list[int], outside: list[int], counts: tuple[int, ...],
                       cutoff_ms: float = math.inf) -> float | None:
        """The same with the count on each stage of ``reachable`` fixed (``counts``, in that order): the least
        over the mixes holding exactly that split (:mod:`.group_splits`)."""
        return self._value(grp, reachable, outside, sum(counts), tuple(counts), cutoff_ms)

    def _value(self, grp, reachable, outside, X, counts, cutoff_ms) -> float | None:
        t = self.t
        key = (tuple((t.in_flight(k), t.stage_speed(k), tuple(self.ends.get(k, [])), k in reachable,
                      self.must_hold(k)) for k in reachable + outside),
               t.memory_limit_bytes(min(t.stages_of(grp))), X, counts, cutoff_ms)
        if key not in self.memo:
            if self.spent_s >= self.budget_s:
                return None
            with no_gc():  # python-mip frees models from cffi finalizers: a collection inside a solve can deadlock
                start = time.perf_counter()  # (the collection before it is not the program's time)
                self.memo[key] = self._solve(grp, reachable, outside, X, cutoff_ms, counts)
                self.spent_s += time.perf_counter() - start
        return self.memo[key]

    def _options(self, k: int, u: int) -> list:
        """Layer u's strategies on stage k that no other beats in time, sync, memory and transient bytes at once
        (swapping a beaten one for its better keeps a plan within memory and costs no more)."""
        t = self.t
        price = [(t.layer_time_s(k, c), c.sync_s, t.layer_memory_bytes(k, c), c.transient_bytes) for c in t.cost[u]]
        keep = []
        for j, p in enumerate(price):
            beaten = any(q != p and all(a <= b for a, b in zip(q, p)) for q in price)
            if not beaten and p not in [price[i] for i in keep]:
                keep.append(j)
        return [t.cost[u][j] for j in keep]

    def _solve(self, grp: int, reachable: list[int], outside: list[int], X: int, cutoff_ms: float,
               counts: tuple[int, ...] | None = None) -> float:
        t, R = self.t, self.last - self.first + 1
        m = new_model(self.solver)
        theta = m.add_var("theta")
        objective = self.weight * theta
        static, activation = [0.0] * t.stages, [0.0] * t.stages
        by_size: dict[float, list] = {}
        count = []
        for k in reachable + outside:
            chosen = []  # (cost, variable)
            if k in reachable:
                costs = self._options(k, self.first)
                n = [m.add_var(f"n[{k},{s}]", ub=R, var_type=mip.INTEGER) for s in range(len(costs))]
                chosen += list(zip(costs, n))
                count += n
                if counts is not None:
                    m += mip.xsum(n) == counts[reachable.index(k)], f"split[{k}]"
                elif self.must_hold(k):
                    m += mip.xsum(n) >= 1, f"non_empty[{k}]"
            for u in self.ends.get(k, []):
                costs = self._options(k, u)
                e = [m.add_var(f"end[{k},{u},{s}]", var_type=mip.BINARY) for s in range(len(costs))]
                m += mip.xsum(e) == 1, f"end_placed[{k},{u}]"
                chosen += list(zip(costs, e))
            busy = mip.xsum(t.layer_time_s(k, c) * MS * v for c, v in chosen)
            m += theta >= busy, f"longest[{k}]"
            objective += self.a_p * busy + mip.xsum(c.sync_s * MS * v for c, v in chosen if c.sync_s > 0)
            static[k] = mip.xsum(c.static_bytes / GIB * v for c, v in chosen)
            activation[k] = mip.xsum(c.activation_bytes / GIB * v for c, v in chosen)
            for c, v in chosen:
                if c.transient_bytes > 0:
                    by_size.setdefault(c.transient_bytes / GIB, []).append(v)
        m += mip.xsum(count) == X, "count"
        gmax = m.add_var("gmax")
        for j, (size, vs) in enumerate(by_size.items()):
            used = m.add_var(f"used[{j}]", var_type=mip.BINARY)
            m += mip.xsum(vs) <= (R + len(self.ends)) * used, f"size_used[{j}]"
            m += gmax >= size * used, f"largest_transient[{j}]"
        limit = t.memory_limit_bytes(min(t.stages_of(grp))) * (1 + 1e-9) / GIB
        m += t.group_memory_bytes(grp, static, activation, gmax) <= limit, "memory"
        m.objective = mip.minimize(objective)
        if cutoff_ms < math.inf:
            m.cutoff = cutoff_ms * (1 + 1e-9)
        if self.solver == "highs":  # only the bound counts here: no time on primal heuristics
            m.solver._set_double_option_value("mip_heuristic_effort", 0.0)
        status = m.optimize(max_nodes=MEMORY_NODES, max_seconds=max(0.05, self.budget_s - self.spent_s))
        solved = status == mip.OptimizationStatus.OPTIMAL and m.num_solutions > 0
        if solved and m.objective_value <= cutoff_ms:
            return m.objective_value
        if solved or status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
            return cutoff_ms  # nothing below the cutoff (inf without one: nothing fits)
        bound = m.objective_bound
        return min(bound, cutoff_ms) if bound is not None and -1e20 < bound < 1e20 else None
