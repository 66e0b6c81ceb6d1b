"""Measure a chain of ``nn.Module`` layers on a real sample micro-batch: times, output and saved-activation bytes.

Per layer and micro-batch size: forward and backward seconds (median of ``repeats`` timed runs after ``warmup``
untimed ones, with :class:`~uniap_lightning.profiling.timing.Timer`; each run starts from cold caches, as a layer
does in a training step, :class:`~uniap_lightning.profiling.timing.CacheFlush`), and at the largest size the output bytes, the
bytes of the storages autograd saves for backward (parameters excluded), the bytes the backward adds at its
peak (:mod:`~uniap_lightning.profiling.memory`) and the weight-gradient share of the backward, timed after the
layer's other runs (:mod:`~uniap_lightning.profiling.backward_split`). The
forward runs inside ``context`` - the precision plugin's forward context (autocast for ``bf16-mixed``) - exactly as
training runs it, so times and byte counts follow the precision. Raw readings go to
:mod:`~uniap_lightning.profiling.aggregate` before they become a profile.

A layer's input and output may hold several tensors (a payload, :mod:`uniap_lightning.runtime.payload`): the output
bytes are the sum over its tensors (what crosses a stage boundary), the backward starts from every output tensor
that requires grad, and floating-point inputs get gradients as in training.

Profiling must not change training: the RNG state and every buffer (e.g. batch-norm statistics) are restored and
gradients are cleared afterwards (:func:`training_state_kept`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.profile import LayerProfile, ModelProfile, Timing
from uniap_lightning.profiling.aggregate import Readings, never_faster_when_larger, pool_identical_layers, structure_key
from uniap_lightning.profiling.backward_split import BackwardSplit, measure_backward_split
from uniap_lightning.profiling.estimate import profile_sizes
from uniap_lightning.profiling.memory import SavedBytes, backward_peak_bytes
from uniap_lightning.profiling.structural import powersgd_dims, tensor_bytes
from uniap_lightning.profiling.timing import CacheFlush, Timer
from uniap_lightning.runtime.payload import (backward_ones, call_layer, flatten, float_leaves, head, map_tensors,
                                             nbytes, rows)
from uniap_lightning.runtime.chain import check_layer_output

Context = Callable[[], AbstractContextManager[Any]]


class ProfilingUnavailable(RuntimeError):
    """The layers cannot be timed on this input (meta tensors, rejected batch, ...)."""


@contextmanager
def training_state_kept(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Measure without changing training: the RNG state (CPU and CUDA) and every buffer (e.g. batch-norm
    statistics) are restored, and gradients cleared, when the block ends (also on an error)."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers() if not b.is_meta]
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for layer in layers:
            for p in layer.parameters():
                p.grad = None


def is_meta(layer: nn.Module, x: Any) -> bool:
    if isinstance(x, torch.Tensor) and x.is_meta:
        return True
    if isinstance(x, (tuple, dict)) and any(isinstance(t, torch.Tensor) and t.is_meta for t in flatten(x)):
        return True
    return any(p.is_meta for p in layer.parameters()) or any(b.is_meta for b in layer.buffers())


def _measure_layer(layer: nn.Module, x: Any, repeats: int, warmup: int, context: Context,
                   check: Callable[[Any], None], flush: Callable[[], None],
                   loss: Callable[[Any], torch.Tensor] | None = None) -> tuple[Any, float, float, float, float]:
    """Run the layer on payload ``x``: (detached output, forward s, backward s, saved activation bytes, bytes the
    backward adds at its peak) (:mod:`.memory`). ``flush`` runs, untimed, before each forward. ``loss`` (the last
    layer's): the loss of the output, computed inside the timed forward and back-propagated from, as training does;
    without it the backward starts from a gradient of ones."""
    if is_meta(layer, x):
        raise ProfilingUnavailable("the layer or its input is on the meta device (not materialized)")
    device = flatten(x)[0].device
    timer = Timer(device)
    saved = SavedBytes(layer.parameters())
    peak = [0.0]

    def run(count: bool) -> tuple[Any, float, float]:
        inp = float_leaves(x)
        flush()
        timer.synchronize()
        t0 = timer.mark()
        with saved.hooks() if count else nullcontext(), context():
            out = call_layer(layer, inp)
            check(out)
            value = loss(out) if loss is not None else None
        t1 = timer.mark()
        back = value.backward if value is not None and value.requires_grad else (lambda: backward_ones(out))
        if count:
            peak[0] = backward_peak_bytes(back, layer.parameters(), device)
        else:
            back()
        t2 = timer.mark()
        return _detached(out), timer.elapsed_s(t0, t1), timer.elapsed_s(t1, t2)

    out, _, _ = run(count=True)  # warm-up, and the byte figures
    for _ in range(max(warmup, 1) - 1):
        run(count=False)
    fwd, bwd = zip(*(run(count=False)[1:] for _ in range(max(repeats, 1))))
    return out, statistics.median(fwd), statistics.median(bwd), float(saved.total), peak[0]


class _Loss:
    """The loss the last layer's figures include, checked once on the chain's output at ``x`` (no grad): a loss
    that fails there (or a missing target) is left out of every size alike, ``why`` says why."""

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor] | None, target: Any, layers: Sequence[nn.Module],
                 x: Any, context: Context) -> None:
        self.fn, self.target = fn, target
        self.why = "no loss given" if fn is None else "no target in the sample batch" if target is None else ""
        if self.why or is_meta(layers[-1], x):
            return
        try:
            with torch.no_grad(), training_state_kept(layers), context():
                out = x
                for layer in layers:
                    out = call_layer(layer, out)
                value = fn(out, head(target, rows(x)))
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise TypeError(f"the loss returned {type(value).__name__}, not a one-element tensor")
        except Exception as err:  # noqa: BLE001 - the loss is left out of the profile, not fatal
            self.why = f"left out: it failed on the sample ({type(err).__name__}: {str(err)[:160]})"

    def at(self, m: int) -> Callable[[Any], torch.Tensor] | None:
        if self.why:
            return None
        assert self.fn is not None
        fn, target = self.fn, head(self.target, m)
        return lambda out: fn(out, target).reshape(())


def _detached(out: Any) -> Any:
    return map_tensors(lambda t: t.detach(), out)


#: per layer at the largest size: out bytes, activation bytes, backward peak bytes, the backward's split
Stats = list[tuple[int, float, float, BackwardSplit | None]]


class _Split:
    """The weight-gradient fraction of every layer at one size (``measure``), the seconds it took and why a layer
    has none; a failure leaves that layer's fraction out (the profile's default applies), never the profile."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.failed: dict[str, str] = {}

    def measure(self, i: int, name: str, layer: nn.Module, x: Any, *, context: Context,
                flush: Callable[[], None], loss: Callable[[Any], torch.Tensor] | None) -> BackwardSplit | None:
        t0 = time.perf_counter()
        try:
            return measure_backward_split(layer, x, first=i == 0, context=context, flush=flush, loss=loss)
        except Exception as err:  # noqa: BLE001 - an optional field: the layer keeps the documented default
            cause = err.__cause__ or err  # (torch's split wraps the error in one naming its tensors)
            text = str(cause).strip()
            self.failed[name] = f"{type(cause).__name__}: {text.splitlines()[0][:160] if text else ''}"
            return None
        finally:
            self.seconds += time.perf_counter() - t0


def _time_chain(layers: Sequence[nn.Module], names: Sequence[str], x: Any, repeats: int, warmup: int,
                context: Context, flush: Callable[[], None], loss: Callable[[Any], torch.Tensor] | None = None,
                split: _Split | None = None,
                ) -> tuple[list[tuple[float, float]], Stats]:
    """Every layer in order at one micro-batch size: times, and (out bytes summed over the output's tensors,
    activation bytes, backward peak bytes, weight-gradient fraction: None without ``split``) per layer; ``loss``
    goes with the last layer."""
    times: list[tuple[float, float]] = []
    stats: Stats = []
    for i, (layer, name) in enumerate(zip(layers, names, strict=True)):
        check = partial(check_layer_output, i, name, layer, rows=rows(x))
        try:
            y, fwd_s, bwd_s, act, peak = _measure_layer(layer, x, repeats, warmup, context, check, flush,
                                                        loss if i == len(layers) - 1 else None)
        except UniAPError:
            raise  # the chain contract is broken: an error, not a reason to guess a structural profile
        except ProfilingUnavailable as err:
            raise ProfilingUnavailable(f"layer {i} ({name}): {err}") from err
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            raise ProfilingUnavailable(
                f"layer {i} ({name}) rejected the sample batch ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''})"
            ) from err
        last_loss = loss if i == len(layers) - 1 else None
        frac = split.measure(i, name, layer, x, context=context, flush=flush,
                             loss=last_loss) if split is not None else None
        times.append((fwd_s, bwd_s))
        stats.append((nbytes(y), act, peak, frac))
        x = y
    return times, stats


def profile_layers(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    sample_input: Any,
    *,
    tp_degrees: Sequence[Sequence[int]] | None = None,
    tp_allreduces: Sequence[int] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    micro_batches: Sequence[int] | None = None,
    model: str = "model",
    device: str = "",
    progress: Callable[[str], None] | None = None,
    sync: Callable[[], Any] | None = None,
    context: Context = nullcontext,
    flush_bytes: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
) -> ModelProfile:
    """Profile ``layers`` applied in order to ``sample_input`` (a payload, batch on dim 0) at each of
    ``micro_batches`` sizes, the forward inside ``context`` (the precision's forward context), each timed run
    after ``flush_bytes`` written to evict the caches (None: the device's default; 0: hot caches). With ``loss_fn``
    and ``target`` (a payload with the batch on dim 0, or None) the last layer's figures include the loss - its
    forward, its backward and what it saves - as a training step computes it right after that layer; a loss that
    fails on the sample is left out (``meta["loss"]`` says why).

    ``sync``, when given, is called once before each size, *also after an error* (e.g. a barrier, so that ranks
    profiling together time the same size at the same time; a rank that failed keeps answering the barriers, so
    the others never wait for it). Raises :class:`ProfilingUnavailable` when a layer cannot be run on real tensors
    (meta device, a batch the layer rejects), which :func:`~uniap_lightning.profiling.module.profile_chain` turns
    into the structural fallback, and :class:`UniAPError` when a layer breaks the chain contract.
    """
    n_rows = rows(sample_input)
    sizes = profile_sizes(n_rows, micro_batches)
    t_start = time.perf_counter()
    flush = CacheFlush(flatten(sample_input)[0].device, flush_bytes)
    with_loss = _Loss(loss_fn, target, layers, head(sample_input, sizes[0]), context)
    readings: Readings = {}
    stats: Stats = []  # at the largest size
    split = _Split()
    skipped: dict[int, str] = {}
    failure: Exception | None = None
    with training_state_kept(layers):
        for m in sizes:  # largest last: its outputs give the per-sample byte figures
            if sync is not None:
                sync()
            if failure is not None:
                continue
            try:
                readings[m], size_stats = _time_chain(layers, names, head(sample_input, m), repeats, warmup,
                                                      context, flush, with_loss.at(m),
                                                      split=split if m == n_rows else None)
            except ProfilingUnavailable as err:
                if m == n_rows or "meta device" in str(err):
                    failure = err
                else:
                    skipped[m] = str(err)  # e.g. batch norm refuses one sample: time the other sizes
                continue
            except Exception as err:  # noqa: BLE001 - raised after the remaining syncs
                failure = err
                continue
            if m == n_rows:
                stats = size_stats
            if progress is not None:
                progress(f"timed {len(layers)} layers at micro-batch {m} ({time.perf_counter() - t_start:.1f} s)")
    if failure is not None:
        raise failure
    pool_identical_layers(layers, [s[:2] for s in stats], readings)
    stats = _pooled_stats(layers, stats)
    never_faster_when_larger(readings)
    out = _layer_profiles(layers, names, readings, stats, tp_degrees=tp_degrees, tp_allreduces=tp_allreduces)
    meta = {
        "micro_batch": n_rows, "micro_batches": sorted(readings), "repeats": repeats,
        "timer": Timer(flatten(sample_input)[0].device).name, "cache_flush_bytes": flush.nbytes,
        "loss": with_loss.why or "with the last layer",
        "skipped_micro_batches": {str(m): why for m, why in skipped.items()},
        "profile_seconds": time.perf_counter() - t_start,
        "backward_split": {"micro_batch": n_rows, "seconds": split.seconds, "failed": split.failed},
    }
    return ModelProfile(model=model, layers=out, source="measured", device=device, meta=meta)


def _pooled_stats(layers: Sequence[nn.Module], stats: Stats) -> Stats:
    """Identical layers get the largest backward peak of their group and the medians of its weight-gradient
    fractions and split overheads (the rule of :mod:`.aggregate`; a layer whose split failed takes the group's)."""
    peak: dict[Any, float] = {}
    splits: dict[Any, list[BackwardSplit]] = {}
    keys = [(structure_key(layer), *s[:2]) for layer, s in zip(layers, stats)]
    for key, s in zip(keys, stats):
        peak[key] = max(peak.get(key, 0.0), s[2])
        splits.setdefault(key, [])
        if s[3] is not None:
            splits[key].append(s[3])

    def pooled(group: list[BackwardSplit]) -> BackwardSplit | None:
        if not group:
            return None
        overheads = [q.overhead for q in group if q.overhead is not None]
        return BackwardSplit(statistics.median(q.fraction for q in group),
                             statistics.median(overheads) if overheads else None)

    return [(s[0], s[1], peak[key], pooled(splits[key])) for key, s in zip(keys, stats)]


def _layer_profiles(layers: Sequence[nn.Module], names: Sequence[str], readings: Readings,
                    stats: Stats, *, tp_degrees: Sequence[Sequence[int]] | None,
                    tp_allreduces: Sequence[int] | None) -> list[LayerProfile]:
    """Per-sample figures at the largest size (the sample's rows), with the timings at every size."""
    sizes = sorted(readings)
    rows = sizes[-1]
    out = []
    for i, (layer, name) in enumerate(zip(layers, names)):
        fwd_s, bwd_s = readings[rows][i]
        out_bytes, act_bytes, peak_bytes, split = stats[i]
        out.append(LayerProfile(
            name=name, forward_s=fwd_s / rows, backward_s=bwd_s / rows,
            params=sum(p.numel() for p in layer.parameters()), activation_bytes=act_bytes / rows,
            output_bytes=out_bytes / rows, tp_degrees=tuple(tp_degrees[i]) if tp_degrees else (1,),
            tp_allreduces=int(tp_allreduces[i]) if tp_allreduces else 0,
            timings=tuple(Timing(m, *readings[m][i]) for m in sizes) if len(sizes) > 1 else (),
            param_tensors=sum(1 for p in layer.parameters() if p.requires_grad),
            backward_peak_bytes=peak_bytes / rows,
            weight_grad_fraction=split.fraction if split is not None else None,
            backward_split_overhead=split.overhead if split is not None else None,
            **powersgd_dims(layer),  # PowerSGD pricing (profiling.structural)
        ))
    return out
