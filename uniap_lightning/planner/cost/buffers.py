"""NCCL's buffers: what a rank holds on the device for every communicator it uses, beside its tensors.

NCCL allocates each communicator's buffers on the device when the communicator first runs an operation (its
channels' FIFOs: ``NCCL_BUFFSIZE``, 4 MiB per channel and peer for the Simple protocol, and the LL128 and LL
buffers; NCCL docs, "Environment Variables"), and holds them until the communicator is destroyed: more
communicators, more memory, linearly (NCCL maintainers, NVIDIA/nccl#864, #986). Measured with torch on four NVLink
A100s after one 4 MB all-reduce per group: 688 MB for a group of 3-4 ranks, 544 MB for a pair (NVIDIA/nccl#964);
:data:`~uniap_lightning.planner.devices.NCCL_COMMUNICATOR_GIB` and
:data:`~uniap_lightning.planner.devices.NCCL_PAIR_SHARE` carry those, ``Cluster.nccl_comm_gib`` the figure a cluster
is priced with.

A rank's communicators under one layer's strategy, on a stage of ``n`` of the cluster's ``N`` devices:

* the world group (``N > 1``: the process group every job creates, used for barriers and the loss's reduction);
* the layer's tensor-parallel group (``tp > 1``), gradient-reduction group (``dp x cp > 1``; ZeRO shards over
  it), context-parallel group (``cp > 1``) and expert groups (``ep > 1``);
* with pipeline stages (``n < N``): a send/recv pair with the stage before and one with the stage after (two-rank
  communicators; the first and last stages have one, priced as two: the term does not know the stage's place).

The bytes join the layer's ``transient_bytes``, which a device group holds once (its largest): every layer of a
stage pays the same communicators when they share a strategy, and a stage that mixes strategies is priced with the
communicators of the layer whose transient is largest (the union would need a per-stage term the program lacks).
"""

from __future__ import annotations

from uniap_lightning.planner.cluster import GIB, Cluster
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.devices import NCCL_PAIR_SHARE


def communicators(s: Strategy, n: int, num_devices: int) -> tuple[int, int]:
    """``(groups, pairs)``: the NCCL communicators of more than two ranks, or of any size but pipeline hand-offs,
    and the two-rank send/recv pairs a rank uses under ``s`` on a stage of ``n`` of ``num_devices`` devices."""
    if num_devices <= 1:
        return 0, 0
    groups = 1 + (s.tp > 1) + (s.replicas > 1) + (s.cp > 1) + (s.ep > 1)
    pairs = 2 if n < num_devices else 0
    return groups, pairs


def communicator_bytes(cluster: Cluster, s: Strategy, n: int) -> float:
    """NCCL's buffers on one rank of a layer under ``s`` on a stage of ``n`` devices (0 where the cluster prices
    none: ``nccl_comm_gib`` 0)."""
    if cluster.nccl_comm_gib <= 0:
        return 0.0
    groups, pairs = communicators(s, n, cluster.num_devices)
    return cluster.nccl_comm_gib * GIB * (groups + NCCL_PAIR_SHARE * pairs)
