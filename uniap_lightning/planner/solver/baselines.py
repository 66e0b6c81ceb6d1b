"""Baselines, scored by the same ``evaluate`` as the planner's plans.

* ``ddp``: pp = 1, every layer data parallel over all devices (replicated), best micro-batch count;
* ``fsdp``: the same, sharded (ZeRO-3);
* ``megatron``: the best uniform Megatron-style grid: one ``(pp, tp, dp)`` for all layers, even split, best c;
* ``intra_only``: the planner restricted to pp = 1 (UniAP's intra-layer-only ablation);
* ``inter_only``: the planner restricted to tp = 1 with replicated data parallelism (pipeline + DP only).

A baseline that no memory-feasible plan realizes is reported as ``None``.
"""

from __future__ import annotations

from uniap_lightning.planner.cost.layer import Strategy
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.solver.backend import Deadline
from uniap_lightning.planner.solver.search import search
from uniap_lightning.planner.solver.uniform import best_uniform

BASELINES = ("ddp", "fsdp", "megatron", "intra_only", "inter_only")


def baseline_plans(
    problem: Problem, *, solver: str = "auto", time_limit_s: float = 30.0, deadline: Deadline | None = None
) -> dict[str, Plan | None]:
    """Every baseline (``None`` where none fits or the deadline left no time for it). All of them end by
    ``deadline`` (or ``time_limit_s`` from now); the first restricted search takes at most half of what is left."""
    deadline = deadline if deadline is not None else Deadline.after(time_limit_s)
    N = problem.num_devices
    cs = problem.training.microbatch_candidates()
    out: dict[str, Plan | None] = {}
    out["ddp"] = best_uniform(problem, ((1, c, Strategy(N, 1, False)) for c in cs), deadline=deadline)
    out["fsdp"] = best_uniform(problem, ((1, c, Strategy(N, 1, N > 1)) for c in cs), deadline=deadline)
    grid = []
    for pp in problem.pp_candidates():
        n = N // pp
        for t in (1, 2, 4, 8, 16, 32, 64):
            if n % t == 0:
                grid += [(pp, c, Strategy(n // t, t, False)) for c in cs]
    out["megatron"] = best_uniform(problem, grid, deadline=deadline)
    for key, share, kwargs in (
        ("intra_only", 0.5, {"pp": [1]}),
        ("inter_only", 1.0, {"allowed": lambda s: s.t == 1 and not s.shard}),
    ):
        try:
            out[key] = search(problem, solver=solver, deadline=deadline.share(share), **kwargs)
        except UniAPError:
            out[key] = None
    return out
