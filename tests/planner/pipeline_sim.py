"""The two sides the schedule tests compare: the time per iteration the planner prices (``planner_tpi``: the
coefficients of ``cost.pipeline.pipeline_shape`` through ``CandidateCosts.bottleneck_s`` and ``tpi_s``, the very
calls ``cost.evaluate`` makes) and a discrete-event simulation of the order the runtime runs (``simulate``: each
device group runs its actions in the schedule's order, an action waits for the one it depends on on the
neighbouring stage plus half the boundary's hand-off; ``cost.schedules.simulate_blocks``, which imports no formula).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Sequence

from planner_factories import random_problem

from uniap_lightning.planner.cost.schedules import simulate_blocks
from uniap_lightning.planner.cost.tables import CandidateCosts
from uniap_lightning.planner.cost.torch_orders import torch_pipeline_order


@lru_cache(maxsize=None)
def _problem(pp: int):
    return random_problem(0, num_layers=2, nodes=1, per_node=pp)  # only its device count matters here


@lru_cache(maxsize=None)
def _costs(schedule: str, pp: int, v: int, m: int) -> CandidateCosts:
    return CandidateCosts(_problem(pp), pp, m, schedule=schedule, virtual_stages=v)


def planner_tpi(schedule: str, pp: int, v: int, m: int, f: Sequence[float], b: Sequence[float],
                w: Sequence[float], o: Sequence[float], sync: float = 0.0) -> float:
    """What the planner prices for per-stage times ``f, b, w`` (``p_k = f_k + b_k + w_k``), hand-offs ``o`` and the
    largest group's end-of-step ``sync``: the same calls as ``cost.evaluate.evaluate`` on a plan's stage terms."""
    costs = _costs(schedule, pp, v, m)
    p = [x + y + z for x, y, z in zip(f, b, w)]
    groups = [sum(p[k] for k in costs.stages_of(g)) for g in range(pp)]
    return costs.tpi_s(sum(p), sum(o), costs.bottleneck_s(groups, o, p), sync, sum(w), max(w))


def runtime_order(schedule: str, pp: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """The action list the runtime runs: torch's own order (1F1B below ``pp`` micro-batches runs as GPipe)."""
    return torch_pipeline_order("gpipe" if schedule == "1f1b" and m < pp else schedule, pp, v, m)


def simulate(order: Mapping[int, Sequence], f: Sequence[float], b: Sequence[float], w: Sequence[float],
             o: Sequence[float]) -> tuple[float, dict[int, float]]:
    """Makespan and per-group busy time of an action list, by discrete events."""
    busy = {g: 0.0 for g in order}
    end = 0.0
    for g, _kind, _mb, _k, start, dur in simulate_blocks(order, f, b, w, o):
        busy[g] += dur
        end = max(end, start + dur)
    return end, busy
