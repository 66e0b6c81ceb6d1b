"""The quick measurement behind setup's duration estimate (:mod:`.estimate`): one dense matmul and one cache flush
on this machine, under the thread count a rank will run with, in about a tenth of a second."""

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
    compute threads (None: the current count), and one cache flush as profiling makes it. ``ranks``: the processes
    that will compute at once on this machine (on a CPU, their threads beyond its cores take turns)."""
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
        flush = CacheFlush(device)
        flush()  # the first write also faults the pages in
        timer.synchronize()
        t0 = time.perf_counter()
        flush()
        timer.synchronize()
        flush_s = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    cores = os.cpu_count() or 1
    busy = (threads or before) * max(ranks, 1)
    if kind == "cpu" and busy > cores:
        flops *= cores / busy  # the ranks' threads take turns on the cores
    return Rates(flops_per_s=flops, flush_s=flush_s, memory_bytes_per_s=flush.nbytes / max(flush_s, 1e-9),
                 link_bytes_per_s=LINK_BYTES_PER_S[kind])
