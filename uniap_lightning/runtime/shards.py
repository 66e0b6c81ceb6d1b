"""A rank's shard of a parameter and FSDP2 sharding of a layer (:mod:`.data_parallel`): :func:`local_tensor` (a
DTensor's local piece, a plain tensor as it is), :func:`apply_fsdp` (``fully_shard`` over the layer's data-parallel
mesh) and :func:`own_outputs` (outputs that alias gathered parameters copied before FSDP2 frees them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

def apply_fsdp(layer: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool = True,
               ignored: set[nn.Parameter] | None = None, offload_policy: Any = None) -> None:
    """Shard the layer's parameters, gradients and optimizer states over ``dp_mesh`` (FSDP2); outputs that are
    views of the gathered parameters are copied before FSDP2 frees them (:func:`own_outputs`). ``ignored``:
    parameters FSDP2 leaves alone (expert-parallel shards, whose gradients travel their own way);
    ``offload_policy``: FSDP2's (None: its default, state on the device; a dimension that keeps state on the host
    passes ``CPUOffloadPolicy``)."""
    options = {} if offload_policy is None else {"offload_policy": offload_policy}
    fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None,
                **options)
    own_outputs(layer)


def own_outputs(layer: nn.Module) -> None:
    """After ``fully_shard(layer)``: every output of the layer's forward that shares storage with one of its
    gathered (unsharded) parameters is replaced by a copy, before FSDP2's post-forward hook reshards.

    FSDP2 frees a gathered parameter's storage when it reshards (after the forward under zero3, after the step or
    an evaluation forward under zero1/zero2), so a view of it handed on to later layers - T5's first block passes
    its relative-position table to the stack's other blocks as ``weight.unsqueeze(0).expand(batch, ...)`` - would
    be read after the free (a crash, or ``setStorage ... out of bounds for storage of size 0``). The copy is
    differentiable, so the later layers' gradient still reaches the parameter (FSDP2's pre-backward hook, put on
    the copy as on any output, gathers the parameter again for it). Outputs that are not such views, the usual
    case, are returned as they are: the check is one storage pointer per parameter and per output tensor."""
    layer.register_forward_hook(_copy_views_of_parameters, prepend=True)  # before FSDP2's post-forward (reshard)


def _copy_views_of_parameters(module: nn.Module, args: Any, output: Any) -> Any:
    storages = {_storage_ptr(p) for p in module.parameters()} - {0}  # during the forward: the gathered parameters
    leaves, spec = tree_flatten(output)
    views = [isinstance(t, torch.Tensor) and _storage_ptr(t) in storages for t in leaves]
    if not any(views):
        return None
    return tree_unflatten([t.clone(memory_format=torch.contiguous_format) if v else t
                           for t, v in zip(leaves, views, strict=True)], spec)


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of the storage under ``t`` (its local shard for a DTensor); 0 for none: an empty (freed)
    storage, or a tensor subclass with no storage of its own (a collective's pending result)."""
    try:
        s = local_tensor(t).untyped_storage()
        return s.data_ptr() if s.nbytes() else 0
    except (RuntimeError, NotImplementedError):
        return 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard of ``t`` held by this rank (``t`` itself for a plain tensor); in-place edits reach ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t
