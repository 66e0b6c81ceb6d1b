"""Activation offload: a layer's tensors saved for backward go to host memory in its forward and come back before
its backward (:mod:`uniap_lightning.runtime.stage` runs the layer under saved-tensor hooks that copy them over the
device's host link, asynchronously where the device has streams).

Opt-in, like compression: the planner offers ``offload`` only on a cluster that allows it (``Cluster.offload ==
"auto"``; default ``"off"``, so plans made without it are unchanged) and has a host link
(``Cluster.host_link_gbps > 0``: the catalogue device's PCIe or NVLink-C2C figure, or the cluster's own; a CPU
cluster has none: its "host" is its device memory, so no candidate). Numerics do not change: the same tensors come
back.

Rules: not with ``recompute`` (a recomputed layer keeps only its input; offloading that input buys little and the
two wrappers would nest). Priced by :func:`offload_s` and :func:`offload_memory` (this dimension's cost hook,
which the cost model calls after the activations and recomputation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.base import Column, Dimension, Field, LayerTerms, Slot, flag


def allowed(cluster: Any) -> bool:
    """The cluster lets the planner offload: it opted in (``offload: auto``) and has a host link."""
    return cluster.offload == "auto" and cluster.host_link_gbps > 0


def _options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[bool, ...]:
    return (False, True) if allowed(slot.cluster) and not chosen["recompute"] else (False,)


def _rules(s: Any, where: str, experts: int | None) -> None:
    if s.offload and s.recompute:
        raise UniAPError(f"{where}: offload and recompute exclude each other (a recomputed layer keeps only its "
                         "input for backward); choose one")


def offload_s(saved_bytes: float, forward_s: float, backward_s: float, host_bytes_per_s: float,
              floor_s: float) -> float:
    """Exposed seconds per micro-batch of moving ``saved_bytes`` (the layer's saved activations on one device) to
    the host in forward and back in backward over a link of ``host_bytes_per_s`` per direction. Each copy runs on
    a side stream beside the same pass's compute, so only what exceeds it is priced, and the host's work of
    issuing and waiting for the copies (``floor_s``, one eager operation's least time, per direction) is never
    hidden: ``max(0, B / bw - forward_s) + max(0, B / bw - backward_s) + 2 floor_s``. The floor also makes
    offload strictly dearer than keeping the activations where memory does not bind."""
    copy = saved_bytes / host_bytes_per_s
    return max(0.0, copy - forward_s) + max(0.0, copy - backward_s) + 2.0 * floor_s


def offload_memory(activation_bytes: float) -> tuple[float, float]:
    """``(activation_bytes, transient_bytes)`` an offloaded layer adds: nothing per micro-batch in flight (its
    saved tensors wait on the host), and while it runs its backward its own saved tensors back on the device plus
    one layer's prefetched beside them (bounded: counted at this layer's size), ``2 x activation_bytes``."""
    return 0.0, 2.0 * activation_bytes


def _price_activations(x: LayerTerms) -> None:
    """Its saved activations wait on the host: the copies' exposed time, one layer back plus a prefetch."""
    if not x.s.offload:
        return
    forward = x.compute * x.layer.forward_fraction
    x.comm += offload_s(x.act, forward, x.compute * (1 - x.layer.forward_fraction),
                        x.cluster.host_link_gbps * 1e9, x.cluster.kernel_floor_us * 1e-6)
    x.act, back = offload_memory(x.act)
    x.transient += back


def _cell(s: Any) -> str:
    return "host" if s.offload else "-"


OFFLOAD = Dimension(
    name="offload",
    fields=(Field("offload", bool, False, _options, check=flag("offload"), since=5),),
    suffix=lambda s: "+off" if s.offload else "",
    rules=_rules,
    # shown where some layer offloads (and not in explain's table, whose strategy label says "+off"): reports of
    # plans without offload are unchanged
    columns=(Column("offload", _cell, shown=lambda s: bool(s.offload)),),
    price_activations=_price_activations,
)
