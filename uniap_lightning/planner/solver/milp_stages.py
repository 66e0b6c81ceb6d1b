"""The stage totals of the grouped MILP (:mod:`.milp`): each stage's time, sync and memory rows, the bottleneck
``T`` and its floors, and the splits of a run's layers over a group's stages; a base class of
:class:`~uniap_lightning.planner.solver.milp.GroupedMilp`, whose constructor calls these in the module docstring's
order. Moved from :mod:`.milp` to keep files under 400 lines; the rows are unchanged.
"""

from __future__ import annotations

import math

import mip

from uniap_lightning.planner.cluster import GIB
from uniap_lightning.planner.solver.backend import MS
from uniap_lightning.planner.solver.bounds import (chain_bottleneck_s, chain_sync_floor_s, group_floor_s,
                                                  group_sync_floor_s, memory_chain_floor_s, memory_chain_sync_floor_s,
                                                  run_bottleneck_s)
from uniap_lightning.planner.solver.group_floor import cheapest_stage_sum_s, group_stage_floor_s
from uniap_lightning.planner.solver.group_splits import SplitTable


class StageTotals:
    """Stage time, sync, memory and bottleneck rows (``self``: the :class:`GroupedMilp` being built)."""

    def _here(self, i: int) -> list[int]:
        return [g for g in range(self.G) if i in self.stage_range(g)]

    def _stage_time(self) -> None:
        """p_i = stage_time_s(sum A n, sum X tau + sum X zeta)  (which adds the slot overhead);  T >= sum of p_i
        over each device group's stages;  w_i = sum W n (weight-gradient time) and Wmax >= w_i where the schedule
        prices them (zero-bubble)."""
        self.p, self.w = [], []
        weighted = self.t.shape.a_w != 0 or self.t.shape.b_W != 0
        self.Wmax = self.m.add_var("Wmax") if weighted else 0.0
        for i in range(self.P):
            layers, reshard, weight = [], list(self.junction.get(i, [])), []
            for g in self._here(i):
                layers += [self.t.layer_time_s(i, c) * MS * self.n[g, i][k] for k, c in enumerate(self.cost[g])]
                if weighted:
                    weight += [self.t.weight_time_s(i, c) * MS * self.n[g, i][k] for k, c in enumerate(self.cost[g])
                               if c.weight_grad_s > 0]
                for (d, e), tv in self.tau.get((g, i), {}).items():
                    reshard.append(self.reshard_ms(g, self.levels[g][d], self.levels[g][e]) * tv)
            p = self.t.stage_time_s(mip.xsum(layers), mip.xsum(reshard), per_s=MS)
            self.p.append(p)
            if weighted:
                w = mip.xsum(weight)
                self.w.append(w)
                self.m += self.Wmax >= w, f"weight_max[{i}]"
        for grp in range(self.t.pp):
            self.m += self.T >= mip.xsum(self.p[i] for i in self.t.stages_of(grp)), f"bottleneck_group[{grp}]"
        if self.t.shape.stage_weight:  # several stages per group: each priced as long as the group's longest
            for i in range(self.P):
                self.m += self.T >= self.t.shape.stage_weight * self.p[i], f"bottleneck_stage[{i}]"

    def _sync(self) -> None:
        """Y >= sum_{g,k} S_gk n[g,i,k] over each device group's stages i (the largest end-of-iteration sync)."""
        for grp in range(self.t.pp):
            terms = [c.sync_s * MS * self.n[g, i][k] for i in self.t.stages_of(grp) for g in self._here(i)
                     for k, c in enumerate(self.cost[g]) if c.sync_s > 0]
            if terms:
                self.m += self.Y >= mip.xsum(terms), f"sync[{grp}]"

    def _memory(self) -> None:
        """group_memory_bytes(grp, sum W n, sum Act n per stage, gmax_grp) <= M (GiB) for every device group;
        gmax_grp >= G_k v[g,i,k] over the group's stages (one layer of a device runs its backward at a time)."""
        m, t = self.m, self.t
        static, act = [], []
        for i in range(self.P):
            here = self._here(i)
            static.append(mip.xsum(c.static_bytes / GIB * self.n[g, i][k] for g in here
                                   for k, c in enumerate(self.cost[g])))
            act.append(mip.xsum(c.activation_bytes / GIB * self.n[g, i][k] for g in here
                                for k, c in enumerate(self.cost[g])))
        for grp in range(t.pp):
            mine = set(t.stages_of(grp))
            limit = t.memory_limit_bytes(min(mine)) / GIB
            gathered = [size / GIB * v for (g, ii, _), (v, size) in self.v.items() if ii in mine]
            gmax = 0.0
            if gathered:
                gmax = m.add_var(f"gmax[{grp}]")
                for j, term in enumerate(gathered):
                    m += gmax >= term, f"gathered[{grp},{j}]"
            m += t.group_memory_bytes(grp, static, act, gmax) <= limit, f"memory[{grp}]"

    def _bottleneck(self) -> None:
        """T >= o_j;  T >= sum p_i + o_in + o_out per device group where hand-offs block (DeepSpeed);
        T >= run_bottleneck_s(g) for every run of two or more layers;  T >= chain_bottleneck_s;
        (c - 1) T + Y >= chain_sync_floor_s (valid: see :mod:`.bounds`)."""
        for j, o in enumerate(self.o):
            self.m += self.T >= self.t.shape.boundary_weight * o, f"bottleneck_boundary[{j}]"
        for grp in range(self.t.pp):  # blocking hand-offs (DeepSpeed): a group's stages plus both its hand-offs
            sides = self.t.handoffs_of(grp)
            if sides:
                self.m += (self.T >= mip.xsum(self.p[i] for i in self.t.stages_of(grp))
                           + mip.xsum(self.o[j] for j in sides)), f"bottleneck_handoffs[{grp}]"
        for g, (a, e) in enumerate(self.runs):
            floor = run_bottleneck_s(self.t, a, e)
            if e > a and floor < float("inf"):
                self.m += self.T >= floor * MS, f"run_floor[{g}]"
        if self.P > 1:
            chain = chain_bottleneck_s(self.t)
            self.m += self.T >= chain * MS, "chain_floor"
            if self.t.shape.stage_weight:  # T >= v p_k, p_k >= its layers' partition floor + the slot overhead
                chunk = chain + self.t.stage_time_s(0.0)
                self.m += self.T >= self.t.shape.stage_weight * chunk * MS, "chunk_floor"
            # a group pays its v stages' slot overhead beside its layers
            empty = self.t.stage_time_s(0.0) * self.t.v
            self.m += self.T >= (group_floor_s(self.t) + empty) * MS, "group_floor"
        self.m += self.t.tpi_s(0.0, 0.0, self.T, self.Y) >= chain_sync_floor_s(self.t) * MS, "chain_sync_floor"
        # the same two floors where memory decides strategies (a stage that cannot keep its blocks' activations
        # must recompute one): T >= x (p_k's memory-aware floor + the slot), x = v with several stages per group
        memory_floor, memory_sync_floor = memory_chain_floor_s(self.t), memory_chain_sync_floor_s(self.t)
        if math.isfinite(memory_floor):  # inf: nothing fits (the solver finds that out itself)
            x = max(1.0, self.t.shape.stage_weight)
            self.m += self.T >= x * self.t.stage_time_s(memory_floor) * MS, "memory_chain_floor"
        if math.isfinite(memory_sync_floor):
            self.m += self.t.tpi_s(0.0, 0.0, self.T, self.Y) >= memory_sync_floor * MS, "memory_chain_sync_floor"
        # whole layers of each run on each device group's stages, the busiest stage priced x times
        floor = group_stage_floor_s(self.t)
        if math.isfinite(floor):
            self.m += self.t.tpi_s(0.0, 0.0, self.T, self.Y) >= floor * MS, "group_stage_floor"
        floor = (self.t.tpi_s(cheapest_stage_sum_s(self.t), 0.0, 0.0, 0.0)
                 + group_stage_floor_s(self.t, stage_sum=True))
        if math.isfinite(floor):
            self.m += self.t.tpi_s(mip.xsum(self.p), 0.0, self.T, self.Y) >= floor * MS, "group_stage_sum_floor"
        # with one stage per group on equal devices the partition floor above is at least as strong
        if self.t.v > 1 or self.t.problem.cluster.rank_speed is not None:
            self.m += self.t.tpi_s(0.0, 0.0, self.T, self.Y) >= group_sync_floor_s(self.t) * MS, "group_sync_floor"

    def _splits(self, table: SplitTable) -> None:
        """sum_s w[h,s] = 1 and m[g,i] = sum_s s_i w[h,s] for each stage i of group h's entry (run g): the run's
        counts on the group's stages are one of the splits that can beat the cutoff (:mod:`.group_splits`)."""
        for gs in table.groups:
            w = [self.m.add_var(f"split[{gs.run},{gs.group},{j}]", var_type=mip.BINARY)
                 for j in range(len(gs.splits))]
            self.m += mip.xsum(w) == 1, f"one_split[{gs.run},{gs.group}]"
            for pos, i in enumerate(gs.stages):
                count = mip.xsum(self.n[gs.run, i].values())
                self.m += count == mip.xsum(s[pos] * v for s, v in zip(gs.splits, w)), f"split_count[{gs.run},{i}]"
