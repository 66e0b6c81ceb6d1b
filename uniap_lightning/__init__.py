"""uniap-lightning: UniAP automatic hybrid parallelism as a PyTorch Lightning strategy.

Planner API (torch-free to import)::

    from uniap_lightning import build_problem, solve, evaluate, Plan
    problem = build_problem(model="llama_7b", cluster="h100_4x8", global_batch_size=64)
    plan = solve(problem)            # exact MILP search; plan.estimate, plan.solver, plan.baselines
    evaluate(problem, plan)          # re-score any plan with the cost model
    Plan.from_json(plan.to_json())   # the public plan format

Heavy modules (solver, Lightning strategy) load on first use; torch only where it is needed: to price a cluster
whose compute_model is roofline (every shipped cluster naming a catalogue device) and to train.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Plan": "uniap_lightning.planner.plan",
    "LayerPlan": "uniap_lightning.planner.plan",
    "StagePlan": "uniap_lightning.planner.plan",
    "Estimate": "uniap_lightning.planner.plan",
    "Cluster": "uniap_lightning.planner.cluster",
    "Problem": "uniap_lightning.planner.problem",
    "TrainingConfig": "uniap_lightning.planner.problem",
    "ModelProfile": "uniap_lightning.planner.profile",
    "LayerProfile": "uniap_lightning.planner.profile",
    "load_profile": "uniap_lightning.planner.profile",
    "save_profile": "uniap_lightning.planner.profile",
    "build_problem": "uniap_lightning.profiling.pricing",  # the planner's, handed the roofline model
    "solve": "uniap_lightning.planner.solver",
    "evaluate": "uniap_lightning.planner.cost",
    "UniAPError": "uniap_lightning.errors",
    "InfeasibleError": "uniap_lightning.errors",
    "UniAPStrategy": "uniap_lightning.strategy",
}

__all__ = sorted(_LAZY)

from uniap_lightning._autoregister import install as _install  # noqa: E402  (registers "uniap" lazily)

_install()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'uniap_lightning' has no attribute {name!r}")
