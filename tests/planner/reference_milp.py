r"""Test reference: the per-layer MILP for one ``(pp, c)`` candidate: stage placement and per-layer strategies, jointly and exactly.

UniAP's program is quadratic (placement x strategy products). We linearize it exactly; python-mip solves it
with CBC or HiGHS. Units inside the model are milliseconds and GiB (coefficients near 1e-3..1e3 keep solver
tolerances meaningful); every returned plan is re-scored with :func:`uniap_lightning.planner.cost.evaluate`.

Indices: layers ``u = 0..L-1``, stages ``i = 0..P-1``, strategies ``k`` of layer ``u`` (``CostTables``).

Variables
  ``x[u,k]``  binary: layer u uses strategy k.
  ``q[u,i]``  binary, ``i = 1..P-1``: stage(u) >= i.  ``s[u,i] = q[u,i] - q[u,i+1]`` (``q[u,0] = 1``,
             ``q[u,P] = 0``) is 1 iff layer u sits on stage i; ``b[u,j] = q[u+1,j+1] - q[u,j+1]`` is 1 iff the
             boundary between stages j and j+1 falls after layer u.
  ``w[u,i,k]`` in [0,1]: s[u,i] AND x[u,k] (disaggregated, so stage sums are exact and the LP is tight).
  ``z[u,k,l]`` in [0,1]: x[u,k] AND x[u+1,l] (transportation form).
  ``r[u,i] >= 0``: resharding between u and u+1 inside stage i;  ``o[j] >= 0``: boundary j's transfer.
  ``T``: the bottleneck (max of stage and boundary times);  ``Y``: the largest end-of-iteration sync.

Constraints (one function each below)
  order:      q[u,i] <= q[u+1,i];  q[u,i+1] <= q[u,i];  q[u+1,i+1] <= q[u,i]  (steps of at most one stage);
              q[0,i] = 0, q[L-1,i] = 1 (first layer on stage 0, last on P-1: no stage is empty).
  link:       sum_k w[u,i,k] = s[u,i];  sum_i w[u,i,k] = x[u,k];  sum_k x[u,k] = 1.
  pairs:      sum_l z[u,k,l] = x[u,k];  sum_k z[u,k,l] = x[u+1,l].
  reshard:    r[u,i] >= sum_kl R[u,k,l] z[u,k,l] - Rmax_u (1 - s[u,i] + b[u,i]).
  boundary:   o[j] >= sum_kl X[u,k,l,j] z[u,k,l] - Xmax_uj (1 - b[u,j]).
  stage time: p_i = sum_uk A[u,k] w[u,i,k] + sum_u r[u,i];  T >= p_i;  T >= o[j];  T >= sum_k A[u,k] x[u,k].
  sync:       Y >= sum_uk S[u,k] w[u,i,k].
  memory:     sum_uk (W[u,k] + F_i Act[u,k]) w[u,i,k] + g[i] <= M;  g[i] >= sum_k G[u,k] w[u,i,k]  (g: the
              largest transient, a gathered ZeRO-3 layer or a recomputed layer's activations; F_i micro-batches
              in flight).
Objective: minimize ``sum_i p_i + sum_j o[j] + (c - 1) T + Y`` (UniAP's TPI).
"""

from __future__ import annotations

import time

import mip

from uniap_lightning.planner.cluster import GIB
from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver.backend import MS, MilpResult, add_cutoff, new_model, optimize


class StageMilp:
    """Builds and solves the MILP of one candidate. See the module docstring for the formulation."""

    def __init__(self, tables: CostTables, *, solver: str = "cbc", threads: int = 1) -> None:
        t0 = time.perf_counter()
        self.t = tables
        self.P, self.L = tables.pp, len(tables.layers)
        self.m = new_model(solver, threads)
        self._variables()
        self._order()
        self._link()
        self._pairs()
        self._stage_time()
        self._sync()
        self._memory()
        self._symmetry()
        self.tpi = mip.xsum(self.p) + mip.xsum(self.o) + (tables.c - 1) * self.T + self.Y
        self.m.objective = mip.minimize(self.tpi)
        self.build_s = time.perf_counter() - t0

    # ----------------------------------------------------------------- helpers
    def stages_of(self, u: int) -> range:
        """Stages layer u can sit on: at most one stage per earlier layer, enough layers left for the rest."""
        return range(max(0, self.P - self.L + u), min(u, self.P - 1) + 1)

    def s(self, u: int, i: int):
        return self.q(u, i) - self.q(u, i + 1)

    def q(self, u: int, i: int):
        if i <= 0:
            return 1
        if i >= self.P:
            return 0
        return self.qv[u, i]

    def b(self, u: int, j: int):
        """1 iff the boundary between stage j and j + 1 falls right after layer u."""
        if j >= self.P - 1:
            return 0
        return self.q(u + 1, j + 1) - self.q(u, j + 1)

    def _variables(self) -> None:
        m, t, P, L = self.m, self.t, self.P, self.L
        self.x = {(u, k): m.add_var(f"x[{u},{k}]", var_type=mip.BINARY) for u in range(L) for k in range(len(t.strategies[u]))}
        self.qv = {}
        for u in range(L):
            rng = self.stages_of(u)
            for i in range(1, P):
                lb = 1 if i <= rng.start else 0
                ub = 1 if i <= rng.stop - 1 else 0
                self.qv[u, i] = m.add_var(f"q[{u},{i}]", lb=lb, ub=ub, var_type=mip.BINARY)
        self.w = {
            (u, i, k): m.add_var(f"w[{u},{i},{k}]", ub=1)
            for u in range(L)
            for i in self.stages_of(u)
            for k in range(len(t.strategies[u]))
        }
        self.T = m.add_var("T")
        self.Y = m.add_var("Y")

    # ----------------------------------------------------------------- constraint families
    def _order(self) -> None:
        """q[u,i] <= q[u+1,i]; q[u,i+1] <= q[u,i]; q[u+1,i+1] <= q[u,i]."""
        m, P = self.m, self.P
        for u in range(self.L):
            for i in range(1, P):
                if u + 1 < self.L:
                    m += self.qv[u, i] <= self.qv[u + 1, i], f"monotone[{u},{i}]"
                    if i + 1 < P:
                        m += self.qv[u + 1, i + 1] <= self.qv[u, i], f"step[{u},{i}]"
                if i + 1 < P:
                    m += self.qv[u, i + 1] <= self.qv[u, i], f"nested[{u},{i}]"

    def _link(self) -> None:
        """sum_k w[u,i,k] = s[u,i]; sum_i w[u,i,k] = x[u,k]; sum_k x[u,k] = 1."""
        m, t = self.m, self.t
        for u in range(self.L):
            K = range(len(t.strategies[u]))
            m += mip.xsum(self.x[u, k] for k in K) == 1, f"one_strategy[{u}]"
            for i in self.stages_of(u):
                m += mip.xsum(self.w[u, i, k] for k in K) == self.s(u, i), f"w_stage[{u},{i}]"
            for k in K:
                m += mip.xsum(self.w[u, i, k] for i in self.stages_of(u)) == self.x[u, k], f"w_strategy[{u},{k}]"

    def _pairs(self) -> None:
        """z[u,k,l] = x[u,k] AND x[u+1,l] (transportation form), then resharding and boundary costs."""
        m, t = self.m, self.t
        self.r: dict[tuple[int, int], mip.Var] = {}
        self.o = [m.add_var(f"o[{j}]") for j in range(self.P - 1)]
        for u in range(self.L - 1):
            K, Kn = range(len(t.strategies[u])), range(len(t.strategies[u + 1]))
            d, dn = [s.layout for s in t.strategies[u]], [s.layout for s in t.strategies[u + 1]]
            R = {(k, l): t.reshard_s(u, d[k], dn[l]) * MS for k in K for l in Kn}
            boundaries = [j for j in range(self.P - 1) if j in self.stages_of(u) and j + 1 in self.stages_of(u + 1)]
            X = {(k, l, j): t.boundary_s(u, d[k], dn[l], j) * MS for k in K for l in Kn for j in boundaries}
            need_pairs = any(v > 0 for v in R.values()) or bool(boundaries)
            if not need_pairs:
                continue
            z = {(k, l): m.add_var(f"z[{u},{k},{l}]", ub=1) for k in K for l in Kn}
            for k in K:
                m += mip.xsum(z[k, l] for l in Kn) == self.x[u, k], f"z_out[{u},{k}]"
            for l in Kn:
                m += mip.xsum(z[k, l] for k in K) == self.x[u + 1, l], f"z_in[{u},{l}]"
            rmax = max(R.values())
            if rmax > 0:
                pair = mip.xsum(R[kl] * z[kl] for kl in z if R[kl] > 0)
                for i in self.stages_of(u):
                    if i not in self.stages_of(u + 1):
                        continue
                    r = self.r[u, i] = m.add_var(f"r[{u},{i}]")
                    m += r >= pair - rmax * (1 - self.s(u, i) + self.b(u, i)), f"reshard[{u},{i}]"
            for j in boundaries:
                xmax = max(X[k, l, j] for k in K for l in Kn)
                m += (
                    self.o[j] >= mip.xsum(X[k, l, j] * z[k, l] for k in K for l in Kn) - xmax * (1 - self.b(u, j)),
                    f"boundary[{u},{j}]",
                )

    def _stage_time(self) -> None:
        """p_i = sum A w + sum r; T >= p_i, T >= o[j], T >= each layer's own time."""
        m, t = self.m, self.t
        self.p = []
        for i in range(self.P):
            expr = mip.xsum(
                t.layer_time_s(i, t.cost[u][k]) * MS * self.w[u, i, k]
                for u in range(self.L)
                if i in self.stages_of(u)
                for k in range(len(t.strategies[u]))
            ) + mip.xsum(r for (u, ii), r in self.r.items() if ii == i) + t.slot_overhead_s * MS
            self.p.append(expr)
            m += self.T >= expr, f"bottleneck_stage[{i}]"
        for j, o in enumerate(self.o):
            m += self.T >= o, f"bottleneck_boundary[{j}]"
        for u in range(self.L):  # valid inequality: strengthens the LP bound on T
            m += self.T >= mip.xsum(t.fastest_layer_time_s(c) * MS * self.x[u, k] for k, c in enumerate(t.cost[u])), \
                f"layer_floor[{u}]"

    def _sync(self) -> None:
        """Y >= the end-of-iteration gradient all-reduce of every stage."""
        t = self.t
        for i in range(self.P):
            terms = [
                (t.cost[u][k].sync_s * MS, self.w[u, i, k])
                for u in range(self.L)
                if i in self.stages_of(u)
                for k in range(len(t.strategies[u]))
                if t.cost[u][k].sync_s > 0
            ]
            if terms:
                self.m += self.Y >= mip.xsum(a * v for a, v in terms), f"sync[{i}]"

    def _memory(self) -> None:
        """Static + in-flight activations + largest gathered FSDP layer <= device memory (GiB)."""
        m, t = self.m, self.t
        for i in range(self.P):
            limit = t.memory_limit_bytes(i) / GIB
            F = t.in_flight(i)
            members = [u for u in range(self.L) if i in self.stages_of(u)]
            use = mip.xsum(
                (t.cost[u][k].static_bytes + F * t.cost[u][k].activation_bytes) / GIB * self.w[u, i, k]
                for u in members
                for k in range(len(t.strategies[u]))
            )
            gathered = [u for u in members if any(c.transient_bytes > 0 for c in t.cost[u])]
            if gathered:
                g = m.add_var(f"g[{i}]")
                for u in gathered:
                    m += g >= mip.xsum(
                        c.transient_bytes / GIB * self.w[u, i, k] for k, c in enumerate(t.cost[u]) if c.transient_bytes
                    ), f"gathered[{u},{i}]"
                use = use + g
            m += use <= limit, f"memory[{i}]"

    def _symmetry(self) -> None:
        """Identical neighbours on one stage with the same batch split d: strategies in index order.

        Swapping such a pair changes no cost (time, sync, memory and resharding depend on the multiset and on d
        only), so ordering them removes equivalent optima without losing any: x[u,k] + x[u+1,l] <= 1 +
        (boundary after u) for l < k with the same d.
        """
        t = self.t
        for u in range(self.L - 1):
            if t.layers[u] != t.layers[u + 1] or t.strategies[u] != t.strategies[u + 1]:
                continue
            boundary = mip.xsum(self.b(u, j) for j in range(self.P - 1)) if self.P > 1 else 0
            for k, s in enumerate(t.strategies[u]):
                for l in range(k):
                    if t.strategies[u + 1][l].dp == s.dp:
                        self.m += self.x[u, k] + self.x[u + 1, l] <= 1 + boundary, f"sym[{u},{k},{l}]"

    # ----------------------------------------------------------------- solve
    def warm_start(self, stage_of_layer: list[int], strategy_index: list[int]) -> None:
        start = [(self.x[u, k], 1.0 if k == strategy_index[u] else 0.0) for (u, k) in self.x]
        start += [(v, 1.0 if stage_of_layer[u] >= i else 0.0) for (u, i), v in self.qv.items()]
        self.m.start = start

    def solve(self, *, time_limit_s: float, cutoff_s: float | None = None) -> MilpResult:
        if cutoff_s is not None:
            add_cutoff(self.m, self.tpi, cutoff_s)
        name, objective_s, bound_s, solve_s = optimize(self.m, time_limit_s)
        if objective_s is None:
            return MilpResult(name, None, bound_s, None, None, self.build_s, solve_s, self.m.num_cols, self.m.num_rows)
        strategy = []
        for u in range(self.L):
            vals = [self.x[u, k].x for k in range(len(self.t.strategies[u]))]
            strategy.append(max(range(len(vals)), key=vals.__getitem__))
        stages = [sum(1 for i in range(1, self.P) if self.qv[u, i].x > 0.5) for u in range(self.L)]
        return MilpResult(
            name, objective_s, bound_s, stages, strategy, self.build_s, solve_s, self.m.num_cols, self.m.num_rows
        )
