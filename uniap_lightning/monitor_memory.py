"""One training step's peak memory on a CPU, for :class:`~uniap_lightning.monitor.UniAPMonitor`.

The plan predicts tensor bytes (parameters, gradients, optimizer state, activations, temporaries), the figure a GPU
reports as ``torch.cuda.max_memory_allocated``. A CPU has no allocator statistics, so :class:`CpuStepMemory`
counts the same thing: the bytes of this rank's parameters, optimizer state and gradients that exist when the step
starts, plus the most bytes of storages the step's ops create and hold at any one time (a
:class:`~uniap_lightning.profiling.memory.LiveBytes` dispatch mode over the step; CPU autograd runs on the calling
thread, so the backward is seen too). It is measured on the first step of each window only: the dispatch mode makes
that step slower, and the step time reported is the window's median, which one step does not move.

Not counted: storages made before the step other than those above (e.g. gradient buckets, pipeline receive
buffers, both allocated once), and temporaries a tensor subclass makes inside its own dispatch (DTensor's local
ops; its outputs are counted by their local shards).

Next to it, the process's growth over that step: the resident set's high-water mark after the step less the
resident set before it (``/proc/self/status``; the mark is reset through ``/proc/self/clear_refs``, or, where that
is not allowed, the lifetime ``ru_maxrss`` is used), after glibc has handed back the memory it keeps for reuse
(``malloc_trim(0)``). It adds what the allocator keeps beyond live tensors (fragmentation, the Python and torch
runtime's own growth) and is what the operating system sees; the plan does not predict it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
from typing import Any

import torch

from uniap_lightning.runtime.data_parallel import local_tensor
from uniap_lightning.profiling.memory import LiveBytes


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")  # find_library runs ldconfig: once
    except OSError:
        return None


def _trim_heap() -> None:
    """Hand the memory glibc keeps for reuse back to the system (no-op where there is no glibc)."""
    try:
        _libc().malloc_trim(0)
    except AttributeError:
        pass


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _tensor_bytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def _unique_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def static_bytes(module: torch.nn.Module, optimizers: list[Any]) -> int:
    """Bytes of this rank's local parameters and optimizer state tensors."""
    total = sum(_tensor_bytes(p.data) for p in _unique_params(module))
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += _tensor_bytes(v)
    return total


def grad_bytes(module: torch.nn.Module) -> int:
    """Bytes of the gradients this rank's parameters hold now (none after ``zero_grad(set_to_none=True)``)."""
    return sum(_tensor_bytes(p.grad) for p in _unique_params(module) if p.grad is not None)


class CpuStepMemory:
    """``start`` before a step, ``stop`` after it: ``(tensor peak bytes, process growth bytes)``."""

    def __init__(self) -> None:
        self._live: Any = None
        self.hwm_reset = False

    @property
    def active(self) -> bool:
        return self._live is not None

    def start(self, module: torch.nn.Module, optimizers: list[Any]) -> None:
        self.abandon()
        self._static = static_bytes(module, optimizers)
        self._grads = grad_bytes(module)
        _trim_heap()
        self.hwm_reset = _reset_hwm()
        self._rss0 = (_proc_status_kib("VmRSS") or 0) * 1024
        self._live = LiveBytes()
        self._live.__enter__()

    def stop(self) -> tuple[float, float]:
        live, self._live = self._live, None
        assert live is not None, "stop() without start()"
        live.__exit__(None, None, None)
        if self.hwm_reset:
            hwm = (_proc_status_kib("VmHWM") or 0) * 1024
        else:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return float(self._static + self._grads + live.peak), float(self._static + max(hwm - self._rss0, 0))

    def abandon(self) -> None:
        """Leave the dispatch mode without a figure (the step failed or the window was dropped)."""
        live, self._live = self._live, None
        if live is not None:
            live.__exit__(None, None, None)
