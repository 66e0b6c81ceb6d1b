"""Top-k sparsification with error feedback, and Deep Gradient Compression's momentum correction (Lin et al.,
ICLR 2018, "Deep Gradient Compression").

Per gradient piece the ``k = max(1, ceil(q * numel))`` largest-magnitude entries of the accumulated gradient are
all-gathered (fp32 values, int32 indices: ``8 k`` bytes sent per rank); the average is the sum of everyone's
entries / ``d``; what was not sent stays in the accumulator (error feedback) and is sent later.

What the accumulator accumulates depends on the optimizer, because DGC's momentum correction is only sound for
plain SGD with momentum:

- ``dgc_momentum = 0`` (the default; any optimizer, e.g. AdamW, ``uniap train``'s): plain error feedback,
  ``v += g``. Adam's per-coordinate normalization makes the optimizer's own momentum the right place for momentum,
  so the gradient is sparsified as is.
- ``dgc_momentum = m > 0``: DGC. The momentum moves *before* the compression: ``u = m u + g`` (local momentum),
  ``v += u`` (local accumulation), send top-k of ``v``, then zero ``v`` *and* ``u`` where sent (momentum factor
  masking: a sent coordinate's stale momentum does not keep pushing). The averaged sparse ``v`` is then the update
  direction, so the optimizer must be ``torch.optim.SGD`` with ``momentum=0`` (it applies ``lr`` and weight
  decay); another optimizer is refused at the first step with a :class:`UniAPError` (momentum applied twice, or
  fed into Adam's moments, is not DGC). With ``q = 1`` (or during the warm-up) this is exactly SGD with momentum
  ``m``: the dense steps send ``u`` and keep it (no masking), as DGC's reference implementation does.

DGC's warm-up (exponentially rising sparsity over the first epochs) is replaced here by the common dense warm-up
(:mod:`.compression`, ``start_iter`` / ``start_fraction``); its local gradient clipping is not done (Lightning
clips the averaged gradients; with ``gradient_clip_val`` set the clipping sees the sparse average).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from uniap_lightning.runtime.compression_base import ByteCounter, Compressor, Pending, all_gather, all_reduce, topk_count
from uniap_lightning.errors import UniAPError


class TopKCompressor(Compressor):
    """Top-k sparsification per gradient piece with error feedback (and DGC's momentum correction when
    ``dgc_momentum > 0``); values and int32 indices all-gathered.

    Memory: the fp32 accumulator (the bucket's size: ``grad + error`` is formed in it and what is sent is zeroed
    there), with DGC also the fp32 local momentum (the bucket's size), kept; the gathered values and indices
    (``d * k`` each), transient."""

    method = "topk"

    def __init__(self, options: Mapping[str, float]) -> None:
        super().__init__(options)
        self.ratio = float(self.options.get("topk_ratio", 0.01))
        self.momentum = float(self.options["dgc_momentum"])
        self.error: torch.Tensor | None = None  # v: what was not sent yet
        self.velocity: torch.Tensor | None = None  # u: DGC's local momentum

    def state_dict(self) -> dict[str, Any]:
        return {k: t for k, t in (("error", self.error), ("velocity", self.velocity)) if t is not None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.error = state["error"].clone() if "error" in state else None
        self.velocity = state["velocity"].clone() if "velocity" in state else None

    def _corrected(self, buffer: torch.Tensor) -> torch.Tensor:
        """DGC: ``u = m u + g`` (fp32); plain error feedback: the gradient itself."""
        if not self.momentum:
            return buffer
        if self.velocity is None:
            self.velocity = torch.zeros(buffer.shape, dtype=torch.float32, device=buffer.device)
        return self.velocity.mul_(self.momentum).add_(buffer)

    def start_dense(self, buffer: torch.Tensor, group: dist.ProcessGroup, size: int,
                    counter: ByteCounter | None) -> Pending:
        if self.momentum:  # dense DGC = SGD with momentum: send u (and any owed v), keep u
            buffer.copy_(self._corrected(buffer))
        return super().start_dense(buffer, group, size, counter)

    def start_compressed(self, buffer: torch.Tensor, slots: Sequence[torch.Tensor], group: dist.ProcessGroup,
                         size: int, counter: ByteCounter | None) -> Pending:
        if buffer.numel() >= 2**31:
            raise ValueError(f"top-k compression indexes a bucket with int32: {buffer.numel()} elements is too many")
        if self.error is None:
            self.error = torch.zeros(buffer.shape, dtype=torch.float32, device=buffer.device)
        acc = self.error.add_(self._corrected(buffer))  # v += u (DGC) or v += g, in the error buffer
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
        if self.velocity is not None:
            self.velocity[index] = 0.0  # DGC's momentum factor masking
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


def check_dgc_optimizers(optimizers: Iterable[Any], params: Iterable[torch.Tensor], momentum: float) -> None:
    """DGC (``dgc_momentum > 0``) applies the momentum itself: every optimizer parameter group holding one of
    ``params`` (the top-k layers' parameters) must be ``torch.optim.SGD`` with ``momentum=0``; else a
    :class:`UniAPError` naming the option."""
    wanted = {id(p) for p in params}
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer
        for group in opt.param_groups:
            if not any(id(p) in wanted for p in group["params"]):
                continue
            if type(opt) is not torch.optim.SGD or group.get("momentum", 0) or group.get("nesterov", False):
                what = f"{type(opt).__name__}" + (f"(momentum={group['momentum']})" if "momentum" in group else "")
                raise UniAPError(
                    f"compression_options.dgc_momentum={momentum} (Deep Gradient Compression's momentum correction) "
                    f"applies the momentum before top-k, so the optimizer of the top-k layers must be "
                    f"torch.optim.SGD with momentum=0; got {what}. Use dgc_momentum=0 (plain error feedback) with "
                    f"other optimizers.")
