"""Baselines, scored by the same ``evaluate`` as the planner's plans.

* ``ddp``: pp = 1, every layer data parallel over all devices (replicated), best micro-batch count;
* ``zero2``: the same with ZeRO-2 on every layer, recomputing the activations of the layers (the planner picks
  which, with pp = 1 and this one split) where that is needed to fit memory;
* ``fsdp``: the same, sharded (ZeRO-3);
* ``megatron``: the best uniform Megatron-style grid: one ``(pp, tp, dp)`` for all layers, replicated, even
  split, best c; with full recomputation (every layer) when no grid point fits without it;
* ``intra_only``: the planner restricted to pp = 1 (UniAP's intra-layer-only ablation);
* ``inter_only``: the planner restricted to tp = 1 with replicated data parallelism (pipeline + DP only).

No baseline compresses gradients, offloads (activations or state) or runs float8 matmuls: those are the
planner's opt-in dimensions, which the systems the baselines stand for do not choose per layer.

A baseline that no memory-feasible plan realizes is reported as ``None``.
"""

from __future__ import annotations

from uniap_lightning.planner.cost.layer import Strategy, cost_cache
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.solver.backend import Deadline
from uniap_lightning.planner.solver.search import search
from uniap_lightning.planner.solver.uniform import best_uniform

BASELINES = ("ddp", "zero2", "fsdp", "megatron", "intra_only", "inter_only")


def _unmodified(s: Strategy) -> bool:
    """No opt-in modifier: uncompressed gradients, no offload of activations or state, the run's own precision."""
    return s.compression == "none" and not s.offload and not s.state_offload and s.precision == "default"


@cost_cache()  # one cost cache for every baseline (the enclosing solve's, when there is one)
def baseline_plans(
    problem: Problem, *, solver: str = "auto", time_limit_s: float = 30.0, deadline: Deadline | None = None
) -> dict[str, Plan | None]:
    """Every baseline (``None`` where none fits or the deadline left no time for it). All of them end by
    ``deadline`` (or ``time_limit_s`` from now); the first restricted search takes at most half of what is left."""
    deadline = deadline if deadline is not None else Deadline.after(time_limit_s)
    N = problem.num_devices
    cs = problem.training.microbatch_candidates()
    out: dict[str, Plan | None] = {}
    out["ddp"] = best_uniform(problem, ((1, c, Strategy(N, 1)) for c in cs), deadline=deadline)
    try:  # ZeRO-2 everywhere; the search only decides which layers recompute (and c)
        out["zero2"] = search(problem, solver=solver, deadline=deadline.share(0.2), pp=[1],
                              allowed=lambda s: s.dp == N and _unmodified(s)
                              and s.dp_mode == ("zero2" if N > 1 else "replicate"))
    except UniAPError:
        out["zero2"] = None
    out["fsdp"] = best_uniform(problem, ((1, c, Strategy(N, 1, "zero3" if N > 1 else "replicate")) for c in cs),
                               deadline=deadline)
    for recompute in (False, True):
        grid = []
        for pp in problem.pp_candidates():
            n = N // pp
            for t in (1, 2, 4, 8, 16, 32, 64):
                if n % t == 0:
                    grid += [(pp, c, Strategy(n // t, t, "replicate", recompute)) for c in cs]
        out["megatron"] = best_uniform(problem, grid, deadline=deadline)
        if out["megatron"] is not None:
            break
    plain = lambda s: s.tp == 1 and s.dp_mode == "replicate" and not s.recompute and _unmodified(s)  # noqa: E731
    for key, share, kwargs in (
        ("intra_only", 0.5, {"pp": [1], "allowed": lambda s: s.compression == "none"}),
        ("inter_only", 1.0, {"allowed": plain}),
    ):
        try:
            out[key] = search(problem, solver=solver, deadline=deadline.share(share), **kwargs)
        except UniAPError:
            out[key] = None
    return out
