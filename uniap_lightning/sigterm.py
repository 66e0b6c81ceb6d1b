"""SIGTERM under the strategy: every rank stops at the same batch, without a blocking collective per batch.

Lightning 2.6 checks for SIGTERM by broadcasting a flag from rank 0 at the start of *every* training batch
(``_TrainingEpochLoop._broadcast_sigterm_tensor``): a blocking collective over the whole world, i.e. a barrier per
step that hand-written training loops do not have. On 4 CPU ranks (gloo) the time between two batches was 4-8 ms
with it and 0.5 ms without it, of a 120 ms step; across pipeline stages it lines every rank up at each step. Its
signal handler also issues a ``broadcast`` from inside the handler, which pairs with whatever collective the other
ranks run next.

:class:`AgreedSigterm` replaces both, for this trainer only:

- the handler only records that this rank got SIGTERM (and, as Lightning's does, forwards it to processes the
  launcher started);
- at the start of each training batch every rank starts a non-blocking MAX all-reduce of its flag on a dedicated
  gloo group and reads the result of the previous batch's all-reduce (normally complete long before);
- when that result says some rank got SIGTERM, every rank sets ``trainer.received_sigterm`` and raises
  Lightning's ``SIGTERMException`` at the same batch, as Lightning does after its broadcast.

So a SIGTERM delivered to *any* rank (Lightning only heeds rank 0's) stops all ranks together at the start of
the second training batch after it arrives. Outside fitting (``trainer.validate`` / ``test`` / ``predict``) the
flag is set at once, as in Lightning. With a Lightning version that lacks these hooks nothing is replaced.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class AgreedSigterm:
    """Non-blocking, all-rank SIGTERM agreement for one strategy (see the module docstring)."""

    def __init__(self, guard: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        #: wraps waiting on the exchange, so a dead peer gives the strategy's clear error
        self._guard = guard or (lambda fn: fn())
        self.group: Any = None
        self._got = False  # this rank received SIGTERM and has not told the others yet
        self._buf: torch.Tensor | None = None
        self._work: Any = None

    @staticmethod
    def supported(trainer: pl.Trainer) -> bool:
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        connector = getattr(trainer, "_signal_connector", None)
        return (hasattr(loop, "_broadcast_sigterm_tensor") and hasattr(connector, "_sigterm_notifier_fn")
                and hasattr(connector, "received_sigterm"))

    def install(self, trainer: pl.Trainer) -> bool:
        """Hook into ``trainer`` (call on every rank, in ``Strategy.setup``: before Lightning registers its signal
        handlers). Collective the first time (creates the group). Returns whether the hooks were installed."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        if not self.supported(trainer):
            return False
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        self._got, self._buf, self._work = False, None, None
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: self.check(trainer)
        trainer._signal_connector._sigterm_notifier_fn = lambda signum, frame: self.notify(trainer, signum)
        return True

    def notify(self, trainer: pl.Trainer, signum: int) -> None:
        """The SIGTERM handler: Lightning's, minus its collective."""
        from lightning.pytorch.trainer.states import TrainerFn
        from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        connector = trainer._signal_connector
        if not connector.received_sigterm and not self._got:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        if trainer.state.fn == TrainerFn.FITTING:
            self._got = True  # agreed on at the next batches' exchange (check)
        else:
            connector.received_sigterm = True  # no training batches to agree at: Lightning's local behaviour

    def finish(self) -> None:
        """Complete the exchange in flight, if any (every rank; at the end of training too, so nothing is left)."""
        if self._work is not None:
            work, self._work = self._work, None
            self._guard(work.wait)

    def check(self, trainer: pl.Trainer) -> None:
        """Start of a training batch (in place of Lightning's blocking broadcast)."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        self.finish()  # the previous batch's exchange
        if self._buf is not None and self._buf.item():
            trainer._signal_connector.received_sigterm = True
            with contextlib.suppress(Exception):  # as Lightning: line the ranks up before they exit
                dist.barrier(group=self.group)
            raise SIGTERMException()
        self._buf = torch.tensor([1 if self._got else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)


class StoppedBySigterm(SystemExit):
    """SIGTERM before the first training batch: nothing to save, so the rank stops at once with status 143 (128 +
    SIGTERM, as a shell reports a process ended by it). The other ranks got the same signal (a scheduler signals the
    whole job) or see this one leave at their next collective, which the strategy's guard reports within seconds.

    It takes (and ignores) any arguments: an exception that crosses a pickle (DCP gathers each rank's failure) is
    rebuilt as ``cls(*args)``, and a copy must be this exception again, not a ``TypeError`` that reads as damage."""

    def __init__(self, *_args: object) -> None:
        super().__init__(143)


_received = False  # SetupSigterm raised in this process: what fails after it is the interruption's doing


def sigterm_received() -> bool:
    """Whether :class:`SetupSigterm` stopped this process (an error seen since is the interruption, not damage)."""
    return _received


def interruption_in(err: BaseException | None) -> BaseException | None:
    """The interruption (:class:`StoppedBySigterm`, ``KeyboardInterrupt``) behind ``err``, following causes,
    contexts and DCP's per-rank failures; ``None`` when ``err`` is a failure of its own."""
    seen: set[int] = set()
    stack = [err]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, (StoppedBySigterm, KeyboardInterrupt)):
            return node
        failures = getattr(node, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            for failure in failures.values():
                stack.extend(f for f in (failure if isinstance(failure, tuple) else (failure,))
                             if isinstance(f, BaseException))
        stack.extend((node.__cause__, node.__context__))
    return None


def reraise_interruption(err: BaseException) -> None:
    """Raise the interruption behind ``err`` (see :func:`interruption_in`), or :class:`StoppedBySigterm` when
    SIGTERM stopped this process meanwhile; return when ``err`` is a failure of its own. Called before an error
    reader says "damaged": an interrupted read is never reported as a bad checkpoint."""
    found = interruption_in(err)
    if isinstance(found, KeyboardInterrupt):
        raise KeyboardInterrupt from err
    if found is not None or sigterm_received():
        raise StoppedBySigterm() from err


class SetupSigterm:
    """SIGTERM handler for the time before Lightning installs its own (``Trainer._run`` registers them after the
    strategy's setup: profiling, solving and wrapping can take minutes). Without it SIGTERM kills a rank with the
    default action (status -15, no message) and leaves the others waiting in a collective until the timeout.

    Raises :class:`StoppedBySigterm` in the main thread, after calling ``forward(signum)`` (e.g. to pass the
    signal to processes this one started). Once Lightning's handler is registered it keeps calling this one as
    "the handler that was there before"; this one then does nothing, so the agreed stop of
    :class:`AgreedSigterm` (every rank at the same batch, with a checkpoint) is untouched."""

    def __init__(self, forward: Callable[[int], None] | None = None) -> None:
        self.forward = forward

    @staticmethod
    def install_once(forward: Callable[[int], None] | None = None) -> SetupSigterm | None:
        """Install a handler unless one of these is already installed (the CLI's, which also forwards to the ranks
        it started) or this is not the main thread (where handlers cannot be set)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        current = signal.getsignal(signal.SIGTERM)
        if isinstance(current, SetupSigterm):
            return current
        if current not in (signal.SIG_DFL, None):
            return None  # the user's own handler: theirs to keep
        handler = SetupSigterm(forward)
        signal.signal(signal.SIGTERM, handler)
        return handler

    def __call__(self, signum: int, frame: Any) -> None:
        if signal.getsignal(signal.SIGTERM) is not self:
            return  # called by Lightning's handler: training is on, AgreedSigterm decides
        global _received
        _received = True
        if self.forward is not None:
            with contextlib.suppress(Exception):
                self.forward(signum)
        raise StoppedBySigterm()
