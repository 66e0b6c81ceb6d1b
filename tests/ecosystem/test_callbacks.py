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
