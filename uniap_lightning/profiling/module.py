"""Measure a chain of ``nn.Module`` layers on a real sample micro-batch and return a :class:`ModelProfile`.

Per layer: parameter count, output bytes and saved-activation bytes per sample (from a real forward, counting
the tensors autograd saves for backward, parameters excluded), and forward / backward seconds (median of
``repeats`` timed runs after ``warmup`` untimed ones; made non-decreasing in the micro-batch size, since a
smaller reading at a larger size can only be noise). Times are taken at two or more micro-batch sizes and written
to the profile's ``timings`` field, so the cost model interpolates instead of assuming time linear in the batch
(a CPU or GPU is far from linear at small batches). ``forward_s`` / ``backward_s`` are per sample at the largest
size. Layers of identical structure (type, parameter shapes, output and activation sizes: a transformer's blocks)
get the median of their readings, which evens out a noisy measurement of one of them.

Timing: ``time.perf_counter`` on CPU; on CUDA, CUDA events around each pass (after a synchronize), and the
allocator's peak (``torch.cuda.max_memory_allocated`` minus what was allocated before the layer ran) as the
layer's peak memory, recorded in ``meta["peak_memory_bytes"]`` (``None`` per layer on CPU, where the allocator
keeps no such statistic).

Profiling must not change training: the RNG state and every buffer (e.g. batch-norm statistics) are restored and
gradients are cleared afterwards.

When measuring is impossible (meta-device parameters or input, a batch the model rejects, an empty dataloader),
:func:`profile_chain` falls back to :func:`structural_profile` - parameter counts from the modules, output sizes
from a forward on meta tensors, and times from a nominal FLOP rate - and says so in a warning. Such a profile has
``source="structural"``: enough to plan, not to trust the predicted times.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from uniap_lightning.planner.profile import LayerProfile, ModelProfile, Timing

#: nominal FLOP/s used by the structural fallback (per device), only to rank layers by cost
NOMINAL_FLOPS = {"cpu": 5e10, "cuda": 1e14}


class ProfilingUnavailable(RuntimeError):
    """The layers cannot be timed on this input (meta tensors, rejected batch, ...)."""


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Timer:
    """perf_counter on CPU; CUDA events (with a synchronize) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


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


def structure_key(layer: nn.Module) -> tuple[Any, ...]:
    """Layers with equal keys (type and parameter shapes) compute the same function shape: they cost the same."""
    return (type(layer).__qualname__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()))


def _is_meta(layer: nn.Module, x: Any) -> bool:
    if isinstance(x, torch.Tensor) and x.is_meta:
        return True
    return any(p.is_meta for p in layer.parameters()) or any(b.is_meta for b in layer.buffers())


def _measure_layer(
    layer: nn.Module, x: torch.Tensor, repeats: int, warmup: int = 1
) -> tuple[torch.Tensor, float, float, float, float | None]:
    """Run the layer: (detached output, forward s, backward s, saved activation bytes, peak bytes or None)."""
    if _is_meta(layer, x):
        raise ProfilingUnavailable("the layer or its input is on the meta device (not materialized)")
    param_ptrs = {p.data_ptr() for p in layer.parameters()}
    saved = [0]
    device = x.device
    timer = _Timer(device)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in param_ptrs:
            saved[0] += _tensor_bytes(t)
        return t

    def run(count_saved: bool) -> tuple[torch.Tensor, float, float]:
        inp = x.detach().requires_grad_(x.is_floating_point())
        if timer.cuda:
            torch.cuda.synchronize(device)
        t0 = timer.mark()
        if count_saved:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(inp)
        else:
            out = layer(inp)
        if not isinstance(out, torch.Tensor):
            raise ProfilingUnavailable(f"the layer returned {type(out).__name__}, not one tensor")
        t1 = timer.mark()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        t2 = timer.mark()
        return out.detach(), timer.elapsed(t0, t1), timer.elapsed(t1, t2)

    peak: float | None = None
    if timer.cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    out, _, _ = run(count_saved=True)  # warm-up, the saved-tensor count and (CUDA) the peak
    if timer.cuda:
        peak = float(torch.cuda.max_memory_allocated(device) - before)
    for _ in range(max(warmup, 1) - 1):
        run(count_saved=False)
    fwd, bwd = [], []
    for _ in range(max(repeats, 1)):
        _, f, b = run(count_saved=False)
        fwd.append(f)
        bwd.append(b)
    return out, statistics.median(fwd), statistics.median(bwd), float(saved[0]), peak


def default_micro_batches(rows: int) -> list[int]:
    """Two samples (batch norm refuses one), a quarter of the sample and all of it (fewer when the sample is small):
    plans run anything from a sample or two per device (many micro-batches, wide data parallelism) to the whole
    batch, and a CPU or GPU is least linear at the small end."""
    return sorted({min(2, rows), max(rows // 4, 1), rows})


def profile_layers(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    sample_input: torch.Tensor,
    *,
    tp_degrees: Sequence[Sequence[int]] | None = None,
    tp_allreduces: Sequence[int] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    micro_batches: Sequence[int] | None = None,
    model: str = "model",
    device: str = "",
    progress: Any = None,
    sync: Any = None,
) -> ModelProfile:
    """Profile ``layers`` applied in order to ``sample_input`` (batch on dim 0) at each of ``micro_batches`` sizes.

    ``sync``, when given, is called before each size (e.g. a barrier, so that ranks profiling together time the
    same size at the same time and none of them runs alone while the others wait).

    Raises :class:`ProfilingUnavailable` when a layer cannot be run on real tensors (meta device, a batch the
    layer rejects); :func:`profile_chain` turns that into the structural fallback.
    """
    rows = int(sample_input.shape[0])
    sizes = sorted({int(m) for m in (micro_batches or default_micro_batches(rows)) if 1 <= int(m) <= rows}) or [rows]
    if sizes[-1] != rows:
        sizes.append(rows)
    t_start = time.perf_counter()
    per_size: dict[int, list[tuple[float, float]]] = {}
    stats: list[tuple[int, float, float | None]] = []  # at the largest size: out bytes, act bytes, peak
    skipped: dict[int, str] = {}
    with training_state_kept(layers):
        for m in sizes:  # largest last: its outputs give the per-sample byte figures
            if sync is not None:
                sync()
            x: Any = sample_input[:m]
            times: list[tuple[float, float]] = []
            try:
                for i, (layer, name) in enumerate(zip(layers, names, strict=True)):
                    try:
                        y, fwd_s, bwd_s, act, peak = _measure_layer(layer, x, repeats, warmup)
                    except ProfilingUnavailable as err:
                        raise ProfilingUnavailable(f"layer {i} ({name}): {err}") from err
                    except (RuntimeError, TypeError, ValueError, IndexError) as err:
                        raise ProfilingUnavailable(
                            f"layer {i} ({name}) rejected the sample batch ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''})"
                        ) from err
                    times.append((fwd_s, bwd_s))
                    if m == rows:
                        stats.append((_tensor_bytes(y), act, peak))
                    x = y
            except ProfilingUnavailable as err:
                if m == rows or "meta device" in str(err):
                    raise
                skipped[m] = str(err)  # e.g. batch norm refuses one sample: time the other sizes
                continue
            per_size[m] = times
            if progress is not None:
                progress(f"timed {len(layers)} layers at micro-batch {m} ({time.perf_counter() - t_start:.1f} s)")
    sizes = [m for m in sizes if m in per_size]
    # Layers of the same structure on inputs of the same size cost the same: use the median over them at every
    # size (a transformer's N blocks give N samples of one cost, so a stray reading does not skew one block).
    groups: dict[Any, list[int]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault((structure_key(layer), stats[i][0], stats[i][1]), []).append(i)
    for members in (g for g in groups.values() if len(g) > 1):
        for m in sizes:
            f = statistics.median(per_size[m][i][0] for i in members)
            b = statistics.median(per_size[m][i][1] for i in members)
            for i in members:
                per_size[m][i] = (f, b)
    # A larger micro-batch never takes less time: a smaller reading at a larger size is noise (another process took
    # the core), so each pass's times are made non-decreasing in the size (running maximum, smallest size first).
    for i in range(len(layers)):
        hi_f = hi_b = 0.0
        for m in sizes:
            f, b = per_size[m][i]
            hi_f, hi_b = max(hi_f, f), max(hi_b, b)
            per_size[m][i] = (hi_f, hi_b)
    out: list[LayerProfile] = []
    for i, (layer, name) in enumerate(zip(layers, names)):
        fwd_s, bwd_s = per_size[rows][i]
        out_bytes, act_bytes, _ = stats[i]
        timings = tuple(Timing(m, per_size[m][i][0], per_size[m][i][1]) for m in sizes) if len(sizes) > 1 else ()
        out.append(
            LayerProfile(
                name=name,
                forward_s=fwd_s / rows,
                backward_s=bwd_s / rows,
                params=sum(p.numel() for p in layer.parameters()),
                activation_bytes=act_bytes / rows,
                output_bytes=out_bytes / rows,
                tp_degrees=tuple(tp_degrees[i]) if tp_degrees else (1,),
                tp_allreduces=int(tp_allreduces[i]) if tp_allreduces else 0,
                timings=timings,
            )
        )
    meta = {
        "micro_batch": rows,
        "micro_batches": sizes,
        "repeats": repeats,
        "timer": "cuda_events" if sample_input.device.type == "cuda" else "perf_counter",
        "peak_memory_bytes": [s[2] for s in stats],
        "skipped_micro_batches": {str(m): why for m, why in skipped.items()},
        "profile_seconds": time.perf_counter() - t_start,
    }
    return ModelProfile(model=model, layers=out, source="measured", device=device, meta=meta)


def structural_profile(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    sample_input: torch.Tensor | None,
    *,
    tp_degrees: Sequence[Sequence[int]] | None = None,
    tp_allreduces: Sequence[int] | None = None,
    model: str = "model",
    device: str = "",
    device_type: str = "cpu",
    reason: str = "",
) -> ModelProfile:
    """A profile from the modules' structure alone (no timing): see the module docstring.

    Output bytes come from running the layers on meta tensors shaped like ``sample_input`` (0 where a layer
    cannot run on meta tensors or no input is known); activations are taken as 4x the output (a typical block
    saves a few tensors of its output's size); forward time is ``2 * params * tokens / NOMINAL_FLOPS`` with
    ``tokens`` the output's elements per sample over its last dimension; backward is twice the forward.
    """
    flops = NOMINAL_FLOPS.get(device_type, NOMINAL_FLOPS["cpu"])
    x: Any = None
    if sample_input is not None:
        x = torch.empty(sample_input.shape, dtype=sample_input.dtype, device="meta")
    out: list[LayerProfile] = []
    for i, (layer, name) in enumerate(zip(layers, names, strict=True)):
        params = sum(p.numel() for p in layer.parameters())
        out_bytes, tokens = 0.0, 1.0
        if x is not None:
            try:
                with torch.no_grad():
                    meta_layer = _meta_copy(layer)
                    y = meta_layer(x)
                rows = max(int(y.shape[0]), 1)
                out_bytes = _tensor_bytes(y) / rows
                tokens = y.numel() / rows / max(int(y.shape[-1]), 1) if y.dim() > 1 else 1.0
                x = y
            except Exception:  # noqa: BLE001 - any failure only loses the size estimate
                x = None
        fwd = 2.0 * params * tokens / flops
        out.append(
            LayerProfile(
                name=name, forward_s=fwd, backward_s=2 * fwd, params=params, activation_bytes=4 * out_bytes,
                output_bytes=out_bytes, tp_degrees=tuple(tp_degrees[i]) if tp_degrees else (1,),
                tp_allreduces=int(tp_allreduces[i]) if tp_allreduces else 0,
            )
        )
    return ModelProfile(model=model, layers=out, source="structural", device=device,
                        meta={"fallback_reason": reason, "nominal_flops": flops})


def _meta_copy(layer: nn.Module) -> nn.Module:
    import copy

    if all(p.is_meta for p in layer.parameters()) and all(b.is_meta for b in layer.buffers()):
        return layer
    m = copy.deepcopy(layer)
    return m.to("meta")


def profile_chain(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    sample_input: torch.Tensor | None,
    *,
    tp_degrees: Sequence[Sequence[int]] | None = None,
    tp_allreduces: Sequence[int] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    micro_batches: Sequence[int] | None = None,
    model: str = "model",
    device: str = "",
    progress: Any = None,
    why_no_input: str = "",
    sync: Any = None,
) -> ModelProfile:
    """Measure the chain; when that is impossible, warn and return the structural profile instead (no crash)."""
    kw = dict(tp_degrees=tp_degrees, tp_allreduces=tp_allreduces, model=model, device=device)
    device_type = sample_input.device.type if isinstance(sample_input, torch.Tensor) else "cpu"
    reason = why_no_input or "no sample batch"
    if sample_input is not None:
        try:
            return profile_layers(layers, names, sample_input, repeats=repeats, warmup=warmup,
                                  micro_batches=micro_batches, progress=progress, sync=sync, **kw)
        except ProfilingUnavailable as err:
            reason = str(err)
    warnings.warn(
        f"UniAP could not measure the model ({reason}); planning with a structural profile instead (parameter "
        "counts and output sizes from the modules, times from a nominal FLOP rate). The plan fits memory as far "
        "as the structure tells, but its predicted times are rough; pass profile=<file> for a measured one.",
        stacklevel=2,
    )
    return structural_profile(layers, names, sample_input, device_type=device_type, reason=reason, **kw)


def median_over_ranks(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """One profile from the same chain measured on several ranks at once: every time is the median over the
    ranks (sizes, bytes and the rest from the first). A rank that happened to run alone for a moment, or was
    descheduled, does not decide the plan."""
    first = profiles[0]
    if len(profiles) == 1:
        return first
    med = statistics.median
    layers = []
    for i, lp in enumerate(first.layers):
        peers = [p.layers[i] for p in profiles]
        timings = tuple(
            Timing(t.micro_batch, med(q.timings[j].forward_s for q in peers), med(q.timings[j].backward_s for q in peers))
            for j, t in enumerate(lp.timings)
        ) if all(len(q.timings) == len(lp.timings) for q in peers) else lp.timings
        layers.append(replace(lp, forward_s=med(q.forward_s for q in peers), backward_s=med(q.backward_s for q in peers),
                              timings=timings))
    meta = dict(first.meta)
    meta["ranks_combined"] = len(profiles)
    return ModelProfile(model=first.model, layers=layers, source=first.source, device=first.device, meta=meta)
