"""Gradient clipping across pipeline stages and shards, as a Lightning ``Precision`` plugin.

Lightning clips through the precision plugin (``Precision.clip_gradients`` -> ``clip_grad_by_norm`` /
``clip_grad_by_value``), the way ``FSDPStrategy`` enforces its ``FSDPPrecision``. Under a UniAP plan each rank holds
only some parameters, sharded (FSDP, TP) or replicated in mixed ways, so clipping by the local norm would clip each
stage differently from one device. :class:`GlobalNormClipping` clips by the norm of the whole model's gradient
(:func:`uniap_lightning.runtime.grads.clip_grad_norm`, identical on every rank).

Any precision the user picks keeps its own behaviour (autocast, dtype conversion, ...): the strategy's
``precision_plugin`` setter turns the plugin into an instance of a subclass of its own class with this mixin in
front (:func:`with_global_norm_clipping`), as ``torch.nn.utils.parametrize`` does for modules.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from uniap_lightning.runtime.data_parallel import local_tensor
from uniap_lightning.runtime.grads import clip_grad_norm

#: ``clip(params, max_norm)``: clips in place by the global norm (a collective over the world)
ClipByNorm = Callable[[list[torch.nn.Parameter], float], Any]


class GlobalNormClipping(Precision):
    """Clips by the norm of the whole model (all stages and shards), and by value on each rank's local pieces."""

    _uniap_clip_by_norm: ClipByNorm | None = None

    def bind_global_norm(self, clip_by_norm: ClipByNorm) -> None:
        """Set by the strategy once the plan is applied (the norm needs its stages and process groups)."""
        self._uniap_clip_by_norm = clip_by_norm

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._uniap_clip_by_norm is None:
            raise RuntimeError("UniAP clips gradients after its setup has applied a plan; none is applied yet")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._uniap_clip_by_norm(params, float(clip_val))

    @torch.no_grad()
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    local_tensor(p.grad).clamp_(-float(clip_val), float(clip_val))


@lru_cache(maxsize=None)
def _with_mixin(cls: type[Precision]) -> type[Precision]:
    return type(f"UniAP{cls.__name__}", (GlobalNormClipping, cls), {"__module__": __name__})


def with_global_norm_clipping(plugin: Precision) -> Precision:
    """A copy of ``plugin`` whose class also clips by the global norm (``plugin`` itself if it already does)."""
    if isinstance(plugin, GlobalNormClipping):
        return plugin
    out = copy.copy(plugin)
    out.__class__ = _with_mixin(type(plugin))
    return out


def global_norm_clipper(devices_per_stage: int, *, device: torch.device, guard: Any) -> ClipByNorm:
    """The clip a plan needs: by the norm of the whole model's gradient (a collective over the world)."""
    def clip(params: list[torch.nn.Parameter], max_norm: float) -> None:
        guard(lambda: clip_grad_norm(params, max_norm, devices_per_stage, device=device))

    return clip
