"""Layers are timed from cold caches, as a training step runs them (profiling/timing.py: CacheFlush)."""

from __future__ import annotations

import torch
from torch import nn

from uniap_lightning.profiling import timing
from uniap_lightning.profiling.measure import profile_layers
from uniap_lightning.profiling.timing import CPU_FLUSH_BYTES, CacheFlush


def _chain() -> tuple[list[nn.Module], list[str]]:
    torch.manual_seed(0)
    return [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)], ["a", "b", "c"]


def test_flush_runs_before_every_timed_forward(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(CacheFlush, "__call__", lambda self: calls.append(self.nbytes))
    # the split calls' fixed cost, measured once per process (with its own flushes), as if already measured
    from uniap_lightning.profiling import backward_split

    monkeypatch.setattr(backward_split, "_CALL_S", {"perf_counter": 0.0})
    layers, names = _chain()
    profile = profile_layers(layers, names, torch.randn(8, 8), repeats=3, warmup=2, micro_batches=[4, 8])
    # per layer and size: the byte-counting run, one more warm-up run, then three timed runs; at the largest size
    # the backward split's two halves and the whole backward they are compared with (backward_split_overhead), of
    # the one layer with both parameters and an input gradient (the last)
    assert len(calls) == len(layers) * 2 * (1 + 1 + 3) + 3
    assert set(calls) == {CPU_FLUSH_BYTES}
    assert profile.meta["cache_flush_bytes"] == CPU_FLUSH_BYTES


def test_flush_size_and_off_switch() -> None:
    flush = CacheFlush(torch.device("cpu"), 1 << 20)
    assert flush.nbytes == 1 << 20 and flush._buffer is not None and flush._buffer.numel() * 4 == 1 << 20
    flush._buffer.fill_(7)
    flush()
    assert int(flush._buffer.abs().sum()) == 0  # the buffer was written
    off = CacheFlush(torch.device("cpu"), 0)
    off()
    assert off.nbytes == 0 and off._buffer is None
    layers, names = _chain()
    assert profile_layers(layers, names, torch.randn(4, 8), repeats=1, flush_bytes=0).meta["cache_flush_bytes"] == 0
    assert timing.flush_bytes_for(torch.device("cpu")) == CPU_FLUSH_BYTES
