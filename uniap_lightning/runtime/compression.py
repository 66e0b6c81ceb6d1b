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

Warm-up (PowerSGD and top-k; ``compression_options``): the first optimizer steps average uncompressed, as torch's
``PowerSGDState(start_powerSGD_iter=...)`` and the PowerSGD / DGC papers do (the start of training is the most
sensitive to inexact gradients). Compression starts at optimizer step ``max(start_iter, ceil(start_fraction *
S))``, ``S`` the run's optimizer steps (``Trainer.estimated_stepping_batches``; unknown or infinite: ``start_iter``
alone; the step is the Trainer's ``global_step``, so a resumed run or a plan switch does not warm up again).
Defaults ``start_iter=0``, ``start_fraction=0.02``: torch's docs suggest about 10% of training for accuracy, but
a warm-up of a fraction ``f`` caps the whole run's byte saving at ``1 / f`` (10% -> at most 10x, 5.1x for PowerSGD
rank 4 on the shipped GPT), and on the shipped GPT 2% already gives most of its gain (benchmarks/compression.py).
A warm-up step is the plain all-reduce (``grad_bytes * numel``), counted as such: ``wire_bytes_per_step()`` is
the formula of the step just averaged, ``wire_bytes_per_step(steady=True)`` the compressed one, which is what
the cost model prices (the warm-up is not priced). bf16 has no warm-up (no error feedback to protect). Top-k with
``dgc_momentum > 0`` is Deep Gradient Compression with momentum correction (:mod:`.compression_topk`).

Every collective goes through :class:`ByteCounter` (payload bytes this rank hands to the collective: the input
tensor's bytes), so bytes per step are counted, not computed. What a compressor keeps between steps
(:meth:`Compressor.state_bytes`, the memory the cost model charges): top-k and PowerSGD an fp32 error-feedback
buffer of the bucket's size, PowerSGD also its warm-start ``Q`` (``4 k r`` bytes per matrix), DGC also its local
momentum (the bucket's size again); bf16 nothing. The state is per rank and saved with the strategy's checkpoints
(:mod:`.compression_state`): resuming under the same plan continues it exactly; under another layout it starts
from zero (with a warning).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from uniap_lightning.runtime.compression_base import (  # noqa: F401 - also imported from here
    METHODS,
    ORTHOGONALIZATION_EPSILON,
    POWERSGD_SEED,
    WARMED_UP,
    ByteCounter,
    Compressor,
    Pending,
    all_gather,
    all_reduce,
    powersgd_rank,
    start_step,
    topk_count,
    wire_bytes,
)
from uniap_lightning.runtime.compression_topk import TopKCompressor

try:  # torch's own (Gram-Schmidt for rank <= 2, QR above), as its powerSGD_hook uses
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
except ImportError:  # a torch without it: QR, what the hook does for rank > 2
    def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
        matrices.copy_(torch.linalg.qr(matrices).Q)


class BF16Compressor(Compressor):
    """All-reduce in bf16, cast back (no error feedback: round-to-nearest has no systematic drift to correct)."""

    method = "bf16"
    warms_up = False

    def start_compressed(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup,
                         size: int, counter: ByteCounter | None) -> Pending:
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

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.error is not None:
            state["error"] = self.error
        if self.qs is not None:
            state["qs"] = list(self.qs)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.error = state["error"].clone() if "error" in state else None
        self.qs = [q.clone() for q in state["qs"]] if "qs" in state else None

    def start_compressed(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup,
                         size: int, counter: ByteCounter | None) -> Pending:
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


def make_compressor(method: str, options: Mapping[str, float]) -> Compressor | None:
    """The compressor for ``method`` (``None`` for ``"none"``: the plain all-reduce)."""
    compressors: dict[str, type[Compressor]] = {
        "bf16": BF16Compressor, "powersgd": PowerSGDCompressor, "topk": TopKCompressor}
    if method == "none":
        return None
    if method not in compressors:
        raise ValueError(f"unknown compression {method!r}; known: {('none', *METHODS)}")
    return compressors[method](options)


def _pieces(flat: torch.Tensor, slots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` split like the bucket's slots, each piece shaped as its slot (views)."""
    sizes = [s.numel() for s in slots]
    return [piece.view(s.shape) for piece, s in zip(flat.split(sizes), slots)]


def _views(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    sizes = [math.prod(s) for s in shapes]
    return [piece.view(s) for piece, s in zip(flat.split(sizes), shapes)]
