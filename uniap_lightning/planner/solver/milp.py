r"""The MILP of one ``(pp, c)`` candidate: stage split and per-layer strategies, jointly and exactly.

UniAP's program is quadratic (placement x strategy); this is an exact linearization over *runs* of identical
layers. Transformers repeat one block dozens of times; with one binary per layer and strategy, which of 80
identical blocks gets which strategy is a symmetric choice branch-and-bound enumerates (the per-layer form is
kept as a test reference, ``tests/planner/reference_milp.py``). Here a run of ``R_g`` interchangeable layers on a
stage is described by integer counts, which is exact because such layers differ in no cost except resharding,
and resharding is captured by a walk over the run's data-parallel *levels* (a level = one batch split ``d``; its
strategies differ only in what does not move activations).

Every coefficient is a term of :class:`~uniap_lightning.planner.cost.tables.CostTables`, and every stage total
is built with its combinators (``stage_time_s``, ``stage_memory_bytes``, ``tpi_s``): the formulas ``evaluate``
computes. Units inside the model are milliseconds and GiB (:mod:`.backend`).

Indices: runs ``g`` (``CostTables.runs``), stages ``i``, boundaries ``j`` (between stage j and j + 1), strategies
``k`` of the run, levels ``d`` of the run.

Variables
  ``Q[g,i]``, ``E[g,i]`` binary (i = 1..P-1): the first / last layer of run g sits on stage >= i (``Q[g,0] = 1``,
       ``Q[g,P] = 0``). Present ``pi[g,i] = E[g,i] - Q[g,i+1]``; stage j ends in run g:
       ``eta[g,j] = Q[g+1,j+1] - Q[g,j+1]``; g spans j and j+1: ``mu[g,j] = E[g,j+1] - Q[g,j+1]``; the junction
       g|g+1 is boundary j: ``beta[g,j] = Q[g+1,j+1] - E[g,j+1]``.
  ``n[g,i,k]`` integer: layers of run g on stage i with strategy k (``m[g,i] = sum_k n[g,i,k]``).
  ``f[g,i,k]``, ``l[g,i,k]`` binary: strategy of the first / last layer of that portion; ``w[g,i]`` binary: the
       portion has at most one layer.
  ``tau[g,i,d,e]`` integer: level changes d -> e inside the portion;  ``y[g,i,d]`` binary: level d is used.
  ``v[g,i,k]`` binary: strategy k is used (for the largest gathered FSDP layer);  ``gmax[i]``: that layer's bytes.
  ``zeta``, ``psi``, ``chi`` in [0,1]: AND-products for run junctions inside a stage and stage boundaries.
  ``o[j] >= 0``: boundary j's transfer;  ``T``: the bottleneck;  ``Y``: the largest end-of-iteration sync.

Program (terms: ``A`` time, ``S`` sync, ``W`` static, ``Act`` activation, ``G`` transient bytes; ``X`` reshard,
``Out``/``In`` leaving/entering a boundary; ``F_i`` micro-batches in flight; ``H`` the slot overhead)
  order:       Q, E non-increasing in i;  Q[g,i] <= E[g,i] <= Q[g+1,i];  Q[g+1,i+1] <= E[g,i].
  counts:      sum_i m[g,i] = R_g;  pi <= m <= U pi;  n_k <= U_k  (U, U_k: how many layers of the run, in all
               and with strategy k, fit stage i's memory at all, at most R_g; ``_caps``).
  ends:        sum_k f = sum_k l = pi;  f_k, l_k <= n_k;  f_k + l_k <= n_k + w;  |f_k - l_k| <= 1 - w;
               m <= 1 + (U - 1)(1 - w).
  walk:        in_d + f_d = out_d + l_d;  in_d + f_d <= n_d;  n_d <= U y_d <= U (in_d + f_d);
               sum_{e not in S, d in S} tau[e,d] + f(S) >= y_d for every proper level subset S, d in S.
               (beyond SUBSET_CUT_LEVELS levels, the same by a flow: one unit enters at the first level, each used
               level consumes one, along arcs with tau > 0)
  junctions:   zeta[g,i,d,e] >= l_d[g,i] + f_e[g+1,i] - 1.
  boundaries:  o_j >= sum Out_gdj psi[g,j,d] + sum In_gd chi[...];  psi >= l_d[g,j] + eta[g,j] - 1;
               chi >= f_d[g,j+1] + mu[g,j] - 1 (or f_d[g+1,j+1] + beta[g,j] - 1).
  stage time:  p_i = sum A_i n + sum X tau + sum X zeta + H;  T >= sum of p_i over a device group's stages and,
               with v > 1 stages per group, T >= v p_i (every chunk priced as long as its group's longest: torch's
               orders assume equal chunks) (A_i: the layer's time at stage i's speed, its slowest device's on a
               heterogeneous cluster).
  sync:        Y >= sum S n  (per stage).
  memory:      sum W n + F_i sum Act n + gmax_i <= M_i  (stage i's smallest device);  gmax_i >= G v_G;  sum_{k: G_k = G} n_k <= U v_G.
  bottleneck:  T >= o_j;  T >= run_bottleneck_s(g), T >= chain_bottleneck_s (times v, plus the slot, with v > 1);  (c - 1) T + Y >= chain_sync_floor_s
               and, with v > 1, >= group_sync_floor_s; (c - 1) T + Y, and with a_p sum p, >= group_stage_floor_s
               (whole layers on a group's stages, the busiest priced v times; within each group's memory once the
               search has computed group_memory_floor_s for the tables);
               the chain floors again where memory decides strategies (memory_chain_floor_s,
               memory_chain_sync_floor_s) (valid inequalities, :mod:`.bounds`: some stage, some device group,
               holds whole layers' time and sync at once).
  splits:      once the search has computed them for a cutoff at least the solve's (:mod:`.group_splits`):
               sum_s w[h,s] = 1, m[g,i] = sum_s s_i w[h,s] over the stages i of device group h (binary w, one per
               split of run g's layers over h's stages that can still beat the cutoff).
Objective: ``TPI = sum_i p_i + sum_j o_j + (c - 1) T + Y``.

Any feasible assignment maps to one plan (an Euler walk over levels fixes the order inside each portion,
:mod:`.decode`) whose ``evaluate`` equals the objective; the tests check this against brute force.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import mip

from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver.backend import MS, MilpResult, add_cutoff, beyond_cutoff, new_model, optimize
from uniap_lightning.planner.solver.group_splits import split_table
from uniap_lightning.planner.solver.decode import decode
from uniap_lightning.planner.solver.milp_stages import StageTotals


#: up to this many levels in a portion, connectivity is stated with one row per subset of levels (tight); beyond,
#: with a flow (polynomial; layouts multiply with context parallelism)
SUBSET_CUT_LEVELS = 4

class GroupedMilp(StageTotals):
    """Builds (one method per constraint family, in the module docstring's order) and solves one candidate."""

    def __init__(self, tables: CostTables, *, solver: str = "cbc", threads: int = 1) -> None:
        t0 = time.perf_counter()
        self.t = tables
        self.P, self.L = tables.stages, len(tables.layers)  # pipeline stages (pp * virtual stages), layers
        self.runs = tables.runs()
        self.G = len(self.runs)
        self.m = new_model(solver, threads)
        self._run_data()
        self._order()
        self._counts()
        self._ends()
        self._walks()
        self._used()
        self._junctions()
        self._boundaries()
        self._stage_time()
        self._sync()
        self._memory()
        self._bottleneck()
        self.tpi = tables.tpi_s(mip.xsum(self.p), mip.xsum(self.o), self.T, self.Y, mip.xsum(self.w), self.Wmax)
        self.m.objective = mip.minimize(self.tpi)
        self.build_s = time.perf_counter() - t0

    # ----------------------------------------------------------------- data and indicator expressions
    def _run_data(self) -> None:
        t = self.t
        self.R, self.K, self.cost, self.levels, self.level_of, self.first = [], [], [], [], [], []
        for a, e in self.runs:
            self.R.append(e - a + 1)
            self.K.append(t.strategies[a])
            self.cost.append(t.cost[a])
            lv = sorted({s.layout for s in t.strategies[a]})
            self.levels.append(lv)
            self.level_of.append([lv.index(s.layout) for s in t.strategies[a]])
            self.first.append(a)  # every layer of a run has the same output, so run g's pair terms use layer a
        self.T = self.m.add_var("T")
        self.Y = self.m.add_var("Y")

    def stage_range(self, g: int) -> range:
        """Stages run g can touch: every earlier layer on its own stage at most, enough layers left for the rest."""
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
        if i >= self.P or g < 0:
            return 0
        return self.ev[g, i]

    def pi(self, g: int, i: int):
        return self.E(g, i) - self.Q(g, i + 1)

    def reshard_ms(self, g: int, d_from: int, d_to: int) -> float:
        return self.t.reshard_s(self.first[g], d_from, d_to) * MS

    def _level_sum(self, g: int, d: int, var: dict) -> mip.LinExpr:
        return mip.xsum(var[k] for k in range(len(self.K[g])) if self.level_of[g][k] == d)

    # ----------------------------------------------------------------- constraint families
    def _order(self) -> None:
        """Q, E non-increasing in i;  Q[g,i] <= E[g,i] <= Q[g+1,i];  Q[g+1,i+1] <= E[g,i] (no stage skipped)."""
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

    def _caps(self, g: int, i: int) -> tuple[int, list[int]]:
        """How many layers of run g stage i can hold at most (``U[g,i]``), in all and per strategy: each takes at
        least its own static and in-flight bytes, and the stage has ``M``. Valid for every feasible plan, and
        much tighter than ``R_g`` in the LP relaxation when memory binds (the big-M rows below use it)."""
        limit = self.t.memory_limit_bytes(i) * (1 + 1e-9)
        per_k = []
        for c in self.cost[g]:
            need = self.t.layer_memory_bytes(i, c)
            per_k.append(self.R[g] if need <= 0 else min(self.R[g], int(limit // need)))
        return max(per_k, default=0), per_k

    def _counts(self) -> None:
        """sum_i m[g,i] = R_g;  pi[g,i] <= m[g,i] <= U[g,i] pi[g,i]  (m = sum_k n[g,i,k], n[g,i,k] <= U[g,i,k])."""
        m = self.m
        self.n, self.U = {}, {}
        for g in range(self.G):
            R = self.R[g]
            for i in self.stage_range(g):
                U, per_k = self._caps(g, i)
                self.U[g, i] = U
                n = self.n[g, i] = {k: m.add_var(f"n[{g},{i},{k}]", ub=per_k[k], var_type=mip.INTEGER)
                                    for k in range(len(self.K[g]))}
                m += mip.xsum(n.values()) >= self.pi(g, i), f"present_min[{g},{i}]"
                m += mip.xsum(n.values()) <= U * self.pi(g, i), f"present_max[{g},{i}]"
            m += mip.xsum(v for i in self.stage_range(g) for v in self.n[g, i].values()) == R, f"run_size[{g}]"

    def _ends(self) -> None:
        """At the level of batch splits (all a portion's ends decide is resharding, which depends on ``d`` only):
        sum_d f = sum_d l = pi;  f_d, l_d <= n_d;  f_d + l_d <= n_d + w;  |f_d - l_d| <= 1 - w;
        m <= 1 + (R_g - 1)(1 - w)  (``n_d``: the portion's layers at level d). A one-layer run has l = f."""
        m = self.m
        self.f, self.l = {}, {}
        for g in range(self.G):
            R, D = self.R[g], range(len(self.levels[g]))
            for i in self.stage_range(g):
                pres = self.pi(g, i)
                nd = {d: self._level_sum(g, d, self.n[g, i]) for d in D}
                if len(D) == 1:  # one level: the ends are the portion's presence
                    self.f[g, i] = self.l[g, i] = {0: pres}
                    continue
                f = self.f[g, i] = {d: m.add_var(f"f[{g},{i},{d}]", var_type=mip.BINARY) for d in D}
                m += mip.xsum(f.values()) == pres, f"first_one[{g},{i}]"
                for d in D:
                    m += f[d] <= nd[d], f"first_used[{g},{i},{d}]"
                if R == 1:
                    self.l[g, i] = f
                    continue
                l = self.l[g, i] = {d: m.add_var(f"l[{g},{i},{d}]", var_type=mip.BINARY) for d in D}
                w = m.add_var(f"w[{g},{i}]", var_type=mip.BINARY)
                m += mip.xsum(l.values()) == pres, f"last_one[{g},{i}]"
                m += mip.xsum(self.n[g, i].values()) <= 1 + max(self.U[g, i] - 1, 0) * (1 - w), f"single[{g},{i}]"
                for d in D:
                    m += l[d] <= nd[d], f"last_used[{g},{i},{d}]"
                    m += f[d] + l[d] <= nd[d] + w, f"ends_distinct[{g},{i},{d}]"
                    m += f[d] - l[d] <= 1 - w, f"single_same_a[{g},{i},{d}]"
                    m += l[d] - f[d] <= 1 - w, f"single_same_b[{g},{i},{d}]"

    def _walks(self) -> None:
        """Level changes inside a portion form one walk from the first layer's level to the last's:
        in_d + f_d = out_d + l_d;  in_d + f_d <= n_d;  n_d <= U y_d <= U (in_d + f_d);
        sum_{e not in S, d in S} tau[e,d] + f(S) >= y_d for every proper subset S of levels (no detached loops)."""
        m = self.m
        self.tau = {}
        for g in range(self.G):
            R, D = self.R[g], range(len(self.levels[g]))
            if R == 1 or len(D) == 1:
                continue
            for i in self.stage_range(g):
                f, l, n = self.f[g, i], self.l[g, i], self.n[g, i]
                U = self.U[g, i]
                tau = self.tau[g, i] = {(d, e): m.add_var(f"tau[{g},{i},{d},{e}]", ub=U, var_type=mip.INTEGER)
                                        for d in D for e in D if d != e}
                y = {d: m.add_var(f"y[{g},{i},{d}]", var_type=mip.BINARY) for d in D}
                for d in D:
                    into = mip.xsum(tau[e, d] for e in D if e != d)
                    out = mip.xsum(tau[d, e] for e in D if e != d)
                    fd, ld, nd = f[d], l[d], self._level_sum(g, d, n)
                    m += into + fd == out + ld, f"walk_balance[{g},{i},{d}]"
                    m += into + fd <= nd, f"walk_visits[{g},{i},{d}]"
                    m += nd <= U * y[d], f"level_used[{g},{i},{d}]"
                    m += into + fd >= y[d], f"level_visited[{g},{i},{d}]"
                if len(D) <= SUBSET_CUT_LEVELS:
                    for size in range(1, len(D)):
                        for S in itertools.combinations(D, size):
                            entering = mip.xsum(tau[e, d] for d in S for e in D if e not in S)
                            start = mip.xsum(f[d] for d in S)
                            for d in S:
                                m += entering + start >= y[d], f"connected[{g},{i},{S},{d}]"
                else:
                    self._connected_by_flow(g, i, D, tau, f, y)

    def _connected_by_flow(self, g: int, i: int, D: range, tau: dict, f: dict, y: dict) -> None:
        """The same connectivity with ``O(|D|^2)`` rows instead of one per subset (layouts multiply with context
        parallelism): one unit of flow enters at the first layer's level and every used level consumes one,
        along level changes the walk makes. phi[d,e] <= |D| tau[d,e];  src_d <= |D| f_d;
        src_d + sum_e phi[e,d] - sum_e phi[d,e] = y_d. A used level unreachable from the first one cannot be fed."""
        m, big = self.m, len(D)
        phi = {(d, e): m.add_var(f"phi[{g},{i},{d},{e}]", ub=big) for d in D for e in D if d != e}
        for (d, e), x in phi.items():
            m += x <= big * tau[d, e], f"flow_arc[{g},{i},{d},{e}]"
        for d in D:
            src = m.add_var(f"phi_src[{g},{i},{d}]", ub=big)
            m += src <= big * f[d], f"flow_source[{g},{i},{d}]"
            m += (src + mip.xsum(phi[e, d] for e in D if e != d) - mip.xsum(phi[d, e] for e in D if e != d)
                  == y[d]), f"flow_use[{g},{i},{d}]"

    def _used(self) -> None:
        """sum_{k: G_k = x} n[g,i,k] <= R_g v[g,i,x] for every distinct transient size x > 0 of run g (gathered
        ZeRO-3 weights, recomputed activations): v says a layer of that size sits on the stage."""
        m = self.m
        self.v = {}
        for g in range(self.G):
            sizes = sorted({c.transient_bytes for c in self.cost[g] if c.transient_bytes > 0})
            for i in self.stage_range(g):
                for x, size in enumerate(sizes):
                    v = self.v[g, i, x] = (m.add_var(f"v[{g},{i},{x}]", var_type=mip.BINARY), size)
                    ks = [k for k, c in enumerate(self.cost[g]) if c.transient_bytes == size]
                    m += mip.xsum(self.n[g, i][k] for k in ks) <= self.U[g, i] * v[0], f"used[{g},{i},{x}]"

    def _junctions(self) -> None:
        """zeta[g,i,d,e] >= l_d[g,i] + f_e[g+1,i] - 1: run g ends and run g+1 starts on stage i at levels d, e;
        its resharding ``X_g(d, e) zeta`` joins stage i's time."""
        m = self.m
        self.junction = defaultdict(list)  # stage -> cost terms
        for g in range(self.G - 1):
            for i in self.stage_range(g):
                if i not in self.stage_range(g + 1):
                    continue
                for d, dv in enumerate(self.levels[g]):
                    for e, ev in enumerate(self.levels[g + 1]):
                        cost = self.reshard_ms(g, dv, ev)
                        if cost <= 0:
                            continue
                        z = m.add_var(f"zeta[{g},{i},{d},{e}]", ub=1)
                        m += z >= self.l[g, i][d] + self.f[g + 1, i][e] - 1, f"junction[{g},{i},{d},{e}]"
                        self.junction[i].append(cost * z)

    def _boundaries(self) -> None:
        """o_j >= sum Out_gdj psi[g,j,d] + sum In_gd chi[g,h,j,d], where psi >= l_d[g,j] + eta[g,j] - 1 (stage j
        ends in run g at level d) and chi >= f_d[h,j+1] + gate - 1 (stage j+1 starts in run h = g at level d
        when g spans the boundary, gate mu; or in h = g+1 when the junction is the boundary, gate beta)."""
        m, t, P = self.m, self.t, self.P
        self.o = [m.add_var(f"o[{j}]") for j in range(P - 1)]
        for j in range(P - 1):
            terms = []
            for g in range(self.G):
                if j not in self.stage_range(g):
                    continue
                eta = self.Q(g + 1, j + 1) - self.Q(g, j + 1)
                for d, dv in enumerate(self.levels[g]):
                    psi = m.add_var(f"psi[{g},{j},{d}]", ub=1)
                    m += psi >= self.l[g, j][d] + eta - 1, f"stage_end[{g},{j},{d}]"
                    terms.append(t.boundary_out_s(self.first[g], dv, j) * MS * psi)
                for h, gate in ((g, self.E(g, j + 1) - self.Q(g, j + 1)), (g + 1, self.Q(g + 1, j + 1) - self.E(g, j + 1))):
                    if h >= self.G or j + 1 not in self.stage_range(h):
                        continue
                    for d, dv in enumerate(self.levels[h]):
                        cost = t.boundary_in_s(self.first[g], dv) * MS
                        if cost <= 0:
                            continue
                        chi = m.add_var(f"chi[{g},{h},{j},{d}]", ub=1)
                        m += chi >= self.f[h, j + 1][d] + gate - 1, f"stage_start[{g},{h},{j},{d}]"
                        terms.append(cost * chi)
            m += self.o[j] >= mip.xsum(terms), f"boundary[{j}]"

    # ----------------------------------------------------------------- solve
    def solve(self, *, time_limit_s: float, cutoff_s: float | None = None) -> MilpResult:
        """Optimize within ``time_limit_s``; only plans better than ``cutoff_s`` are of interest."""
        if cutoff_s is not None:
            add_cutoff(self.m, self.tpi, cutoff_s)
        table = split_table(self.t, cutoff_s)
        if table is not None and table.hopeless:  # some group holds no split that beats the cutoff
            return MilpResult("infeasible", None, cutoff_s, None, None, self.build_s, 0.0, self.m.num_cols,
                              self.m.num_rows)
        if table is not None:
            self._splits(table)
        name, objective_s, bound_s, solve_s = optimize(self.m, time_limit_s)
        if beyond_cutoff(name, objective_s, cutoff_s):
            name, objective_s, bound_s = "infeasible", None, max(bound_s or 0.0, cutoff_s)
        stages = strategies = None
        if objective_s is not None:
            stages, strategies = decode(self)
        return MilpResult(name, objective_s, bound_s, stages, strategies, self.build_s, solve_s,
                          self.m.num_cols, self.m.num_rows)
