"""Dynamic load balancing: re-plan from measured stage times and switch plans without restarting.

``UniAPStrategy(rebalance=True, rebalance_threshold=0.10, rebalance_check_every=50, max_rebalances=3)``:

- :mod:`.timing`: each rank times its own stage's forward / backward per micro-batch (hooks; CUDA events on GPU;
  no collective per step);
- :mod:`.decision`: measured vs predicted -> per-rank speed factors -> re-plan? -> switch? (pure arithmetic);
- :mod:`.switch`: the in-process switch (state through a distributed checkpoint, the runtime rebuilt from pristine
  copies of the layers, optimizers and LR schedules continued);
- :mod:`.callback`: the :class:`Rebalancer` callback that runs the checks and keeps the history.

:func:`plan_and_apply` replaces setup's own when rebalancing is on: it keeps the pristine copies before the plan
changes the module, and for a pinned plan it also measures the cluster and profiles the model (a pinned plan is
then the starting point, not a constraint).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from uniap_lightning import setup
from uniap_lightning.adapters import extract_chain
from uniap_lightning.rebalance.callback import Rebalancer
from uniap_lightning.rebalance.decision import RebalanceOptions
from uniap_lightning.rebalance.switch import Pristine

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from uniap_lightning.runtime import Runtime
    from uniap_lightning.setup import Ranks, SetupOptions, SetupResult


def plan_and_apply(strategy: Any, trainer: pl.Trainer, *, ranks: Ranks, options: SetupOptions,
                   rebalance: RebalanceOptions) -> tuple[SetupResult, Runtime, Rebalancer | None]:
    """Setup's plan-and-apply (collective), with what re-planning needs kept aside when ``rebalance.enabled``; the
    :class:`Rebalancer` is ``None`` when rebalancing is off, or (with a warning) when no profile or cluster could be
    had to re-plan with."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    module, precision = strategy.lightning_module, strategy.precision_plugin
    if not rebalance.enabled:
        result, runtime = setup.plan_and_apply(module, trainer, ranks=ranks, options=options,
                                               precision_plugin=precision)
        return result, runtime, None
    chain = extract_chain(module)
    pristine = Pristine(chain)
    basis = None
    if options.pinned_plan is not None:  # measure and profile as for solving; the pinned plan runs first
        basis = setup.run_setup(chain, trainer, ranks=ranks, options=replace(options, pinned_plan=None),
                                precision=str(precision.precision), forward_context=precision.train_step_context)
    result, runtime = setup.plan_and_apply(module, trainer, ranks=ranks, options=options, precision_plugin=precision)
    source = basis or result
    if source.profile is None or source.planning_cluster is None:
        rank_zero_warn("UniAP rebalance: no profile or cluster to re-plan with; rebalancing is off for this run")
        return result, runtime, None
    plan = result.plan
    training = setup._training(SimpleNamespace(layers=list(pristine.copies.values())), plan.global_batch_size,
                               plan.schedule)
    rebalancer = Rebalancer(rebalance, options, pristine, source.profile, source.planning_cluster, training)
    return result, runtime, rebalancer


__all__ = ["RebalanceOptions", "plan_and_apply"]
