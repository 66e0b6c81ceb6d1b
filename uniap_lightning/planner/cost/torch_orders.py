"""Torch's own pipeline action lists, built without processes (imports torch when called, not at import: the
planner stays torch-free; the tests check the schedule formulas against it and the plan picture draws it).

``torch_pipeline_order(name, p, v, m)`` constructs torch's real schedule class with stub stages (only the
attributes the constructors read) and returns ``{group: [(kind, microbatch, stage), ...]}`` with kind in
F, B, I, W; None (bubbles) and comm actions are dropped, DualPipeV's OVERLAP_F_B is split into its F then B.
GPipe and 1F1B are ``PipelineScheduleSingle``: their ``pipeline_order`` is only a visualisation (torch 2.13
lists micro-batch m for 1F1B), so their order is the one their ``_step_microbatches`` runs, written out here.
"""

from __future__ import annotations

from uniap_lightning.planner.cost.schedules import SCHEDULES, group_of_stage, stages_of_group


class _Stub:
    def __init__(self, index: int, num_stages: int, p: int, rank: int) -> None:
        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = p
        self.group_rank = rank
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.submod = None


def _single_order(name: str, p: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    order = {}
    for g in range(p):
        if name == "gpipe":
            order[g] = [("F", i, g) for i in range(m)] + [("B", i, g) for i in range(m)]
            continue
        warm = min(m, p - g)  # Schedule1F1B: warmup forwards, then B/F pairs, then the cooldown backwards
        acts = [("F", i, g) for i in range(warm)]
        nf, nb = warm, 0
        while nb < m:
            acts.append(("B", nb, g))
            nb += 1
            if nf < m:
                acts.append(("F", nf, g))
                nf += 1
        order[g] = acts
    return order


def torch_pipeline_order(name: str, p: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """Every group's computation actions under torch's schedule ``name``; raises ValueError where torch refuses."""
    from torch.distributed.pipelining import schedules as ts

    info = SCHEDULES[name]
    if name in ("gpipe", "1f1b"):
        if name == "1f1b" and m < p:
            raise ValueError("Schedule1F1B needs m >= p")  # torch 2.13 checks this in __init__
        return _single_order(name, p, m)
    cls = getattr(ts, info.torch_class)
    stages = [_Stub(k, p * v, p, 0) for k in stages_of_group(0, p, v, info.placement)]
    sched = cls(stages, m)
    ct = ts._ComputationType
    kinds = {ct.FORWARD: "F", ct.FULL_BACKWARD: "B", ct.BACKWARD_INPUT: "I", ct.BACKWARD_WEIGHT: "W"}
    out: dict[int, list[tuple[str, int, int]]] = {}
    for g, acts in sched.pipeline_order.items():
        row = []
        for a in acts:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                kind = kinds.get(sub.computation_type)
                if kind is None:
                    raise RuntimeError(f"torch action {sub!r} is not F/B/I/W: torch's schedule format changed")
                if group_of_stage(sub.stage_index, p, v, info.placement) != g:
                    raise RuntimeError(f"torch put stage {sub.stage_index} on group {g}: placement rule changed")
                row.append((kind, sub.microbatch_index, sub.stage_index))
        out[g] = row
    return out
