"""Bucketed replicated-gradient averaging: buckets start during the backward, in order, and sum what ``.grad``
will hold (fresh + the window's earlier gradients); unused parameters do not hold a bucket back.

One process (a gloo group of one rank, so an all-reduce is the identity and averaging divides by the recorded
degree): the multi-process parity of the same code is in ``test_equivalence.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from uniap_lightning.runtime.data_parallel import ReplicatedGrads, make_buckets


@pytest.fixture
def world_of_one(tmp_path) -> Iterator[dist.ProcessGroup]:
    """A one-process group; an in-process Trainer of an earlier test (devices=1) may have left one behind."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def test_buckets_respect_the_cap_and_start_with_the_last_layers() -> None:
    model = _model()
    params = list(model.parameters())
    cap_bytes = (8 * 8 + 8) * 4
    buckets = make_buckets([(None, 2, params)], cap_bytes=cap_bytes)  # type: ignore[list-item]
    # reversed: last bias (1) + last weight (8) + middle bias (8) | middle weight (64) + first bias (8) | first weight
    assert [b.buffer.numel() for b in buckets] == [17, 72, 64]
    assert buckets[0].params[0] is params[-1]  # last layer's bias first: its gradient is ready first
    assert all(b.buffer.numel() * 4 <= cap_bytes for b in buckets)
    # as DDP: a smaller first bucket, so that a reduction starts early in the backward
    groups = [(None, 2, params)]
    first_small = make_buckets(groups, cap_bytes=cap_bytes, first_cap_bytes=9 * 4)  # type: ignore[arg-type]
    assert [b.buffer.numel() for b in first_small] == [9, 72, 72]


def test_buckets_launch_during_backward_and_average_fresh_plus_previous(world_of_one: dist.ProcessGroup) -> None:
    model = _model()
    params = list(model.parameters())
    rg = ReplicatedGrads([(world_of_one, 2, params)], bucket_cap_bytes=1)  # one bucket per parameter
    previous = {p: torch.full_like(p, 0.5) for p in params}
    launched_before_flush: list[int] = []
    rg.arm(backward_passes=2, previous=previous)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    model(x).sum().backward()
    launched_before_flush.append(rg._next)
    fresh = [p.grad.clone() for p in params]
    rg.flush()
    for p in params:  # what Lightning's backward leaves in .grad: previous + fresh (the strategy's hand-over)
        p.grad = p.grad + previous[p]
    rg.finish()
    assert launched_before_flush == [len(params)]  # every bucket started inside the backward, none at flush
    for p, g in zip(params, fresh):
        torch.testing.assert_close(p.grad, (g + 0.5) / 2)


def test_tied_parameter_gets_one_slot_and_buffer_bytes_count_each_gradient_once(
    world_of_one: dist.ProcessGroup,
) -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight  # tied: one parameter used by two replicated layers
    rg = ReplicatedGrads()
    rg.add(first, world_of_one, 2)
    rg.add(second, world_of_one, 2)
    assert rg.buffer_bytes() == (16 + 4 + 4) * 4
    rg.arm(backward_passes=1, previous={})
    second(first(torch.randn(3, 4))).sum().backward()
    assert rg._next == len(rg.buckets)  # the tied weight's hook ran once, after both uses were accumulated
    expected = first.weight.grad.clone() / 2
    rg.flush()
    rg.finish()
    torch.testing.assert_close(first.weight.grad, expected)
    assert rg.buffer_bytes() == (16 + 4 + 4) * 4


def test_unused_parameter_gets_the_average_and_disarmed_hooks_do_nothing(world_of_one: dist.ProcessGroup) -> None:
    model = _model()
    unused = nn.Linear(2, 2)
    params = list(model.parameters()) + list(unused.parameters())
    rg = ReplicatedGrads([(world_of_one, 2, params)], bucket_cap_bytes=1)
    rg.arm(backward_passes=1, previous={})
    model(torch.randn(4, 8)).sum().backward()
    assert rg._next == 0  # the unused parameters' buckets come first (registered last) and hold the rest back
    rg.flush()
    rg.finish()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in unused.parameters())
    before = [p.grad.clone() for p in model.parameters()]
    model(torch.randn(4, 8)).sum().backward()  # not armed: plain accumulation, no collective
    rg.finish()
    assert all(not torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert all(b.work is None for b in rg.buckets)


REPL = (2, 1, False)


@pytest.mark.parametrize("world", [2, 4])
def test_short_last_window_across_epochs_matches_one_process(world: int, tmp_path) -> None:
    """16 samples per batch, 4 batches per epoch, windows of 3: each epoch ends with a window of one batch that
    both opens and closes (Lightning zeroes ``.grad`` there), so the buckets must leave the stale gradients out."""
    import uniap_rt_helpers as h

    if world == 2:
        plan = h.make_plan([REPL] * 4, [0, 0, 0, 0], pp=1, microbatches=2)
    else:
        plan = h.make_plan([REPL] * 4, [0, 0, 1, 1], pp=2, microbatches=2, world=4)
    cases = {"short_window": {"plan": plan, "accumulate": 3, "epochs": 2, "clip": 0.5}}
    results = h.spawn(world, cases, tmp_path)
    h.assert_close_to_reference(results, "short_window", h.reference_for(cases["short_window"]))


def _counting_worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    """Train one case and record, after every batch, (optimizer steps so far, bucket collectives so far, buckets)."""
    import os
    from pathlib import Path

    import lightning.pytorch as pl

    import uniap_rt_helpers as h
    from uniap_lightning.strategy import UniAPStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    os.chdir(out_dir)
    torch.set_num_threads(1)
    case = cases["count"]
    strategy = UniAPStrategy(plan=case["plan"], monitor=False)
    seen: list[tuple[int, int, int]] = []

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            rg = strategy.runtime.replicated
            seen.append((trainer.global_step, rg.launches, len(rg.buckets)))

    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[Count()], **h.trainer_kwargs(case))
    trainer.fit(h.make_module(), h.make_data(16))
    torch.save(seen, Path(out_dir) / f"rank{rank}.pt")


def test_one_collective_per_bucket_per_optimizer_step(tmp_path) -> None:
    """Accumulation windows of 3 over two 4-batch epochs: 4 optimizer steps, and each starts every bucket once
    (all-reduce is linear, so parity alone would not notice a reduction per batch)."""
    import uniap_rt_helpers as h

    cases = {"count": {"plan": h.make_plan([REPL] * 4, [0, 0, 0, 0], pp=1, microbatches=2), "accumulate": 3,
                       "epochs": 2}}
    for seen in h.spawn(2, cases, tmp_path, fn=_counting_worker):
        steps = [s for s, _, _ in seen]
        buckets = seen[-1][2]
        assert steps == [0, 0, 1, 2, 2, 2, 3, 4] and buckets >= 1
        assert [launches for _, launches, _ in seen] == [step * buckets for step in steps]
