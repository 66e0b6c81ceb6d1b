"""The backward's split into the input's gradient (B) and the parameters' gradients (W): the profile fields
``weight_grad_fraction`` and ``backward_split_overhead``, their defaults, the profiler's measurement of them
(single process, CPU) and what the cost model does with the overhead."""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from uniap_lightning.errors import UniAPError
from uniap_lightning.profiling import backward_split, measure
from uniap_lightning.profiling.aggregate import median_over_ranks
from uniap_lightning.profiling.backward_split import BackwardSplit, measure_backward_split
from uniap_lightning.profiling.measure import profile_layers
from uniap_lightning.planner.profile import (
    DEFAULT_WEIGHT_GRAD_FRACTION,
    LayerProfile,
    ModelProfile,
    load_profile,
    save_profile,
)

LAYER = LayerProfile(name="block", forward_s=1e-3, backward_s=2e-3, params=1000, activation_bytes=1e4,
                     output_bytes=1e3)


def _doc(**extra: object) -> dict[str, object]:
    layer = {"name": "block", "forward_s": 1e-3, "backward_s": 2e-3, "params": 1000, "activation_bytes": 1e4,
             "output_bytes": 1e3, "tp_degrees": [1], "tp_allreduces": 0, **extra}
    return {"format_version": 1, "model": "m", "source": "measured", "device": "cpu", "meta": {}, "layers": [layer]}


def test_the_field_round_trips_and_is_omitted_when_not_measured(tmp_path: Path) -> None:
    prof = ModelProfile("m", [replace(LAYER, weight_grad_fraction=0.375), LAYER, replace(LAYER, params=0)])
    save_profile(prof, tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert [("weight_grad_fraction" in lp) for lp in raw["layers"]] == [True, False, False]
    back = load_profile(tmp_path / "p.json")
    assert back.layers == prof.layers
    assert [lp.backward_split() for lp in back.layers] == [0.375, DEFAULT_WEIGHT_GRAD_FRACTION, 0.0]
    # measured 1.0 (a first layer: no input gradient) and 0.0 are kept, not taken for "absent"
    edge = ModelProfile("m", [replace(LAYER, weight_grad_fraction=1.0), replace(LAYER, weight_grad_fraction=0.0)])
    save_profile(edge, tmp_path / "e.json")
    assert [lp.backward_split() for lp in load_profile(tmp_path / "e.json").layers] == [1.0, 0.0]


def test_an_old_profile_without_the_field_reads_as_none_and_writes_back_byte_identical(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    save_profile(ModelProfile.from_dict(_doc(backward_peak_bytes=5.0)), old)
    before = old.read_bytes()
    assert b"weight_grad_fraction" not in before
    prof = load_profile(old)
    assert prof.layers[0].weight_grad_fraction is None
    assert prof.layers[0].backward_split() == DEFAULT_WEIGHT_GRAD_FRACTION == 0.5
    save_profile(prof, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == before
    # readers ignore fields they do not know: how a reader from before this field loads a profile with it
    assert ModelProfile.from_dict(_doc(a_later_field=0.5)).layers[0] == ModelProfile.from_dict(_doc()).layers[0]
    # an explicit null is "not measured" too
    assert ModelProfile.from_dict(_doc(weight_grad_fraction=None)).layers[0].weight_grad_fraction is None


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (1.5, r"profile: layers\[0\]\.weight_grad_fraction must be in \[0, 1\], got 1\.5"),
        (-0.25, r"layers\[0\]\.weight_grad_fraction must be in \[0, 1\], got -0\.25"),
        ("half", r"layers\[0\]\.weight_grad_fraction must be a finite number, got 'half'"),
        (True, r"layers\[0\]\.weight_grad_fraction must be a finite number, got True"),
        (float("nan"), r"layers\[0\]\.weight_grad_fraction must be a finite number"),
        ([0.5], r"layers\[0\]\.weight_grad_fraction must be a finite number"),
    ],
)
def test_bad_values_are_refused_naming_the_layer_and_field(value: object, match: str) -> None:
    with pytest.raises(UniAPError, match=match) as err:
        ModelProfile.from_dict(_doc(weight_grad_fraction=value))
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ measured


class _Embed(nn.Module):
    """A first layer on token ids: its input has no gradient (no B)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class _Block(nn.Module):
    """A pre-norm transformer block (attention and MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


VOCAB, D, ROWS, SEQ = 64, 32, 8, 16
NAMES = ["embed", "block0", "block1", "act", "frozen", "head"]


def _chain() -> list[nn.Module]:
    torch.manual_seed(0)
    frozen = nn.Linear(D, D)
    frozen.requires_grad_(False)
    return [_Embed(), _Block(), _Block(), nn.GELU(), frozen, _Head()]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def _profile(layers: list[nn.Module]) -> ModelProfile:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    return profile_layers(layers, NAMES, ids, repeats=1, micro_batches=[2, ROWS], loss_fn=_loss, target=ids,
                          flush_bytes=0)


def test_a_measured_profile_splits_each_backward_and_leaves_the_other_fields_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = _chain()
    prof = _profile(layers)
    frac = {lp.name: lp.weight_grad_fraction for lp in prof.layers}
    assert frac["embed"] == 1.0  # token ids: no input gradient, the whole backward is W
    assert frac["act"] == 0.0 and frac["frozen"] == 0.0  # no trainable parameters: no W
    for name in ("block0", "block1", "head"):  # the head's includes the loss's backward, as training runs it
        assert 0.0 < frac[name] < 1.0, (name, frac[name])
    assert frac["block0"] == frac["block1"]  # identical layers pool their fractions (the median)
    over = {lp.name: lp.backward_split_overhead for lp in prof.layers}
    assert over["embed"] is None and over["act"] is None and over["frozen"] is None  # no split to price
    for name in ("block0", "block1", "head"):  # a ratio of two timings (noisy on a shared host): positive, finite
        assert backward_split.MIN_SPLIT_RATIO <= over[name] < float("inf"), (name, over[name])
    assert over["block0"] == over["block1"]
    split = prof.meta["backward_split"]
    assert split["micro_batch"] == ROWS and split["failed"] == {} and split["seconds"] > 0
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # training state kept
    assert ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict()))).layers == prof.layers

    # without the split every other field, bytes and counts, is what it was (times are not comparable)
    monkeypatch.setattr(measure, "measure_backward_split", lambda *a, **k: None)
    plain = _profile(_chain())
    assert all(lp.weight_grad_fraction is None for lp in plain.layers)
    untimed = ("params", "activation_bytes", "output_bytes", "backward_peak_bytes", "param_tensors", "matrix_dims",
               "vector_params", "tp_degrees", "tp_allreduces")
    for a, b in zip(prof.layers, plain.layers):
        assert [getattr(a, k) for k in untimed] == [getattr(b, k) for k in untimed]
        assert [t.micro_batch for t in a.timings] == [t.micro_batch for t in b.timings] == [2, ROWS]


def test_a_failing_split_leaves_the_field_out_not_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(layer: nn.Module, *args: object, **kwargs: object) -> BackwardSplit:
        if isinstance(layer, _Block):  # as torch's split reports it: a wrapper naming the tensors, and the cause
            raise RuntimeError("\n  Failed to run stage backward input:\n  Stage output: ...") from ValueError(
                "no split here\nsecond line")
        return BackwardSplit(0.25, 1.2)

    monkeypatch.setattr(measure, "measure_backward_split", broken)
    prof = _profile(_chain())
    assert prof.source == "measured"
    assert [lp.weight_grad_fraction for lp in prof.layers] == [0.25, None, None, 0.25, 0.25, 0.25]
    assert [lp.backward_split_overhead for lp in prof.layers] == [1.2, None, None, 1.2, 1.2, 1.2]
    assert prof.meta["backward_split"]["failed"] == {"block0": "ValueError: no split here",
                                                     "block1": "ValueError: no split here"}
    assert prof.layers[1].backward_split() == DEFAULT_WEIGHT_GRAD_FRACTION


class _HeavyInputGradient(nn.Module):
    """Parameters (a layer norm) first, then ten products with a fixed matrix: the input's gradient is ten matrix
    products, the parameters' gradients none. Timing W as a second ``autograd.grad`` from the output would repeat
    those ten products (W = B, a fraction of 0.5); split as the zero-bubble schedules split it, W holds none."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.register_buffer("m", torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for _ in range(10):
            x = x @ self.m
        return x


class _ProductFlops(TorchDispatchMode):
    """Counts the flops of the matrix products dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


class _FlopClock:
    """A Timer whose marks are the matrix-product flops counted so far: the split's halves in flops, exactly."""

    counter = _ProductFlops()
    name = "flops"  # the split's fixed cost is cached per timer kind: in products it is none (the same products)

    def __init__(self, device: torch.device) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def mark(self) -> int:
        return self.counter.flops

    def elapsed_s(self, start: int, end: int) -> float:
        return float(end - start)


def test_w_is_only_the_parameters_gradients_not_the_path_back_to_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted in flops instead of seconds (deterministic): a linear layer's W is half its backward (the two
    products of equal size); a layer whose parameters come first has W free of the input-gradient products. The
    split does no product twice, so in flops its overhead is 1 (in seconds it is what two graph walks cost)."""
    monkeypatch.setattr(backward_split, "Timer", _FlopClock)
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    with _FlopClock.counter:
        split = partial(measure_backward_split, first=False, context=nullcontext, flush=lambda: None)
        assert split(nn.Linear(64, 64, bias=False), x) == BackwardSplit(0.5, 1.0)
        assert split(_HeavyInputGradient(), x) == BackwardSplit(0.0, 1.0)
        assert split(nn.Linear(64, 64), x, first=True) == BackwardSplit(1.0, None)
        assert split(nn.GELU(), x) == BackwardSplit(0.0, None)


def test_ranks_combined_take_the_median_fraction_and_overhead() -> None:
    profiles = [ModelProfile("m", [replace(LAYER, weight_grad_fraction=f, backward_split_overhead=r), LAYER])
                for f, r in ((0.2, 1.3), (0.5, 1.1), (0.3, 1.2))]
    combined = median_over_ranks(profiles)
    assert [lp.weight_grad_fraction for lp in combined.layers] == [0.3, None]
    assert [lp.backward_split_overhead for lp in combined.layers] == [1.2, None]


# ------------------------------------------------------------------ the overhead field and its price


def test_the_overhead_field_round_trips_defaults_to_one_and_refuses_bad_values(tmp_path: Path) -> None:
    prof = ModelProfile("m", [replace(LAYER, backward_split_overhead=1.25), LAYER])
    save_profile(prof, tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert [("backward_split_overhead" in lp) for lp in raw["layers"]] == [True, False]
    back = load_profile(tmp_path / "p.json")
    assert back.layers == prof.layers
    assert [lp.split_overhead() for lp in back.layers] == [1.25, 1.0]
    for value, match in ((0, r"layers\[0\]\.backward_split_overhead must be > 0, got 0"),
                         (-1.0, r"backward_split_overhead must be > 0"),
                         ("x", r"layers\[0\]\.backward_split_overhead must be a finite number, got 'x'")):
        with pytest.raises(UniAPError, match=match):
            ModelProfile.from_dict(_doc(backward_split_overhead=value))


def test_the_split_calls_fixed_cost_is_measured_once_and_left_out_of_each_layer(monkeypatch: pytest.MonkeyPatch):
    """torch's split calls cost a fixed amount each (graph walks, Python) that a schedule pays once per stage: it is
    measured once on a tiny layer and taken off every layer's ratio, so a tiny layer is not priced 3x slower split."""
    monkeypatch.setattr(backward_split, "_CALL_S", {})
    calls = []
    real = backward_split.split_call_s

    def counted(timer: Any, flush: Any, runs: int = 15) -> float:
        calls.append(timer.name)
        return real(timer, flush, runs)

    monkeypatch.setattr(backward_split, "split_call_s", counted)
    split = partial(measure_backward_split, first=False, context=nullcontext, flush=lambda: None, repeats=5)
    small = split(nn.Linear(8, 8), torch.randn(4, 8))
    split(nn.Linear(8, 8), torch.randn(4, 8))
    assert len(backward_split._CALL_S) == 1 and backward_split._CALL_S["perf_counter"] >= 0.0
    assert small.overhead is not None and backward_split.MIN_SPLIT_RATIO <= small.overhead < 2.0
