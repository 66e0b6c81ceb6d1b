"""The profiler predicts its own duration from its first timings and says once when it is long (issue 21
item 3): what to change is in the message."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from uniap_lightning.profiling import measure
from uniap_lightning.profiling.measure import predicted_profile_s, profile_layers


def test_prediction_scales_with_layers_and_micro_batches() -> None:
    # 2 of 12 layers took 1 s at micro-batch 2; sizes 2, 4, 16 cost 1 + 2 + 8 times the first size
    assert predicted_profile_s(1.0, 2, 12, [2, 4, 16]) == pytest.approx(0.5 * 12 * 11)
    assert predicted_profile_s(3.0, 4, 4, [8]) == pytest.approx(3.0)


def _profile(messages: list[str], **kwargs: object) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(3)]
    profile_layers(layers, [f"l{i}" for i in range(3)], torch.randn(8, 8), repeats=2, micro_batches=[2, 8],
                   progress=messages.append, flush_bytes=0, **kwargs)


def test_a_long_profile_is_announced_once_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "SLOW_PROFILE_S", 0.0)  # every profile is "long": the first layer says so
    messages: list[str] = []
    _profile(messages)
    said = [m for m in messages if m.startswith("this will take about")]
    assert len(said) == 1 and messages[0] is said[0]  # after the first 3 layers, before any size is done
    assert "3 layers at micro-batches 2, 8; the first 3 at 2 took" in said[0]
    assert "profile_repeats=1 (now 2)" in said[0] and "profile=FILE" in said[0] and "\n" not in said[0]


def test_a_short_profile_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "SLOW_PROFILE_S", 1e9)
    messages: list[str] = []
    _profile(messages)
    assert messages and not any("will take" in m for m in messages)
