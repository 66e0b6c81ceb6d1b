"""What every gradient compressor shares (:mod:`.compression` has the methods, :mod:`.compression_topk` top-k):
the counted collectives, the wire-byte formula, the warm-up rule and the :class:`Compressor` base class."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from uniap_lightning.planner.plan import COMPRESSION_RUNTIME_DEFAULTS

METHODS = ("bf16", "powersgd", "topk")
#: methods that average uncompressed during the warm-up (those with error feedback)
WARMED_UP = ("powersgd", "topk")
#: seed of PowerSGD's first ``Q`` (the same on every rank of a group: the ``P`` all-reduce needs a shared basis)
POWERSGD_SEED = 0
#: added to the column norms when orthogonalizing (an all-zero gradient column would otherwise divide by 0)
ORTHOGONALIZATION_EPSILON = 1e-8


@dataclass
class ByteCounter:
    """Payload bytes this rank hands to gradient collectives: the current (or last) optimizer step's, by op, and
    the total. :meth:`begin_step` at the start of each step's averaging."""

    step_bytes: int = 0
    step_by_op: dict[str, int] = field(default_factory=dict)
    total_bytes: int = 0
    steps: int = 0

    def begin_step(self) -> None:
        self.step_bytes, self.step_by_op = 0, {}
        self.steps += 1

    def count(self, op: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.step_bytes += n
        self.total_bytes += n
        self.step_by_op[op] = self.step_by_op.get(op, 0) + n


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, counter: ByteCounter | None) -> Any:
    """Asynchronous sum all-reduce, counted."""
    if counter is not None:
        counter.count("all_reduce", t)
    return dist.all_reduce(t, group=group, async_op=True)


def all_gather(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup, counter: ByteCounter | None) -> Any:
    """Asynchronous all-gather of ``t`` into ``out`` (``d`` times its size), counted as ``t``'s bytes (what this
    rank sends)."""
    if counter is not None:
        counter.count("all_gather", t)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=group, async_op=True)


def topk_count(numel: int, ratio: float) -> int:
    """Entries top-k sends for a piece of ``numel`` elements: ``max(1, ceil(ratio * numel))`` (at most ``numel``)."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def powersgd_rank(shape: Sequence[int], rank: int) -> int:
    n = int(shape[0])
    return min(n, math.prod(shape) // max(n, 1), rank)


def start_step(options: Mapping[str, float], run_steps: float | None) -> int:
    """The first optimizer step (0-based) that compresses (see the module doc): ``max(start_iter,
    ceil(start_fraction * run_steps))``; ``run_steps`` ``None`` or infinite: ``start_iter``."""
    opts = {**COMPRESSION_RUNTIME_DEFAULTS, **options}
    start = int(opts["start_iter"])
    if run_steps is not None and math.isfinite(run_steps) and run_steps > 0:
        start = max(start, math.ceil(float(opts["start_fraction"]) * run_steps))
    return start


def wire_bytes(method: str, shapes: Sequence[Sequence[int]], *, grad_bytes: int, options: Mapping[str, float],
               dense: bool = False) -> int:
    """Bytes one rank puts on the wire per optimizer step for gradient pieces of ``shapes`` (the formula the
    counted bytes must match). ``method`` ``"none"``, or ``dense`` (a warm-up step): the plain all-reduce of
    ``grad_bytes`` per element."""
    numels = [math.prod(s) for s in shapes]
    if method == "none" or (dense and method in WARMED_UP):
        return grad_bytes * sum(numels)
    if method == "bf16":
        return 2 * sum(numels)
    if method == "powersgd":
        r = int(options.get("powersgd_rank", 1))
        total = 0
        for s, n in zip(shapes, numels):
            if len(s) >= 2 and n:
                total += 4 * powersgd_rank(s, r) * (s[0] + n // s[0])
            else:
                total += 4 * n
        return total
    if method == "topk":
        q = float(options.get("topk_ratio", 0.01))
        return sum(8 * topk_count(n, q) for n in numels if n)
    raise ValueError(f"unknown compression {method!r}; known: {('none', *METHODS)}")


class Pending:
    """A started compressed averaging; :meth:`wait` finishes it (the average is then in the bucket's buffer)."""

    def __init__(self, finish: Any) -> None:
        self._finish = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class Compressor:
    """One bucket's compressor (and its error-feedback state). ``buffer``: the bucket's flat gradient;
    ``slots``: each parameter's piece of it, shaped as its local gradient. :attr:`start_step`: the first optimizer
    step that compresses (earlier ones: the warm-up, a plain all-reduce); set from the run's length by
    :class:`~.data_parallel.ReplicatedGrads`."""

    method = "none"
    warms_up = True

    def __init__(self, options: Mapping[str, float]) -> None:
        self.options = {**COMPRESSION_RUNTIME_DEFAULTS, **options}
        self.start_step = start_step(self.options, None) if self.warms_up else 0

    def dense_at(self, step: int | None) -> bool:
        """Whether optimizer step ``step`` (0-based; ``None``: steady state) is a warm-up step."""
        return step is not None and step < self.start_step

    def start(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup, size: int,
              counter: ByteCounter | None, step: int | None = None) -> Pending:
        """Start averaging ``buffer`` for optimizer step ``step`` (a warm-up step: uncompressed)."""
        if self.dense_at(step):
            return self.start_dense(buffer, group, size, counter)
        return self.start_compressed(buffer, slots, group, size, counter)

    def start_dense(self, buffer: torch.Tensor, group: dist.ProcessGroup, size: int,
                    counter: ByteCounter | None) -> Pending:
        """The plain all-reduce (a warm-up step). Error owed from compressed steps, if any, goes out with it."""
        error = getattr(self, "error", None)
        if error is not None:
            buffer.add_(error.to(buffer.dtype))
            error.zero_()
        work = all_reduce(buffer, group, counter)

        def finish() -> None:
            work.wait()
            buffer.div_(size)

        return Pending(finish)

    def start_compressed(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup,
                         size: int, counter: ByteCounter | None) -> Pending:
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Bytes of the error-feedback state this compressor holds."""
        tensors = [t for t in tree_flatten(self.state_dict())[0] if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict(self) -> dict[str, Any]:
        """What this compressor carries between steps (tensors; empty before its first compressed step)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (same bucket layout; checked by :mod:`.compression_state`)."""
