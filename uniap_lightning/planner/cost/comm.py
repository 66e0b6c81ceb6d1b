"""Alpha-beta model of collectives (Thakur et al. 2005; NCCL's bus-bandwidth convention).

``all_reduce(S, p) = 2 (p - 1) alpha + 2 (p - 1) / p * S / bw`` (the ring; across nodes the tree's
``2 ceil(log2 p) alpha + 2 S / bw`` where that is less, as NCCL chooses); all-gather and reduce-scatter of a full tensor
of ``S`` bytes, and an all-to-all of ``S`` bytes held by each rank: ``(p - 1) alpha + (p - 1) / p * S / bw``;
point-to-point: ``alpha + S / bw``. Each collective is
priced with its own ``bw`` and ``alpha`` (:meth:`Cluster.bandwidth_bytes_per_s` / :meth:`Cluster.latency_s` with
``op=``), which depend on whether the group spans nodes and on the group size where the cluster carries measured
``collective_tables`` (e.g. gloo's reduce-scatter is an all-reduce of the whole tensor, several times slower per
byte than its all-reduce). Without a table for an op the all-reduce figures are used for it.
"""

from __future__ import annotations

import math

from uniap_lightning.planner.cluster import Cluster


def _ring(cluster: Cluster, op: str, nbytes: float, p: int, inter_node: bool, steps: float) -> float:
    """``steps (p - 1) alpha + steps (p - 1) / p * S / bw`` with ``op``'s figures."""
    bw = cluster.bandwidth_bytes_per_s(p, inter_node, op=op)
    alpha = cluster.latency_s(inter_node, op=op, group_size=p)
    return steps * (p - 1) * alpha + steps * (p - 1) / p * nbytes / bw


def all_reduce_s(cluster: Cluster, nbytes: float, p: int, inter_node: bool) -> float:
    """The all-reduce NCCL would run: the ring, or across nodes the (double binary) tree when that is faster
    (:func:`tree_all_reduce_s`: small messages over many nodes, where the ring's ``2 (p - 1)`` latencies add
    up). Measured links (a cluster's collective or bandwidth tables) already hold the library's choice: ring
    formula only."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    ring = _ring(cluster, "all_reduce", nbytes, p, inter_node, 2)
    if not inter_node or cluster.measured_links("all_reduce", True):
        return ring
    return min(ring, tree_all_reduce_s(cluster, nbytes, p))


def tree_all_reduce_s(cluster: Cluster, nbytes: float, p: int) -> float:
    """A pipelined tree all-reduce over ``p`` nodes (reduce up, broadcast down; NCCL's double binary tree keeps
    both directions of every link busy): ``2 ceil(log2 p) alpha + 2 S / bw`` (Sanders et al., "Two-tree
    algorithms for full bandwidth broadcast, reduction and scan", 2009)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    bw = cluster.bandwidth_bytes_per_s(p, True, op="all_reduce")
    alpha = cluster.latency_s(True, op="all_reduce", group_size=p)
    return 2 * math.ceil(math.log2(p)) * alpha + 2 * nbytes / bw


def all_gather_s(cluster: Cluster, nbytes: float, p: int, inter_node: bool) -> float:
    """All-gather producing a ``nbytes`` tensor on each of ``p`` devices."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return _ring(cluster, "all_gather", nbytes, p, inter_node, 1)


def reduce_scatter_s(cluster: Cluster, nbytes: float, p: int, inter_node: bool) -> float:
    """Reduce-scatter of a ``nbytes`` tensor over ``p`` devices (the all-gather formula, reduce-scatter's figures)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return _ring(cluster, "reduce_scatter", nbytes, p, inter_node, 1)


def all_to_all_s(cluster: Cluster, nbytes: float, p: int, inter_node: bool) -> float:
    """All-to-all over ``p`` devices, each holding ``nbytes`` and keeping ``1 / p`` of it (pairwise exchanges)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return _ring(cluster, "all_to_all", nbytes, p, inter_node, 1)


def p2p_s(cluster: Cluster, nbytes: float, inter_node: bool) -> float:
    if nbytes <= 0:
        return 0.0
    return cluster.latency_s(inter_node, op="p2p", group_size=2) + nbytes / cluster.bandwidth_bytes_per_s(
        2, inter_node, op="p2p"
    )
