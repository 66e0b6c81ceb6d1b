"""Compressed gradient averaging for replicated / ZeRO-1 layers: bf16, PowerSGD, top-k (with error feedback).

A compressor stands in for the plain all-reduce of one gradient bucket of
:class:`~uniap_lightning.runtime.data_parallel.ReplicatedGrads` (buckets never mix methods). It works on the
bucket's flat buffer, which holds this rank's gradient summed over the accumulation window (so it runs once per
optimizer step), and on its slots (each parameter's *local* piece: for a DTensor TP parameter its shard, which
is what is compressed). :meth:`Compressor.start` runs when the bucket is complete (during the backward) and starts
the first collectives; the returned :class:`Pending` finishes the work in :meth:`Pending.wait` and leaves the
*average* over the ``d`` ranks of the group in the buffer.

What goes on the wire per optimizer step, per rank (the agreed cost-model terms; ``numel`` of local pieces):

- ``bf16``: all-reduce of the gradient cast to bf16: ``2 * numel`` bytes; the result cast back.
- ``powersgd`` (rank ``r``, torch's ``powerSGD_hook`` algorithm): each piece with ``ndim >= 2`` viewed as
  ``(n, k) = (shape[0], numel / shape[0])``, ``M = grad + error``; ``P = M Q`` (``Q`` warm-started from the last
  step, orthogonalized; at the first step random from a seed every rank shares), all-reduce ``P``, orthogonalize,
  ``Q = M^T P``, all-reduce ``Q``, average ``P Q^T``; error ``= M - P Q^T``. Bytes ``4 * r * (n + k)`` per matrix
  (``r`` capped at ``min(n, k)``, as torch does), plus ``4 * numel`` for 1-D pieces, all-reduced uncompressed in
  fp32 (as torch's hook does with vectors).
- ``topk`` (ratio ``q``, error feedback as Deep Gradient Compression): per piece the ``k = max(1, ceil(q *
  numel))`` largest-magnitude entries of ``grad + error``; all-gather of their values (fp32) and indices (int32):
  ``8 * k`` bytes sent per rank; the result is the sum of everyone's entries / ``d``; error ``=`` what was not sent.

Every collective goes through :class:`ByteCounter` (payload bytes this rank hands to the collective: the input
tensor's bytes), so bytes per step are counted, not computed. What a compressor keeps between steps
(:meth:`Compressor.state_bytes`, the memory the cost model charges): top-k and PowerSGD an fp32 error-feedback
buffer of the bucket's size, PowerSGD also its warm-start ``Q`` (``4 k r`` bytes per matrix); bf16 nothing. The
state is not checkpointed (a resumed run starts with zero error and a fresh ``Q``, as after DDP's hook is
registered again).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

try:  # torch's own (Gram-Schmidt for rank <= 2, QR above), as its powerSGD_hook uses
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
except ImportError:  # a torch without it: QR, what the hook does for rank > 2
    def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
        matrices.copy_(torch.linalg.qr(matrices).Q)

METHODS = ("bf16", "powersgd", "topk")
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


def wire_bytes(method: str, shapes: Sequence[Sequence[int]], *, grad_bytes: int, options: Mapping[str, float]) -> int:
    """Bytes one rank puts on the wire per optimizer step for gradient pieces of ``shapes`` (the formula the
    counted bytes must match). ``method`` ``"none"``: the plain all-reduce of ``grad_bytes`` per element."""
    numels = [math.prod(s) for s in shapes]
    if method == "none":
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
    ``slots``: each parameter's piece of it, shaped as its local gradient."""

    method = "none"

    def __init__(self, options: Mapping[str, float]) -> None:
        self.options = dict(options)

    def start(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup, size: int,
              counter: ByteCounter | None) -> Pending:
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Bytes of the error-feedback state this compressor holds."""
        return 0


class BF16Compressor(Compressor):
    """All-reduce in bf16, cast back (no error feedback: round-to-nearest has no systematic drift to correct)."""

    method = "bf16"

    def start(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup, size: int,
              counter: ByteCounter | None) -> Pending:
        half = buffer.to(torch.bfloat16)
        work = all_reduce(half, group, counter)

        def finish() -> None:
            work.wait()
            buffer.copy_(half).div_(size)

        return Pending(finish)


class PowerSGDCompressor(Compressor):
    """Rank-``r`` PowerSGD with error feedback and warm start (torch's ``powerSGD_hook``, per bucket).

    Memory: the fp32 error-feedback buffer (the bucket's size; ``M = grad + error`` is formed in it and becomes
    the new error in place) and the warm-started ``Q`` factors, kept; ``P`` and one matrix's approximation at a
    time, transient."""

    method = "powersgd"

    def __init__(self, options: Mapping[str, float]) -> None:
        super().__init__(options)
        self.rank = int(self.options.get("powersgd_rank", 1))
        self.error: torch.Tensor | None = None  # fp32, the bucket's size
        self.qs: list[torch.Tensor] | None = None  # per matrix (1, k, r), kept across steps (warm start)

    def state_bytes(self) -> int:
        n = 0 if self.error is None else self.error.numel() * 4
        return n + sum(q.numel() * 4 for q in self.qs or [])

    def start(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup, size: int,
              counter: ByteCounter | None) -> Pending:
        if self.error is None:
            self.error = torch.zeros(buffer.shape, dtype=torch.float32, device=buffer.device)
        m_flat = self.error.add_(buffer)  # M = grad + error, in the error buffer
        pieces = _pieces(m_flat, slots)
        is_matrix = [p.dim() >= 2 and p.numel() > 0 for p in pieces]
        matrices = [p.view(1, p.shape[0], -1) for p, mat in zip(pieces, is_matrix) if mat]
        ranks = [powersgd_rank(m.shape[1:], self.rank) for m in matrices]
        if self.qs is None:  # the first step: the same random Q on every rank (a shared seed), orthogonalized
            gen = torch.Generator().manual_seed(POWERSGD_SEED)
            self.qs = [torch.randn(1, m.shape[2], r, generator=gen).to(m.device) for m, r in zip(matrices, ranks)]
        for q in self.qs:
            _orthogonalize(q, ORTHOGONALIZATION_EPSILON)
        p_flat = m_flat.new_empty(sum(m.shape[1] * r for m, r in zip(matrices, ranks)))
        ps = _views(p_flat, [(1, m.shape[1], r) for m, r in zip(matrices, ranks)])
        for m, q, p in zip(matrices, self.qs, ps):
            torch.bmm(m, q, out=p)
        # 1-D pieces travel uncompressed in fp32 (a copy: their error must stay readable as this rank's gradient)
        vec = torch.cat([p.reshape(-1) for p, mat in zip(pieces, is_matrix) if not mat] or [m_flat.new_empty(0)])
        works = [all_reduce(t, group, counter) for t in (vec, p_flat) if t.numel()]

        def finish() -> None:
            for w in works:
                w.wait()
            assert self.qs is not None
            q_flat = m_flat.new_empty(sum(q.numel() for q in self.qs))
            qs = _views(q_flat, [tuple(q.shape) for q in self.qs])
            for p in ps:
                _orthogonalize(p, ORTHOGONALIZATION_EPSILON)
            for m, p, q in zip(matrices, ps, qs):
                torch.bmm(m.transpose(1, 2), p, out=q)
            if q_flat.numel():
                all_reduce(q_flat, group, counter).wait()
            q_flat.div_(size)
            self.qs = qs  # the averaged Q: next step's warm start (as torch's hook keeps it)
            out_pieces = _pieces(buffer, slots)
            matrix_iter = iter(zip(matrices, ps, qs))
            offset = 0
            for piece, out, mat in zip(pieces, out_pieces, is_matrix):
                if mat:
                    m, p, q = next(matrix_iter)
                    approx = torch.bmm(p, q.transpose(1, 2))
                    m.sub_(approx)  # error feedback: what this rank's M lost in the low-rank average
                    out.copy_(approx.view(out.shape))
                else:  # exact: no error to carry
                    out.copy_(vec[offset:offset + piece.numel()].view(out.shape).div(size))
                    piece.zero_()
                    offset += piece.numel()

        return Pending(finish)


class TopKCompressor(Compressor):
    """Top-k sparsification per gradient piece with error feedback; values and int32 indices all-gathered.

    Memory: the fp32 error-feedback buffer (the bucket's size: ``grad + error`` is formed in it and what is sent
    is zeroed there), kept; the gathered values and indices (``d * k`` each), transient."""

    method = "topk"

    def __init__(self, options: Mapping[str, float]) -> None:
        super().__init__(options)
        self.ratio = float(self.options.get("topk_ratio", 0.01))
        self.error: torch.Tensor | None = None

    def state_bytes(self) -> int:
        return 0 if self.error is None else self.error.numel() * 4

    def start(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup, size: int,
              counter: ByteCounter | None) -> Pending:
        if buffer.numel() >= 2**31:
            raise ValueError(f"top-k compression indexes a bucket with int32: {buffer.numel()} elements is too many")
        if self.error is None:
            self.error = torch.zeros(buffer.shape, dtype=torch.float32, device=buffer.device)
        acc = self.error.add_(buffer)  # grad + error, in the error buffer
        chosen, offset = [], 0
        for piece in slots:
            n = piece.numel()
            if n:
                idx = torch.topk(acc[offset:offset + n].abs(), topk_count(n, self.ratio), sorted=False).indices
                chosen.append(idx + offset)
            offset += n
        index = torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long, device=acc.device)
        values = acc[index]
        acc[index] = 0.0  # error feedback: everything not sent this step is carried to the next
        sent_idx = index.to(torch.int32)
        all_values = values.new_empty(size * values.numel())
        all_idx = sent_idx.new_empty(size * sent_idx.numel())
        works = [all_gather(all_values, values, group, counter), all_gather(all_idx, sent_idx, group, counter)]

        def finish() -> None:
            for w in works:
                w.wait()
            buffer.zero_()
            buffer.index_add_(0, all_idx.long(), all_values.to(buffer.dtype))
            buffer.div_(size)

        return Pending(finish)


_COMPRESSORS: dict[str, type[Compressor]] = {
    "bf16": BF16Compressor, "powersgd": PowerSGDCompressor, "topk": TopKCompressor}


def make_compressor(method: str, options: Mapping[str, float]) -> Compressor | None:
    """The compressor for ``method`` (``None`` for ``"none"``: the plain all-reduce)."""
    if method == "none":
        return None
    if method not in _COMPRESSORS:
        raise ValueError(f"unknown compression {method!r}; known: {('none', *METHODS)}")
    return _COMPRESSORS[method](options)


def _pieces(flat: torch.Tensor, slots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` split like the bucket's slots, each piece shaped as its slot (views)."""
    sizes = [s.numel() for s in slots]
    return [piece.view(s.shape) for piece, s in zip(flat.split(sizes), slots)]


def _views(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [piece.view(s) for piece, s in zip(flat.split(sizes), shapes)]
