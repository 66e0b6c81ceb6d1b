"""One training batch under Lightning's automatic optimization: the schedule, the gradients, the loss.

Lightning's closure runs ``training_step``, *then* ``zero_grad`` (first batch of an accumulation window), *then*
``backward``. A pipeline schedule runs forward and backward inside ``training_step``, so :class:`TrainStep` keeps
the fresh gradients apart (:mod:`.grads`) and hands them back in ``backward``.

Replicated layers' gradients are averaged once per optimizer step, overlapped with the backward of the window's
last batch (:class:`~.data_parallel.ReplicatedGrads`): Lightning calls ``optimizer_step`` only on that batch and
runs its ``training_step`` and ``backward`` inside the closure, so the strategy marks it (:meth:`closing`). The
window's earlier gradients go into the buckets with the fresh ones, unless that batch also opens the window
(Lightning then wipes them).

The loss is summed over the world in the background (:class:`~.pipeline.PendingLoss`); :meth:`finish_loss` waits
for it once, in ``on_train_batch_end``.

:attr:`TrainStep.work_s` adds up the seconds this rank spends in the plan's own work - the schedule, handing
gradients back, the optimizer step, the loss's wait - (:meth:`timed`, around the strategy's hooks), apart from
Lightning's loop, logging and callbacks: what the plan's prediction covers, and what the monitor compares it with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from uniap_lightning.runtime.grads import GradStash, add_grads, put_grads, take_grads
from uniap_lightning.runtime.checks import check_same_batch
from uniap_lightning.runtime.payload import flatten, is_payload

if TYPE_CHECKING:
    from uniap_lightning.runtime import Runtime
    from uniap_lightning.runtime.pipeline import PendingLoss

Guard = Callable[[Callable[[], Any]], Any]


class TrainStep:
    """The state one training batch leaves for the next hooks: fresh gradients, the pending loss, the window."""

    def __init__(self, runtime: Runtime, guard: Guard) -> None:
        self.runtime, self.guard = runtime, guard
        self._fresh: GradStash = []
        self._pending: PendingLoss | None = None
        self._closing = False  # this batch is the last of its accumulation window
        self._window_open = False  # `.grad` holds earlier gradients of the current window
        self._batch_checked = False
        self.work_s = 0.0  # seconds spent in the plan's work so far (:meth:`timed`)
        self._depth = 0

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the time inside into :attr:`work_s` (nested uses count once: ``optimizer_step`` runs
        ``training_step`` and ``backward`` in its closure)."""
        self._depth += 1
        start = time.perf_counter() if self._depth == 1 else None
        try:
            yield
        finally:
            self._depth -= 1
            if start is not None:
                self.work_s += time.perf_counter() - start

    @contextmanager
    def closing(self) -> Iterator[None]:
        """Around Lightning's closure in ``optimizer_step``: the batch inside closes its window."""
        self._closing = True
        try:
            yield
        finally:
            self._closing = False

    def run(self, x: Any, y: Any, *, accumulate: int,
            context: Callable[[], AbstractContextManager[Any]]) -> torch.Tensor:
        """Forward and backward of the whole batch; returns this rank's local loss (the global mean follows in
        :meth:`finish_loss`)."""
        rt = self.runtime
        if not self._batch_checked:
            tensors = [t for part in (x, y) if is_payload(part) for t in flatten(part)]
            self.guard(lambda: check_same_batch(*tensors))
            self._batch_checked = True
        self.finish_loss()  # a previous batch that never reached on_train_batch_end (an exception in between)
        params = rt.local_parameters()
        previous = take_grads(params)
        closing = self._closing
        if closing:
            rt.replicated.arm(backward_passes=rt.plan.microbatches, previous=dict(previous) if self._window_open else {})
        zero = rt.zero  # zero1/zero2: gradient sync and reshard only in the window's last backward
        zero.begin(closing=closing, backward_passes=rt.plan.microbatches)
        try:
            with context():
                self._pending = self.guard(lambda: rt.runner.train_step(x, y, rt.chain.loss_fn, 1.0 / accumulate))
            self.guard(rt.replicated.flush)
        finally:
            rt.replicated.disarm()
            zero.end()
        zero.check_reduced()
        self._window_open = not closing
        self._fresh = take_grads(params)
        put_grads(previous)
        assert self._pending is not None
        return self._pending.local

    def hand_back(self) -> None:
        """In ``backward``: the batch's gradients back into ``.grad``, then the replicated layers' averages."""
        add_grads(self._fresh)
        self._fresh = []
        self.guard(self.runtime.replicated.finish)  # no-op unless this batch closes the window
        ties = self.runtime.ties
        if ties is not None and self._closing:  # once per optimizer step, after the data-parallel averages
            self.guard(ties.sum_grads)
        self.runtime.zero.finish()  # zero1: the averages into the shards (same condition)

    def finish_loss(self) -> torch.Tensor | None:
        """The global mean loss of the last training batch (waits for its background all-reduce), once."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        with self.timed():
            return self.guard(pending.wait)

    def reset(self) -> None:
        """At each setup (fit, validate, ...): check the next batch again, forget gradients in flight."""
        self._fresh, self._batch_checked = [], False
