"""Run micro-batches through the stages: torch.distributed.pipelining schedules for ``pp > 1``, a plain loop else.

Each rank feeds its *lane's* share of the batch: the global batch (every rank loads the same one) is cut into
``c`` micro-batches of ``b`` samples, each micro-batch into ``n`` slices, and the rank at stage position ``r``
takes slice ``r`` of every micro-batch (a micro-batch smaller than ``n``, any ``pp``: ``g = gcd(b, n)`` slices,
slice ``r // (n / g)``, so ``n / g`` lanes hold each; their equal losses average out in the global mean). Lane
``r`` is a pipeline over ranks ``r, n+r, ...`` with its own process group, so the ``n`` lanes run side by side
(lanes holding the same slice send the same activations down their own pipelines).

A rank runs every pipeline stage its device group holds (``virtual_stages`` of them, placed by the schedule: loop
or V), one ``PipelineStage`` each, through the plan's torch schedule class (:data:`SCHEDULE_CLASSES`). Evaluation
and prediction run forward only over the same stages (:func:`forward_only_schedule` when there are several).

Losses are means over a lane's slice; gradients are the mean over micro-batches (each micro-batch's loss carries
``1 / microbatches`` before its backward) and, through the data-parallel averages, over lanes: exactly the gradient
of the mean loss over the global batch, as on one device. The scaling is in the loss, not in the schedules'
``scale_grads`` (which divides ``.grad`` after the whole step), so a gradient is final as soon as the last
micro-batch's backward has accumulated it: replicated layers start reducing it then
(:class:`~uniap_lightning.runtime.data_parallel.ReplicatedGrads`).

Inputs and targets may be payloads (:mod:`.payload`: a tensor, a tuple or a flat dict of tensors): every tensor is
sliced alike. Stages send and receive the tensors of a payload as one flat tuple. The schedules get, as their
``target``, the index of each micro-batch; the loss looks the micro-batch's real target up by that index, so a
target may be any payload (e.g. labels with the count of valid tokens) where torch's schedules take one tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import Plan
from uniap_lightning.runtime.mesh import PlanMeshes
from uniap_lightning.runtime.payload import chunk, concat, flatten, is_payload, map_tensors, signature, unflatten
from uniap_lightning.runtime.sequence import check_sequence_length, piece_loss
from uniap_lightning.runtime.stage import StageModule

LossFn = Callable[[Any, Any], torch.Tensor]

#: plan schedule -> torch.distributed.pipelining class name (1f1b runs as GPipe with fewer micro-batches than stages)
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zb_v": "ScheduleZBVZeroBubble",
    "dualpipe_v": "ScheduleDualPipeV",
}
_SINGLE = ("ScheduleGPipe", "Schedule1F1B")  # classes that take one stage, not a list


def schedule_class_name(plan: Plan) -> str:
    name = SCHEDULE_CLASSES[plan.schedule]
    if name == "Schedule1F1B" and plan.microbatches < plan.pp:
        return "ScheduleGPipe"  # no steady state with fewer micro-batches than stages: exactly GPipe
    return name


def check_schedule_runs(plan: Plan) -> None:
    """torch's own requirements of the plan's schedule class, as one clear line before any collective."""
    if plan.pp == 1:
        return
    m, pp, k = plan.microbatches, plan.pp, plan.num_stages
    name = schedule_class_name(plan)
    where = f"plan schedule={plan.schedule!r} (torch {name}, pp={pp}, virtual_stages={plan.virtual_stages}, " \
            f"microbatches={m})"
    if name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            raise UniAPError(f"{where}: microbatches must be a multiple of max(1, microbatches // pp) = {rounds}")
    if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") and plan.virtual_stages != 2:
        raise UniAPError(f"{where}: the V schedules run exactly 2 stages per device group")
    if name == "ScheduleDualPipeV" and m < k:
        raise UniAPError(f"{where}: DualPipeV needs at least as many microbatches as stages ({k})")
    if name in _SINGLE and plan.virtual_stages != 1:
        raise UniAPError(f"{where}: runs one stage per device group")


def lane_slice(t: Any, plan: Plan, lane: int) -> Any:
    """This lane's samples of every micro-batch, concatenated in micro-batch order (every tensor of a payload;
    ``None`` stays ``None``)."""
    if t is None:
        return None
    if not is_payload(t):
        raise UniAPError(
            f"batch inputs and targets must be tensors, tuples or flat dicts of tensors (batch on dim 0), got "
            f"{type(t).__name__}"
        )
    return map_tensors(lambda x: _lane_slice_tensor(x, plan, lane), t)


def _lane_slice_tensor(t: torch.Tensor, plan: Plan, lane: int) -> torch.Tensor:
    batch = t.shape[0]
    c, n = plan.microbatches, plan.devices_per_stage
    g = _chunks_per_microbatch(plan)
    if batch % (c * g):
        raise UniAPError(
            f"batch of {batch} samples cannot be split into microbatches={c} x {g} devices per stage: "
            f"the batch size must be a multiple of {c * g} (drop_last=True avoids a short last batch)"
        )
    if g == 1:
        return t
    return t.reshape(c, g, batch // (c * g), *t.shape[1:])[:, lane // (n // g)].reshape(batch // g, *t.shape[1:])


def _chunks_per_microbatch(plan: Plan) -> int:
    """How many slices a micro-batch is cut into at stage boundaries: ``n``, or ``gcd(b, n)`` for a micro-batch
    smaller than that (each slice then held by ``n / g`` lanes; :func:`~.mesh.boundary_layout`)."""
    return plan.boundary_chunks


def unslice(local: torch.Tensor, plan: Plan, gathered: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`lane_slice` given every lane's part (in lane order)."""
    c, n = plan.microbatches, plan.devices_per_stage
    g = _chunks_per_microbatch(plan)
    parts = [g_.reshape(c, g_.shape[0] // c, *g_.shape[1:]) for g_ in gathered[::n // g]]
    return torch.stack(parts, dim=1).reshape(-1, *local.shape[1:])


def forward_only_schedule(plan: Plan) -> type:
    """A forward-only schedule over the plan's placement (loop or V): each device group runs every micro-batch
    through its stages in chain order (torch's ScheduleLoopedBFS order, which assumes the loop placement, with
    the plan's stages and its stage-to-group map)."""
    from torch.distributed.pipelining.schedules import (  # deferred: torch.distributed.pipelining loads dynamo (~0.4 s)
        ScheduleLoopedBFS, _Action, _add_send_recv, _ComputationType)

    groups = {g: plan.stages_of_group(g) for g in range(plan.pp)}

    class ForwardOnly(ScheduleLoopedBFS):
        def _calculate_single_rank_operations(self, rank: int) -> list[Any]:
            ops: list[Any] = [None] * rank
            for k in groups[rank]:
                ops.extend(_Action(k, _ComputationType.FORWARD, mb) for mb in range(self._n_microbatches))
            return ops

        def _prepare_schedule_with_comms(self, actions: Any, format: str = "compute_only") -> None:
            # torch's lowering validates that every stage runs its backward; a forward-only order only needs sends
            # and receives, over the plan's stage-to-group map
            self.stage_index_to_group_rank = {k: plan.group_of_stage(k) for k in range(plan.num_stages)}
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank
            self.pipeline_order_with_comms = _add_send_recv(
                {r: [a for a in ops if a is not None] for r, ops in actions.items()},
                stage_to_rank=lambda k: plan.group_of_stage(k), num_stages=plan.num_stages)

    return ForwardOnly


class PipelineRunner:
    """Forward/backward of one batch on this rank's stages; the global mean loss on every rank."""

    def __init__(self, plan: Plan, meshes: PlanMeshes, stage_modules: list[StageModule],
                 device: torch.device) -> None:
        self.plan = plan
        self.meshes = meshes
        self.stage_modules = stage_modules
        self.stages = plan.stages_of_group(meshes.group)  # the pipeline stage index of each module
        self.device = device
        self._schedules: dict[tuple[Any, ...], Any] = {}
        # Schedules keep the loss function they were built with; it reads the current loss and scale from here.
        self._loss_fn: LossFn | None = None
        self._loss_scale = 1.0
        self._targets: list[Any] = []  # this step's targets per micro-batch, read by _indexed_loss

    @property
    def is_first(self) -> bool:
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        return self.plan.num_stages - 1 in self.stages

    @property
    def last_module(self) -> StageModule:
        """The module of the chain's last stage (on this rank when :attr:`is_last`)."""
        return self.stage_modules[self.stages.index(self.plan.num_stages - 1)] if self.is_last else \
            self.stage_modules[-1]

    def _run_local(self, *tensors: torch.Tensor) -> Any:
        """All stages in one process (pp == 1: one device group holds every stage, in order)."""
        out: Any = tensors
        for module in self.stage_modules:
            out = module(*(out if isinstance(out, tuple) else (out,)))
        return out

    # ------------------------------------------------------------------ schedules
    def _output(self, out: Any) -> Any:
        """The last stage's output (a tensor or the flat tuple a stage returns) as the chain's payload."""
        return unflatten(out, self.last_module.out_spec)

    def _scaled_loss(self, out: Any, target: Any) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(self._output(out), target) * self._loss_scale

    def _indexed_loss(self, out: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedules' loss: ``index`` is the micro-batch's position, its target is looked up."""
        return self._scaled_loss(out, self._targets[int(index.reshape(-1)[0])])

    def _schedule(self, mode: str, xs: Any) -> Any:
        """PipelineStages + schedule per (mode, input shapes): stages infer and cache tensor shapes.

        Training runs the plan's schedule class. Evaluation and prediction run forward only: with one stage per
        device through the plan's class (GPipe / 1F1B have a forward-only path), with several through
        :func:`forward_only_schedule` (the multi-stage classes' ``eval`` still runs their backward actions)."""
        # deferred: torch.distributed.pipelining loads dynamo (~0.4 s); the runtime imports this module for any plan
        import torch.distributed.pipelining as pipelining

        key = (mode, repr(signature(xs)))
        if key not in self._schedules:
            stages = [
                pipelining.PipelineStage(module, k, self.plan.num_stages, self.device, group=self.meshes.lane_group)
                for module, k in zip(self.stage_modules, self.stages)
            ]
            name = schedule_class_name(self.plan)
            loss_fn = None if mode == "predict" else self._indexed_loss
            if name in _SINGLE:
                cls, arg = getattr(pipelining, name), stages[0]
            elif mode == "train":
                cls, arg = getattr(pipelining, name), stages
            else:
                cls, arg = forward_only_schedule(self.plan), stages
            self._schedules[key] = cls(arg, n_microbatches=self.plan.microbatches, loss_fn=loss_fn,
                                       scale_grads=False)
        return self._schedules[key]

    # ------------------------------------------------------------------ steps
    def train_step(self, x: Any, y: Any, loss_fn: LossFn, scale: float) -> PendingLoss:
        """Forward and backward of one batch; gradients land in ``.grad`` times ``scale``.

        The global mean loss is reduced in the background (see :class:`PendingLoss`): waiting for it right here
        would hold every rank until the slowest stage finishes its backward, a per-step barrier that hand-written
        pipeline code does not have."""
        check_sequence_length(self.plan, x)  # every rank alike, before any stage waits on another
        self._loss_fn, self._loss_scale = loss_fn, scale
        lane = self.meshes.lane
        xs, ys = lane_slice(x, self.plan, lane), lane_slice(y, self.plan, lane)
        c = self.plan.microbatches
        losses: list[torch.Tensor] = []
        self._targets = self._loss_targets(loss_fn, y, ys)
        if self.plan.pp == 1:
            for xm, ym in zip(chunk(xs, c), self._targets):
                loss = self._scaled_loss(self._run_local(*flatten(xm)), ym)
                (loss / c).backward()
                losses.append(loss.detach())
            self._targets = []
            return self._pending_mean([loss.detach() / scale for loss in losses])
        self._loss_scale = scale / c  # the schedule does not divide by c (scale_grads=False, see the module doc)
        args = flatten(xs) if self.is_first else ()
        try:
            self._schedule("train", xs).step(*args, target=self._indices() if self.is_last else None, losses=losses,
                                               return_outputs=False)
        finally:
            self._targets = []
        return self._pending_mean([loss.detach() / self._loss_scale for loss in losses])

    def _loss_targets(self, loss_fn: LossFn, y: Any, ys: Any) -> list[Any]:
        """This step's targets per micro-batch; a per-token loss runs on the last layer's sequence pieces where it
        splits the sequence (:func:`~.sequence.piece_loss`: the last stage then keeps its output in pieces)."""
        piece = piece_loss(self.plan, loss_fn, y, self.meshes.lane) if self.is_last else None
        if self.is_last:
            self.last_module.keep_layout = piece is not None
        if piece is None:
            return self._chunks(ys)
        self._loss_fn = piece[0]
        return piece[1]

    def _chunks(self, ys: Any) -> list[Any]:
        c = self.plan.microbatches
        return [None] * c if ys is None else chunk(ys, c)

    def _indices(self) -> torch.Tensor:
        return torch.arange(self.plan.microbatches, device=self.device)

    @torch.no_grad()
    def eval_step(self, x: Any, y: Any, loss_fn: LossFn) -> torch.Tensor:
        check_sequence_length(self.plan, x)
        self._loss_fn, self._loss_scale = loss_fn, 1.0
        lane = self.meshes.lane
        xs, ys = lane_slice(x, self.plan, lane), lane_slice(y, self.plan, lane)
        c = self.plan.microbatches
        losses: list[torch.Tensor] = []
        self._targets = self._loss_targets(loss_fn, y, ys)
        try:
            if self.plan.pp == 1:
                losses = [self._scaled_loss(self._run_local(*flatten(xm)), ym)
                          for xm, ym in zip(chunk(xs, c), self._targets)]
            else:
                args = flatten(xs) if self.is_first else ()
                self._schedule("eval", xs).eval(*args, target=self._indices() if self.is_last else None,
                                                losses=losses)
        finally:
            self._targets = []
        return self._global_mean([loss.detach() for loss in losses])

    @torch.no_grad()
    def predict_step(self, x: Any) -> Any:
        """The chain's output for the whole batch (a payload), on every rank."""
        check_sequence_length(self.plan, x)
        if self.is_last:
            self.last_module.keep_layout = False  # predictions are whole sequences
        xs = lane_slice(x, self.plan, self.meshes.lane)
        if self.plan.pp == 1:
            out = concat([self._output(self._run_local(*flatten(xm))) for xm in chunk(xs, self.plan.microbatches)])
        else:
            out = self._schedule("predict", xs).eval(*(flatten(xs) if self.is_first else ()))
            out = self._output(out) if self.is_last else None
        full = None
        if self.is_last:
            n = self.plan.devices_per_stage
            full = map_tensors(lambda t: self._gather_lanes(t, n), out)
        box = [full]
        if self.plan.pp > 1 or self.plan.devices_per_stage > 1:
            dist.broadcast_object_list(box, src=self.plan.ranks_of_stage(self.plan.num_stages - 1)[0])
        return box[0]

    def _gather_lanes(self, out: torch.Tensor, n: int) -> torch.Tensor:
        parts = [out]
        if n > 1:
            parts = [torch.empty_like(out) for _ in range(n)]
            dist.all_gather(parts, out.contiguous(), group=self.meshes.stage_group)
        return unslice(out, self.plan, parts)

    def _global_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean loss over the global batch, on every rank (it exists only on the last stage)."""
        return self._pending_mean(losses).wait()

    def _pending_mean(self, losses: list[torch.Tensor]) -> PendingLoss:
        local = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        local = local.detach().to(self.device, torch.float32)
        total = local.clone()
        work = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(total, async_op=True)
        return PendingLoss(local, total, work, self.plan.devices_per_stage)


class PendingLoss:
    """The global mean loss of one batch, being summed over the world in the background.

    ``local`` is this rank's lane mean (zero on ranks without the last stage) and is safe to read at once;
    :meth:`wait` returns the global mean, identical on every rank. The sum is a 4-byte all-reduce over the default
    group, issued right after the schedule: ranks that finish early (the last stage in 1F1B) go on with their
    gradient averaging and optimizer step, and whoever waits later finds it done.
    """

    def __init__(self, local: torch.Tensor, total: torch.Tensor, work: Any, lanes: int) -> None:
        self.local = local
        self._total, self._work, self._lanes = total, work, lanes
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            self._value = self._total / self._lanes
        return self._value
