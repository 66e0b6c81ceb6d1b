"""Sequence parallelism with tensor parallelism (Korthikanti et al., 2022), executed with DTensor.

:func:`apply_sp` shards a layer with its ``uniap_sp_plan(tp)``: LayerNorms ``SequenceParallel`` (run on this
rank's piece of the sequence), column-parallel linears gather the sequence (``input_layouts=Shard(1)``; q, k and v
share one gather, see :func:`sp_plan`), row-parallel ones reduce-scatter it (``output_layouts=Shard(1)``). The
layer's input and output at the chain boundary stay replicated over the tensor-parallel group (the layout the
runtime uses between layers): the input is sliced (no communication), the output all-gathered.

Collectives of a GPT block per pass (measured, ``tests/runtime/test_sequence_parallel.py``): forward 2 all-gathers
and 2 reduce-scatters of ``b s h`` elements (Megatron's, in place of TP's 2 all-reduces) plus the boundary's
all-gather of the output; backward the same (the boundary gathers the input's gradient) plus one all-reduce of
each LayerNorm weight's gradient (``h`` elements; DTensor leaves it ``Partial``, a hook sums it).

Layers opt in with ``uniap_sp_plan(tp) -> dict[str, ParallelStyle]`` (build it with :func:`sp_plan`) beside their
``uniap_tp_degrees()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.tensor_parallel import check_tp_supported, grads_like_params

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def sp_boundary() -> Any:
    """Replicated ``[b, s, h]`` in (sliced to this rank's sequence piece) and out (all-gathered back)."""
    return PrepareModuleInputOutput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                    output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                                    use_local_input=True, use_local_output=True)


def sp_plan(*, norms: Sequence[str], colwise: Sequence[str], rowwise: Sequence[str],
            gathered: Sequence[str] = ()) -> dict[str, Any]:
    """The sequence-parallel TP plan of a transformer block by module name: the boundary (``""``), norms,
    column-parallel linears that gather the sequence themselves, ``gathered`` column-parallel linears that read
    an input the layer gathered once (:func:`replicate_sequence`), and row-parallel linears.

    Why ``gathered``: q, k and v read the same norm output. Each ``ColwiseParallel(input_layouts=Shard(1))`` would
    gather it again, and even fed an already gathered DTensor it redistributes it (a no-op forward) whose backward
    all-reduces the gradient, once per projection. Declared replicated, the three partial gradients add up first
    and the one gather's backward reduce-scatters them once, as in Megatron."""
    plan: dict[str, Any] = {"": sp_boundary()}
    plan.update({n: SequenceParallel() for n in norms})
    plan.update({n: ColwiseParallel(input_layouts=Shard(1)) for n in colwise})
    plan.update({n: ColwiseParallel(input_layouts=Replicate()) for n in gathered})
    plan.update({n: RowwiseParallel(output_layouts=Shard(1)) for n in rowwise})
    return plan


def apply_sp(layer: nn.Module, name: str, tp_mesh: DeviceMesh, *, plan: dict[str, Any] | None = None) -> None:
    """Shard ``layer`` over ``tp_mesh`` with sequence parallelism, in place: ``plan`` or the layer's
    ``uniap_sp_plan(tp)``."""
    tp = tp_mesh.size()
    if plan is None and not hasattr(layer, "uniap_sp_plan"):
        raise UniAPError(f"layer '{name}' ({type(layer).__name__}) has no sequence-parallel plan (uniap_sp_plan)")
    check_tp_supported(layer, name, tp)

    parallelize_module(layer, tp_mesh, plan if plan is not None else layer.uniap_sp_plan(tp))
    for p in layer.parameters():
        if p.requires_grad and hasattr(p, "placements") and all(pl.is_replicate() for pl in p.placements):
            p.register_post_accumulate_grad_hook(_sum_partial_grad)
    grads_like_params(layer)


def _sum_partial_grad(p: Any) -> None:
    """A replicated weight read by sequence-sharded activations (a LayerNorm's) gets a partial gradient; sum it
    over the group at once, so everything that reads ``.grad`` (data-parallel averaging, clipping, checkpoints)
    sees the replicated gradient it expects."""
    grad = p.grad
    if grad is not None and any(pl.is_partial() for pl in grad.placements):
        p.grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)


def replicate_sequence(x: Any) -> Any:
    """A sequence-sharded DTensor (a ``SequenceParallel`` norm's output) gathered once, so the q, k and v
    projections that read it share one all-gather; anything else unchanged."""
    if isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements):
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim)
    return x
