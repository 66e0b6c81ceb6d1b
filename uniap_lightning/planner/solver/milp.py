r"""The MILP over runs of identical layers: exact, and free of the symmetry that sinks the per-layer form.

Transformers repeat one block dozens of times. With one binary per layer and strategy (:mod:`.milp`), which of
80 identical blocks gets which strategy is a symmetric choice that branch-and-bound enumerates; here a run of
``R_g`` identical layers on a stage is described by integer counts, which is exact because identical layers are
interchangeable in every cost except resharding, and resharding is captured by a flow over the run's
data-parallel *levels* (a level = one ``(d, t)``; its strategies differ only in ``shard``).

Indices: runs ``g`` (maximal runs of identical consecutive layers, with identical strategy lists), stages ``i``,
strategies ``k`` of the run, levels ``d`` (distinct ``(d, t)`` of the run), boundaries ``j`` (between stage j and
j + 1).

Variables
  ``Q[g,i]``, ``E[g,i]`` binary (i = 1..P-1): the first / last layer of run g sits on stage >= i.
       present ``pi[g,i] = E[g,i] - Q[g,i+1]``;  stage j ends in run g: ``eta[g,j] = Q[g+1,j+1] - Q[g,j+1]``;
       g spans j and j+1: ``mu[g,j] = E[g,j+1] - Q[g,j+1]``; the junction g|g+1 is boundary j:
       ``beta[g,j] = Q[g+1,j+1] - E[g,j+1]``.
  ``n[g,i,k]`` integer: layers of run g on stage i with strategy k (their sum ``m[g,i]``).
  ``f[g,i,k]``, ``l[g,i,k]`` binary: strategy of the first / last layer of that portion.
  ``tau[g,i,d,e]`` integer: level changes d -> e inside the portion (a walk from f's level to l's level).
  ``y[g,i,d]`` binary: level d is used;  ``w[g,i]`` binary: the portion has at most one layer;
  ``v[g,i,k]`` binary: strategy k is used (for the largest gathered FSDP layer).
  ``zeta``, ``psi``, ``chi`` in [0,1]: AND-products for run junctions inside a stage and stage boundaries.

Constraints
  order:     Q, E non-increasing in i; Q[g,i] <= E[g,i] <= Q[g+1,i]; Q[g+1,i+1] <= E[g,i] (no stage skipped).
  counts:    sum_i m[g,i] = R_g;  sum_k n = m;  pi <= m <= R_g pi;  sum_k f = sum_k l = pi;  f_k, l_k <= n_k;
             f_k + l_k <= n_k + w;  |f_k - l_k| <= 1 - w;  m <= 1 + (R_g - 1)(1 - w).
  walk:      in_d + f_d = out_d + l_d;  in_d + f_d <= n_d (each visit of a level holds a layer);
             n_d <= R_g y_d <= R_g (in_d + f_d);  for every proper level subset S:
             sum_{e not in S, d in S} tau[e,d] + f(S) >= y_d (d in S)  (no detached sub-walks).
  stage:     p_i = sum A n + sum c_g(d,e) tau + junction resharding (zeta);  T >= p_i;  Y >= sum S n.
  boundary:  o_j >= sum (P2P_gj + Xout_gd) psi[g,j,d] + sum Xin_gd chi[...];
             psi >= l_d[g,j] + eta[g,j] - 1;  chi >= f_d[g,j+1] + mu[g,j] - 1 or f_d[g+1,j+1] + beta[g,j] - 1.
  memory:    sum (W + F_i Act) n + gathered_i <= M;  gathered_i >= G_k v_k;  n_k <= R_g v_k.
Objective: ``sum_i p_i + sum_j o_j + (c - 1) T + Y``, as in :mod:`.milp`.

Any feasible assignment maps to one plan (an Euler walk over levels fixes the order inside each portion) whose
``evaluate`` equals the objective; the tests check this against brute force on chains with repeated layers.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import mip

from uniap_lightning.planner.cluster import GIB
from uniap_lightning.planner.cost.comm import p2p_s
from uniap_lightning.planner.cost.layer import CostTables, boundary_inter_node, reshard_s, runs_of
from uniap_lightning.planner.solver.bounds import run_bottleneck_s
from uniap_lightning.planner.solver.backend import MS, MilpResult, add_cutoff, new_model, optimize


class GroupedMilp:
    """Builds and solves the run-aggregated MILP of one candidate (see the module docstring)."""

    def __init__(self, tables: CostTables, *, solver: str = "cbc", threads: int = 1) -> None:
        t0 = time.perf_counter()
        self.t = tables
        self.P, self.L = tables.pp, len(tables.layers)
        self.runs = runs_of(tables)
        self.G = len(self.runs)
        self.m = new_model(solver, threads)
        self._run_data()
        self._order()
        self._portions()
        self._junctions()
        self._boundaries()
        self._stage_terms()
        self.tpi = mip.xsum(self.p) + mip.xsum(self.o) + (tables.c - 1) * self.T + self.Y
        self.m.objective = mip.minimize(self.tpi)
        self.build_s = time.perf_counter() - t0

    # ----------------------------------------------------------------- data
    def _run_data(self) -> None:
        t = self.t
        self.R, self.K, self.cost, self.levels, self.level_of, self.out = [], [], [], [], [], []
        for a, e in self.runs:
            self.R.append(e - a + 1)
            self.K.append(t.strategies[a])
            self.cost.append(t.cost[a])
            lv = sorted({s.d for s in t.strategies[a]})
            self.levels.append(lv)
            self.level_of.append([lv.index(s.d) for s in t.strategies[a]])
            self.out.append(t.layers[a].output_bytes)

    def stage_range(self, g: int) -> range:
        a, e = self.runs[g]
        return range(max(0, self.P - self.L + a), min(e, self.P - 1) + 1)

    def Q(self, g: int, i: int):
        if i <= 0:
            return 1
        if i >= self.P or g >= self.G:
            return 0 if g < self.G else 1
        return self.qv[g, i]

    def E(self, g: int, i: int):
        if i <= 0:
            return 1
        if i >= self.P:
            return 0
        if g < 0:
            return 0
        return self.ev[g, i]

    def pi(self, g: int, i: int):
        return self.E(g, i) - self.Q(g, i + 1)

    def reshard(self, g: int, d_from: int, d_to: int) -> float:
        return reshard_s(self.t.problem.cluster, self.out[g], self.t.b, d_from, d_to) * MS

    # ----------------------------------------------------------------- order
    def _order(self) -> None:
        m, P = self.m, self.P
        self.qv, self.ev = {}, {}
        for g, (a, e) in enumerate(self.runs):
            for var, name, u in ((self.qv, "Q", a), (self.ev, "E", e)):
                lo, hi = max(0, P - self.L + u), min(u, P - 1)
                for i in range(1, P):
                    var[g, i] = m.add_var(f"{name}[{g},{i}]", lb=1 if i <= lo else 0, ub=1 if i <= hi else 0,
                                          var_type=mip.BINARY)
        for g in range(self.G):
            for i in range(1, P):
                if i + 1 < P:
                    m += self.qv[g, i + 1] <= self.qv[g, i], f"q_mono[{g},{i}]"
                    m += self.ev[g, i + 1] <= self.ev[g, i], f"e_mono[{g},{i}]"
                m += self.qv[g, i] <= self.ev[g, i], f"first_le_last[{g},{i}]"
                if g + 1 < self.G:
                    m += self.ev[g, i] <= self.qv[g + 1, i], f"runs_in_order[{g},{i}]"
            if g + 1 < self.G:
                for i in range(P - 1):
                    m += self.Q(g + 1, i + 1) <= self.E(g, i), f"no_skip[{g},{i}]"

    # ----------------------------------------------------------------- portions
    def _portions(self) -> None:
        m = self.m
        self.n, self.f, self.l, self.tau, self.v = {}, {}, {}, {}, {}
        for g in range(self.G):
            R, K, lv = self.R[g], range(len(self.K[g])), range(len(self.levels[g]))
            for i in self.stage_range(g):
                pres = self.pi(g, i)
                n = {k: m.add_var(f"n[{g},{i},{k}]", ub=R, var_type=mip.INTEGER) for k in K}
                f = {k: m.add_var(f"f[{g},{i},{k}]", var_type=mip.BINARY) for k in K}
                self.n[g, i], self.f[g, i] = n, f
                total = mip.xsum(n.values())
                m += total >= pres, f"present_min[{g},{i}]"
                m += total <= R * pres, f"present_max[{g},{i}]"
                m += mip.xsum(f.values()) == pres, f"first_one[{g},{i}]"
                if R == 1:
                    self.l[g, i] = f
                    for k in K:
                        m += f[k] <= n[k], f"first_used[{g},{i},{k}]"
                    continue
                l = {k: m.add_var(f"l[{g},{i},{k}]", var_type=mip.BINARY) for k in K}
                self.l[g, i] = l
                w = m.add_var(f"w[{g},{i}]", var_type=mip.BINARY)
                m += mip.xsum(l.values()) == pres, f"last_one[{g},{i}]"
                m += total <= 1 + (R - 1) * (1 - w), f"single[{g},{i}]"
                for k in K:
                    m += f[k] <= n[k], f"first_used[{g},{i},{k}]"
                    m += l[k] <= n[k], f"last_used[{g},{i},{k}]"
                    m += f[k] + l[k] <= n[k] + w, f"ends_distinct[{g},{i},{k}]"
                    m += f[k] - l[k] <= 1 - w, f"single_same_a[{g},{i},{k}]"
                    m += l[k] - f[k] <= 1 - w, f"single_same_b[{g},{i},{k}]"
                self._walk(g, i, n, f, l)
            m += mip.xsum(n for i in self.stage_range(g) for n in self.n[g, i].values()) == R, f"run_size[{g}]"
            for i in self.stage_range(g):
                for k in K:
                    if self.cost[g][k].transient_bytes > 0:
                        v = self.v[g, i, k] = m.add_var(f"v[{g},{i},{k}]", var_type=mip.BINARY)
                        m += self.n[g, i][k] <= R * v, f"used[{g},{i},{k}]"

    def _level_sum(self, g: int, d: int, var: dict) -> mip.LinExpr:
        return mip.xsum(var[k] for k in range(len(self.K[g])) if self.level_of[g][k] == d)

    def _walk(self, g: int, i: int, n: dict, f: dict, l: dict) -> None:
        """Level changes inside the portion form one walk from the first layer's level to the last's."""
        m, R = self.m, self.R[g]
        D = range(len(self.levels[g]))
        if len(D) == 1:
            return
        tau = {(d, e): m.add_var(f"tau[{g},{i},{d},{e}]", ub=R, var_type=mip.INTEGER) for d in D for e in D if d != e}
        self.tau[g, i] = tau
        y = {d: m.add_var(f"y[{g},{i},{d}]", var_type=mip.BINARY) for d in D}
        for d in D:
            into = mip.xsum(tau[e, d] for e in D if e != d)
            out = mip.xsum(tau[d, e] for e in D if e != d)
            fd, ld, nd = self._level_sum(g, d, f), self._level_sum(g, d, l), self._level_sum(g, d, n)
            m += into + fd == out + ld, f"walk_balance[{g},{i},{d}]"
            m += into + fd <= nd, f"walk_visits[{g},{i},{d}]"
            m += nd <= R * y[d], f"level_used[{g},{i},{d}]"
            m += into + fd >= y[d], f"level_visited[{g},{i},{d}]"
        for size in range(1, len(D)):
            for S in itertools.combinations(D, size):
                entering = mip.xsum(tau[e, d] for d in S for e in D if e not in S)
                start = mip.xsum(self._level_sum(g, d, f) for d in S)
                for d in S:
                    m += entering + start >= y[d], f"connected[{g},{i},{S},{d}]"

    # ----------------------------------------------------------------- junctions and boundaries
    def _junctions(self) -> None:
        """Run g's last layer and run g+1's first layer on the same stage: resharding between their levels."""
        m = self.m
        self.junction = defaultdict(list)  # stage -> list of cost terms
        for g in range(self.G - 1):
            for i in self.stage_range(g):
                if i not in self.stage_range(g + 1):
                    continue
                for d, dv in enumerate(self.levels[g]):
                    for e, ev in enumerate(self.levels[g + 1]):
                        cost = self.reshard(g, dv, ev)
                        if cost <= 0:
                            continue
                        z = m.add_var(f"zeta[{g},{i},{d},{e}]", ub=1)
                        m += z >= self._level_sum(g, d, self.l[g, i]) + self._level_sum(g + 1, e, self.f[g + 1, i]) - 1, \
                            f"junction[{g},{i},{d},{e}]"
                        self.junction[i].append(cost * z)

    def _boundaries(self) -> None:
        m, t, P = self.m, self.t, self.P
        cl = t.problem.cluster
        self.o = [m.add_var(f"o[{j}]") for j in range(P - 1)]
        for j in range(P - 1):
            terms = []
            inter = boundary_inter_node(cl, t.n, j)
            for g in range(self.G):
                if j not in self.stage_range(g):
                    continue
                eta = self.Q(g + 1, j + 1) - self.Q(g, j + 1)
                send = 2 * p2p_s(cl, self.out[g] * t.b / t.n, inter) * MS
                for d, dv in enumerate(self.levels[g]):
                    psi = m.add_var(f"psi[{g},{j},{d}]", ub=1)
                    m += psi >= self._level_sum(g, d, self.l[g, j]) + eta - 1, f"stage_end[{g},{j},{d}]"
                    terms.append((send + self.reshard(g, dv, t.n)) * psi)
                # the next stage starts inside run g, or at run g+1 when the junction is the boundary
                for h, gate in ((g, self.E(g, j + 1) - self.Q(g, j + 1)), (g + 1, self.Q(g + 1, j + 1) - self.E(g, j + 1))):
                    if h >= self.G or j + 1 not in self.stage_range(h):
                        continue
                    for d, dv in enumerate(self.levels[h]):
                        cost = self.reshard(g, t.n, dv)
                        if cost <= 0:
                            continue
                        chi = m.add_var(f"chi[{g},{h},{j},{d}]", ub=1)
                        m += chi >= self._level_sum(h, d, self.f[h, j + 1]) + gate - 1, f"stage_start[{g},{h},{j},{d}]"
                        terms.append(cost * chi)
            m += self.o[j] >= mip.xsum(terms), f"boundary[{j}]"

    # ----------------------------------------------------------------- per stage
    def _stage_terms(self) -> None:
        m, t = self.m, self.t
        limit = t.problem.cluster.memory_bytes / GIB
        self.T = m.add_var("T")
        self.Y = m.add_var("Y")
        self.p = []
        for i in range(self.P):
            here = [g for g in range(self.G) if i in self.stage_range(g)]
            time_terms, sync_terms, mem_terms = [], [], []
            F = t.in_flight(i)
            gathered = []
            for g in here:
                n = self.n[g, i]
                for k, c in enumerate(self.cost[g]):
                    time_terms.append(c.time_s * MS * n[k])
                    if c.sync_s > 0:
                        sync_terms.append(c.sync_s * MS * n[k])
                    mem_terms.append((c.static_bytes + F * c.activation_bytes) / GIB * n[k])
                    if (g, i, k) in self.v:
                        gathered.append(c.transient_bytes / GIB * self.v[g, i, k])
                for (d, e), tv in self.tau.get((g, i), {}).items():
                    cost = self.reshard(g, self.levels[g][d], self.levels[g][e])
                    if cost > 0:
                        time_terms.append(cost * tv)
            p = mip.xsum(time_terms) + mip.xsum(self.junction.get(i, [])) + t.slot_overhead_s * MS
            self.p.append(p)
            m += self.T >= p, f"bottleneck_stage[{i}]"
            if sync_terms:
                m += self.Y >= mip.xsum(sync_terms), f"sync[{i}]"
            use = mip.xsum(mem_terms)
            if gathered:
                gv = m.add_var(f"gathered[{i}]")
                for j, term in enumerate(gathered):
                    m += gv >= term, f"gathered[{i},{j}]"
                use = use + gv
            m += use <= limit, f"memory[{i}]"
        for j, o in enumerate(self.o):
            m += self.T >= o, f"bottleneck_boundary[{j}]"
        for g, (a, e) in enumerate(self.runs):  # valid inequality: integer rounding of the split (see bounds)
            floor = run_bottleneck_s(t, a, e)
            if e > a and floor < float("inf"):
                m += self.T >= floor * MS, f"run_floor[{g}]"

    # ----------------------------------------------------------------- solve and decode
    def solve(self, *, time_limit_s: float, cutoff_s: float | None = None) -> MilpResult:
        if cutoff_s is not None:
            add_cutoff(self.m, self.tpi, cutoff_s)
        name, objective_s, bound_s, solve_s = optimize(self.m, time_limit_s)
        if objective_s is None:
            return MilpResult(name, None, bound_s, None, None, self.build_s, solve_s, self.m.num_cols, self.m.num_rows)
        stages, strategies = self._decode()
        return MilpResult(name, objective_s, bound_s, stages, strategies, self.build_s, solve_s,
                          self.m.num_cols, self.m.num_rows)

    def _decode(self) -> tuple[list[int], list[int]]:
        stages: list[int] = []
        strategies: list[int] = []
        for g in range(self.G):
            for i in self.stage_range(g):
                counts = {k: round(v.x) for k, v in self.n[g, i].items()}
                if sum(counts.values()) == 0:
                    continue
                seq = self._order_portion(g, i, counts)
                stages += [i] * len(seq)
                strategies += seq
        assert len(stages) == self.L, "decoded plan does not cover the chain"
        return stages, strategies

    def _order_portion(self, g: int, i: int, counts: dict[int, int]) -> list[int]:
        """Layers of one portion in an order whose level changes are exactly the solver's walk."""
        first = next(k for k, v in self.f[g, i].items() if v.x > 0.5)
        last = next(k for k, v in self.l[g, i].items() if v.x > 0.5)
        lvl = self.level_of[g]
        edges = defaultdict(list)
        for (d, e), tv in self.tau.get((g, i), {}).items():
            edges[d] += [e] * round(tv.x)
        walk = _euler_walk(edges, lvl[first])
        pool = defaultdict(list)  # level -> strategies still to place (first/last reserved below)
        for k, c in sorted(counts.items(), key=lambda kv: not self.K[g][kv[0]].shard):
            pool[lvl[k]] += [k] * c
        pool[lvl[first]].remove(first)
        if sum(counts.values()) > 1:
            pool[lvl[last]].remove(last)
        visits = defaultdict(int)
        for d in walk:
            visits[d] += 1
        total = sum(counts.values())
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


def _euler_walk(edges: dict[int, list[int]], start: int) -> list[int]:
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
