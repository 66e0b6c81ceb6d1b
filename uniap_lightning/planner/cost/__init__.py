"""The cost model: per-layer time and memory of each intra-layer strategy, and ``evaluate`` of whole plans.

Formulas (see ``planner.md`` and the README's "Cost model" section); the per-layer terms are written in
:mod:`.layer`, combined into stage totals only in :mod:`.tables`, which ``evaluate``, the MILP and the bounds read:

* compute: ``profile.compute_s(b / d) / t`` per micro-batch;
* tensor parallel: ``2 * tp_allreduces`` ring all-reduces of ``output_bytes * b / d`` over ``t`` devices;
* FSDP (shard, d > 1): all-gather of the weights in forward and backward, reduce-scatter of the gradients,
  every micro-batch; DP (replicate, d > 1): one gradient all-reduce per iteration;
* resharding when ``d`` changes between neighbours (inside a stage, and to/from the stage-boundary layout in
  which the micro-batch is cut into ``g = gcd(b, n)`` chunks, ``b / g`` samples on each of ``n / g`` ranks):
  one all-gather of the boundary activation;
* stage boundary: point-to-point send of ``output_bytes * b / g`` per rank, forward and backward;
* memory: weights + gradients + optimizer state ``/ t`` (and ``/ d`` when sharded), the largest gathered
  FSDP layer, and activations times the micro-batches in flight (``c`` for GPipe, ``min(c, pp - i)`` for 1F1B);
* ``TPI = sum_i p_i + sum_j o_j + (c - 1) * max(p_i, o_j) + max_i sync_i``.
"""

from __future__ import annotations

from uniap_lightning.planner.cost.comm import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s
from uniap_lightning.planner.cost.evaluate import evaluate
from uniap_lightning.planner.cost.layer import LayerCost, Strategy, layer_cost, strategies_for
from uniap_lightning.planner.cost.tables import CandidateCosts, CostTables

__all__ = [
    "CandidateCosts",
    "CostTables",
    "LayerCost",
    "Strategy",
    "all_gather_s",
    "all_reduce_s",
    "evaluate",
    "layer_cost",
    "p2p_s",
    "reduce_scatter_s",
    "strategies_for",
]
