"""The quick measurement behind setup's duration estimate (:mod:`.estimate`): one dense matmul, one cache flush and
a few small operations on this machine, under the thread count a rank will run with, in about a tenth of a
second (at most about a second on busy cores)."""

from __future__ import annotations

import os
import statistics
import time

import torch

from uniap_lightning.profiling.estimate import LINK_BYTES_PER_S, Rates
from uniap_lightning.profiling.timing import CacheFlush, Timer

#: the matmul timed, (m, k, n): a transformer's projection on a CPU (~0.6 GFLOP), a large one on a GPU
MATMUL = {"cpu": (512, 768, 768), "cuda": (4096, 4096, 4096)}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the layers' matmuls run in under a Lightning precision (``bf16-mixed``: bfloat16, ...)."""
    return torch.bfloat16 if "bf16" in precision else torch.float16 if precision.startswith("16") else torch.float32


def measure_rates(device: torch.device | str = "cpu", *, precision: str = "32-true", threads: int | None = None,
                  ranks: int = 1, repeats: int = 3) -> Rates:
    """:class:`Rates` of ``device``: the median of ``repeats`` timed matmuls after a warm-up one, with ``threads``
    compute threads (None: the current count), of ``repeats`` cache flushes as profiling makes them, and the mean
    of a few small operations (:func:`_small_op_s`). ``ranks``: the processes that will compute at once on this
    machine (on a CPU, their threads beyond its cores take turns)."""
    device = torch.device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    m, k, n = MATMUL[kind]
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(max(int(threads), 1))
    try:
        dtype = compute_dtype(precision)
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        timer = Timer(device)
        seconds = []
        for i in range(repeats + 1):
            timer.synchronize()
            t0 = timer.mark()
            torch.mm(a, b)
            t1 = timer.mark()
            if i:
                seconds.append(timer.elapsed_s(t0, t1))
        flops = 2.0 * m * k * n / max(statistics.median(seconds), 1e-9)
        op_s = _small_op_s(device, timer)
        flush = CacheFlush(device)
        flush()  # the first write also faults the pages in
        flushes = []
        for _ in range(repeats):
            timer.synchronize()
            t0 = time.perf_counter()
            flush()
            timer.synchronize()
            flushes.append(time.perf_counter() - t0)
        flush_s = statistics.median(flushes)
    finally:
        torch.set_num_threads(before)
    cores = os.cpu_count() or 1
    busy = (threads or before) * max(ranks, 1)
    if kind == "cpu" and busy > cores:
        flops *= cores / busy  # the ranks' threads take turns on the cores
    return Rates(flops_per_s=flops, flush_s=flush_s, memory_bytes_per_s=flush.nbytes / max(flush_s, 1e-9),
                 link_bytes_per_s=LINK_BYTES_PER_S[kind], op_s=op_s)


def _small_op_s(device: torch.device, timer: Timer, *, rounds: int = 5, budget_s: float = 0.5) -> float:
    """Mean seconds of one small operation (a 128 x 64 x 64 matmul, a GELU, an add: a tiny layer's kernels), over
    up to ``rounds`` rounds of ten of each, stopping after ``budget_s``. On cores other processes keep busy, a rank
    with several threads waits for all of them at some kernels: milliseconds instead of tens of microseconds, in
    bursts (so the mean, not the median; the matmul alone, long enough to be shared out, does not show it)."""
    x = torch.randn(128, 64, device=device)
    w = torch.randn(64, 64, device=device)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < rounds and (not samples or time.perf_counter() - start < budget_s):
        timer.synchronize()
        t0 = timer.mark()
        for _ in range(10):
            torch.nn.functional.gelu(x @ w).add_(x)
        t1 = timer.mark()
        samples.append(timer.elapsed_s(t0, t1) / 30)
    return statistics.fmean(samples)
