"""Alpha-beta ring model of collectives (Thakur et al. 2005; NCCL's bus-bandwidth convention).

``all_reduce(S, p) = 2 (p - 1) alpha + 2 (p - 1) / p * S / bw``; all-gather and reduce-scatter of a full
tensor of ``S`` bytes cost half of that. ``bw`` and ``alpha`` come from the cluster and depend on whether the
group spans nodes (and on the group size, where the cluster carries measured tables).
"""

from __future__ import annotations

from uniap_lightning.cluster import Cluster


def all_reduce_s(cluster: Cluster, nbytes: float, p: int, inter_node: bool) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    bw = cluster.bandwidth_bytes_per_s(p, inter_node)
    return 2 * (p - 1) * cluster.latency_s(inter_node) + 2 * (p - 1) / p * nbytes / bw


def all_gather_s(cluster: Cluster, nbytes: float, p: int, inter_node: bool) -> float:
    """All-gather producing a ``nbytes`` tensor on each of ``p`` devices."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    bw = cluster.bandwidth_bytes_per_s(p, inter_node)
    return (p - 1) * cluster.latency_s(inter_node) + (p - 1) / p * nbytes / bw


def reduce_scatter_s(cluster: Cluster, nbytes: float, p: int, inter_node: bool) -> float:
    """Reduce-scatter of a ``nbytes`` tensor over ``p`` devices (same cost as all-gather in a ring)."""
    return all_gather_s(cluster, nbytes, p, inter_node)


def p2p_s(cluster: Cluster, nbytes: float, inter_node: bool) -> float:
    if nbytes <= 0:
        return 0.0
    return cluster.latency_s(inter_node) + nbytes / cluster.bandwidth_bytes_per_s(2, inter_node)
