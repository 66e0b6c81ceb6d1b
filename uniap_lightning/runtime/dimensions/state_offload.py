"""The state offload dimension's runtime (``state_offload``): a layer's parameters, gradients and optimizer state in
host memory, its optimizer step on the host (ZeRO-Offload), through FSDP2's ``CPUOffloadPolicy``.

Wrap (before ``data``, after the tensor, context and expert dimensions): the layer becomes an FSDP2 unit over its
replica mesh (:meth:`PlanMeshes.dp_mesh`; one rank where it has no replicas) that reshards after forward, as
ZeRO-3, with ``offload_policy=CPUOffloadPolicy()``: FSDP2 keeps the sharded parameters on the host, copies them to
the device before each all-gather and the reduce-scattered gradients back, so the user's optimizer (built from the
module's parameters, as for any FSDP2 layer) steps them on the host. ``data`` then leaves the layer (FSDP2 shards a
module once). Checkpoints see the same DTensor shards by name as a ZeRO-3 layer's, so they reshard across plans
that differ in it.

Pinned host memory where an accelerator exists (the copies run asynchronously); on a CPU-only build
``CPUOffloadPolicy(pin_memory=True)`` fails ("Cannot access accelerator device when none is available": pinning
needs one), so CPU runs use unpinned memory: the same FSDP2 offload path (host shards, copy in before the
all-gather, gradients to the host after the reduce-scatter), each copy then a no-op between host tensors.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.dimensions.base import LayerJob, RuntimeDimension
from uniap_lightning.runtime.shards import apply_fsdp


def check(layer: torch.nn.Module, name: str, st: object) -> None:
    if getattr(st, "state_offload", False) and not any(p.requires_grad for p in layer.parameters()):
        raise UniAPError(f"plan layer {name}: state_offload keeps a layer's trained state on the host, and this "
                         "layer has no trained parameters; plan it without state_offload")


def wrap(job: LayerJob) -> None:
    st = job.st
    if not st.state_offload:
        return
    policy = CPUOffloadPolicy(pin_memory=job.meshes.device_type != "cpu")
    apply_fsdp(job.layer, job.meshes.dp_mesh(st.replicas, st.tp), ignored=job.held_apart, offload_policy=policy)


STATE_OFFLOAD = RuntimeDimension("state_offload", check=check, wrap=wrap)
