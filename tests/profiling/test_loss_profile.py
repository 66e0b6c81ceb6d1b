"""The last layer's profile includes the loss, as a training step computes it right after that layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from uniap_lightning.profiling.cache import loss_code
from uniap_lightning.profiling.measure import profile_layers

V, H, N = 64, 16, 8


def _chain() -> tuple[list[nn.Module], list[str]]:
    torch.manual_seed(0)
    return [nn.Linear(H, H), nn.Linear(H, V)], ["body", "head"]


def _profile(**kw):
    layers, names = _chain()
    return profile_layers(layers, names, torch.randn(N, H), repeats=1, micro_batches=[N], flush_bytes=0, **kw)


def test_the_loss_adds_what_it_saves_to_the_last_layer() -> None:
    target = torch.randint(0, V, (N,))
    plain = _profile()
    with_loss = _profile(loss_fn=F.cross_entropy, target=target)
    assert plain.meta["loss"] == "no loss given" and with_loss.meta["loss"] == "with the last layer"
    # cross_entropy saves its log-softmax (N x V float32), and nll_loss the target (N int64) and its total weight
    # (one float32): per sample V * 4 + 8 + 4 / N bytes
    extra = with_loss.layers[1].activation_bytes - plain.layers[1].activation_bytes
    assert extra == V * 4 + 8 + 4 / N
    assert with_loss.layers[0].activation_bytes == plain.layers[0].activation_bytes  # only the last layer moves


def test_a_loss_that_fails_on_the_sample_is_left_out_not_fatal() -> None:
    def bad(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("needs a batch dict")

    prof = _profile(loss_fn=bad, target=torch.zeros(N))
    assert prof.meta["loss"].startswith("left out: it failed on the sample (ValueError: needs a batch dict")
    assert prof.layers[1].activation_bytes == _profile().layers[1].activation_bytes
    assert _profile(loss_fn=F.cross_entropy).meta["loss"] == "no target in the sample batch"


def test_the_profile_cache_key_follows_the_loss_code() -> None:
    class A(nn.Module):
        def uniap_loss(self, out, y):
            return out.sum()

    class B(nn.Module):
        def uniap_loss(self, out, y):
            return out.mean()

    assert loss_code(A().uniap_loss) != loss_code(B().uniap_loss)
    assert loss_code(A().uniap_loss) == loss_code(A().uniap_loss)
    assert loss_code(nn.CrossEntropyLoss()) != loss_code(nn.MSELoss())
