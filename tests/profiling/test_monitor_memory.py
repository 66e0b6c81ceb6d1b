"""The monitor's CPU memory figure counts tensor bytes, as the plan predicts them (uniap_lightning/monitor_memory.py)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from uniap_lightning.monitor_memory import CpuStepMemory


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 10)  # 1010 parameters: 4040 bytes
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 100)).sum().backward()
    opt.step()  # AdamW state: exp_avg and exp_avg_sq (4040 bytes each; the step counters are scalars)
    opt.zero_grad(set_to_none=True)
    return model, opt


def test_tensor_peak_is_static_plus_the_most_held_at_once() -> None:
    model, opt = _model_and_optimizer()
    mem = CpuStepMemory()
    mem.start(model, [opt])
    a = torch.empty(1000)  # 4000 bytes
    b = torch.empty(2000)  # 8000: 12000 held
    del a
    c = torch.empty(500)  # 2000: 10000 held, the peak stays 12000
    tensors, process = mem.stop()
    assert tensors == 3 * 4040 + 12000
    assert process >= 3 * 4040  # the static bytes plus a growth that is never negative
    assert _get_current_dispatch_mode() is None
    del b, c


def test_gradients_held_at_the_start_count_and_the_backward_is_seen() -> None:
    model, opt = _model_and_optimizer()
    model(torch.randn(4, 100)).sum().backward()  # gradients kept (accumulation): 4040 bytes
    mem = CpuStepMemory()
    mem.start(model, [opt])
    with_grads = mem._grads
    x = torch.randn(64, 100, requires_grad=True)  # 25600 bytes
    model(x).sum().backward()
    tensors, _ = mem.stop()
    assert with_grads == 4040
    assert tensors >= 3 * 4040 + 4040 + 25600 * 2  # x and its gradient at least


def test_abandon_leaves_no_dispatch_mode() -> None:
    model, opt = _model_and_optimizer()
    mem = CpuStepMemory()
    mem.start(model, [opt])
    assert mem.active and _get_current_dispatch_mode() is not None
    mem.abandon()
    assert not mem.active and _get_current_dispatch_mode() is None
    mem.abandon()  # twice is harmless
