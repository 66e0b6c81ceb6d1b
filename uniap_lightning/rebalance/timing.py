"""This rank's stage forward and backward time per micro-batch, measured cheaply while training.

Hooks on the stage module (the unit the pipeline schedule calls once per micro-batch):

- forward: a pre-hook and a hook mark its start and end;
- backward: the hook routes the stage's first differentiable output through an identity autograd function whose
  backward marks the start of the stage's backward, and asks the autograd engine (``queue_callback``, the hook
  FSDP uses for its own end-of-backward work) to mark its end when that backward call completes.

Marks are ``time.perf_counter()`` on CPU and CUDA events on GPU (recorded on the current stream, read only when
the medians are asked for, every ``rebalance_check_every`` steps): nothing waits for the device and no collective
runs per step. Only training passes are timed (grad enabled, module in training mode); evaluation is not. What
the marks cover is the stage's own work: its layers' compute and the collectives inside them (tensor parallelism,
FSDP gathers, re-layouts between data-parallel degrees), not the pipeline's sends and receives between stages.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

import torch
from torch import nn

#: most micro-batch timings kept per direction (older ones are dropped)
MAX_SAMPLES = 4096


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class _BackwardMark(torch.autograd.Function):
    """Identity; its backward marks when the gradient reaches the stage's output, and queues the end mark."""

    @staticmethod
    def forward(ctx: Any, timer: StageTimer, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.timer = timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        ctx.timer._backward_started()
        return None, grad


class StageTimer:
    """Forward and backward seconds of every training micro-batch through ``module`` on this rank."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.clock = _Clock(device)
        self.forward: deque[tuple[Any, Any]] = deque(maxlen=MAX_SAMPLES)
        self.backward: deque[tuple[Any, Any]] = deque(maxlen=MAX_SAMPLES)
        self._start: Any = None
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def clear(self) -> None:
        self.forward.clear()
        self.backward.clear()

    def medians(self) -> tuple[float, float, int] | None:
        """(median forward s, median backward s, micro-batches) since the last :meth:`clear`; ``None`` if none."""
        fwd = [self.clock.seconds(a, b) for a, b in self.forward]
        bwd = [self.clock.seconds(a, b) for a, b in self.backward]
        if not fwd:
            return None
        return statistics.median(fwd), statistics.median(bwd) if bwd else 0.0, len(fwd)

    # ---------------------------------------------------------------- hooks
    def _pre(self, module: nn.Module, args: Any) -> None:
        self._start = self.clock.now() if module.training and torch.is_grad_enabled() else None

    def _post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._start is None:
            return None
        start, self._start = self._start, None
        self.forward.append((start, self.clock.now()))
        if isinstance(output, torch.Tensor):
            return _BackwardMark.apply(self, output) if _differentiable(output) else None
        if isinstance(output, tuple):
            for i, t in enumerate(output):
                if isinstance(t, torch.Tensor) and _differentiable(t):
                    return output[:i] + (_BackwardMark.apply(self, t),) + output[i + 1:]
        return None

    def _backward_started(self) -> None:
        start = self.clock.now()

        def done() -> None:
            self.backward.append((start, self.clock.now()))

        torch.autograd.Variable._execution_engine.queue_callback(done)


def _differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad and t.is_floating_point()
