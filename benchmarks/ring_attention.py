"""Ring attention vs Ulysses, one attention forward + backward per rank (CPU, gloo; issue 22).

    python benchmarks/ring_attention.py [--world 2] [--seq 1024,4096] [--heads 8] [--head-dim 64] [--batch 1]

Each of ``--world`` gloo processes (one thread each) holds its contiguous ``s / world`` piece of q, k, v
(``[batch, heads, s/world, head_dim]``, float32, causal, a key padding mask of ones) and runs
:func:`uniap_lightning.runtime.ring.ring_attention` (per block: torch's CPU flash kernel; and ``fused=False``:
plain matmuls) and :func:`uniap_lightning.runtime.sequence.ulysses_attention`, forward and backward, 4 times each;
printed: the median of the last 3 on rank 0 (between barriers). Timings on a shared machine are noisy.

``--balance``: instead, the CPU time (``time.thread_time``) each rank spends in ring attention's per-block forward
(causal, 3 calls, averaged), printed per rank: the causal load balance (query chunks ``r`` and ``2c-1-r`` on rank
``r``) should make them equal.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist


def _rank(rank: int, world: int, port: int, args: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from uniap_lightning.runtime.ring import ring_attention
    from uniap_lightning.runtime.sequence import ulysses_attention

    g = torch.Generator().manual_seed(rank)
    if args.balance:
        _balance(rank, world, args, g)
        return
    for s in args.seq:
        n = s // world
        q, k, v = (torch.randn(args.batch, args.heads, n, args.head_dim, generator=g).requires_grad_()
                   for _ in range(3))
        valid = torch.ones(args.batch, n, dtype=torch.bool)
        row = {}
        for name, fn in (("ring", ring_attention), ("ring (matmuls)", functools.partial(ring_attention, fused=False)),
                         ("Ulysses", ulysses_attention)):
            times = []
            for _ in range(4):
                dist.barrier()
                t0 = time.perf_counter()
                fn(q, k, v, dist.group.WORLD, causal=True, key_valid=valid).sum().backward()
                dist.barrier()
                times.append(time.perf_counter() - t0)
            row[name] = statistics.median(times[1:]) * 1e3
        if rank == 0:
            print(f"seq {s:>6,} over {world} ranks: " + ", ".join(f"{k} {v:,.1f} ms" for k, v in row.items()),
                  flush=True)
    dist.destroy_process_group()


def _balance(rank: int, world: int, args: Any, g: torch.Generator) -> None:
    import uniap_lightning.runtime.ring as ring

    spent = [0.0]
    block_forward = ring._block_forward

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.thread_time()
        out = block_forward(*a, **kw)
        spent[0] += time.thread_time() - t0
        return out

    ring._block_forward = timed
    for s in args.seq:
        spent[0] = 0.0
        q, k, v = (torch.randn(args.batch, args.heads, s // world, args.head_dim, generator=g) for _ in range(3))
        for _ in range(3):
            ring.ring_attention(q, k, v, dist.group.WORLD, causal=True)
        got = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(got, torch.tensor([spent[0] / 3]))
        if rank == 0:
            print(f"seq {s:>6,} over {world} ranks: block-forward CPU s per rank "
                  + ", ".join(f"{float(t):.3f}" for t in got), flush=True)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--balance", action="store_true")
    args = p.parse_args()
    mp.start_processes(_rank, args=(args.world, 29611, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
