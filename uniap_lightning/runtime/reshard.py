"""Activation re-layout between layers whose layouts differ.

A layout is ``(dp, cp, tp)`` on a stage of ``n = dp * cp * tp`` lanes (tp innermost, then cp, then dp): the
micro-batch is cut into ``dp`` chunks along dim 0, each sample's sequence into ``cp`` contiguous pieces along dim 1,
and lane ``r`` holds *piece* ``(r // (cp tp), (r // tp) % cp)`` (so the ``tp`` ranks of one tensor-parallel group
hold the same piece). Stage boundaries use layout ``(n, 1, 1)`` (every lane a different slice of whole sequences),
which is what the cost model assumes.

A move from layout ``A`` to ``B`` goes through their common coarsening ``K = (gcd(dp), gcd(cp))`` pieces (the
planner's :func:`~uniap_lightning.planner.cost.movement.reshard_s` prices it so): each lane all-gathers the ``A``
pieces that make up its ``K`` piece, over the lanes of the same ``K`` piece and tensor-parallel index (one per
``A`` piece), then keeps the part of it that is its ``B`` piece (a local slice). Where a lane's ``K`` piece along
the sequence would differ between ``A`` and ``B`` (the tensor-parallel degree changes where cp moves: ``(1, 2, 2)``
vs ``(2, 2, 1)`` order the pieces differently), the sequence is gathered whole (``K`` takes cp 1), which is
always consistent. A batch-only move is the all-gather or the slice of before.

Gradient scale convention, which makes every data-parallel reduction a plain *average* over its ``dp x cp``
replicas: in a layout of ``P = dp cp`` pieces the gradient a lane holds for its piece is ``P`` times the gradient of
the global mean loss with respect to that piece (with ``cp = 1``: the gradient of the mean loss over its chunk).
Gathering ``m`` pieces into one is an all-gather forward and "take my piece, times ``m``" backward; slicing one piece
into ``m`` is "take my piece" forward and an all-gather of the gradients, divided by ``m``, backward. Ulysses
attention and tensor parallelism move exact adjoints, so the convention holds through them; a replicated or sharded
layer that averages over its ``dp x cp`` ranks then gets exactly the gradient of the global mean loss.

A layer's input or output may hold several tensors (:mod:`.payload`): each is re-laid out alike (tensors without
gradients, e.g. integer token ids or padding masks, by the same gather / slice outside autograd). A move that
changes the sequence split cuts every tensor along dim 1 (each must be sequence-shaped there).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.payload import map_tensors

if TYPE_CHECKING:
    from uniap_lightning.runtime.mesh import PlanMeshes

Layout = tuple[int, int, int]  # (dp, cp, tp)


def piece_of_lane(lane: int, layout: Layout) -> tuple[int, int]:
    """``(batch chunk, sequence piece)`` lane ``lane`` holds in ``layout``."""
    _, c, t = layout
    return lane // (c * t), (lane // t) % c


def common_pieces(a: Layout, b: Layout) -> tuple[int, int]:
    """The common coarsening ``(kd, kc)`` a move from ``a`` to ``b`` gathers to (see the module doc)."""
    n = a[0] * a[1] * a[2]
    kd, kc = math.gcd(a[0], b[0]), math.gcd(a[1], b[1])
    if kc > 1 and any(_coarse(lane, a, kd, kc)[1] != _coarse(lane, b, kd, kc)[1] for lane in range(n)):
        kc = 1
    return kd, kc


def _coarse(lane: int, layout: Layout, kd: int, kc: int) -> tuple[int, int]:
    """The ``K`` piece (of ``kd x kc``) holding lane ``lane``'s piece of ``layout``."""
    d, c, _ = layout
    pd, pc = piece_of_lane(lane, layout)
    return pd // (d // kd), pc // (c // kc)


def gather_classes(layout: Layout, k: tuple[int, int]) -> list[list[int]]:
    """The lanes that gather ``layout``'s pieces into ``k`` pieces together: same ``K`` piece, same tensor-parallel
    index; each class has one lane per piece, in (batch, sequence) piece order (= lane order)."""
    n = layout[0] * layout[1] * layout[2]
    classes: dict[tuple[int, ...], list[int]] = {}
    for lane in range(n):
        classes.setdefault((*_coarse(lane, layout, *k), lane % layout[2]), []).append(lane)
    return sorted(classes.values())


def moves_of(a: Layout, b: Layout) -> list[tuple[Layout, tuple[int, int]]]:
    """The (layout, K) gather groups a move ``a -> b`` uses: ``a``'s gather and ``b``'s slice (its backward)."""
    if a == b:
        return []
    k = common_pieces(a, b)
    return [(x, k) for x in (a, b) if x[0] * x[1] != k[0] * k[1]]


def _assemble(parts: list[torch.Tensor], gd: int, gc: int) -> torch.Tensor:
    if gc > 1:
        parts = [torch.cat(parts[i * gc:(i + 1) * gc], dim=1) for i in range(gd)]
    return torch.cat(parts, dim=0)


def _take(x: torch.Tensor, gd: int, gc: int, sub: tuple[int, int]) -> torch.Tensor:
    rows = x.shape[0] // gd
    x = x.narrow(0, sub[0] * rows, rows)
    if gc > 1:
        cols = x.shape[1] // gc
        x = x.narrow(1, sub[1] * cols, cols)
    return x.contiguous()


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, gd: int, gc: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(gd * gc)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return _assemble(parts, gd, gc)


def _check_splits(x: torch.Tensor, gd: int, gc: int) -> None:
    if x.shape[0] % gd:
        raise UniAPError(f"cannot split {x.shape[0]} samples into {gd} equal chunks")
    if gc > 1 and (x.dim() < 2 or x.shape[1] % gc):
        what = f"sequence length {x.shape[1]}" if x.dim() >= 2 else f"a tensor of shape {tuple(x.shape)}"
        raise UniAPError(f"context parallelism cannot split {what} into {gc} equal pieces along dim 1; pad the "
                         f"sequence to a multiple of {gc}")


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, gd: int, gc: int,
                sub: tuple[int, int]) -> torch.Tensor:
        ctx.gd, ctx.gc, ctx.sub = gd, gc, sub
        return _all_gather(x, group, gd, gc)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _take(grad, ctx.gd, ctx.gc, ctx.sub) * (ctx.gd * ctx.gc), None, None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, gd: int, gc: int,
                sub: tuple[int, int]) -> torch.Tensor:
        ctx.group, ctx.gd, ctx.gc = group, gd, gc
        return _take(x, gd, gc, sub)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_gather(grad, ctx.group, ctx.gd, ctx.gc) / (ctx.gd * ctx.gc), None, None, None, None


def _sub(lane: int, layout: Layout, k: tuple[int, int]) -> tuple[tuple[int, int], int, int]:
    """Lane's piece inside its ``K`` piece, and how many pieces a ``K`` piece holds along batch and sequence."""
    d, c, _ = layout
    gd, gc = d // k[0], c // k[1]
    pd, pc = piece_of_lane(lane, layout)
    return (pd % gd, pc % gc), gd, gc


def relayout(x: Any, frm: Layout | int, to: Layout | int, meshes: PlanMeshes) -> Any:
    """Move activation ``x`` (a tensor, or every tensor of a payload) from layout ``frm`` to ``to`` (a bare
    ``dp`` means ``(dp, 1, n / dp)``; identity when equal)."""
    n = meshes.n
    a, b = _as_layout(frm, n), _as_layout(to, n)
    if a == b:
        return x

    k = common_pieces(a, b)
    lane = meshes.lane
    if a[0] * a[1] != k[0] * k[1]:  # gather my K piece
        group = meshes.relayout_group(a, k)
        sub, gd, gc = _sub(lane, a, k)

        def gather(t: torch.Tensor) -> torch.Tensor:
            if gc > 1 and t.dim() < 2:
                _check_splits(t, 1, gc)  # refuses: not sequence-shaped
            return _Gather.apply(t, group, gd, gc, sub) if t.requires_grad else _all_gather(t, group, gd, gc)

        x = map_tensors(gather, x)
    if b[0] * b[1] != k[0] * k[1]:  # keep my B piece of it
        group = meshes.relayout_group(b, k)
        sub, gd, gc = _sub(lane, b, k)

        def split(t: torch.Tensor) -> torch.Tensor:
            _check_splits(t, gd, gc)
            return _Split.apply(t, group, gd, gc, sub) if t.requires_grad else _take(t, gd, gc, sub)

        x = map_tensors(split, x)
    return x


def _as_layout(x: Layout | int, n: int) -> Layout:
    if isinstance(x, int):
        return (x, 1, n // x)
    return (int(x[0]), int(x[1]), int(x[2]))
