"""Ring attention (Liu et al., 2023): exact attention over a sequence split into contiguous pieces, on any device.

The contract is :func:`uniap_lightning.runtime.sequence.ulysses_attention`'s: cp rank ``r`` of ``c`` holds
positions ``[r s/c, (r+1) s/c)`` of q ``[b, heads, s/c, d]``, k / v ``[b, kv_heads, s/c, d]`` (grouped-query: the
compact k / v travel, each block expands them locally) and the key padding mask ``[b, s/c]``; the output is its
piece ``[b, heads, s/c, d]``, equal to :func:`~.sequence.attention` over the whole sequence (padding and rows
with no visible key included: such a row sees itself, as there).

**Forward.** k and v go round the ring in ``c - 1`` steps (``batch_isend_irecv`` to rank ``r+1``, from ``r-1``;
the next transfer is posted before this block is computed, so they overlap). Each block's scores are merged into
the running output with the log-sum-exp (online softmax; accumulators in float32, float64 for float64 inputs);
the LSE is saved.

**Backward** (flash-style): each block's probabilities are recomputed from the saved LSE,
``D = rowsum(dout * out)``, ``ds = p (dp - D)``; k, v *and* the dk / dv accumulators go round the ring, so after
``c`` transfers of the accumulators every rank holds the gradient of its own k / v.

**Causal load balance** ("zigzag"). With contiguous pieces rank ``c-1`` would compute ``c`` blocks and rank 0 one.
Only q moves: the sequence is cut into ``2c`` chunks of ``s/(2c)`` and rank ``r`` takes query chunks ``r`` and
``2c-1-r`` (one all-to-all with uneven splits, :func:`zigzag`), so every rank computes ``2c+1`` chunk pairs
(blocks above the diagonal are skipped, keys cut to the visible prefix, the causal mask built only where a block
straddles the diagonal). The output goes back the same way; the backward moves ``dout`` and ``dq``. k / v stay
contiguous. Needs the local piece length even (``s % 2c == 0``).

**Bytes** (elements sent to other ranks, counted in a :class:`~.sequence.AllToAllCounter`): forward
``(c-1)`` transfers of k and v, plus (causal) q and the output through the zigzag exchange; backward ``(c-1)``
transfers of k, v and ``c`` of dk, dv, plus ``dout`` and ``dq``. :func:`ring_elements` is the formula.

Attention dropout is not supported (refused when the plan is checked). Per block, on CPU: torch's flash kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the whole row's LSE and output: the
flash-style recomputation above); elsewhere, or with ``fused=False``: plain matmuls in the accumulators' dtype
(the reference, tested equal), taking query rows in chunks so a block's scores stay within
:data:`MATMUL_SCORE_ELEMENTS`. No CUDA kernel is called: a GPU runs the matmul path (not run here: no multi-GPU
machine).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.sequence import attention, gather_sequence


def check_ring(*, seq_len: int | None, cp: int, causal: bool = True, name: str = "layer") -> None:
    """Refuse a ring degree the sequence cannot run, in one line (causal: the local piece must split in two)."""
    if cp < 1:
        raise UniAPError(f"{name}: context-parallel degree cp={cp} must be >= 1")
    multiple = 2 * cp if causal and cp > 1 else cp
    if seq_len is not None and seq_len % multiple:
        raise UniAPError(f"{name}: ring attention needs the sequence length {seq_len} divisible by {multiple} "
                         f"(2 x cp for causal load balance); pad it to a multiple of {multiple}")


def zigzag_owner(chunk: int, cp: int) -> int:
    """The rank holding query chunk ``chunk`` (of ``2 cp``) in the balanced layout: ``r`` holds ``r``, ``2cp-1-r``."""
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def zigzag_sent(rank: int, cp: int) -> int:
    """How many of its 2 contiguous chunks rank ``rank`` sends away going to the zigzag layout (and receives)."""
    return sum(zigzag_owner(j, cp) != rank for j in (2 * rank, 2 * rank + 1))


def ring_elements(*, rank: int, cp: int, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                  causal: bool) -> tuple[int, int]:
    """(forward, backward) elements one :func:`ring_attention` sends from ``rank`` to other ranks."""
    if cp == 1:
        return 0, 0
    kv = batch * kv_heads * (seq_len // cp) * head_dim
    q_chunk = batch * heads * (seq_len // (2 * cp)) * head_dim
    zig = 2 * q_chunk * zigzag_sent(rank, cp) if causal else 0  # q and out forward; dout and dq backward
    return 2 * kv * (cp - 1) + zig, 2 * kv * (cp - 1) + 2 * kv * cp + zig


# ---------------------------------------------------------------------------------------------- exchanges
def _count(counter: Any, n: int, *, backward: bool) -> None:
    if counter is not None and n:
        counter.add(n, backward=backward)


def zigzag(x: torch.Tensor, group: Any, *, inverse: bool = False, counter: Any = None,
           backward: bool = False) -> torch.Tensor:
    """``[b, h, s/c, d]`` contiguous piece -> this rank's query chunks ``(r, 2c-1-r)`` concatenated (``inverse``:
    back), by one all-to-all with uneven splits (a permutation: its adjoint is the inverse exchange)."""
    c, r = dist.get_world_size(group), dist.get_rank(group)
    half = x.shape[2] // 2
    mine = (r, 2 * c - 1 - r)  # zigzag chunks held here
    if inverse:  # send zigzag chunk j to the owner of contiguous piece j // 2
        send_chunks = [(j // 2, j, part) for j, part in zip(mine, x.split(half, dim=2), strict=True)]
        recv_chunks = [(zigzag_owner(j, c), j) for j in (2 * r, 2 * r + 1)]
    else:
        send_chunks = [(zigzag_owner(j, c), j, part) for j, part in zip((2 * r, 2 * r + 1), x.split(half, dim=2),
                                                                      strict=True)]
        recv_chunks = [(j // 2, j) for j in mine]
    # the all-to-all's buffers: for each peer, its chunks in chunk order
    send = sorted(send_chunks, key=lambda t: (t[0], t[1]))
    recv = sorted(recv_chunks)
    inp = torch.cat([part.movedim(2, 0) for _, _, part in send], dim=0)  # chunks along dim 0: a flat exchange
    out = torch.empty_like(inp)
    in_split = [half * sum(p == peer for p, _, _ in send) for peer in range(c)]
    out_split = [half * sum(p == peer for p, _ in recv) for peer in range(c)]
    dist.all_to_all_single(out, inp, output_split_sizes=out_split, input_split_sizes=in_split, group=group)
    _count(counter, half * inp[0].numel() * sum(p != r for p, _, _ in send), backward=backward)
    got = dict(zip([j for _, j in recv], out.split(half, dim=0), strict=True))
    order = (2 * r, 2 * r + 1) if inverse else mine
    return torch.cat([got[j] for j in order], dim=0).movedim(0, 2)


class _Ring:
    """One rank's ring: send to ``r+1``, receive from ``r-1`` (ranks within ``group``)."""

    def __init__(self, group: Any, counter: Any, backward: bool) -> None:
        self.group, self.counter, self.backward = group, counter, backward
        self.c, self.r = dist.get_world_size(group), dist.get_rank(group)

    def start(self, tensors: list[torch.Tensor], tag: int = 0) -> tuple[list[Any], list[torch.Tensor]]:
        """Post the transfer of ``tensors`` (tags ``tag, tag+1, ...``: k / v and dk / dv never cross)."""
        ops, got = [], []
        for i, t in enumerate(tensors):
            t = t.contiguous()
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t, group=self.group, group_peer=(self.r + 1) % self.c, tag=tag + i))
            ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=(self.r - 1) % self.c, tag=tag + i))
            got.append(buf)
            _count(self.counter, t.numel(), backward=self.backward)
        return dist.batch_isend_irecv(ops), got

    @staticmethod
    def wait(pending: tuple[list[Any], list[torch.Tensor]]) -> list[torch.Tensor]:
        works, got = pending
        for w in works:
            w.wait()
        return got


# ---------------------------------------------------------------------------------------------- blocks
def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _block_mask(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, key_valid: torch.Tensor | None,
                row_empty: torch.Tensor | None) -> torch.Tensor | None:
    """``[b or 1, 1, n_q, n_k]`` allowed keys of a block (``None``: all), as :func:`~.sequence.attention` builds them:
    valid keys (causal: not after the query), plus a row's own key where the row sees no key at all."""
    allowed = None
    if causal and int(kpos[-1]) > int(qpos[0]):
        allowed = (kpos[None, :] <= qpos[:, None])[None, None]
    if key_valid is not None:
        kv = key_valid[:, kpos][:, None, None, :]
        allowed = kv if allowed is None else allowed & kv
        own = (kpos[None, :] == qpos[:, None])[None, None] & row_empty[:, qpos][:, None, :, None]
        allowed = allowed | own
    return allowed


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _additive(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if mask is None else torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(
        ~mask, float("-inf"))


#: the plain-matmul path computes a block's scores this many elements at a time at most (query rows in chunks:
#: softmax is per row, so chunking is exact); it bounds the transient memory of long blocks (a 32k x 32k block of
#: 32 heads would otherwise take 128 GiB of float32 scores)
MATMUL_SCORE_ELEMENTS = 1 << 26


def _row_chunks(q: torch.Tensor, n_keys: int) -> list[slice]:
    """Query-row slices whose ``[b, heads, rows, n_keys]`` scores stay within :data:`MATMUL_SCORE_ELEMENTS`."""
    per_row = max(q.shape[0] * q.shape[1] * n_keys, 1)
    rows = max(MATMUL_SCORE_ELEMENTS // per_row, 1)
    return [slice(i, min(i + rows, q.shape[2])) for i in range(0, q.shape[2], rows)]


def _rows(mask: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    """The query rows ``sl`` of a block mask (one broadcast row, e.g. a key padding mask alone, stays as it is)."""
    return None if mask is None or mask.shape[2] == 1 else mask[:, :, sl]


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's softmax(q k^T) v and its log-sum-exp (``-inf`` where the block hides every key of a row)."""
    if fused:  # torch's CPU flash kernel; it reports lse 0 for a row it sees no key of
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k, v, 0.0, False, attn_mask=_additive(mask, q), scale=scale)
        if mask is not None:
            lse = lse.masked_fill(~mask.any(-1).expand_as(lse), float("-inf"))
        return o, lse
    outs, lses = [], []
    for sl in _row_chunks(q, k.shape[2]):
        s = _scores(q[:, :, sl], k, scale, _rows(mask, sl))
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - lse[..., None]).nan_to_num(0.0), v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, big_d: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of dq, dk, dv, its probabilities recomputed from the whole row's ``lse`` (``out``: the
    whole attention output, ``big_d = rowsum(do * out)``)."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.contiguous(), q.contiguous(), k, v, out.contiguous(), lse.contiguous(), 0.0, False,
            attn_mask=_additive(mask, q), scale=scale)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sl in _row_chunks(q, k.shape[2]):
        p = torch.exp(_scores(q[:, :, sl], k, scale, _rows(mask, sl)) - lse[:, :, sl, None]).nan_to_num(0.0)
        ds = p * (torch.matmul(do[:, :, sl], v.transpose(-1, -2)) - big_d[:, :, sl, None])
        dq[:, :, sl] = torch.matmul(ds, k) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, sl]) * scale
        dv += torch.matmul(p.transpose(-1, -2), do[:, :, sl])
    return dq, dk, dv


class _Plan:
    """Which keys of kv piece ``p`` each local query chunk sees (positions global)."""

    def __init__(self, c: int, r: int, n_local: int, causal: bool, device: torch.device) -> None:
        self.causal, self.device = causal, device
        half = n_local // 2
        # (global position of the first query, number of queries) of each local query chunk, in local order
        self.q_chunks = ([(j * half, half) for j in (r, 2 * c - 1 - r)] if causal and c > 1
                         else [(r * n_local, n_local)])
        self.n_local = n_local

    def blocks(self, p: int) -> list[tuple[int, torch.Tensor, torch.Tensor, int]]:
        """``(local query offset, query positions, key positions, number of keys)`` of the blocks against piece p."""
        out, off = [], 0
        k0 = p * self.n_local
        for q0, length in self.q_chunks:
            n_keys = self.n_local
            if self.causal:
                n_keys = min(self.n_local, q0 + length - k0)  # keys after the chunk's last query are masked
            if n_keys > 0:
                out.append((off, torch.arange(q0, q0 + length, device=self.device),
                            torch.arange(k0, k0 + n_keys, device=self.device), n_keys))
            off += length
        return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                key_valid: torch.Tensor | None, row_empty: torch.Tensor | None, scale: float,
                counter: Any, fused: bool) -> torch.Tensor:
        c, r = dist.get_world_size(group), dist.get_rank(group)
        zig = causal and c > 1
        qz = zigzag(q, group, counter=counter) if zig else q
        plan = _Plan(c, r, q.shape[2], causal, q.device)
        heads, acc_dtype = q.shape[1], torch.promote_types(q.dtype, torch.float32)
        qf = qz.to(acc_dtype)
        acc = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:3], float("-inf"), dtype=acc_dtype, device=q.device)
        ring = _Ring(group, counter, backward=False)
        kv = [k, v]
        for step in range(c):
            pending = ring.start(kv) if step < c - 1 else None  # overlap the next transfer with this block
            p = (r - step) % c
            kb, vb = (_expand(t, heads).to(acc_dtype) for t in kv)
            for off, qpos, kpos, n_keys in plan.blocks(p):
                sl = slice(off, off + len(qpos))
                mask = _block_mask(qpos, kpos, causal, key_valid, row_empty)
                o, block_lse = _block_forward(qf[:, :, sl], kb[:, :, :n_keys], vb[:, :, :n_keys], mask, scale, fused)
                new_lse = torch.logaddexp(lse[:, :, sl], block_lse)
                old = torch.exp(lse[:, :, sl] - new_lse).nan_to_num(0.0)  # -inf - -inf: nothing seen yet
                new = torch.exp(block_lse - new_lse).nan_to_num(0.0)
                acc[:, :, sl] = acc[:, :, sl] * old[..., None] + o * new[..., None]
                lse[:, :, sl] = new_lse
            if pending is not None:
                kv = _Ring.wait(pending)
        out = acc.to(q.dtype)
        ctx.save_for_backward(qz, k, v, out, lse)
        ctx.group, ctx.causal, ctx.key_valid, ctx.row_empty, ctx.scale, ctx.counter, ctx.fused = (
            group, causal, key_valid, row_empty, scale, counter, fused)
        return zigzag(out, group, inverse=True, counter=counter) if zig else out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        qz, k, v, out, lse = ctx.saved_tensors
        group, causal, key_valid, row_empty, scale, counter, fused = (
            ctx.group, ctx.causal, ctx.key_valid, ctx.row_empty, ctx.scale, ctx.counter, ctx.fused)
        c, r = dist.get_world_size(group), dist.get_rank(group)
        zig = causal and c > 1
        doutz = zigzag(dout, group, counter=counter, backward=True) if zig else dout
        plan = _Plan(c, r, qz.shape[2], causal, qz.device)
        heads, kv_heads, acc_dtype = qz.shape[1], k.shape[1], lse.dtype
        qf, do, outf = qz.to(acc_dtype), doutz.to(acc_dtype), out.to(acc_dtype)
        big_d = (do * outf).sum(-1)  # D = rowsum(dout * out)
        dq = torch.zeros_like(qf)
        ring = _Ring(group, counter, backward=True)
        kv = [k, v]
        grads = [torch.zeros(k.shape, dtype=acc_dtype, device=k.device),
                 torch.zeros(v.shape, dtype=acc_dtype, device=v.device)]
        for step in range(c):
            pending = ring.start(kv) if step < c - 1 else None
            p = (r - step) % c
            kb, vb = (_expand(t, heads).to(acc_dtype) for t in kv)
            dk = torch.zeros_like(kb)
            dv = torch.zeros_like(vb)
            for off, qpos, kpos, n_keys in plan.blocks(p):
                sl = slice(off, off + len(qpos))
                mask = _block_mask(qpos, kpos, causal, key_valid, row_empty)
                bq, bk, bv = _block_backward(do[:, :, sl], qf[:, :, sl], kb[:, :, :n_keys], vb[:, :, :n_keys],
                                             outf[:, :, sl], lse[:, :, sl], big_d[:, :, sl], mask, scale, fused)
                dq[:, :, sl] += bq
                dk[:, :, :n_keys] += bk
                dv[:, :, :n_keys] += bv
            if heads != kv_heads:  # grouped-query: the compact gradient
                dk, dv = (t.view(t.shape[0], kv_heads, heads // kv_heads, *t.shape[2:]).sum(2) for t in (dk, dv))
            grads = [grads[0] + dk, grads[1] + dv]
            # the accumulators travel with their block: after c transfers they are home
            moving = ring.start(grads, tag=2)
            if pending is not None:
                kv = _Ring.wait(pending)
            grads = _Ring.wait(moving)
        dq = dq.to(qz.dtype)
        if zig:
            dq = zigzag(dq, group, inverse=True, counter=counter, backward=True)
        return dq, grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *, causal: bool = True,
                   key_valid: torch.Tensor | None = None, scale: float | None = None,
                   counter: Any = None, fused: bool | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """:func:`~.sequence.attention` over the whole sequence for q / k / v given as this rank's contiguous sequence
    piece (``[b, heads, s/c, d]``; k / v may have fewer heads); ``key_valid`` is this rank's ``[b, s/c]`` piece of
    the key padding mask. Returns this rank's piece of the output. Exact in float32 (see the module docstring).
    ``fused``: each block through torch's CPU flash kernel (default on CPU) or plain matmuls (``False``; the only
    choice on other devices). ``dropout_p`` (the caller's attention dropout) must be 0: ring attention runs none."""
    if dropout_p:
        raise UniAPError(f"ring attention does not run attention dropout (p={dropout_p}); set the model's attention "
                         "dropout to 0 or use Ulysses")
    c = dist.get_world_size(group)
    if c == 1:
        return attention(q, k, v, causal=causal, key_valid=key_valid, scale=scale)
    check_ring(seq_len=q.shape[2] * c, cp=c, causal=causal, name="ring attention")
    if q.shape[1] % k.shape[1]:
        raise UniAPError(f"ring attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    row_empty = None
    full_valid = None
    if key_valid is not None:  # the whole mask (b x s booleans): which rows see no key at all
        full_valid = gather_sequence(key_valid.to(torch.bool), group)
        seen = full_valid.cummax(dim=1).values if causal else full_valid.any(1, keepdim=True).expand_as(full_valid)
        row_empty = ~seen
    fused = q.device.type == "cpu" if fused is None else fused and q.device.type == "cpu"
    return _RingAttention.apply(q, k, v, group, causal, full_valid, row_empty, scale, counter, fused)
