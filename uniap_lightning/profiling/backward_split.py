"""How a layer's backward splits into the input's gradient (B) and the parameters' gradients (W).

Zero-bubble pipeline schedules run B when the gradient of a stage's output arrives (the previous stage waits for
it) and W later, in what would be bubbles. The profile's ``weight_grad_fraction`` is W's share, ``W / (B + W)``,
timed at one micro-batch size (the profile's largest) as ``torch.distributed.pipelining`` runs the two halves in
its zero-bubble schedules: ``stage_backward_input`` (the input's gradient, keeping the gradients that reach the
parameters' operations) then ``stage_backward_weight`` (only the parameters' gradients, from those). A run is a
fresh forward (untimed) and the two halves, each timed from cold caches, after the layer's other timed runs.

The split is not free: two passes over the graph, the input half keeping what the weight half needs. The profile's
``backward_split_overhead`` is ``(B + W)`` over one ordinary backward of the same forward, timed in the same run
(a fresh forward, then ``torch.autograd.backward`` from cold caches), so the cost model prices a split schedule's
backward as it runs. On this project's CPU host a GPT-2 block's ratio was 1.1-1.3.

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
from typing import Any, NamedTuple

import torch
from torch import nn

from uniap_lightning.profiling.timing import Timer
from uniap_lightning.runtime.payload import call_layer, flatten, float_leaves


#: split runs per layer (more: the median of each half over that many)
SPLIT_RUNS = 1


class BackwardSplit(NamedTuple):
    """One layer's measured split: W's share of ``B + W``, and ``B + W`` over one ordinary backward (None: the
    layer's backward is not split, so nothing to price)."""

    fraction: float
    overhead: float | None = None


def measure_backward_split(layer: nn.Module, x: Any, *, first: bool, repeats: int = SPLIT_RUNS,
                           context: Callable[[], Any], flush: Callable[[], None],
                           loss: Callable[[Any], torch.Tensor] | None = None) -> BackwardSplit:
    """W's share of ``layer``'s backward on payload ``x`` and the split's overhead (the rules in the module
    docstring): the forward inside ``context``, with ``loss`` (the last layer's) the backward from the loss, else
    from a gradient of ones; the median of ``repeats`` timings of each half and of the whole backward, ``flush``
    (untimed) before each. Leaves the layer's ``.grad`` as it found them."""
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return BackwardSplit(0.0)
    if first or not any(t.is_floating_point() for t in flatten(x)):
        return BackwardSplit(1.0)
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    saved = [p.grad for p in params]
    timer = Timer(flatten(x)[0].device)

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor] | None, Any]:
        inp = float_leaves(x)
        with context():
            out = call_layer(layer, inp)
            value = loss(out) if loss is not None else None
        if value is not None and value.requires_grad:
            return [value], None, inp
        outs = [t for t in flatten(out) if t.requires_grad]
        return outs, [torch.ones_like(t) for t in outs], inp

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        flush()
        timer.synchronize()
        t0 = timer.mark()
        result = fn()
        t1 = timer.mark()
        return timer.elapsed_s(t0, t1), result

    b_s, w_s, whole_s = [], [], []
    try:
        for _ in range(max(repeats, 1)):
            outs, grads, inp = forward()
            if not outs:
                return BackwardSplit(0.0)  # no backward at all
            outs = [t.clone() for t in outs]  # stage_backward_input detaches them in place, which a view refuses
            ins = [t for t in flatten(inp) if t.requires_grad]
            b, (_, groups) = timed(lambda: stage_backward_input(outs, grads, ins, iter(params)))
            w, _ = timed(lambda: stage_backward_weight(iter(params), groups))
            b_s.append(b)
            w_s.append(w)
            outs, grads, _ = forward()
            whole, _ = timed(lambda: torch.autograd.backward(outs, grads))
            whole_s.append(whole)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    b, w, whole = statistics.median(b_s), statistics.median(w_s), statistics.median(whole_s)
    fraction = min(max(w / (b + w), 0.0), 1.0) if b + w > 0 else 0.0
    return BackwardSplit(fraction, (b + w) / whole if whole > 0 and b + w > 0 else None)
