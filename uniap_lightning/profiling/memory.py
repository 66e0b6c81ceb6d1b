"""What a layer holds for backward, and what its backward adds at its peak: the byte figures of a profile.

* :class:`SavedBytes`: the storages autograd saves in a forward (a ``saved_tensors_hooks`` pack hook), each counted
  once at its full size, parameters excluded. Several ops saving one tensor, or views of one storage (``q``, ``k``,
  ``v`` cut from one projection), hold its memory once; counting per saved tensor overstated a transformer block's
  activations by about a fifth.
* :func:`backward_peak_bytes`: the most bytes the backward allocates beyond what is already live - the gradient it
  receives, the one it hands back, temporaries - with parameter gradients already allocated (they are static
  memory, counted elsewhere). On a CPU a :class:`LiveBytes` dispatch mode follows every storage the backward's ops
  create until it is freed (CPU autograd runs on the calling thread); on CUDA the allocator's peak. Storages the
  backward frees (saved activations released node by node) are not subtracted, so the figure errs high.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (it has no storage of its own); any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a storage
        return None


class SavedBytes:
    """``pack`` hook counting the bytes of every storage saved for backward once (``excluded``: parameters)."""

    def __init__(self, excluded: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {k[0] for t in excluded for k in [_storage_key(_local(t))] if k is not None}
        self._seen: set[int] = set()
        self.total = 0

    def pack(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            local = _local(t)  # a DTensor holds its local shard
            key = _storage_key(local)
            if key is None:
                self.total += local.numel() * local.element_size()
            elif key[0] not in self._excluded and key[0] not in self._seen:
                self._seen.add(key[0])
                self.total += key[1]
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while the mode is active (views and in-place results of their inputs
    excluded) and that are still alive; ``peak``: the most at any time. A DTensor counts as its local shard."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {k[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                  for k in [_storage_key(_local(t))] if k is not None}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            t = _local(t)
            key = _storage_key(t)
            if key is None or key[1] == 0 or key[0] in inputs or key[0] in self._alive:
                continue
            storage = t.untyped_storage()
            self.live += key[1]
            self.peak = max(self.peak, self.live)
            self._alive[key[0]] = weakref.ref(storage, lambda _r, k=key[0], n=key[1]: self._free(k, n))
        return out

    def _free(self, key: int, size: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= size

    def reset_peak(self) -> None:
        self.peak = self.live


def backward_peak_bytes(backward: Any, params: Iterable[torch.nn.Parameter], device: torch.device) -> float:
    """Run ``backward()`` (the gradient of a layer's output into it) and return the most bytes it allocated beyond
    what was live before. Parameter gradients are allocated (zeros) first, as after a first micro-batch."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        backward()
        torch.cuda.synchronize(device)
        return float(max(torch.cuda.max_memory_allocated(device) - before, 0))
    with LiveBytes() as live:
        backward()
    return float(live.peak)
