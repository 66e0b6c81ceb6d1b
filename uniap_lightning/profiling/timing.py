"""The one timer of profiling: layers, TP / FSDP overheads and collectives are all timed with :class:`Timer`.

On a GPU, CUDA events recorded on the current stream (the device is synchronized before the start mark, so earlier
work is not counted, and the end event is waited for before reading). On a CPU, ``time.perf_counter`` after a
``before`` hook that lines the ranks up (a barrier), since a CPU collective or layer has no events to record.
:func:`median_s` is the measuring loop every caller shares: ``warmup`` untimed runs, then the median of ``repeats``.

:class:`CacheFlush` makes a layer's timed run start from cold caches, as it does in training. A training step runs
each layer once per micro-batch, between other layers, the loss, the optimizer step and the loop, so the layer's
weights and buffers come back from memory; repeating one layer back to back keeps them in cache and times it
faster than training ever runs it (on the README's demo model, on this project's 2-core CPU host: 9-14% faster
per stage; a 64 MiB write before each timed forward brought the profile within 2-5% of the stage times measured
inside the 1F1B schedule, where a 4 MiB write, twice the private L2, changed nothing; BENCHMARKS.md). On a GPU the
buffer is twice the L2 cache, as ``triton.testing.do_bench`` flushes L2 between runs.
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


#: bytes written before each timed layer run on a CPU (see the module docstring for how it was chosen)
CPU_FLUSH_BYTES = 64 << 20
#: on a GPU without a reported L2 size
CUDA_FLUSH_BYTES = 256 << 20


def flush_bytes_for(device: torch.device) -> int:
    """The default eviction size on ``device``: :data:`CPU_FLUSH_BYTES`, or twice the GPU's L2 cache."""
    if device.type != "cuda":
        return CPU_FLUSH_BYTES
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    return 2 * l2 if l2 > 0 else CUDA_FLUSH_BYTES


class CacheFlush:
    """Call it (untimed) before a timed run: writes ``nbytes`` of a buffer kept for the purpose, which evicts what
    the previous run left in cache. ``nbytes=0`` turns it off."""

    def __init__(self, device: torch.device, nbytes: int | None = None) -> None:
        self.nbytes = flush_bytes_for(device) if nbytes is None else max(int(nbytes), 0)
        self._buffer = torch.empty(self.nbytes // 4, dtype=torch.int32, device=device) if self.nbytes >= 4 else None

    def __call__(self) -> None:
        if self._buffer is not None:
            self._buffer.zero_()


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
