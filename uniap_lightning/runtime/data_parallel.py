"""Data parallelism per layer: sharded (FSDP2 ``fully_shard``) or replicated (gradient average per step).

Replication is done here rather than with DDP or ``replicate()``: the plan's cost model charges one gradient
all-reduce per optimizer *step* (not per micro-batch), layers of one stage may use different data-parallel groups,
and tensor-parallel layers carry DTensor parameters that DDP does not handle. So replicated layers only record
their parameters and group, and :class:`ReplicatedGrads` averages their gradients once per optimizer step, in
buckets all-reduced asynchronously while the backward of the step's last micro-batch is still running (as DDP
overlaps its buckets with backward); see :class:`uniap_lightning.runtime.step.TrainStep`. A layer whose plan says
``compression`` gets buckets of its own whose averaging a compressor does instead (:mod:`.compression`); every
collective's payload is counted (:attr:`ReplicatedGrads.counter`). The compressors' state (error feedback) is per
rank and travels with the strategy's checkpoints (:mod:`.compression_state`).

The pieces are their own modules: :mod:`.shards` (a rank's shard of a parameter, FSDP2) and :mod:`.buckets` (the
gradient buckets); their names are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from uniap_lightning.planner.plan import COMPRESSION_DEFAULTS
from uniap_lightning.runtime.buckets import BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES, Bucket, make_buckets
from uniap_lightning.runtime.compression import ByteCounter, make_compressor, start_step, wire_bytes
from uniap_lightning.runtime.shards import apply_fsdp, local_tensor, own_outputs
from uniap_lightning.runtime.compression_topk import check_dgc_optimizers

__all__ = ["BUCKET_CAP_BYTES", "FIRST_BUCKET_CAP_BYTES", "Bucket", "ReplicatedGrads", "apply_fsdp", "local_tensor",
           "make_buckets", "own_outputs"]


@dataclass
class ReplicatedGrads:
    """Parameters replicated over data-parallel groups; their gradients averaged once per optimizer step.

    Per optimizer step: :meth:`arm` before the forward/backward of the step's last batch (the last one of the
    accumulation window), :meth:`flush` right after it, :meth:`finish` before anything reads the gradients. While
    armed, a hook on each parameter counts its gradient accumulations; at the last micro-batch's one the gradient
    is final, is copied into its bucket (with the window's earlier batches' gradients, ``previous``), and each
    bucket whose gradients are all in starts its all-reduce at once - in bucket order, so every rank of a group
    issues the same collectives in the same order. Parameters without a gradient on this rank (unused in this
    forward) contribute zeros at :meth:`flush`, so they never hold a collective back on other ranks.

    Memory: the bucket buffers persist and hold one copy of every replicated gradient of this rank, i.e.
    :meth:`buffer_bytes` = sum over replicated layers of (local parameters x bytes per gradient element), beside
    the gradients themselves. Freeing the buffers after each step would not lower the peak (all buckets are in
    flight at the end of the backward) and would pay allocation and page faults every step. The cost model
    charges exactly this, ``local parameters x grad_bytes`` per replicated layer, inside its ``static_bytes``
    (``planner.cost.layer``).
    """

    #: ``(group, dp, parameters)`` or ``(group, dp, parameters, compression)``
    groups: list[tuple[Any, ...]] = field(default_factory=list)
    bucket_cap_bytes: int = BUCKET_CAP_BYTES
    first_bucket_cap_bytes: int = FIRST_BUCKET_CAP_BYTES
    #: the plan's ``compression_options`` (PowerSGD rank, top-k ratio, warm-up, DGC momentum)
    compression_options: dict[str, float] = field(default_factory=lambda: dict(COMPRESSION_DEFAULTS))
    #: the Trainer (:meth:`bind`): optimizer step index, run length (warm-up) and optimizers (DGC's check)
    trainer: Any = field(default=None, repr=False)
    #: the optimizer step being averaged (0-based; the Trainer's ``global_step``, else counted here)
    step: int = field(default=-1, init=False)
    #: payload bytes of this rank's gradient collectives: the last optimizer step's and the total
    counter: ByteCounter = field(default_factory=ByteCounter, init=False)
    buckets: list[Bucket] = field(default_factory=list, init=False)
    _slot_of: dict[nn.Parameter, tuple[int, int]] = field(default_factory=dict, init=False, repr=False)
    _hits: dict[nn.Parameter, int] = field(default_factory=dict, init=False, repr=False)
    _previous: dict[nn.Parameter, torch.Tensor | None] = field(default_factory=dict, init=False, repr=False)
    #: collectives started so far: one per bucket per optimizer step
    launches: int = field(default=0, init=False)
    _expected: int = field(default=0, init=False, repr=False)  # gradient accumulations per parameter when armed
    _next: int = field(default=0, init=False, repr=False)  # index of the next bucket to launch
    _armed: bool = field(default=False, init=False, repr=False)
    _start: int | None = field(default=None, init=False, repr=False)  # the first compressed step, once known
    #: ``(parameters, divisor)`` whose reduction group is this rank alone (expert shards with ep = replicas): no
    #: bucket and no collective, the window's gradient is only divided, at :meth:`finish` of a closing batch
    local: list[tuple[list[nn.Parameter], int]] = field(default_factory=list, init=False)
    _divide: bool = field(default=False, init=False, repr=False)

    def add(self, layer: nn.Module, group: dist.ProcessGroup, dp: int, compression: str = "none", *,
            exclude: set[nn.Parameter] | None = None) -> None:
        """Average ``layer``'s gradients (but ``exclude``'s) over ``group`` (``dp`` ranks) each optimizer step,
        compressed as ``compression`` says (``"none"``, ``"bf16"``, ``"powersgd"``, ``"topk"``; see
        :mod:`.compression`)."""
        skip = {id(p) for p in exclude or ()}
        self.add_params([p for p in layer.parameters() if id(p) not in skip], group, dp, compression)

    def add_params(self, params: list[nn.Parameter], group: dist.ProcessGroup, divisor: int,
                   compression: str = "none") -> None:
        """Sum ``params``' gradients over ``group`` each optimizer step and divide by ``divisor`` (the group's
        size for replicated layers; the layer's replicas for expert shards, whose gradients already hold the
        contributions of their ep group's tokens, summed over the ranks holding the same experts)."""
        make_compressor(compression, self.compression_options)  # an unknown method fails here, not mid-step
        if self.buckets:
            raise RuntimeError("ReplicatedGrads.add after the buckets were built (at the first step)")
        # a parameter shared by two layers (tied weights) gets one slot: its hook runs once per backward
        known = {id(p) for _, _, plist, *_ in self.groups for p in plist}
        params = [p for p in params if p.requires_grad and id(p) not in known]
        if divisor > 1 and params:
            for g, size, plist, *method in self.groups:
                if g is group and size == divisor and (method[0] if method else "none") == compression:
                    plist.extend(params)
                    return
            self.groups.append((group, divisor, params, compression))

    def add_divided(self, params: list[nn.Parameter], divisor: int) -> None:
        """Divide ``params``' gradients by ``divisor`` once per optimizer step, with no collective: parameters no
        other rank holds (expert shards with ``ep`` = replicas; their gradient already has every rank's tokens)."""
        if self.buckets:
            raise RuntimeError("ReplicatedGrads.add_divided after the buckets were built (at the first step)")
        params = [p for p in params if p.requires_grad]
        if divisor > 1 and params:
            self.local.append((params, divisor))

    def buffer_bytes(self) -> int:
        """Bytes of the bucket buffers (the replicated gradients of this rank, once more; see the class doc)."""
        if not self.buckets:
            locals_ = [local_tensor(p) for _, _, plist, *_ in self.groups for p in plist]
            return sum(t.numel() * t.element_size() for t in locals_)
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def wire_bytes_per_step(self, *, steady: bool = False) -> int:
        """Bytes this rank's gradient collectives should carry in the last averaged optimizer step (a warm-up step:
        uncompressed), or with ``steady`` in a compressed step (what the cost model prices), by the agreed formulas
        (:func:`.compression.wire_bytes`); :attr:`counter` counts what they carried."""
        dense = not steady and 0 <= self.step < self.start_step()
        total = 0
        for _, _, plist, *method in self.groups:
            for t in map(local_tensor, plist):
                total += wire_bytes(method[0] if method else "none", [tuple(t.shape)], grad_bytes=t.element_size(),
                                    options=self.compression_options, dense=dense)
        return total

    def bind(self, trainer: Any) -> None:
        """Take the optimizer step from ``trainer.global_step`` and the warm-up's length from its run length (a
        runtime installed mid-run, e.g. after a plan switch, does not warm up again)."""
        self.trainer = trainer

    def start_step(self) -> int:
        """The first optimizer step that compresses (:func:`.compression.start_step`; fixed once the run's length
        is known)."""
        if self._start is not None:
            return self._start
        if self.trainer is None:
            return start_step(self.compression_options, None)
        try:
            run: float | None = float(self.trainer.estimated_stepping_batches)
        except Exception:  # no dataloader length known: the fixed start_iter alone
            run = None
        self._start = start_step(self.compression_options, run)
        return self._start

    def _build(self) -> None:
        self.buckets = make_buckets(self.groups, self.bucket_cap_bytes, first_cap_bytes=self.first_bucket_cap_bytes,
                                    compression_options=self.compression_options)
        self._check_optimizers()
        for k, b in enumerate(self.buckets):
            for i, p in enumerate(b.params):
                self._slot_of[p] = (k, i)
                p.register_post_accumulate_grad_hook(self._on_grad)

    def arm(self, *, backward_passes: int, previous: dict[nn.Parameter, torch.Tensor | None]) -> None:
        """Reduce during the coming forward/backward, in which each parameter accumulates ``backward_passes``
        gradients (one per micro-batch). ``previous``: gradients that ``.grad`` will hold *in addition* once
        Lightning's backward is done (the accumulation window's earlier batches), to include in the average."""
        if not self.groups and not self.local:
            return
        if not self.buckets:
            self._build()
        self._drain()
        self._expected, self._next = backward_passes, 0
        self.counter.begin_step()
        self.step = int(self.trainer.global_step) if self.trainer is not None else self.step + 1
        first = self.start_step()  # resolved at the first armed step, when the run's length is known
        for b in self.buckets:
            if b.compressor is not None and b.compressor.warms_up:
                b.compressor.start_step = first
        self._hits = {}
        self._previous = {p: previous.get(p) for p in self._slot_of}
        for b in self.buckets:
            b.reset()
        self._armed = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        hits = self._hits[p] = self._hits.get(p, 0) + 1
        if hits == self._expected:
            k, i = self._slot_of[p]
            self.buckets[k].fill(i, self._previous[p])
            self._launch_complete()

    def _launch_complete(self) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].missing:
            b = self.buckets[self._next]
            b.launch(self.counter, self.step)
            self._next += 1
            self.launches += 1

    def flush(self) -> None:
        """After the armed backward: fill what no hook filled (parameters unused in some micro-batches or in all),
        launch the remaining buckets."""
        if not self._armed:
            return
        self._armed = False
        self._divide = bool(self.local)
        with torch.no_grad():
            for b in self.buckets[self._next :]:
                for i, done in enumerate(b.filled):
                    if not done:
                        b.fill(i, self._previous[b.params[i]])
        self._launch_complete()
        self._previous, self._hits = {}, {}

    def disarm(self) -> None:
        """Stop counting (the armed forward/backward failed); launched collectives are waited for at the next arm."""
        self._armed = False
        self._previous, self._hits = {}, {}

    def finish(self) -> None:
        """Wait for the launched buckets and write the averages into ``.grad`` (no-op when nothing is pending)."""
        for b in self.buckets:
            if b.work is not None:
                b.write_back()
        if self._divide:  # after Lightning's backward: ``.grad`` holds the whole window's gradient
            self._divide = False
            with torch.no_grad():
                for params, divisor in self.local:
                    for p in params:
                        if p.grad is not None and p.requires_grad:
                            local_tensor(p.grad).div_(divisor)

    def build(self) -> None:
        """Build the buckets now (else at the first armed step), e.g. to restore the compressors' state."""
        if self.groups and not self.buckets:
            self._build()

    def _check_optimizers(self) -> None:
        momentum = float(self.compression_options.get("dgc_momentum", 0.0))
        if momentum and self.trainer is not None:
            params = [p for b in self.buckets if b.compressor is not None and b.compressor.method == "topk"
                      for p in b.params]
            check_dgc_optimizers(self.trainer.optimizers, params, momentum)

    def _drain(self) -> None:
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
