"""What a layer's activations and tokens move between ranks, beside its own compute and state: the context-parallel
all-to-alls and ring steps, the expert-parallel all-to-alls, the re-layout of an activation between two layers'
layouts, and whether a pipeline hand-off crosses a node. Priced per micro-batch by :func:`~.layer._layer_cost`
(context and experts) and by :class:`~.tables.CostTables` (re-layouts and hand-offs between layers)."""

from __future__ import annotations

import math

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.cost.comm import all_gather_s, all_to_all_s, p2p_s
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.profile import LayerProfile


def context_parallel_s(layer: LayerProfile, s: Strategy, tokens: float, cluster: Cluster, compute_s: float) -> float:
    """Per micro-batch (forward + backward), what a layer's attention moves with its sequence split over ``cp``
    ranks (0 for a token-wise layer). ``H = output_bytes x tokens / t`` is a rank's share of the hidden states
    (q and o), ``H kv / a`` of k and v.

    * Ulysses (Jacobs et al. 2023): forward, one all-to-all each for q, k, v (sequence to head shards) and one for
      the output (back); backward the same four reversed.
    * Ring attention (Liu et al. 2023; :mod:`uniap_lightning.runtime.ring`): k and v blocks pass ``cp - 1`` times
      around the ring in forward; in backward k and v do again, and their gradients ``cp`` times (home to their
      owner). Each step overlaps a block's attention, so only what exceeds the layer's compute is priced (an
      optimistic overlap with the whole layer). The causal load balance moves q and the output (forward), the
      output's gradient and dq (backward) between the contiguous and the head-and-tail layouts: 4 all-to-alls of
      ``H`` that nothing overlaps (priced for every ring layer: a profile does not say whether it is causal).
    """
    cp, a = s.cp, layer.attention_heads
    if cp == 1 or a == 0:
        return 0.0
    inter = cp * s.tp > cluster.devices_per_node  # the cp group (stride t) leaves a node
    H = layer.output_bytes * tokens / s.tp
    kv = H * (layer.kv_heads or a) / a
    if s.cp_method == "ring":
        return ring_attention_s(cluster, H, kv, cp, inter, compute_s)
    return 2 * (2 * all_to_all_s(cluster, H, cp, inter) + 2 * all_to_all_s(cluster, kv, cp, inter))


def ring_attention_s(cluster: Cluster, H: float, kv: float, cp: int, inter: bool, compute_s: float) -> float:
    """Ring attention's exposed time per micro-batch (see :func:`context_parallel_s`): k / v and dk / dv ring steps
    beyond the layer's compute, plus the 4 all-to-alls of the causal load balance."""
    steps = 2 * (cp - 1) * p2p_s(cluster, 2 * kv, inter) + cp * p2p_s(cluster, 2 * kv, inter)
    return max(steps - compute_s, 0.0) + 4 * all_to_all_s(cluster, H, cp, inter)


def expert_parallel_s(layer: LayerProfile, s: Strategy, tokens: float, cluster: Cluster) -> float:
    """Per micro-batch (forward + backward), what a mixture-of-experts layer's tokens move with its experts split
    over ``ep`` ranks: four all-to-alls (dispatch and combine in forward, their reverses in backward) over the ep
    group, each rank holding ``X = output_bytes x tokens x top_k x cf / t`` bytes (its hidden states once per
    routed slot, ``cf`` the capacity factor or 1 when dropless, split over the tensor-parallel ranks) of which
    ``(ep - 1) / ep`` leave it (balanced routing). An ep group is ``ep`` consecutive replicas (stride ``t``): it
    leaves a node when ``ep t`` exceeds one."""
    ep = s.ep
    if ep == 1 or not layer.experts:
        return 0.0
    X = layer.output_bytes * tokens * layer.top_k * (layer.capacity_factor or 1.0) / s.tp
    return 4 * all_to_all_s(cluster, X, ep, ep * s.tp > cluster.devices_per_node)


def _layout(x: int | tuple[int, int]) -> tuple[int, int]:
    return (x, 1) if isinstance(x, int) else (int(x[0]), int(x[1]))


def reshard_s(cluster: Cluster, out_bytes: float, micro_batch: int, frm: int | tuple[int, int],
              to: int | tuple[int, int]) -> float:
    """Moving an activation (and, in backward, its gradient) from one layout to another: a layout is a
    :attr:`Strategy.layout` ``(dp, cp)`` (the batch split over ``dp``, each sample's sequence over ``cp``) or a
    batch split ``d`` alone (``(d, 1)``).

    Batch splits only: going to fewer slices all-gathers in forward; going to more slices is a local slice in
    forward and an all-gather of the gradient in backward. Either way: one all-gather of ``out_bytes * b / min(d)``
    over ``max(d) / min(d)`` ranks, which sit inside one tensor-parallel block and so inside a node. With a
    sequence split on either side, the pieces are first gathered to the layouts' common coarsening ``(gcd(d),
    gcd(c))`` (``k`` pieces), each side paying one all-gather over its ``pieces / k`` ranks.
    """
    (d1, c1), (d2, c2) = _layout(frm), _layout(to)
    if (d1, c1) == (d2, c2):
        return 0.0
    if c1 == c2 == 1:
        lo, hi = min(d1, d2), max(d1, d2)
        return all_gather_s(cluster, out_bytes * micro_batch / lo, hi // lo, False)
    k = math.gcd(d1, d2) * math.gcd(c1, c2)
    return sum(all_gather_s(cluster, out_bytes * micro_batch / k, x // k, False) for x in (d1 * c1, d2 * c2) if x > k)


def boundary_inter_node(cluster: Cluster, n: int, group_a: int, group_b: int) -> bool:
    """Whether the point-to-point links from device group ``group_a`` to ``group_b`` (``n`` devices each, lane to
    lane) cross a node boundary."""
    dpn = cluster.devices_per_node
    if n >= dpn:
        return True
    return (group_a * n) // dpn != (group_b * n) // dpn
