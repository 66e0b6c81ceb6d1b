"""State offload: a layer's parameters, gradients and optimizer state kept in host memory, its optimizer step run
on the host (DeepSpeed's ZeRO-Offload; FSDP2's ``fully_shard(..., offload_policy=CPUOffloadPolicy())``, which
:mod:`uniap_lightning.runtime.dimensions.state_offload` applies). The device holds the layer's gathered weights
only while the layer runs.

Opt-in with activation offload: offered only where the cluster allows offload (``Cluster.offload == "auto"``) and
has a host link (:func:`~.offload.allowed`), for a layer with parameters whose state FSDP2 holds: its replicas
shard it as ZeRO-3 (``dp_mode`` zero3), or it has none (``dp x cp = 1``: one FSDP2 unit over a one-rank mesh).
Not with expert parallelism (the expert shards are reduced apart from FSDP2) nor float8 matmuls (torchao's float8
weights under a host-resident FSDP2 unit are not run). Numerics do not change: the same optimizer steps the same
values on the host.

Priced by :func:`_price_state` over the device's host link (``Cluster.host_link_gbps``, per direction), per
micro-batch: the weight shard copied host -> device before each gather (forward, and again in backward: the unit
reshards after forward), the gradient shard back; each beside its pass's compute, so what exceeds it is exposed,
plus the host's work of issuing the copies (the kernel floor, per pass). Per step: the optimizer runs on the host
instead of the device; with no host-memory bandwidth in the device catalogue, its time is the state's bytes read
once over the host link (a bound: host memory is faster than the link on PCIe hosts, about as fast on GH200).
Memory: the parameter, gradient and optimizer shards leave the device; the gathered weights stay transient.
Host memory is not counted (the cluster has no host-memory size).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.base import Column, Dimension, Field, LayerTerms, Slot, flag
from uniap_lightning.planner.dimensions.offload import allowed


def _fsdp_holds_state(replicas: int, dp_mode: str) -> bool:
    return replicas == 1 or dp_mode == "zero3"


def _options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[bool, ...]:
    if (allowed(slot.cluster) and slot.layer.params > 0 and chosen["ep"] == 1 and chosen["precision"] == "default"
            and _fsdp_holds_state(chosen["dp"] * chosen["cp"], chosen["dp_mode"])):
        return (False, True)
    return (False,)


def _rules(s: Any, where: str, experts: int | None) -> None:
    if not s.state_offload:
        return
    if not _fsdp_holds_state(s.replicas, s.dp_mode):
        raise UniAPError(f"{where}: state_offload needs dp_mode 'zero3' (FSDP2 holds the state it keeps on the "
                         f"host) or no replicas, got dp_mode {s.dp_mode!r} over {s.replicas} replicas")
    if s.ep > 1 or s.precision != "default":
        raise UniAPError(f"{where}: state_offload runs without expert parallelism and in the run's own matmul "
                         f"precision (got ep={s.ep}, precision={s.precision!r}); choose one")


def state_offload_s(shard_w: float, shard_g: float, forward_s: float, backward_s: float, host_bytes_per_s: float,
                    floor_s: float) -> float:
    """Exposed seconds per micro-batch of a host-resident layer's copies over a host link of ``host_bytes_per_s``
    per direction: its ``shard_w`` weight bytes in before the forward's gather, in again before the backward's
    beside its ``shard_g`` gradient bytes out (the other direction), each beyond its pass's compute, plus a kernel
    floor per pass: ``max(0, W / bw - forward_s) + max(0, max(W, G) / bw - backward_s) + 2 floor_s``."""
    w, g = shard_w / host_bytes_per_s, shard_g / host_bytes_per_s
    return max(0.0, w - forward_s) + max(0.0, max(w, g) - backward_s) + 2.0 * floor_s


def _price_state(x: LayerTerms) -> None:
    """The state's shards on the host: the copies (per micro-batch), the host's optimizer step for the device's
    (per step), the shards out of the device's bytes and the gathered weights in its transient."""
    if not x.s.state_offload:
        return
    w, g, o = x.training.weight_bytes, x.training.grad_bytes, x.training.optimizer_bytes
    P, d, link = x.shared, x.d, x.cluster.host_link_gbps * 1e9
    forward = x.compute * x.layer.forward_fraction
    x.state_comm += state_offload_s(P * w / d, P * g / d, forward, x.compute - forward, link,
                                    x.cluster.kernel_floor_us * 1e-6)
    state = P * (w + g + o) / d
    x.sync += state / link - x.cluster.optimizer_s_per_param * P / d
    x.static = max(x.static - state, 0.0)
    if x.mode != "zero3":  # one FSDP2 unit over one rank: its gathered weights, as ZeRO-3's
        x.transient += P * w


def _cell(s: Any) -> str:
    return "host" if s.state_offload else "-"


STATE_OFFLOAD = Dimension(
    name="state_offload",
    fields=(Field("state_offload", bool, False, _options, check=flag("state_offload"), since=7),),
    suffix=lambda s: "+soff" if s.state_offload else "",
    rules=_rules,
    # shown where some layer keeps its state on the host: reports of plans without it are unchanged
    columns=(Column("state", _cell, shown=lambda s: bool(s.state_offload)),),
    price_state=_price_state,
)
