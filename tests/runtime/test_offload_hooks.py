"""Activation offload's saved-tensor hooks (``runtime.dimensions.offload.OffloadedActivations``) in one process:
the same gradients bit for bit, activations copied out (parameters and their views left alone), and the stage
module running each layer as its plan record says (offload, recomputation first). Multi-process parity (pipeline,
tensor parallelism, ZeRO, resuming across plans that differ in offload) is in ``test_zero_recompute.py``."""

from __future__ import annotations

import torch
from torch import nn

from uniap_lightning.planner.decision import Strategy
from uniap_lightning.runtime.dimensions.offload import OffloadedActivations
from uniap_lightning.runtime.stage import StageModule


def _grads(model: nn.Module, x: torch.Tensor, box: OffloadedActivations | None) -> list[torch.Tensor]:
    model.zero_grad()
    x = x.detach().requires_grad_()
    if box is None:
        loss = model(x).pow(2).sum()
    else:
        with torch.autograd.graph.saved_tensors_hooks(box.pack, box.unpack):
            loss = model(x).pow(2).sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def test_the_same_gradients_with_activations_copied_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    box = OffloadedActivations(None)
    want, got = _grads(model, x, None), _grads(model, x, box)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert box.packed  # activations went through the copies
    params = {p.data_ptr() for p in model.parameters()}
    assert not any(host.data_ptr() in params for _, host, _ in box.packed)
    # the input, the intermediates (the norm's statistics among them) and the output, none of the weights (nor
    # their transposed views)
    assert sorted(tuple(host.shape) for _, host, _ in box.packed) == [(5, 1), (5, 1), (5, 4), (5, 8), (5, 16),
                                                                      (5, 16), (5, 16)]


def test_stage_module_takes_offload_per_layer():
    class Meshes:
        n = 1

    plain, off = Strategy.of(1, 1), Strategy.of(1, 1, offload=True)
    both = Strategy.of(1, 1, recompute=True, offload=True)
    stage = StageModule([nn.Linear(2, 2), nn.Linear(2, 2)], [1, 1], Meshes(), strategies=[off, plain])
    assert stage.runners == ["offload", None]
    assert StageModule([nn.Linear(2, 2)], [1], Meshes()).runners == [None]
    # a layer the plan recomputes saves nothing to offload: recomputation runs it (first in the registry)
    assert StageModule([nn.Linear(2, 2)], [1], Meshes(), strategies=[both]).runners == ["recompute"]
