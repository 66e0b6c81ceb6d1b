"""The one timer of profiling: layers, TP / FSDP overheads and collectives are all timed with :class:`Timer`.

On a GPU, CUDA events recorded on the current stream (the device is synchronized before the start mark, so earlier
work is not counted, and the end event is waited for before reading). On a CPU, ``time.perf_counter`` after a
``before`` hook that lines the ranks up (a barrier), since a CPU collective or layer has no events to record.
:func:`median_s` is the measuring loop every caller shares: ``warmup`` untimed runs, then the median of ``repeats``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class Timer:
    """Marks and elapsed seconds on ``device``: CUDA events on a GPU, synchronized wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    @property
    def name(self) -> str:
        return "cuda_events" if self.cuda else "perf_counter"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_s(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def median_s(fn: Callable[[], Any], timer: Timer, *, repeats: int, warmup: int = 1,
             before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn`` over ``repeats`` timed runs after ``warmup`` untimed ones. ``before`` runs ahead of
    every run, untimed (e.g. a barrier, so that ranks timing a collective start it together)."""
    samples = []
    for i in range(max(warmup, 0) + max(repeats, 1)):
        if before is not None:
            before()
        timer.synchronize()
        start = timer.mark()
        fn()
        end = timer.mark()
        if i >= warmup:
            samples.append(timer.elapsed_s(start, end))
    return statistics.median(samples)
