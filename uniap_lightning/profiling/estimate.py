"""How long setup's measuring and the first training steps will take, said in one line before anything is measured.

Setup measures in phases (:mod:`uniap_lightning.setup.measure`): the cluster's links, every layer timed at each
profiled micro-batch size (:mod:`.measure`), then, on several ranks, each *distinct* layer timed again under every
TP / FSDP / replication mode it may get (:mod:`.strategies`). A first estimate taken from the first layers' timings
(the earlier design) came too late (a minute into a GPT-2 run) and saw the first phase only. The prediction here
needs no timing of the model: the model's size (forward FLOPs and parameters per layer, from the analytic model or
counted on the meta device) and a quick measurement of this machine (:class:`Rates`: one dense matmul, one cache
flush) priced with the number of runs each phase makes, counted from the same rules the phases follow
(:func:`profile_sizes`, :func:`strategy_kinds`). It is pure arithmetic: no torch, so ``uniap train`` says it within
seconds of the command, before Lightning is even imported.

The constants are calibrated on a CPU by ``benchmarks/profiling_estimate.py`` (predicted vs measured, BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: rows of the sample batch kept for profiling (the largest micro-batch timed; setup.sample takes them)
PROFILE_ROWS = 16
#: the share of the timed matmul's rate a layer's forward and backward reach (attention's softmax, norms, GELU and
#: copies run slower than a matmul, the layer's larger matmuls faster; fitted on a CPU, gpt2_small at sequence 64)
LAYER_EFFICIENCY = 0.9
#: a backward costs this many forwards
BACKWARD = 2.0
#: seconds a timed run costs beside its compute and the cache flush (Python, hooks, the timer, the allocator)
RUN_S = 0.008
#: the same for a run under TP / FSDP / replication beyond a plain run's: hooks, copies and collective latencies
#: (gloo on an idle 2-core CPU: 0.2-0.5 ms each). Where other processes keep the cores busy, the run's small
#: operations wait, and that is :attr:`Rates.op_s` (measured), not this: tiny_gpt's TP/FSDP timing, 2 ranks, took
#: 1.5 s idle and 4.4 s at a 1-minute load of 6-10 (about 180 timed pairs of a plain and a strategy run)
STRATEGY_RUN_S = 0.003
#: small operations (kernels) in a layer's forward and backward, each costing at least :attr:`Rates.op_s`
OPS_PER_RUN = 50
#: seconds setup takes to measure the cluster's links (collectives at two sizes, optimizer step, compression):
#: 0.3-0.5 s on an idle 2-core CPU, 0.9-1.1 s at a 1-minute load of 6-13 (2 ranks, gloo)
CLUSTER_S = 1.0
#: bytes per second a collective moves for large messages, assumed before the links are measured (gloo on a
#: 2-core CPU: 0.2-0.8 GB/s)
LINK_BYTES_PER_S = {"cpu": 3.0e8, "cuda": 5.0e10}
#: bytes an Adam step reads and writes per parameter (weights, gradient, two moments; fp32)
ADAM_BYTES_PER_PARAM = 28
#: how many bytes of parameters each mode moves per timed step, in units of the layer's parameter bytes
_COMM_FACTOR = {"tp": 0.0, "fsdp": 3.0, "dp": 2.0, "zero2": 2.0, "zero1": 2.0}


@dataclass(frozen=True)
class Rates:
    """This machine as one rank sees it: dense matmul FLOP/s, seconds of one cache flush and its bytes per second
    (memory bandwidth), bytes per second of a large collective (assumed, see :data:`LINK_BYTES_PER_S`)."""

    flops_per_s: float
    flush_s: float
    memory_bytes_per_s: float
    link_bytes_per_s: float
    #: seconds of one small operation (a tiny layer's matmul, activation or add): what a run of a small layer costs
    #: per kernel; many times its quiet value where the rank's threads share busy cores
    op_s: float = 0.0


@dataclass(frozen=True)
class Work:
    """What setup will run, from the model's size: per layer forward FLOPs per sample and parameters; the distinct
    layers (timed under the strategies) as (index, its tensor-parallel degrees); the sample's rows, the profiling
    options and the job's shape."""

    flops: Sequence[float]
    params: Sequence[int]
    distinct: Sequence[tuple[int, Sequence[int]]]
    rows: int
    repeats: int = 3
    micro_batches: Sequence[int] | None = None
    world: int = 1
    devices_per_node: int = 1
    measure_cluster: bool = False
    everywhere: bool = False
    samples_per_rank: float = 1.0
    steps: int = 1
    param_bytes: float = 4.0
    warmup: int = 1


@dataclass(frozen=True)
class Prediction:
    """Seconds of each phase of setup's measuring, and of the first ``steps`` training steps."""

    layers_s: float
    strategies_s: float
    cluster_s: float
    steps_s: float
    steps: int

    @property
    def setup_s(self) -> float:
        return self.layers_s + self.strategies_s + self.cluster_s


def default_micro_batches(rows: int) -> list[int]:
    """Two samples (batch norm refuses one), a quarter of the sample and all of it (fewer when the sample is small):
    plans run anything from a sample or two per device (many micro-batches, wide data parallelism) to the whole
    batch, and a CPU or GPU is least linear at the small end."""
    return sorted({min(2, rows), max(rows // 4, 1), rows})


def profile_sizes(rows: int, micro_batches: Sequence[int] | None) -> list[int]:
    """The micro-batch sizes :func:`~uniap_lightning.profiling.measure.profile_layers` times, smallest first."""
    wanted = micro_batches or default_micro_batches(rows)
    sizes = sorted({int(m) for m in wanted if 1 <= int(m) <= rows}) or [rows]
    if sizes[-1] != rows:
        sizes.append(rows)
    return sizes


def strategy_sizes(sizes: Sequence[int]) -> list[int]:
    """The sizes the strategies are timed at: the profile's smallest, middle and largest (interpolated between)."""
    return sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})


def strategy_kinds(world: int, devices_per_node: int, tp_degrees: Sequence[int]) -> list[tuple[str, int]]:
    """The (kind, degree) pairs worth timing for a layer: powers of two that fit the world and (TP, and FSDP
    as measured here) one node."""
    kinds = []
    k = 2
    while k <= min(world, devices_per_node):
        if world % k == 0 and devices_per_node % k == 0:
            if k in tp_degrees:
                kinds.append(("tp", k))
            kinds.append(("fsdp", k))
            kinds.append(("dp", k))
            kinds.append(("zero2", k))
            kinds.append(("zero1", k))
        k *= 2
    return kinds


def predict(work: Work, rates: Rates) -> Prediction:
    """Each phase's seconds: its runs counted as the phase makes them, each run priced as its compute (forward
    and backward FLOPs over the matmul rate times :data:`LAYER_EFFICIENCY`), plus a cache flush and a fixed cost
    per run and :data:`OPS_PER_RUN` small operations (and the parameters' bytes over the link for the sharded and
    replicated modes)."""
    rate = rates.flops_per_s * LAYER_EFFICIENCY
    step = 1.0 + BACKWARD
    fixed, strategy_fixed = RUN_S + OPS_PER_RUN * rates.op_s, STRATEGY_RUN_S + OPS_PER_RUN * rates.op_s

    def run(i: int, m: int) -> float:  # compute seconds of forward + backward of layer i at micro-batch m
        return m * step * work.flops[i] / rate

    sizes = profile_sizes(work.rows, work.micro_batches)
    runs = max(work.repeats, 1) + max(work.warmup, 1)  # the warm-up run also counts the bytes
    layers_s = sizes[0] * sum(work.flops) / rate  # the loss checked on the chain's output
    for m in sizes:
        layers_s += sum(runs * (rates.flush_s + fixed + run(i, m)) for i in range(len(work.flops)))
    # the backward's split into input and weight gradients at the largest size: two more steps, three flushes
    layers_s += sum(2 * run(i, sizes[-1]) + 3 * rates.flush_s for i in range(len(work.flops)))
    strategies_s = 0.0
    if work.everywhere and work.world > 1:
        small = strategy_sizes(sizes)
        strategies_s = small[-1] * sum(work.flops) / rate  # every layer's input at the largest size
        timed = max(work.repeats, 1) + max(work.warmup, 0)
        for i, tp in work.distinct:
            for kind, k in strategy_kinds(work.world, work.devices_per_node, tp):
                if kind != "tp" and kind != "fsdp" and not work.params[i]:
                    continue  # nothing to average: not timed
                comm = _COMM_FACTOR[kind] * work.params[i] * work.param_bytes * (k - 1) / k / rates.link_bytes_per_s
                share = 1.0 / k if kind == "tp" else 1.0
                for m in small:
                    plain = run(i, m) + fixed
                    strategies_s += timed * (plain + run(i, m) * share + strategy_fixed + comm)
    params = sum(work.params)
    one_step = (work.samples_per_rank * step * sum(work.flops) / rate
                + params * ADAM_BYTES_PER_PARAM / rates.memory_bytes_per_s
                + (2 * params * work.param_bytes / rates.link_bytes_per_s if work.world > 1 else 0.0))
    return Prediction(layers_s=layers_s, strategies_s=strategies_s,
                      cluster_s=CLUSTER_S if work.measure_cluster else 0.0,
                      steps_s=work.steps * one_step, steps=work.steps)


def duration(seconds: float) -> str:
    """``"4.2 s"``, ``"42 s"``, ``"3.5 min"``, ``"1.2 h"``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def estimate_line(p: Prediction, *, repeats: int, override: str, more: str = "") -> str:
    """The one line said before setup measures: the whole measuring, by phase, and the first steps; what would
    shorten it, named as the command at hand takes it (``override``: one timed run per size,
    ``strategy.profile_repeats=1`` under ``uniap train``, ``UniAPStrategy(profile_repeats=1)`` in Python);
    ``more``: further ways, as the caller names them."""
    phases = [f"layer timing {duration(p.layers_s)}"]
    if p.strategies_s:
        phases.append(f"TP/FSDP timing {duration(p.strategies_s)}")
    if p.cluster_s:
        phases.append(f"cluster links {duration(p.cluster_s)}")
    fewer = f"{override} (now {repeats}), " if repeats > 1 else ""
    return (f"UniAP: setup will measure for about {duration(p.setup_s)} ({', '.join(phases)}; none of it when a "
            f"cached profile fits), then the first {p.steps} step{'s' if p.steps != 1 else ''} take about "
            f"{duration(p.steps_s)}. To shorten the measuring: {fewer}{more}")


class _Said:
    """Whether the command at hand said the line already (``uniap train`` says it before Lightning starts, and
    setup then does not repeat it)."""

    def __init__(self) -> None:
        self.by_caller = False

    def __enter__(self) -> _Said:
        self.by_caller = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.by_caller = False


#: ``with SAID: ...``: setup says no estimate of its own inside the block
SAID = _Said()
