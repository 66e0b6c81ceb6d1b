"""Multi-process cases for ring attention (:mod:`uniap_lightning.runtime.ring`) on gloo ranks.

A case (``kind: "layer"``) compares :func:`~uniap_lightning.runtime.ring.ring_attention` on this rank's contiguous
sequence piece with :func:`~uniap_lightning.runtime.sequence.attention` on the whole sequence (every rank computes
the reference itself, same seed): the output piece and the q / k / v gradient pieces, plus the elements the
counter saw against :func:`~uniap_lightning.runtime.ring.ring_elements`; ``kind: "chain_bytes"``: the same count
for a GPT or Llama chain switched to ring by ``enable_context_parallel``. Keys: ``causal``, ``padded`` (row 0
left-padded, row 1 all padding, row 2 right-padded), ``kv_heads`` (< 4: grouped-query), ``seq``, ``fused``
(``False``: the matmul path), ``dtype`` (``"float64"``: the ring's accumulators follow, so it must match to
rounding).
"""

from __future__ import annotations

from typing import Any

import sequence_workers
import torch
import torch.distributed as dist
from uniap_lightning.runtime.ring import ring_attention, ring_elements

BATCH, HEADS, HEAD_DIM = 3, 4, 8


def _inputs(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    s, kvh = case.get("seq", 16), case.get("kv_heads", HEADS)
    q = torch.randn(BATCH, HEADS, s, HEAD_DIM, generator=g)
    k = torch.randn(BATCH, kvh, s, HEAD_DIM, generator=g)
    v = torch.randn(BATCH, kvh, s, HEAD_DIM, generator=g)
    dout = torch.randn(BATCH, HEADS, s, HEAD_DIM, generator=g)
    valid = torch.ones(BATCH, s, dtype=torch.bool)
    if case.get("padded"):
        valid[0, : s // 2 + 1] = False  # left padding longer than a cp piece: early queries see no key
        valid[1] = False  # a row of padding
        valid[2, -3:] = False
    dtype = getattr(torch, case.get("dtype", "float32"))
    return (*(t.to(dtype) for t in (q, k, v, dout)), valid)


def layer(case: dict[str, Any]) -> dict[str, Any]:
    from uniap_lightning.runtime.sequence import AllToAllCounter, attention, split_sequence

    c, r = dist.get_world_size(), dist.get_rank()
    causal, padded = case.get("causal", True), case.get("padded", False)
    q, k, v, dout, valid = _inputs(case)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention(*full, causal=causal, key_valid=valid if padded else None)
    ref.backward(dout)

    def piece(t: torch.Tensor) -> torch.Tensor:
        return split_sequence(t.transpose(1, 2), r, c).transpose(1, 2)

    local = [piece(t).clone().requires_grad_() for t in (q, k, v)]
    counter = AllToAllCounter()
    out = ring_attention(*local, dist.group.WORLD, causal=causal,
                         key_valid=split_sequence(valid, r, c) if padded else None, counter=counter,
                         fused=case.get("fused"))
    out.backward(piece(dout))
    diffs = {"out": float((out.detach() - piece(ref.detach())).abs().max())}
    for name, mine, whole in zip("qkv", local, full, strict=True):
        diffs[f"d{name}"] = float((mine.grad - piece(whole.grad)).abs().max())
    expected = ring_elements(rank=r, cp=c, batch=BATCH, seq_len=q.shape[2], heads=HEADS, kv_heads=k.shape[1],
                             head_dim=HEAD_DIM, causal=causal)
    return {"diffs": diffs, "counted": (counter.forward_elements, counter.backward_elements), "expected": expected,
            "scale": float(ref.abs().max())}


def chain_bytes(case: dict[str, Any]) -> dict[str, Any]:
    """A GPT or Llama chain switched to ring attention the way the strategy does (``enable_context_parallel`` with
    ``method="ring"``): the elements its blocks sent in one forward and backward (so ring really ran)."""
    import sequence_workers as sw

    from uniap_lightning.runtime.sequence import AllToAllCounter, enable_context_parallel, split_sequence

    c, r = dist.get_world_size(), dist.get_rank()
    model = sw._llama() if case.get("model") == "llama" else sw._model()
    counter = AllToAllCounter()
    enable_context_parallel(model.layers(), dist.group.WORLD, method="ring", counter=counter)
    ids = split_sequence(sw._batches(1, padded=False)[0]["input_ids"], r, c)
    model(ids).sum().backward()
    kv_heads = 2 if case.get("model") == "llama" else sw.HEADS
    one = ring_elements(rank=r, cp=c, batch=sw.BATCH, seq_len=sw.SEQ, heads=sw.HEADS, kv_heads=kv_heads,
                        head_dim=sw.EMBD // sw.HEADS, causal=True)
    return {"counted": (counter.forward_elements, counter.backward_elements),
            "expected": (one[0] * 2, one[1] * 2)}  # two blocks


KINDS = {"layer": layer, "chain_bytes": chain_bytes}


def worker(rank: int, world: int, port: int, cases: dict[str, dict[str, Any]], out_dir: str) -> None:
    sequence_workers.worker(rank, world, port, cases, out_dir, kinds=KINDS)
