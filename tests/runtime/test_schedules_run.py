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


def deep_chain() -> Any:
    """Eight layers (pp=4 x 2 stages per device group), trained like the helpers' four-layer chain."""
    import lightning.pytorch as pl
    from torch import nn

    class Deep(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            blocks = [nn.Sequential(nn.Linear(h.HID, h.HID), nn.Tanh()) for _ in range(6)]
            self.net = nn.Sequential(nn.Linear(h.IN, h.HID), *blocks, nn.Linear(h.HID, h.OUT))
            self.loss_fn = nn.MSELoss()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss_fn(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.loss_fn(self.net(batch[0]), batch[1])
            self.log("val_loss", loss)
            return loss

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Deep()


DEEP = {"module": {"factory": "test_schedules_run:deep_chain"}}
DEEP_NAMES = [f"net.{i}" for i in range(8)]


def PD(schedule: str, *, m: int, v: int = 2, batch: int = 16) -> Any:
    """The eight-layer chain on pp=4 groups of one process, one layer per stage."""
    return h.make_plan([S()] * 8, list(range(8)), pp=4, microbatches=m, schedule=schedule, world=4,
                       virtual_stages=v, names=DEEP_NAMES, batch=batch)


GPT2_TIED = ["model.transformer.wte", "model.transformer.h.0", "model.transformer.h.1", "model.transformer.ln_f"]
TIED = {"module": {"factory": "hf_models:hf_module", "family": "gpt2_tied"},
        "data": {"factory": "hf_models:hf_batches", "family": "gpt2_tied"}}


def PT(schedule: str, *, m: int, v: int = 2, world: int = 2) -> Any:
    """The tied GPT-2, one layer per stage (the V placement puts embedding and head on group 0, the loop on 0 and
    1)."""
    return h.make_plan([S()] * 4, EACH, pp=2, microbatches=m, schedule=schedule, world=world, virtual_stages=v,
                       names=GPT2_TIED)


EVAL = {"limit_val_batches": 2, "predict": True}  # forward-only runs through the same stages

TWO_RANKS = {
    "gpipe": {"plan": P("gpipe", LOOP2, m=2)},
    "1f1b": {"plan": P("1f1b", LOOP2, m=4), **EVAL},
    "zb_h1": {"plan": P("zb_h1", LOOP2, m=4), **EVAL},
    "interleaved_1f1b": {"plan": P("interleaved_1f1b", EACH, m=2, v=2), **EVAL, **ADAM},
    "interleaved_zb": {"plan": P("interleaved_zb", EACH, m=4, v=2), **EVAL},
    "zb_v": {"plan": P("zb_v", EACH, m=2, v=2), **EVAL, **ADAM},
    "dualpipe_v": {"plan": P("dualpipe_v", EACH, m=4, v=2), **EVAL},
    # tied weights under the split backward: copies on one device group (V) and on two (loop)
    "tied_zb_v": {"plan": PT("zb_v", m=2), **TIED},
    "tied_interleaved_zb": {"plan": PT("interleaved_zb", m=2), **TIED},
    # a checkpoint saved under 1f1b (v=1) resumes under interleaved 1F1B (v=2), whose checkpoint resumes under ZB-V
    "ck_uninterrupted": {"plan": P("1f1b", LOOP2, m=2), "epochs": 3, **ADAM},
    "ck_1f1b": {"plan": P("1f1b", LOOP2, m=2), "epochs": 1, "save": "1f1b.ckpt", **ADAM},
    "ck_interleaved": {"plan": P("interleaved_1f1b", EACH, m=2, v=2), "epochs": 2, "resume": "1f1b.ckpt",
                       "save": "interleaved.ckpt", **ADAM},
    "ck_zb_v": {"plan": P("zb_v", EACH, m=2, v=2), "epochs": 3, "resume": "interleaved.ckpt", **ADAM},
    # last (a failed case ends the run): torch's DualPipeV needs microbatches >= stages; refused on every rank
    "bad_dualpipe_microbatches": {"plan": P("dualpipe_v", EACH, m=2, v=2)},
}
CHECKPOINT_CASES = ("ck_uninterrupted", "ck_1f1b", "ck_interleaved", "ck_zb_v", "bad_dualpipe_microbatches")

MIXED = [S(2, 1, Z1, True), S(2, 1, Z2), S(1, 2, REP, True), S(2, 1, Z3, True)]
SPLIT_OK = [S(2, 1, Z1, True), S(2, 1, REP), S(2, 1, Z1), S(2, 1, REP, True)]  # what the split backward runs
FOUR_RANKS = {
    "interleaved_1f1b_pp4": {"plan": PD("interleaved_1f1b", m=4), **DEEP, **EVAL},
    "interleaved_1f1b_mixed": {"plan": P("interleaved_1f1b", EACH, m=2, v=2, world=4, strategies=MIXED),
                               "clip": 0.3, **EVAL},
    "zb_v_mixed": {"plan": P("zb_v", EACH, m=2, v=2, world=4, strategies=SPLIT_OK), "accumulate": 2, **EVAL},
    # last: zero2 under the split backward is refused on every rank, before any collective
    "bad_zb_v_zero2": {"plan": P("zb_v", EACH, m=2, v=2, world=4, strategies=[S(2, 1, Z2)] * 4)},
}


# the bigger matrix, in the slow run: every schedule with the features it runs, four stages per group, compression
POWERSGD = [(2, 1, REP, False, "powersgd")] * 4
FOUR_RANKS_SLOW = {
    **{f"{sched}_mixed": {"plan": P(sched, LOOP2, m=2, world=4, strategies=MIXED), "accumulate": 2, "clip": 0.3}
       for sched in ("gpipe", "1f1b")},
    "interleaved_zb_mixed": {"plan": P("interleaved_zb", EACH, m=4, v=2, world=4, strategies=SPLIT_OK), **EVAL},
    "zb_h1_mixed": {"plan": P("zb_h1", LOOP2, m=2, world=4, strategies=SPLIT_OK), "accumulate": 2},
    "dualpipe_v_mixed": {"plan": P("dualpipe_v", EACH, m=4, v=2, world=4, strategies=SPLIT_OK), "clip": 0.3},
    "zb_v_pp4": {"plan": PD("zb_v", m=4), **DEEP, **EVAL},
    "dualpipe_v_pp4": {"plan": PD("dualpipe_v", m=8, batch=32), **DEEP, "batch": 32},
    "interleaved_zb_pp4": {"plan": PD("interleaved_zb", m=4), **DEEP},
    # lossy (no one-process reference): the same compressor under the split backward trains as without it, on the
    # same placement (PowerSGD's factors depend on which layers a rank holds)
    "powersgd_1f1b": {"plan": P("1f1b", LOOP2, m=2, world=4, strategies=POWERSGD)},
    "powersgd_zb_h1": {"plan": P("zb_h1", LOOP2, m=2, world=4, strategies=POWERSGD)},
    "powersgd_interleaved_1f1b": {"plan": P("interleaved_1f1b", EACH, m=2, v=2, world=4, strategies=POWERSGD)},
    "powersgd_interleaved_zb": {"plan": P("interleaved_zb", EACH, m=2, v=2, world=4, strategies=POWERSGD)},
}
COMPRESSED_PAIRS = [("powersgd_1f1b", "powersgd_zb_h1"), ("powersgd_interleaved_1f1b", "powersgd_interleaved_zb")]
TWO_RANKS_SLOW = {
    "interleaved_1f1b_v4": {"plan": h.make_plan([S()] * 8, list(range(8)), pp=2, microbatches=4,
                                                schedule="interleaved_1f1b", virtual_stages=4, names=DEEP_NAMES),
                            **DEEP, **EVAL},
    "interleaved_zb_v4": {"plan": h.make_plan([S()] * 8, list(range(8)), pp=2, microbatches=2,
                                              schedule="interleaved_zb", virtual_stages=4, names=DEEP_NAMES), **DEEP},
}


def _check(results: list[dict[str, Any]], cases: dict[str, dict[str, Any]]) -> None:
    for name, case in cases.items():
        if name.startswith(("bad_", "ck_", "powersgd_")):
            continue
        ref = h.reference_for(case)
        h.assert_close_to_reference(results, name, ref)
        for r, res in enumerate(results):
            if "val_loss" in ref:
                assert res[name]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5), (name, r)
            if "predictions" in ref:
                torch.testing.assert_close(res[name]["predictions"], ref["predictions"], rtol=1e-5, atol=1e-6)


def _refused_everywhere(results: list[dict[str, Any]], name: str, *needles: str) -> None:
    for r, res in enumerate(results):
        error = res[name].get("error", "")
        assert error.startswith("UniAPError: ") and "\n" not in error, (r, error)
        assert all(n in error for n in needles), (r, error)


def test_every_schedule_two_ranks(spawn_cases: Any) -> None:
    _check(spawn_cases(2, TWO_RANKS, "schedules2"), TWO_RANKS)


def test_checkpoint_resumes_across_schedules_and_virtual_stages(spawn_cases: Any) -> None:
    results = spawn_cases(2, TWO_RANKS, "schedules2")
    for r, res in enumerate(results):
        for name in CHECKPOINT_CASES[:-1]:
            assert "error" not in res[name], (r, name, res[name].get("traceback"))
        full, first, second, third = (res[n]["losses"] for n in CHECKPOINT_CASES[:-1])
        assert len(full) == 12 and len(first) == len(second) == len(third) == 4
        torch.testing.assert_close(torch.tensor(first + second + third), torch.tensor(full), rtol=1e-5, atol=1e-7)
    full, resumed = h.merge_states(results, "ck_uninterrupted"), h.merge_states(results, "ck_zb_v")
    assert set(full) == set(resumed)
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_torch_schedule_requirements_refused_on_every_rank(spawn_cases: Any) -> None:
    _refused_everywhere(spawn_cases(2, TWO_RANKS, "schedules2"), "bad_dualpipe_microbatches", "dualpipe_v",
                        "at least as many microbatches as stages (4)")


def test_schedules_four_ranks_mixed(spawn_cases: Any) -> None:
    _check(spawn_cases(4, FOUR_RANKS, "schedules4"), FOUR_RANKS)


def test_split_backward_refuses_zero2_on_every_rank(spawn_cases: Any) -> None:
    _refused_everywhere(spawn_cases(4, FOUR_RANKS, "schedules4"), "bad_zb_v_zero2", "zb_v", "zero2")


@pytest.mark.slow
def test_schedules_four_ranks_slow(spawn_cases: Any) -> None:
    results = spawn_cases(4, FOUR_RANKS_SLOW, "schedules4_slow")
    _check(results, FOUR_RANKS_SLOW)
    for plain_name, split_name in COMPRESSED_PAIRS:
        for r, res in enumerate(results):
            for name in (plain_name, split_name):
                assert "error" not in res[name], (r, name, res[name].get("traceback"))
            torch.testing.assert_close(torch.tensor(res[split_name]["losses"]), torch.tensor(res[plain_name]["losses"]),
                                       rtol=1e-5, atol=1e-7)
        plain, split = h.merge_states(results, plain_name), h.merge_states(results, split_name)
        for k in plain:
            torch.testing.assert_close(split[k], plain[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_four_stages_per_group_two_ranks_slow(spawn_cases: Any) -> None:
    _check(spawn_cases(2, TWO_RANKS_SLOW, "schedules2_slow"), TWO_RANKS_SLOW)


# ---------------------------------------------------------------------- checks without processes
def _chain() -> Any:
    from uniap_lightning.runtime.chain import extract_chain

    return extract_chain(h.make_module())


@pytest.mark.parametrize("plan, needles", [
    # interleaved schedules: microbatches % max(1, microbatches // pp) == 0 (5 % 2 here)
    (lambda: h.make_plan([S()] * 4, EACH, pp=2, microbatches=5, schedule="interleaved_1f1b", batch=20,
                         virtual_stages=2), ("interleaved_1f1b", "multiple of max(1, microbatches // pp) = 2")),
    (lambda: h.make_plan([S()] * 4, EACH, pp=2, microbatches=5, schedule="interleaved_zb", batch=20,
                         virtual_stages=2), ("interleaved_zb", "multiple of")),
    (lambda: P("dualpipe_v", EACH, m=2, v=2), ("dualpipe_v", "at least as many microbatches as stages (4)")),
    (lambda: P("zb_h1", LOOP2, m=2, world=4, strategies=[S(1, 2)] * 4), ("zb_h1", "tensor parallelism")),
    (lambda: P("interleaved_zb", EACH, m=2, v=2, world=4, strategies=[S(2, 1, Z3)] * 4), ("interleaved_zb", "zero3")),
])
def test_check_plan_executable_refuses_in_one_line(plan: Any, needles: tuple[str, ...]) -> None:
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.runtime import check_plan_executable

    with pytest.raises(UniAPError) as err:
        check_plan_executable(plan(), _chain())
    assert "\n" not in str(err.value) and all(n in str(err.value) for n in needles), str(err.value)


def test_schedules_without_the_split_backward_accept_every_feature() -> None:
    """The checks before any collective accept ZeRO 1/2/3, tensor parallelism and recomputation together under the
    schedules without a split backward (and refuse the same plan under the split-backward schedule of the same
    shape, naming the feature). They run in ``interleaved_1f1b_mixed`` (4 ranks, default) and ``1f1b_mixed`` /
    ``gpipe_mixed`` (slow): both use these strategies."""
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.runtime import check_plan_executable

    strategies = [h.strategy(s) for s in MIXED]
    assert {s.dp_mode for s in strategies} >= {Z1, Z2, Z3} and any(s.tp > 1 for s in strategies)
    assert any(s.recompute for s in strategies)
    for schedule, split, stages, v in (("gpipe", "zb_h1", LOOP2, 1), ("1f1b", "zb_h1", LOOP2, 1),
                                       ("interleaved_1f1b", "interleaved_zb", EACH, 2)):
        plan = P(schedule, stages, m=2, v=v, world=4, strategies=MIXED)
        assert check_plan_executable(plan, _chain()) is None
        assert [lp.strategy for lp in plan.layers] == strategies
        with pytest.raises(UniAPError, match=rf"{split}.*(zero2|zero3|tensor parallelism)") as err:
            check_plan_executable(P(split, stages, m=2, v=v, world=4, strategies=MIXED), _chain())
        assert "\n" not in str(err.value)
    ran = {name: case for name, case in {**FOUR_RANKS, **FOUR_RANKS_SLOW}.items() if name.endswith("_mixed")}
    assert {ran[n]["plan"].schedule for n in ("interleaved_1f1b_mixed", "1f1b_mixed", "gpipe_mixed")} == {
        "interleaved_1f1b", "1f1b", "gpipe"}
    for name in ("interleaved_1f1b_mixed", "1f1b_mixed", "gpipe_mixed"):
        assert [lp.strategy for lp in ran[name]["plan"].layers] == strategies, name


def test_v_schedule_with_three_stages_per_group_is_refused() -> None:
    from uniap_lightning.errors import UniAPError

    with pytest.raises(UniAPError, match="zb_v.*virtual_stages"):
        h.make_plan([S()] * 8, list(range(6)) + [5, 5], pp=2, microbatches=2,
                    schedule="zb_v", virtual_stages=3, names=DEEP_NAMES)


def test_unsupported_matrix() -> None:
    """The rules the planner reads (torch-free): what the split backward refuses, nothing else."""
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.schedule_rules import SPLIT_BACKWARD, unsupported

    refused = {"zero2": Strategy.of(2, 1, Z2), "zero3": Strategy.of(2, 1, Z3),
               "tensor parallelism": Strategy.of(1, 2)}
    allowed = [Strategy.of(1, 1), Strategy.of(2, 1, REP), Strategy.of(2, 1, Z1), Strategy.of(2, 1, REP, True),
               Strategy.of(2, 1, REP, False, "powersgd"), Strategy.of(2, 1, Z1, True, "topk")]
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", *SPLIT_BACKWARD):
        for s in allowed:
            assert unsupported(schedule, s) is None, (schedule, s)
        for feature, s in refused.items():
            reason = unsupported(schedule, s)
            assert (reason is not None) == (schedule in SPLIT_BACKWARD), (schedule, s)
            assert reason is None or (feature in reason and schedule in reason and "\n" not in reason)
