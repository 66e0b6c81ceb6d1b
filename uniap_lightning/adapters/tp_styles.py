"""Tensor-parallel styles and degree checks every adapter writes its plans with (the plain GPT, the MoE GPT, the
Hugging Face families): one place, so a layer's ``uniap_tp_plan`` reads as the Megatron pattern it is
(column-parallel in, row-parallel out) and its ``uniap_tp_degrees`` as the sizes the degree must divide."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = ["colwise", "divisors_of_all", "replicate", "rowwise"]


def divisors_of_all(*values: int) -> list[int]:
    """The tensor-parallel degrees that split every one of ``values`` (heads, key/value heads, a vocabulary)."""
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]


def colwise(**kw: Any) -> ColwiseParallel:
    return ColwiseParallel(**kw)


def rowwise(**kw: Any) -> RowwiseParallel:
    return RowwiseParallel(**kw)


def replicate() -> Replicate:
    return Replicate()
