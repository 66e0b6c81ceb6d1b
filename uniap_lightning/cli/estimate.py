"""``uniap train``'s first line: how long setup will measure and the first steps will take (issue 42, item 5).

Said before the other ranks start and before Lightning is imported (seconds after the command; setup's own first
line came 39 s in on a loaded CPU), from the config alone: the analytic model gives each layer's forward FLOPs
and parameters (:func:`~uniap_lightning.planner.analytic.analytic_profile` on a nominal cluster: FLOPs are its
seconds times its rate), a matmul and a cache flush timed with the threads a rank will get give this machine's
rates (:mod:`uniap_lightning.profiling.rates`), and :mod:`uniap_lightning.profiling.estimate` counts the runs.
Setup then says no estimate of its own (:data:`~uniap_lightning.profiling.estimate.SAID`).
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from uniap_lightning.planner.analytic import ModelSpec, analytic_profile
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.profiling.estimate import PROFILE_ROWS, Work, estimate_line, predict
from uniap_lightning.profiling.rates import measure_rates

#: the shipped corpus's vocabulary, ``uniap_lightning.data.VOCAB_SIZE`` (that module imports Lightning, which takes
#: seconds; a test keeps the two equal): `uniap train` builds its GPTs with it, not with the config's ``vocab``
CORPUS_VOCAB = 128
#: steps the line predicts at most (the first ones: what a user waits for before the progress bar moves)
FIRST_STEPS = 10
#: what else shortens the measuring, as `uniap train` takes it
MORE = ("fewer strategy.profile_micro_batches, a shorter data.seq_len, or strategy.profile=FILE (a profile measured "
        "elsewhere; profiles are cached, a second run reuses this one)")


def config_work(cfg: DictConfig) -> Work | None:
    """What setup will measure for a checked `uniap train` config; None when it measures nothing (a pinned plan or
    a profile file)."""
    strategy = cfg.get("strategy") or {}
    if strategy.get("plan") is not None or strategy.get("profile") is not None:
        return None
    model = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(model, dict)
    seq_len = int(cfg.data.seq_len or model["seq_len"])
    spec = ModelSpec.from_dict({**model, "seq_len": seq_len, "vocab": CORPUS_VOCAB})
    nominal = Cluster(name="nominal", nodes=1, devices_per_node=1, memory_gib=1.0, peak_tflops=1.0)
    layers = analytic_profile(spec, nominal).layers
    distinct: dict[Any, tuple[int, tuple[int, ...]]] = {}
    for i, lp in enumerate(layers):  # the analytic blocks are alike where their sizes are
        distinct.setdefault((lp.params, lp.forward_s, lp.tp_degrees), (i, tuple(lp.tp_degrees)))
    devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.num_nodes)
    world = devices * nodes
    batch = int(cfg.data.batch_size)
    measure_cluster = bool(strategy.get("measure_cluster", True)) and world > 1
    max_steps = int(cfg.trainer.max_steps)
    precision = str(cfg.trainer.precision)
    return Work(
        flops=[lp.forward_s * nominal.flops_per_s for lp in layers], params=[lp.params for lp in layers],
        distinct=list(distinct.values()), rows=min(batch, PROFILE_ROWS),
        repeats=max(int(strategy.get("profile_repeats", 3)), 1),
        micro_batches=list(strategy.get("profile_micro_batches") or []) or None, world=world,
        devices_per_node=devices, measure_cluster=measure_cluster and strategy.get("cluster") is None,
        everywhere=measure_cluster, samples_per_rank=batch / world,
        steps=min(max_steps, FIRST_STEPS) if max_steps > 0 else FIRST_STEPS,
        param_bytes=2.0 if precision.endswith("-true") and "16" in precision else 4.0,
    )


def estimate(cfg: DictConfig, *, threads: int) -> str | None:
    """The line for ``cfg`` (checked), each rank computing with ``threads`` threads; None when setup measures
    nothing, or when the estimate fails (it is a courtesy: training goes on without it)."""
    try:
        work = config_work(cfg)
        if work is None:
            return None
        device = "cuda" if str(cfg.trainer.accelerator) in ("gpu", "cuda", "auto") and torch.cuda.is_available() \
            else "cpu"
        rates = measure_rates(device, precision=str(cfg.trainer.precision),
                              threads=threads if device == "cpu" else None,
                              ranks=work.devices_per_node if device == "cpu" else 1)
    except Exception:  # noqa: BLE001 - e.g. a model the analytic model cannot describe
        return None
    repeats = int((cfg.get("strategy") or {}).get("profile_repeats", 3))
    return estimate_line(predict(work, rates), repeats=repeats, override="strategy.profile_repeats=1", more=MORE)
