"""ZeRO data-parallel modes per layer (``LayerPlan.dp_mode``), executed with FSDP2 and the replicated-gradient book.

``replicate`` layers are :class:`~.data_parallel.ReplicatedGrads`' (gradients all-reduced once per optimizer
step). The three ZeRO modes all make the layer an FSDP2 module (``fully_shard`` over the layer's data-parallel
mesh), so the module's registered parameters are DTensor shards: the user's optimizer from
``configure_optimizers`` is built on them and holds only ``1/d`` of the optimizer state, and distributed
checkpoints reshard them by name exactly as today's FSDP layers (a plan differing only in ``dp_mode`` loads any
other's checkpoint). What differs is when parameters are gathered and how gradients are reduced:

- ``zero3``: ``fully_shard(reshard_after_forward=True)`` (today's FSDP): parameters gathered in forward and again
  in backward, gradients reduce-scattered at every micro-batch.
- ``zero2``: ``reshard_after_forward=False``; while a step accumulates (micro-batches, and Lightning batches of an
  accumulation window) ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, both turned
  on only for the backward of the step's last micro-batch. So parameters are all-gathered once per step (at the
  step's first forward) and stay gathered until the last backward; the unsharded gradient accumulates inside FSDP2
  and is reduce-scattered once per step.
- ``zero1``: as ``zero2``, but FSDP2 never reduce-scatters (gradient sync always off). The unsharded gradient (on
  FSDP2's unsharded parameter, a leaf that autograd accumulates into) is averaged whole by
  :class:`~.data_parallel.ReplicatedGrads` - the same buckets, overlap and compression as a replicated layer - and
  :meth:`ZeroLayers.finish` copies this rank's chunk of the average into the sharded parameter's gradient, which
  the user's optimizer steps; the updated shards are all-gathered at the next step's first forward.

Why FSDP2 for zero1 rather than an own shard-parameter scheme: the optimizer and the checkpoint must see the
*module's* parameters (Lightning builds the optimizer from ``self.parameters()``; DCP maps optimizer state to
parameter names through the module), so the module must own shard-sized parameters while its forward runs with
full ones - exactly what FSDP2 does, including 2-D (dp x tp) DTensor shards. Only the gradient path is replaced.

Memory per rank, per layer (``P`` local parameters after tp, ``b``/``g``/``o`` bytes per parameter of weights,
gradients and optimizer state, ``d`` = dp, ``m`` micro-batches), as :func:`held_bytes` measures it from the live
tensors (``tests/runtime/test_zero_recompute.py`` checks it term by term):

- replicate: ``P (b + g + o)`` + the all-reduce bucket ``P g``;
- zero1: ``P b`` gathered + ``P b / d`` shard, ``P g`` unsharded gradient + ``P g`` bucket + ``P g / d`` sharded
  gradient, ``P o / d``;
- zero2: ``P b`` gathered + ``P b / d`` shard, ``P g / d`` (+ ``P g`` unsharded while ``m > 1``), ``P o / d``;
- zero3: ``P (b + g + o) / d``, plus the gathered ``P b`` while the layer runs.

The agreed formulas (issue 12 interfaces) leave out the shard FSDP2 keeps beside the gathered parameters (zero1,
zero2) and zero1's bucket and sharded gradient. The sharded gradient could live in the bucket, but the bucket is
refilled (and all-reduced asynchronously) during the next step's backward, before Lightning drops the old
gradients, so a ``zero_grad(set_to_none=False)`` would zero a buffer in flight: it is a copy.

Recomputation is not here: :meth:`~.stage.StageModule.forward` calls a layer whose plan says ``recompute`` through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; FSDP2 gathers a zero3 layer's parameters again
for the recomputation in its pre-backward hook, and a zero1/zero2 layer's are still gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from uniap_lightning.runtime.data_parallel import ReplicatedGrads, apply_fsdp, local_tensor
from uniap_lightning.errors import UniAPError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ZERO_MODES = ("zero1", "zero2", "zero3")


class _Params:
    """The unsharded parameters of a zero1 layer, in the shape :meth:`ReplicatedGrads.add` reads a layer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self._params = params

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)


def fsdp_params(layer: nn.Module) -> list[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) of a ``fully_shard`` layer."""
    state = layer._get_fsdp_state()  # type: ignore[operator]
    return [fp for group in state._fsdp_param_groups for fp in group.fsdp_params]


@dataclass
class _Layer:
    module: nn.Module
    mode: str
    backwards: int = 0  # backward passes of this layer seen in the current batch
    hits: dict[int, int] = field(default_factory=dict)  # per parameter: gradients accumulated in the batch


@dataclass
class ZeroLayers:
    """The zero1/zero2 layers of this rank's stage and the per-micro-batch FSDP2 switches they need.

    :meth:`begin` before a training batch's forward/backward (``closing``: the batch ends its accumulation window;
    ``backward_passes``: micro-batches per batch), :meth:`end` after it, :meth:`finish` after
    :meth:`ReplicatedGrads.finish` (zero1: the averaged gradients into the shards).
    """

    layers: list[_Layer] = field(default_factory=list)
    _closing: bool = field(default=True, init=False)
    _expected: int = field(default=1, init=False)
    _armed: bool = field(default=False, init=False)
    _to_finish: bool = field(default=False, init=False)  # a closing batch ran: zero1 gradients to hand to shards

    def add(self, layer: nn.Module, mode: str, dp_mesh: DeviceMesh, replicated: ReplicatedGrads, group: Any,
            dp: int, compression: str = "none", *, ignored: set[nn.Parameter] | None = None) -> None:
        """Make ``layer`` an FSDP2 module in ``mode`` (``zero1``/``zero2``/``zero3``) over ``dp_mesh``; ``ignored``
        parameters (expert shards) stay plain, outside FSDP2."""
        if mode == "zero3":
            apply_fsdp(layer, dp_mesh, ignored=ignored)
            return
        apply_fsdp(layer, dp_mesh, reshard_after_forward=False, ignored=ignored)
        entry = _Layer(layer, mode)
        self.layers.append(entry)
        layer.register_forward_hook(lambda m, args, out, e=entry: self._after_forward(e))
        # FSDP2 creates the unsharded parameters at the first all-gather: gather once now (collective over the
        # layer's dp group, same order on every rank) so hooks can be put on them
        layer.unshard()  # type: ignore[operator]
        layer.reshard()  # type: ignore[operator]
        unsharded = [fp.unsharded_param for fp in fsdp_params(layer) if fp.sharded_param.requires_grad]
        for p in unsharded:
            p.register_post_accumulate_grad_hook(lambda p, e=entry: self._on_accumulate(e, p))
        if mode == "zero1":
            replicated.add(_Params(unsharded), group, dp, compression)  # type: ignore[arg-type]
        self._switch(entry, last=True)

    # ------------------------------------------------------------------ per batch
    def begin(self, *, closing: bool, backward_passes: int) -> None:
        self._closing, self._expected, self._armed = closing, backward_passes, True
        self._to_finish = closing
        for e in self.layers:
            e.backwards, e.hits = 0, {}
            self._switch(e, last=closing and backward_passes == 1)

    def end(self) -> None:
        """After the batch (or its failure): the switches back to a plain step's (sync and reshard on). When the
        batch closes its window, every layer is sharded again (FSDP2's post-backward did it for a layer its last
        backward reached; a layer that backward skipped must not keep parameters the optimizer step makes stale)."""
        self._armed = False
        for e in self.layers:
            self._switch(e, last=True)
            if self._closing:
                e.module.reshard()  # type: ignore[operator]  # local: frees the gathered copy

    def check_reduced(self) -> None:
        """After a batch that closes its window ran through: no zero2 layer may keep an unreduced gradient (one its
        last micro-batch's backward skipped: FSDP2 reduce-scatters in the post-backward of that backward only)."""
        if not self._closing:
            return
        for e in self.layers:
            if e.mode == "zero2" and any(_pending_grad(fp) for fp in fsdp_params(e.module)):
                raise UniAPError(
                    f"a zero2 layer ({type(e.module).__name__}) got no gradient in the last micro-batch of an "
                    "optimizer step, so its accumulated gradient was never reduce-scattered; plan layers that some "
                    "micro-batches skip as zero1, zero3 or replicate")

    def _switch(self, e: _Layer, *, last: bool) -> None:
        e.module.set_requires_gradient_sync(last and e.mode == "zero2", recurse=False)  # type: ignore[operator]
        e.module.set_reshard_after_backward(last, recurse=False)  # type: ignore[operator]

    def _after_forward(self, e: _Layer) -> None:
        if not torch.is_grad_enabled():
            # evaluation: nothing follows that would use the gathered parameters; keep idle layers sharded (the
            # module's parameters are then the shards the optimizer and checkpoints know)
            e.module.reshard()  # type: ignore[operator]

    def _on_accumulate(self, e: _Layer, p: torch.Tensor) -> None:
        """A gradient accumulated into one of the layer's unsharded parameters: the first one of a backward pass
        counts the pass and sets the switches FSDP2 reads in its post-backward, which runs after the layer's
        accumulations. Counting accumulations, not backward calls, leaves out a pipeline stage's shape inference
        (``torch.autograd.grad`` on its inputs accumulates nothing)."""
        if not self._armed:
            return
        n = e.hits[id(p)] = e.hits.get(id(p), 0) + 1
        if n > e.backwards:
            e.backwards = n
            self._switch(e, last=self._closing and n >= self._expected)

    # ------------------------------------------------------------------ zero1
    @torch.no_grad()
    def finish(self) -> None:
        """zero1: move this rank's chunk of each averaged unsharded gradient into the sharded gradient; free the
        unsharded one (the next window starts from nothing, as after ``zero_grad``)."""
        if not self._to_finish:  # the window goes on: the unsharded gradients keep accumulating
            return
        self._to_finish = False
        for e in self.layers:
            if e.mode != "zero1":
                continue
            for fp in fsdp_params(e.module):
                full = fp.unsharded_param.grad
                if full is None:
                    continue
                fp.unsharded_param.grad = None
                dim = fp.fsdp_placement.dim
                chunk = _chunk_with_empty(local_tensor(full), fp.mesh_info.shard_mesh_size, dim)[
                    fp.mesh_info.shard_mesh_rank]
                shard = fp.to_sharded_dtensor(chunk.contiguous().clone().view(fp.sharded_size))
                p = fp.sharded_param
                p.grad = shard if p.grad is None else p.grad + shard


def _pending_grad(fp: Any) -> bool:
    unsharded = getattr(fp, "_unsharded_param", None)
    return (unsharded is not None and unsharded.grad is not None) or fp.unsharded_accumulated_grad is not None


# ---------------------------------------------------------------------- measurement
def _storage_bytes(t: torch.Tensor | None, seen: set[int]) -> int:
    if t is None:
        return 0
    t = local_tensor(t)
    s = t.untyped_storage()
    key = s.data_ptr()
    if s.nbytes() == 0 or key in seen:
        return 0
    seen.add(key)
    return s.nbytes()


def held_bytes(layer: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes this rank holds for one layer right now, from the live tensors (each storage counted once).

    ``params``: the registered parameters (an FSDP2 layer's shards); ``gathered``: FSDP2's gathered parameters
    while allocated; ``grads``: gradients of the registered parameters; ``unsharded_grads``: FSDP2's unsharded
    (accumulating) gradients; ``optimizer``: state tensors of ``optimizers`` for the layer's parameters, scalars
    such as Adam's ``step`` left out (they do not scale with the parameters)."""
    seen: set[int] = set()
    out = dict.fromkeys(("params", "gathered", "grads", "unsharded_grads", "optimizer"), 0)
    records = fsdp_params(layer) if hasattr(layer, "_get_fsdp_state") else []
    owned = [fp.sharded_param for fp in records]
    for fp in records:
        unsharded = getattr(fp, "_unsharded_param", None)
        out["params"] += _storage_bytes(fp.sharded_param, seen)
        out["gathered"] += _storage_bytes(unsharded, seen)
        out["grads"] += _storage_bytes(fp.sharded_param.grad, seen)
        out["unsharded_grads"] += _storage_bytes(None if unsharded is None else unsharded.grad, seen)
        out["unsharded_grads"] += _storage_bytes(fp.unsharded_accumulated_grad, seen)
    if not records:
        owned = list(layer.parameters())
        for p in owned:
            out["params"] += _storage_bytes(p, seen)
            out["grads"] += _storage_bytes(p.grad, seen)
    for optimizer in optimizers:
        for p in owned:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    out["optimizer"] += _storage_bytes(v, seen)
    return out


def state_bytes(layer: nn.Module, optimizers: list[torch.optim.Optimizer], buckets: list[Any] = ()) -> int:
    """Bytes this rank holds for ``layer``'s training state right now: :func:`held_bytes` of every FSDP2 unit in
    it (the layer's, and nested ones: expert shards under ZeRO, :mod:`.stage`), plus parameters no unit holds
    (gradients and optimizer states with them; expert shards FSDP2 ignores, a replicated layer), plus their slots in
    the gradient ``buckets`` (:class:`~.data_parallel.Bucket`: each parameter's gradient once more)."""
    units = [m for m in layer.modules() if hasattr(m, "_get_fsdp_state")]
    owned: set[int] = set()
    total = 0
    for unit in units:
        held = held_bytes(unit, optimizers)
        total += held["params"] + held["gathered"] + held["grads"] + held["unsharded_grads"] + held["optimizer"]
        owned |= {id(fp.sharded_param) for fp in fsdp_params(unit)}
    mine = list(layer.parameters())
    for p in mine:
        if id(p) in owned:
            continue
        states = [v for opt in optimizers for v in opt.state.get(p, {}).values()
                  if isinstance(v, torch.Tensor) and v.numel() > 1]
        grads = [p.grad] if p.grad is not None else []
        total += sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in [p, *grads, *states])
    ids = {id(p) for p in mine}
    for b in buckets:
        total += sum(local_tensor(p).numel() * b.buffer.element_size() for p in b.params if id(p) in ids)
    return total

