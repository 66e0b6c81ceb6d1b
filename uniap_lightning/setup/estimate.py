"""Setup's one line before it measures (``UniAPStrategy`` in Python): how long the measuring and the first steps
will take, from the chain's size and a quick measurement (:mod:`uniap_lightning.profiling.estimate`).

The chain's forward FLOPs per sample are counted, not timed: every layer runs once on the meta device under
:class:`torch.utils.flop_counter.FlopCounterMode` (its parameters and buffers swapped for meta tensors by
:func:`torch.func.functional_call`; nothing is computed or copied), on one row of the sample. A layer the meta
device cannot run counts two FLOPs per parameter and token. ``uniap train`` says its own line earlier, from the
config (:mod:`uniap_lightning.cli.estimate`); setup then stays silent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from uniap_lightning.profiling.aggregate import structure_key
from uniap_lightning.profiling.estimate import SAID, Work, estimate_line, predict
from uniap_lightning.profiling.rates import measure_rates
from uniap_lightning.runtime.payload import call_layer, flatten, head, map_tensors, rows, signature
from uniap_lightning.runtime.tensor_parallel import tp_degrees
from uniap_lightning.setup.agree import Ranks
from uniap_lightning.setup.options import SetupOptions

#: steps the line predicts at most
FIRST_STEPS = 10
#: what else shortens the measuring, as ``UniAPStrategy`` takes it
MORE = ("fewer profile_micro_batches, a shorter sequence, or profile=FILE (a profile measured elsewhere; profiles "
        "are cached, a second run reuses this one)")


class _Call(nn.Module):
    """``layer`` applied to a payload by the chain's rules, as one module ``functional_call`` can swap tensors in."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Any) -> Any:
        return call_layer(self.layer, x)


def _tokens(x: Any) -> int:
    """Positions per sample of the payload's first tensor (its elements, less a feature dimension when float)."""
    t = flatten(x)[0]
    per_row = t[0].numel() if t.dim() else 1
    return max(per_row // (t.shape[-1] if t.is_floating_point() and t.dim() > 1 else 1), 1)


def forward_flops(layers: list[nn.Module], x: Any) -> list[float]:
    """Each layer's forward FLOPs on payload ``x`` (one sample, say), counted on the meta device."""
    out: list[float] = []
    seen: dict[Any, tuple[float, Any]] = {}
    x = map_tensors(lambda t: t.to("meta"), x)
    for layer in layers:
        key = (structure_key(layer), repr(signature(x)))
        if key not in seen:
            fallback = 2.0 * sum(p.numel() for p in layer.parameters()) * _tokens(x)
            tensors = {f"layer.{n}": torch.empty_like(t, device="meta")
                       for n, t in layer.state_dict(keep_vars=True).items()}
            try:
                with torch.no_grad(), FlopCounterMode(display=False) as counter:
                    y = functional_call(_Call(layer), tensors, (x,), strict=False)
                seen[key] = (float(counter.get_total_flops()) or fallback, y)
            except Exception:  # noqa: BLE001 - a layer meta cannot run (data-dependent shapes): its parameters count
                return out + [2.0 * sum(p.numel() for p in m.parameters()) * _tokens(x) for m in layers[len(out):]]
        flops, x = seen[key]
        out.append(flops)
    return out


def chain_work(layers: list[nn.Module], x: Any, *, ranks: Ranks, options: SetupOptions, everywhere: bool,
               measure_cluster: bool, global_batch: int, steps: int) -> Work:
    """What setup will measure for ``layers`` on the sample ``x``."""
    distinct: dict[Any, tuple[int, list[int]]] = {}
    for i, layer in enumerate(layers):
        distinct.setdefault(structure_key(layer), (i, tp_degrees(layer)))
    params = [p for layer in layers for p in layer.parameters()]
    count = sum(p.numel() for p in params)
    return Work(
        flops=forward_flops(layers, head(x, 1)), params=[sum(p.numel() for p in m.parameters()) for m in layers],
        distinct=list(distinct.values()), rows=rows(x), repeats=options.profile_repeats,
        micro_batches=options.profile_micro_batches, world=ranks.world_size,
        devices_per_node=ranks.devices_per_node, measure_cluster=measure_cluster, everywhere=everywhere,
        samples_per_rank=global_batch / ranks.world_size, steps=steps,
        param_bytes=sum(p.numel() * p.element_size() for p in params) / count if count else 4.0,
    )


def say_estimate(chain: Any, x: Any, trainer: Any, *, ranks: Ranks, options: SetupOptions, precision: str,
                 global_batch: int | None, say: Any) -> str | None:
    """Rank 0, before setup measures: the line, given to ``say``; None (and nothing said) when setup measures
    nothing or the command said it already. Never raises: an estimate that fails is left out."""
    if not ranks.lead or SAID.by_caller or x is None or options.profile_path is not None:
        return None
    distributed = ranks.world_size > 1
    everywhere = options.measure_cluster and distributed
    max_steps = int(getattr(trainer, "max_steps", -1) or -1)
    try:
        work = chain_work(list(chain.layers), x, ranks=ranks, options=options, everywhere=everywhere,
                          measure_cluster=everywhere and options.cluster is None,
                          global_batch=int(global_batch or rows(x)),
                          steps=min(max_steps, FIRST_STEPS) if max_steps > 0 else FIRST_STEPS)
        rates = measure_rates(ranks.device, precision=precision, ranks=ranks.devices_per_node)
        line = estimate_line(predict(work, rates), repeats=options.profile_repeats,
                             override="UniAPStrategy(profile_repeats=1)", more=MORE)
    except Exception:  # noqa: BLE001 - the estimate is a courtesy; setup goes on without it
        return None
    say(line)
    return line
