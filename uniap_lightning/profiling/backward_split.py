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
backward as it runs. The two calls' own fixed cost (about 0.1-0.3 ms on this project's CPU host, measured once on a
2 x 2 layer: :func:`split_call_s`) is taken off first: a schedule pays it once per stage, not once per layer, and
counted per layer it made a chain of small ``Linear(512)`` layers look 3x slower split (1.1x measured in the
schedule). On this project's CPU host a GPT-2 block's ratio was 1.1-1.3.

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
    from torch.distributed.pipelining._backward import (  # deferred: torch.distributed.pipelining loads dynamo (~0.4 s)
        stage_backward_input, stage_backward_weight)

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
    if whole <= 0 or b + w <= 0:
        return BackwardSplit(fraction, None)
    # the split's fixed cost per call pair is paid once per pipeline stage, not per layer: take it off
    split = max(b + w - split_call_s(timer, flush), whole * MIN_SPLIT_RATIO)
    return BackwardSplit(fraction, split / whole)


#: the smallest split-over-whole ratio reported (timer noise on tiny layers can push the difference below zero)
MIN_SPLIT_RATIO = 0.5
_CALL_S: dict[str, float] = {}


def split_call_s(timer: Timer, flush: Callable[[], None], runs: int = 15) -> float:
    """What a split backward costs beyond an ordinary one when the layer does (almost) nothing: torch's two
    pipelining calls' own work (graph walks, hooks, Python), measured once per timer kind on a 2 x 2 linear layer
    (median of ``runs``). Zero-bubble schedules pay it once per stage and micro-batch, so a layer's
    ``backward_split_overhead`` leaves it out (a chain of many small layers would count it once per layer)."""
    key = timer.name
    if key not in _CALL_S:
        from torch.distributed.pipelining._backward import (  # deferred: torch's pipelining loads dynamo (~0.4 s)
            stage_backward_input, stage_backward_weight)

        layer = nn.Linear(2, 2)
        params = list(layer.parameters())
        extra = []
        for _ in range(runs):
            x = torch.randn(2, 2, requires_grad=True)
            y = layer(x).clone()
            flush()
            timer.synchronize()
            t0 = timer.mark()
            _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], iter(params))
            stage_backward_weight(iter(params), groups)
            t1 = timer.mark()
            x = torch.randn(2, 2, requires_grad=True)
            y = layer(x)
            flush()
            timer.synchronize()
            t2 = timer.mark()
            torch.autograd.backward([y], [torch.ones_like(y)])
            t3 = timer.mark()
            extra.append(timer.elapsed_s(t0, t1) - timer.elapsed_s(t2, t3))
        _CALL_S[key] = max(statistics.median(extra), 0.0)
    return _CALL_S[key]
