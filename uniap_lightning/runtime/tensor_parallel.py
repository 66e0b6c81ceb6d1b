"""Tensor parallelism (DTensor, Megatron pattern) per layer type.

Contract between layers: a layer's input and output are *replicated* across its tensor-parallel group (every
rank of the group holds the same activation), so any layer can follow any other. Inside a layer the Megatron
pattern applies: column-parallel first, row-parallel last, one all-reduce per pair.

A layer gets a plan from, in order:
1. its own ``uniap_tp_plan(tp) -> dict[str, ParallelStyle]`` and ``uniap_tp_degrees() -> list[int]`` methods
   (what the adapters in :mod:`uniap_lightning.adapters` implement for transformer blocks);
2. a built-in rule for ``nn.Linear`` (column-parallel, output gathered), ``nn.Embedding`` (vocabulary-parallel,
   output all-reduced) and an ``nn.Sequential`` MLP ``Linear, <elementwise>..., Linear`` (column then row).

Any other layer supports only ``tp = 1``; a plan asking for more is refused with a :class:`UniAPError` before any
process group work starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from uniap_lightning.errors import UniAPError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Modules that act elementwise, allowed between the two Linear layers of a tensor-parallel MLP.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU, nn.Mish)


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def _mlp_linears(layer: nn.Module) -> tuple[str, str] | None:
    if not isinstance(layer, nn.Sequential) or len(layer) < 2:
        return None
    kids = list(layer.named_children())
    first, last = kids[0], kids[-1]
    if not (isinstance(first[1], nn.Linear) and isinstance(last[1], nn.Linear)):
        return None
    if not all(isinstance(m, ELEMENTWISE) for _, m in kids[1:-1]):
        return None
    return first[0], last[0]


def tp_degrees(layer: nn.Module) -> list[int]:
    """Tensor-parallel degrees this layer supports (always includes 1)."""
    if hasattr(layer, "uniap_tp_degrees"):
        return sorted(set(layer.uniap_tp_degrees()) | {1})
    if isinstance(layer, nn.Linear):
        return _divisors(layer.out_features)
    if isinstance(layer, nn.Embedding):
        return _divisors(layer.num_embeddings)
    names = _mlp_linears(layer)
    if names is not None:
        return _divisors(getattr(layer, names[0]).out_features)
    return [1]


def tp_allreduces(layer: nn.Module) -> int:
    """Activation collectives per pass under tensor parallelism (what the cost model charges)."""
    if hasattr(layer, "uniap_tp_allreduces"):
        return int(layer.uniap_tp_allreduces())
    return 1 if tp_degrees(layer) != [1] else 0


def _builtin_plan(layer: nn.Module) -> dict[str, Any] | None:
    if isinstance(layer, nn.Linear):
        return {"": ColwiseParallel(output_layouts=Replicate())}
    if isinstance(layer, nn.Embedding):
        return {"": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    names = _mlp_linears(layer)
    if names is not None:
        return {names[0]: ColwiseParallel(), names[1]: RowwiseParallel()}
    return None


def check_tp_supported(layer: nn.Module, name: str, tp: int) -> None:
    """Refuse a tensor-parallel degree the layer cannot run, naming the layer and what it supports."""
    if tp == 1:
        return
    degrees = tp_degrees(layer)
    if tp not in degrees:
        if degrees == [1]:
            raise UniAPError(
                f"layer '{name}' ({type(layer).__name__}) has no tensor-parallel plan, but the plan asks for tp={tp}. "
                "Supported out of the box: nn.Linear, nn.Embedding, nn.Sequential(Linear, <activation>, Linear), and "
                "layers defining uniap_tp_plan()/uniap_tp_degrees() (see uniap_lightning.adapters)."
            )
        raise UniAPError(f"layer '{name}' ({type(layer).__name__}) supports tp in {degrees}, the plan asks for tp={tp}")


def apply_tp(layer: nn.Module, name: str, tp_mesh: DeviceMesh) -> None:
    """Shard ``layer`` over ``tp_mesh`` in place (input and output stay replicated over the group)."""
    tp = tp_mesh.size()
    check_tp_supported(layer, name, tp)
    plan_fn: Callable[[int], dict[str, Any]] | None = getattr(layer, "uniap_tp_plan", None)
    plan = plan_fn(tp) if plan_fn is not None else _builtin_plan(layer)
    if plan is None:  # unreachable after check_tp_supported, kept as an invariant
        raise AssertionError(f"no TP plan for {name}")
    if "" in plan:
        parallelize_module(layer, tp_mesh, plan[""])
    else:
        parallelize_module(layer, tp_mesh, plan)
    grads_like_params(layer)


def grads_like_params(layer: nn.Module) -> None:
    """Keep each tensor-parallel weight's gradient in the weight's layout: DTensor hands a vocabulary-parallel
    embedding (``Shard(0)`` weight) a *replicated* gradient, whose local tensor is then the whole gradient, not this
    rank's shard (data-parallel buckets, clipping and checkpoints read local tensors). Keeping the shard is a local
    slice."""
    for p in layer.parameters():
        if p.requires_grad and hasattr(p, "placements"):
            p.register_post_accumulate_grad_hook(_grad_like_param)


def _grad_like_param(p: Any) -> None:
    grad = p.grad
    if grad is not None and hasattr(grad, "placements") and tuple(grad.placements) != tuple(p.placements) and \
            not any(pl.is_partial() for pl in grad.placements):
        p.grad = grad.redistribute(placements=p.placements)
