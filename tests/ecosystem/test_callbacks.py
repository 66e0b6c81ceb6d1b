"""The training CLI's callbacks in a distributed job whose collectives cannot carry CPU tensors (NCCL on a GPU)."""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist

from uniap_lightning.callbacks import PerplexityLogger


@pytest.fixture
def one_rank_group() -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Module:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **_: Any) -> None:
        self.logged[name] = value


class _Trainer:
    def __init__(self, step: int) -> None:
        self.global_step, self.max_steps = step, 10


def test_perplexity_is_computed_without_a_collective(one_rank_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The losses it averages are global (equal on every rank), so it never gathers: on a CUDA job the metric's CPU
    state over NCCL failed every ``uniap train trainer.accelerator=gpu`` run at its first perplexity."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("No backend type associated with device type cpu")

    monkeypatch.setattr(dist, "all_gather", refuse)
    assert dist.is_initialized() and os.environ.get("WORLD_SIZE") in (None, "1")
    ppl, module = PerplexityLogger(window=2), _Module()
    for step, loss in ((1, 1.0), (2, 2.0)):
        ppl.on_train_batch_end(_Trainer(step), module, torch.tensor(loss), None, 0)  # type: ignore[arg-type]
    assert ppl.last_train_ppl == pytest.approx(math.exp(1.5))
    assert module.logged["train_ppl"] == pytest.approx(math.exp(1.5))
    ppl.on_validation_batch_end(_Trainer(2), module, torch.tensor(3.0), None, 0)  # type: ignore[arg-type]
    ppl.on_validation_epoch_end(_Trainer(2), module)  # type: ignore[arg-type]
    assert ppl.last_val_ppl == pytest.approx(math.exp(3.0))


@pytest.fixture
def in_process_fit() -> Any:
    """A fit in this process leaves what a user's script would (Lightning's MASTER_PORT / WORLD_SIZE ... in the
    environment, the strategy's excepthook and signal handlers): put them back, or later tests' subprocesses take
    themselves for started ranks."""
    import signal
    import sys

    env = dict(os.environ)
    hook = sys.excepthook
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        sys.excepthook = hook
        for s, h in handlers.items():
            signal.signal(s, h)
        torch.set_num_threads(threads)


def test_a_users_trainer_bounded_by_steps_shows_no_negative_epoch_count(tmp_path: Any, in_process_fit: Any) -> None:
    """Lightning's default rich bar printed "Epoch 0/-2" for ``Trainer(max_steps=N)`` (``max_epochs=-1``); under
    the strategy it shows "Epoch 0"; a bar the user chose is left as it is."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from torch.utils.data import DataLoader, TensorDataset

    from uniap_lightning import UniAPStrategy
    from uniap_lightning.adapters import CausalLMModule
    from uniap_lightning.adapters.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    module = CausalLMModule(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)).layers())
    ids = torch.randint(0, 32, (16, 8))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, strategy=UniAPStrategy(cache_dir=str(tmp_path), monitor=False,
                                                                           measure_cluster=False))
    assert type(trainer.progress_bar_callback) is RichProgressBar
    trainer.fit(module, DataLoader(TensorDataset(ids, ids), batch_size=8))
    assert trainer.progress_bar_callback._get_train_description(0).strip() == "Epoch 0"
    plain = RichProgressBar()
    plain._trainer = trainer
    assert plain._get_train_description(0).strip() == "Epoch 0/-2"  # Lightning's own, in the same state
    mine = TQDMProgressBar()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[mine], logger=False)
    from uniap_lightning.callbacks import fix_default_progress_bar

    fix_default_progress_bar(trainer)
    assert type(trainer.progress_bar_callback) is TQDMProgressBar
