"""How a layer's backward splits into the input's gradient (B) and the parameters' gradients (W).

Zero-bubble pipeline schedules run B when the gradient of a stage's output arrives (the previous stage waits for
it) and W later, in what would be bubbles. The profile's ``weight_grad_fraction`` is W's share, ``W / (B + W)``,
timed at one micro-batch size (the profile's largest) as ``torch.distributed.pipelining`` runs the two halves in
its zero-bubble schedules: ``stage_backward_input`` (the input's gradient, keeping the gradients that reach the
parameters' operations) then ``stage_backward_weight`` (only the parameters' gradients, from those). A run is a
fresh forward (untimed) and the two halves, each timed from cold caches, after the layer's other timed runs.

One run per layer (:data:`SPLIT_RUNS`): the fraction is a ratio of two halves of one backward, and identical
layers pool their fractions (the median, :mod:`.aggregate`'s rule). On this project's 2-core CPU host, shared with
other jobs, for a 4-block GPT-2 (d=256, 8 x 128 tokens, one thread) one run added 11-30% to the profile's time
(profiles with and without it alternated) and gave the blocks 0.25-0.34 over nine profiles; the median of three
runs added 55-67% and gave 0.33-0.36 over six. On a GPU, whose timings vary far less, one run is enough.

Why not two plain ``torch.autograd.grad`` calls (inputs, then parameters): the second walks the graph again from
the output, so it repeats every input-gradient step between the output and the parameters' operations. A GPT-2
block starts with a layer norm that has parameters, so that "W" is nearly the whole backward (B + W was 1.7-1.9x
the backward on this project's CPU host, and every block's fraction came out ~0.55 whatever its shapes); split
as the schedules do, B + W is 1.1-1.3x the backward and a block's W share ~0.33.

Layers without trainable parameters have no W (0); the chain's first layer has no B (its input, from the data
loader, never needs a gradient: 1 with parameters), nor has a layer whose input holds no floating-point tensor.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from uniap_lightning.profiling.timing import Timer
from uniap_lightning.runtime.payload import call_layer, flatten, float_leaves


#: split runs per layer (more: the median of each half over that many)
SPLIT_RUNS = 1


def weight_grad_fraction(layer: nn.Module, x: Any, *, first: bool, repeats: int = SPLIT_RUNS,
                         context: Callable[[], Any], flush: Callable[[], None],
                         loss: Callable[[Any], torch.Tensor] | None = None) -> float:
    """W's share of ``layer``'s backward on payload ``x`` (the rules in the module docstring): the forward inside
    ``context``, with ``loss`` (the last layer's) the backward from the loss, else from a gradient of ones; the
    median of ``repeats`` timings of each half, ``flush`` (untimed) before each."""
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return 0.0
    if first or not any(t.is_floating_point() for t in flatten(x)):
        return 1.0
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    timer = Timer(flatten(x)[0].device)
    b_s, w_s = [], []
    for _ in range(max(repeats, 1)):
        inp = float_leaves(x)
        with context():
            out = call_layer(layer, inp)
            value = loss(out) if loss is not None else None
        if value is not None and value.requires_grad:
            outs, grads = [value], None
        else:
            outs = [t for t in flatten(out) if t.requires_grad]
            grads = [torch.ones_like(t) for t in outs]
        if not outs:
            return 0.0  # no backward at all
        outs = [t.clone() for t in outs]  # stage_backward_input detaches them in place, which a view refuses
        ins = [t for t in flatten(inp) if t.requires_grad]
        flush()
        timer.synchronize()
        t0 = timer.mark()
        _, groups = stage_backward_input(outs, grads, ins, iter(params))
        t1 = timer.mark()
        b_s.append(timer.elapsed_s(t0, t1))
        flush()
        timer.synchronize()
        t2 = timer.mark()
        stage_backward_weight(iter(params), groups)
        t3 = timer.mark()
        w_s.append(timer.elapsed_s(t2, t3))
    b, w = statistics.median(b_s), statistics.median(w_s)
    return min(max(w / (b + w), 0.0), 1.0) if b + w > 0 else 0.0
