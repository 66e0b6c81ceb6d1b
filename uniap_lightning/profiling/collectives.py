"""Profiling the cluster: collective bandwidth and latency per group size on the job's own process group.

Call :func:`measure_collectives` on every rank of an initialized ``torch.distributed`` process group. For each
group size ``p`` (powers of two up to the world size; the first ``p`` consecutive ranks, so a group inside one
node while ``p`` fits a node, and across nodes beyond) it times all-reduce, all-gather, reduce-scatter and
point-to-point (and all-to-all: ``all_to_all_single`` with equal splits, what expert parallelism's dispatch and
combine run) at two message sizes (median of ``repeats`` after a warm-up) and fits the alpha-beta model of
:mod:`uniap_lightning.planner.cost.comm`: ``t(S) = k_lat * alpha + k_bw * S / bw``. Every op's fit becomes the cluster's
``collective_tables`` (:func:`apply_to_cluster`), so the planner prices each collective with its own measured
figures; the all-reduce fit also fills ``bandwidth_tables`` and the flat latencies (display, older readers).
A few seconds on CPU/gloo with the default sizes.

All-gather and reduce-scatter are timed with the calls FSDP2 (``fully_shard``) makes in torch 2.13
(``_fsdp_collectives.py``): ``all_gather_single`` into one flat buffer whose own shard is the input (in place),
and ``reduce_scatter_single`` of the flat gradient buffer with ``ReduceOp.AVG`` (FSDP2's op for fp32/bf16
gradients). ProcessGroupGloo implements the latter as a clone of the whole input, an all-reduce of it and a
copy of the rank's chunk, so on gloo reduce-scatter costs more than all-reduce per byte; that is what FSDP pays.
Older torch (no ``*_single``): ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, as FSDP2 called then.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from uniap_lightning.planner.cluster import COLLECTIVE_OPS, Cluster
from uniap_lightning.planner.plan import COMPRESSION_DEFAULTS
from uniap_lightning.profiling.timing import Timer, median_s
from uniap_lightning.runtime.compression import METHODS, make_compressor

DEFAULT_SIZES = (1 << 12, 1 << 22)  # 4 KiB (latency), 4 MiB (bandwidth)


def _coefficients(op: str, p: int) -> tuple[float, float]:
    """(latency multiplier, bandwidth multiplier) of the ring model for one op over p ranks."""
    if op == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return p - 1, (p - 1) / p
    return 1.0, 1.0  # p2p


def _fit(op: str, p: int, sizes: tuple[int, int], times: tuple[float, float]) -> tuple[float, float]:
    """Solve the two-point alpha-beta system; returns (bandwidth GB/s, latency us), clamped to be positive."""
    k_lat, k_bw = _coefficients(op, p)
    (s1, s2), (t1, t2) = sizes, times
    dt = max(t2 - t1, 1e-9)
    bw = k_bw * (s2 - s1) / dt
    if t2 - t1 < 0.25 * t2:
        # on a noisy machine t2 - t1 can be ~0 or negative, which fits an absurd bandwidth: the two sizes do not
        # separate bandwidth from latency, so read the bandwidth from the large transfer's whole time (a lower bound)
        bw = k_bw * s2 / max(t2, 1e-9)
    alpha = max((t1 - k_bw * s1 / bw) / k_lat, 0.0)
    return bw / 1e9, alpha * 1e6


def _time(fn, repeats: int, group=None) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, each started by a barrier of ``group``
    (default: all ranks), every member of which must call it. Timed with profiling's one :class:`Timer`."""
    # deferred, torch: timing imports torch at module level, and this module's fits (apply_to_cluster,
    # describe_collectives, _fit) load without torch
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return median_s(fn, Timer(device), repeats=repeats, warmup=1, before=lambda: dist.barrier(group=group))


def measure_collectives(
    *, sizes_bytes: tuple[int, int] = DEFAULT_SIZES, repeats: int = 5, devices_per_node: int | None = None
) -> dict[str, Any]:
    """Measure on the default process group (all ranks must call this). Returns, identically on every rank::

        {"world_size": W, "devices_per_node": D,
         "ops": {"all_reduce": {p: {"bw_gbps": ..., "latency_us": ..., "inter_node": bool}}, ...},
         "seconds": total wall time}
    """
    t_start = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    dpn = devices_per_node or world
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sizes = [p for p in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if p <= world]
    groups = {p: dist.new_group(list(range(p))) for p in sizes}  # collective: every rank creates every group
    ops: dict[str, dict[int, dict[str, float]]] = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {},
                                                    "all_to_all": {}, "p2p": {}}
    for p in sizes:
        group = groups[p]
        member = rank < p
        timings: dict[str, list[float]] = {op: [] for op in ops}
        for nbytes in sizes_bytes:
            numel = max(p, nbytes // 4 // p * p)
            full = torch.ones(numel, device=device)
            shard = torch.ones(numel // p, device=device)
            gathered = torch.ones(numel, device=device)
            # FSDP2 gathers in place: the input is this rank's slot of the output (group rank = rank for members)
            own = gathered.narrow(0, min(rank, p - 1) * (numel // p), numel // p)
            for op, fn in (
                ("all_reduce", lambda: dist.all_reduce(full, group=group)),
                ("all_gather", lambda: _all_gather(gathered, own, group)),
                ("reduce_scatter", lambda: _reduce_scatter(shard, full, group)),
                # expert parallelism's dispatch / combine (runtime.experts): equal splits of the whole buffer
                ("all_to_all", lambda: dist.all_to_all_single(gathered, full, group=group)),
            ):
                # only the group's members time it, so the barrier is the group's (a world barrier that only
                # some ranks reach would hang the others, which go on to the next group)
                timings[op].append(_time(fn, repeats, group) if member else 0.0)
            if p == 2:
                timings["p2p"].append(_time(lambda: _ping(full, rank), repeats) / 2)
        for op in ops:
            if timings[op] and member:
                bw, lat = _fit(op, p, tuple(sizes_bytes), tuple(timings[op]))  # type: ignore[arg-type]
                ops[op][p] = {"bw_gbps": bw, "latency_us": lat, "inter_node": p > dpn}
    slot_us = measure_pipeline_slot(repeats=repeats) * 1e6 if world >= 2 else 0.0
    per_param_s, per_tensor_s = measure_optimizer_step(device, repeats=repeats)
    compression = measure_compression(device=device, repeats=repeats)
    result = {"world_size": world, "devices_per_node": dpn, "ops": ops, "pipeline_slot_us": slot_us,
              "optimizer_ns_per_param": per_param_s * 1e9, "optimizer_us_per_tensor": per_tensor_s * 1e6,
              "compression_ns_per_param": compression, "seconds": time.perf_counter() - t_start}
    shared = [result]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def measure_pipeline_slot(*, repeats: int = 3, microbatches: tuple[int, int] = (2, 8)) -> float:
    """Seconds one pipeline slot costs beyond compute and payload (collective: every rank calls it).

    Consecutive rank pairs run a two-stage ``torch.distributed.pipelining`` 1F1B schedule over a tiny layer (all
    pairs at once, as pipelines run side by side in training), with ``microbatches`` micro-batches; the step time
    grows by one slot per extra micro-batch, so the slope is the slot's fixed cost: the schedule's bookkeeping
    and the forward and backward point-to-point handshakes. The slowest pair's figure counts.
    """
    from torch.distributed.pipelining import (  # deferred: torch.distributed.pipelining loads dynamo (~0.4 s)
        PipelineStage, Schedule1F1B)

    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    pairs = [[i, i + 1] for i in range(0, world - 1, 2)]
    groups = [dist.new_group(pair) for pair in pairs]  # collective: every rank creates every group
    mine = rank // 2 if rank // 2 < len(pairs) else None
    times = []
    for c in microbatches:
        if mine is None:
            times.append(0.0)
            continue
        torch.manual_seed(0)
        stage_idx = rank % 2
        stage = PipelineStage(torch.nn.Linear(8, 8).to(device), stage_idx, 2, device, group=groups[mine])
        sched = Schedule1F1B(stage, n_microbatches=c, loss_fn=lambda out, target: out.pow(2).mean())
        x = torch.randn(c, 8, device=device)

        def step() -> None:
            if stage_idx == 0:
                sched.step(x)
            else:
                sched.step(target=torch.zeros(c, 8, device=device))

        times.append(_time(step, repeats, groups[mine]))
    slope = max((times[1] - times[0]) / (microbatches[1] - microbatches[0]), 0.0)
    t = torch.tensor([slope], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _all_gather(out, inp, group) -> None:
    """FSDP2's all-gather: ``all_gather_single`` (torch >= 2.13; ``all_gather_into_tensor`` before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(shard, full, group) -> None:
    """FSDP2's gradient reduce-scatter: ``reduce_scatter_single(op=AVG)`` (``reduce_scatter_tensor`` before 2.13)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        fn(shard, full, op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError, NotImplementedError):  # a backend without AVG: FSDP2 sums and divides
        fn(shard, full, op=dist.ReduceOp.SUM, group=group)


def _ping(buf, rank: int) -> None:
    """Rank 0 <-> 1 round trip (others idle); half of it is one point-to-point transfer."""
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    elif rank == 1:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def apply_to_cluster(cluster: Cluster, measured: dict[str, Any]) -> Cluster:
    """The cluster with every measured op in ``collective_tables``, plus the all-reduce fit as ``bandwidth_tables``
    and flat bandwidths/latencies (inside / across nodes; medians over group sizes)."""
    collective: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    for op, recs in measured["ops"].items():
        if op not in COLLECTIVE_OPS:
            continue
        for p, rec in recs.items():
            scope = "inter" if rec["inter_node"] else "intra"
            collective.setdefault(op, {}).setdefault(scope, {})[int(p)] = {
                "bw_gbps": float(rec["bw_gbps"]), "latency_us": float(rec["latency_us"])}
    tables: dict[str, dict[int, float]] = {"intra": {}, "inter": {}}
    lat: dict[str, list[float]] = {"intra": [], "inter": []}
    for scope, rows in collective.get("all_reduce", {}).items():
        for p, rec in rows.items():
            tables[scope][p] = rec["bw_gbps"]
            lat[scope].append(rec["latency_us"])
    changes: dict[str, Any] = {"bandwidth_tables": {k: v for k, v in tables.items() if v},
                               "collective_tables": collective}
    if measured.get("pipeline_slot_us") is not None:
        changes["pipeline_overhead_us"] = float(measured["pipeline_slot_us"])
    for key in ("optimizer_ns_per_param", "optimizer_us_per_tensor"):
        if measured.get(key) is not None:
            changes[key] = float(measured[key])
    if measured.get("compression_ns_per_param"):
        changes["compression_ns_per_param"] = {m: float(v) for m, v in measured["compression_ns_per_param"].items()}
    if lat["intra"]:
        changes["intra_latency_us"] = statistics.median(lat["intra"])
        changes["intra_bw_gbps"] = statistics.median(tables["intra"].values())
    if lat["inter"]:
        changes["inter_latency_us"] = statistics.median(lat["inter"])
        changes["inter_bw_gbps"] = statistics.median(tables["inter"].values())
    return replace(cluster, **changes)


def measure_optimizer_step(device: Any, *, repeats: int = 5, big: int = 1 << 20, small: int = 1 << 10,
                           tensors: int = 64) -> tuple[float, float]:
    """``(seconds per parameter, seconds per tensor)`` of one ``torch.optim.AdamW`` step (torch's default
    implementation for the device), from two timings: one tensor of ``big`` elements and ``tensors`` tensors of
    ``small`` elements. Timed on every rank at once, as in training (the ranks share the cores or the memory bus);
    the median over ranks. Adam is what large models train with; SGD costs less, so this errs towards the slower
    plan."""
    # deferred, torch: timing imports torch at module level, and this module's fits (apply_to_cluster,
    # describe_collectives, _fit) load without torch
    def step_s(shapes: list[int]) -> float:
        weights = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in shapes]
        for w in weights:
            w.grad = torch.full_like(w, 1e-3)
        optimizer = torch.optim.AdamW(weights, lr=1e-3)
        return median_s(optimizer.step, Timer(torch.device(device)), repeats=repeats, warmup=2, before=dist.barrier)

    one, many = step_s([big]), step_s([small] * tensors)
    # one = t + big * p and many = tensors * t + tensors * small * p, solved for p (per parameter), t (per tensor)
    per_param = max((tensors * one - many) / (tensors * big - tensors * small), 0.0)
    per_tensor = max((one - big * per_param), 0.0)
    mine = torch.tensor([per_param, per_tensor], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return (statistics.median(float(t[0]) for t in everyone), statistics.median(float(t[1]) for t in everyone))


def measure_compression(options: Mapping[str, float] | None = None, *, device: Any = None, repeats: int = 3,
                        rows: int = 1024, cols: int = 1024) -> dict[str, float]:
    """Nanoseconds per gradient element to compress and decompress with each method of
    :mod:`uniap_lightning.runtime.compression` (``powersgd``: per element and unit of rank, the cost model's
    ``time = y * r * numel``), on this host: the runtime's own compressors on one bucket of a ``rows x cols`` fp32
    gradient and a ``rows``-element vector, with ``options`` (default: the plan defaults, PowerSGD rank 1, top-k 1%).

    Collective: every rank calls it, all at once as in training (the cores or the memory bus are shared); each rank
    compresses over a process group of its own, so the collectives inside are the compute-free one-rank ones and
    the figure is the compression's compute (plus one copy of the gradient into the bucket). The median over ranks.
    """
    # deferred, torch: timing imports torch at module level, and this module's fits (apply_to_cluster,
    # describe_collectives, _fit) load without torch
    opts = {**COMPRESSION_DEFAULTS, **dict(options or {})}
    world, rank = dist.get_world_size(), dist.get_rank()
    own = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank creates every group
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    device = torch.device(device)
    grad = torch.randn(rows * cols + rows, generator=torch.Generator().manual_seed(rank)).to(device)
    buffer = torch.empty_like(grad)
    slots = [buffer[: rows * cols].view(rows, cols), buffer[rows * cols:]]
    figures = []
    for method in METHODS:
        compressor = make_compressor(method, opts)

        def run(compressor: Any = compressor) -> None:
            buffer.copy_(grad)
            compressor.start(buffer, slots, own, 1, None).wait()

        seconds = median_s(run, Timer(device), repeats=repeats, warmup=1, before=dist.barrier)
        per_unit = int(opts["powersgd_rank"]) if method == "powersgd" else 1
        figures.append(seconds / grad.numel() / per_unit * 1e9)
    mine = torch.tensor(figures, dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return {m: statistics.median(float(t[i]) for t in everyone) for i, m in enumerate(METHODS)}


def describe_collectives(cluster: Cluster, scope: str = "intra") -> str:
    """One line per op of ``cluster.collective_tables[...][scope]``: ``op: {p: GB/s / us, ...}`` ("" if none)."""
    lines = []
    for op in COLLECTIVE_OPS:
        rows = cluster.collective_tables.get(op, {}).get(scope)
        if rows:
            cells = ", ".join(f"{p}: {r['bw_gbps']:.2f} GB/s / {r['latency_us']:.0f} us"
                              for p, r in sorted(rows.items()))
            lines.append(f"{op}: {{{cells}}}")
    return "\n".join(lines)
