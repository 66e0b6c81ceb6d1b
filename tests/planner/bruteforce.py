"""Brute force over the same cost formulas: every (pp, c), contiguous split and strategy assignment.

Exponential; for checking the MILP on small instances (L <= 6, a few devices). Scores plans with ``evaluate``
only, so it shares nothing with the MILP's coefficient tables.
"""

from __future__ import annotations

import itertools

from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.cost.layer import strategies_for
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem


def splits(num_layers: int, pp: int):
    """Stage index per layer for every split of the chain into ``pp`` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, num_layers), pp - 1):
        bounds = (0, *cuts, num_layers)
        yield [i for i in range(pp) for _ in range(bounds[i], bounds[i + 1])]


def brute_force(problem: Problem) -> Plan | None:
    best: Plan | None = None
    layers = problem.model.layers
    for pp in problem.pp_candidates():
        n = problem.num_devices // pp
        for c in problem.training.microbatch_candidates():
            b = problem.training.global_batch_size // c
            if pp > 1 and b % n:
                continue
            options = [strategies_for(lp, n, problem.cluster, b) for lp in layers]
            if not all(options):
                continue
            for stage_of in splits(len(layers), pp):
                for combo in itertools.product(*options):
                    plan = problem.plan_for(stage_of_layer=stage_of, strategies=combo, pp=pp, microbatches=c)
                    est = evaluate(problem, plan, check_strategies=False)
                    if est.feasible and (best is None or est.tpi_s < best.estimate.tpi_s):
                        plan.estimate = est
                        best = plan
    return best
