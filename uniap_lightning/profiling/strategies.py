"""Measure what tensor parallelism and FSDP cost per layer beyond the divided compute, on the job's own ranks.

The ring formulas of :mod:`uniap_lightning.planner.cost.comm` price the collectives of a sharded layer, but not what
runs around them: DTensor's dispatch, FSDP2's copy-in/copy-out and hooks, and the part of a layer that tensor
parallelism does not split (norms, residual adds). On small layers those dominate (measured on 4 gloo ranks:
FSDP and TP plans ran 70-170% slower than the formulas said). So at setup, every rank takes part in timing each
*distinct* layer of the chain (layers with the same type and parameter shapes are timed once) under each
strategy it may get:

- ``("tp", t)`` for each tensor-parallel degree ``t > 1`` the layer supports and the world allows, on groups of
  ``t`` consecutive ranks (every group at once, as in training): the layer parallelized by
  :func:`uniap_lightning.runtime.tensor_parallel.apply_tp`;
- ``("fsdp", d)`` for ``d`` in 2, 4, ... up to the devices of one node: the layer wrapped by ``fully_shard``;
- ``("dp", d)`` for the same ``d``: the layer replicated, its gradients averaged by the runtime's own
  :class:`~uniap_lightning.runtime.data_parallel.ReplicatedGrads` (hooks, bucket copies, the all-reduce started
  during the backward), and the step waited for as in training. Where ranks share CPU cores, the all-reduce does
  not overlap the backward: gloo's reduction runs on the cores the backward needs, and the hooks' copies add to it
  (measured on the README demo, 2 ranks on 2 cores: +3.5-4 ms inside a 13 ms backward, beside the all-reduce's
  own time). On a GPU the same measurement sees the overlap instead, so the figure may be below the all-reduce
  formula;
- ``("zero2", d)`` and ``("zero1", d)``: the layer as the runtime runs those modes (:mod:`uniap_lightning.runtime.zero`:
  FSDP2 gathered once per step, gradients reduce-scattered, or averaged whole and moved into the shards), one
  whole step timed: on small layers FSDP2's per-call work dominates what the collective formulas see (the README
  demo: a ZeRO-2 plan predicted at 21 ms from the formulas ran at 52 ms).

Under TP the bytes a layer saves for backward are counted too (on the local shards, at the largest size): the
share of its activations that TP splits (``activation_tp_fraction``, from ``saved(t) = saved(1) ((1 - f) + f / t)``;
norms, residual adds and the inputs of column-parallel projections stay whole on every rank) goes into the profile
with the overheads, where the cost model used to assume every activation split (tensor-parallel plans measured
13-23% more memory than predicted on the fidelity benchmark's GPT).

Each is timed forward + backward at a few micro-batch sizes (samples per device), median of ``repeats`` after
``warmup``, right after the plain layer at the same size (also on every rank at once); the slowest rank's medians
count. The result, per layer, is :class:`~uniap_lightning.planner.profile.Overhead` records (``seconds`` = measured
minus plain / ``t`` for TP, minus plain for FSDP and replication) that :func:`attach_overheads` adds to a profile
and the cost model uses instead of its formulas (for replication: instead of the all-reduce formula, per step).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from uniap_lightning.planner.profile import ModelProfile, Overhead
from uniap_lightning.profiling.aggregate import structure_key
from uniap_lightning.profiling.estimate import strategy_kinds
from uniap_lightning.profiling.measure import Context, training_state_kept
from uniap_lightning.profiling.memory import SavedBytes
from uniap_lightning.profiling.timing import Timer, median_s
from uniap_lightning.runtime.payload import backward_ones, call_layer, flatten, float_leaves, head, rows, signature
from uniap_lightning.runtime.data_parallel import ReplicatedGrads, apply_fsdp
from uniap_lightning.runtime.tensor_parallel import apply_tp, tp_degrees
from uniap_lightning.runtime.zero import ZeroLayers


def _fwd_bwd_s(layer: nn.Module, x: Any, repeats: int, warmup: int, context: Context,
               replicated: Any = None, zero: Any = None) -> float:
    """Median seconds of forward (inside ``context``) + backward (gradient of ones) of ``layer`` on ``x``; with
    ``replicated`` (a ReplicatedGrads holding the layer), its gradient average is armed, started during the
    backward and waited for, as :class:`~uniap_lightning.runtime.step.TrainStep` does for a step's last batch.
    With ``zero`` (a ZeroLayers holding the layer as zero1 / zero2), the step is a whole optimizer step's worth:
    parameters gathered, gradients reduce-scattered (zero2) or averaged into the shards (zero1), resharded.
    ``x`` may be a payload (a tuple or dict of tensors, :mod:`uniap_lightning.runtime.payload`)."""

    def step() -> None:
        inp = float_leaves(x)
        if replicated is not None:
            replicated.arm(backward_passes=1, previous={})
        if zero is not None:
            zero.begin(closing=True, backward_passes=1)
        with context():
            out = call_layer(layer, inp)
        backward_ones(out)
        if zero is not None:
            zero.end()
        if replicated is not None:
            replicated.flush()
            replicated.finish()
        if zero is not None:
            zero.finish()

    seconds = median_s(step, Timer(flatten(x)[0].device), repeats=repeats, warmup=warmup)
    for p in layer.parameters():
        p.grad = None
    return seconds


def _saved_bytes(layer: nn.Module, x: Any, context: Context) -> float:
    """Bytes ``layer`` saves for backward on ``x`` (local shards, each storage once, parameters excluded)."""
    saved = SavedBytes(layer.parameters())
    with saved.hooks(), context():
        out = call_layer(layer, float_leaves(x))
    del out
    return float(saved.total)


def tp_split_bytes(full_bytes: float, local_bytes: float, t: int) -> float:
    """The bytes tensor parallelism divides: ``s`` in ``local = (full - s) + s / t``, within [0, full]."""
    if full_bytes <= 0 or t <= 1:
        return 0.0
    return min(max((full_bytes - local_bytes) / (1.0 - 1.0 / t), 0.0), full_bytes)


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_overheads(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    sample_input: Any,
    *,
    micro_batches: Sequence[int],
    devices_per_node: int | None = None,
    repeats: int = 3,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    context: Context = nullcontext,
    tp_split: dict[int, float] | None = None,
) -> dict[int, list[Overhead]]:
    """Collective (every rank calls it with the same chain): ``{layer index: [Overhead, ...]}``, the same on every
    rank. ``micro_batches`` are samples per device; sizes larger than ``sample_input`` are skipped. Forwards run
    inside ``context`` (the precision's forward context), as in training. ``tp_split``, when given, receives for
    each TP-capable layer the saved bytes per sample that TP divides (:func:`tp_split_bytes`; the least over the
    degrees timed and the ranks; the same on every rank), for :func:`attach_overheads`."""
    world = dist.get_world_size()
    dpn = devices_per_node or world
    device = flatten(sample_input)[0].device
    n_rows = rows(sample_input)
    sizes = sorted({int(m) for m in micro_batches if 1 <= int(m) <= n_rows})
    t_start = time.perf_counter()
    # one mesh per degree, built in the same order on every rank (new_group is collective)
    meshes: dict[int, Any] = {}
    degrees = sorted({k for layer in layers for _, k in strategy_kinds(world, dpn, tp_degrees(layer))})
    for k in degrees:
        meshes[k] = init_device_mesh(device.type, (world // k, k), mesh_dim_names=("rest", "group"))["group"]
    out: dict[int, list[Overhead]] = {}
    seen: dict[tuple[Any, ...], int] = {}
    with training_state_kept(layers):
        # inputs of every layer at the largest size (a plain forward; the chain's weights are not touched)
        inputs: list[Any] = []
        with torch.no_grad(), context():
            x: Any = head(sample_input, sizes[-1]) if sizes else sample_input
            for layer in layers:
                inputs.append(x)
                x = call_layer(layer, x)
        for i, (layer, name) in enumerate(zip(layers, names, strict=True)):
            key = structure_key(layer) + (repr(signature(head(inputs[i], 1))),)
            if key in seen:
                out[i] = out[seen[key]]
                if tp_split is not None and seen[key] in tp_split:
                    tp_split[i] = tp_split[seen[key]]
                continue
            seen[key] = i
            records: list[Overhead] = []
            for kind, k in strategy_kinds(world, dpn, tp_degrees(layer)):
                shard = copy.deepcopy(layer)
                replicated = zero = None
                if kind == "tp":
                    apply_tp(shard, name, meshes[k])
                    if tp_split is not None and sizes:
                        xm = head(inputs[i], sizes[-1])
                        local = _slowest(_saved_bytes(shard, xm, context), device)  # the rank keeping the most
                        split = tp_split_bytes(_saved_bytes(layer, xm, context), local, k) / sizes[-1]
                        tp_split[i] = min(tp_split.get(i, split), split)
                elif kind == "fsdp":
                    apply_fsdp(shard, meshes[k])  # as the runtime shards it (views of parameters copied)
                elif kind in ("zero1", "zero2"):
                    if not any(p.requires_grad for p in shard.parameters()):
                        continue
                    replicated, zero = ReplicatedGrads(), ZeroLayers()
                    zero.add(shard, kind, meshes[k], replicated, meshes[k].get_group(), k)
                else:
                    replicated = ReplicatedGrads()
                    replicated.add(shard, meshes[k].get_group(), k)
                    if not replicated.groups:  # no trainable parameters: nothing to average
                        continue
                for m in sizes:
                    xm = head(inputs[i], m)
                    plain = _slowest(_fwd_bwd_s(layer, xm, repeats, warmup, context), device)
                    dist.barrier()
                    timed = _slowest(_fwd_bwd_s(shard, xm, repeats, warmup, context, replicated, zero), device)
                    records.append(Overhead(kind, k, m, timed - (plain / k if kind == "tp" else plain)))
                del shard
            out[i] = records
            if progress is not None and records:
                progress(f"timed layer {i} ({name}) under {len(records) // max(len(sizes), 1)} strategies "
                         f"({time.perf_counter() - t_start:.1f} s)")
    return out


def attach_overheads(profile: ModelProfile, overheads: dict[int, list[Overhead]],
                     tp_split: dict[int, float] | None = None) -> ModelProfile:
    """The profile with each layer's measured overheads (replacing any it had) and, from ``tp_split`` (bytes per
    sample TP divides, :func:`measure_overheads`), its ``activation_tp_fraction``: that share of the layer's
    activation bytes (which may hold more than the layer saves, e.g. the loss's with the last layer: not split)."""
    split = tp_split or {}

    def fraction(i: int, lp: Any) -> float:
        if i not in split or lp.activation_bytes <= 0:
            return lp.activation_tp_fraction
        return min(split[i] / lp.activation_bytes, 1.0)

    layers = [replace(lp, overheads=tuple(overheads.get(i, lp.overheads)), activation_tp_fraction=fraction(i, lp))
              for i, lp in enumerate(profile.layers)]
    meta = dict(profile.meta)
    meta["overheads_measured"] = True
    return ModelProfile(model=profile.model, layers=layers, source=profile.source, device=profile.device, meta=meta)
