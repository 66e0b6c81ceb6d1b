"""Checkpoints: resume under the same plan (bit-exact), under another plan and on fewer processes (resharded on
load, within 1e-5 of the uninterrupted run), and consolidated single-file exports (live and offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import uniap_rt_helpers as h

ADAM = {"module": {"optimizer": "adam", "lr": 0.01}}  # Adam + StepLR: optimizer and scheduler state must survive
PP2 = h.make_plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2)
OTHER = h.make_plan([(2, 1, True), (1, 2, False), (2, 1, False), (2, 1, True)], [0, 0, 0, 0], pp=1, microbatches=2)
ONE = h.make_plan([(1, 1, False)] * 4, [0, 0, 0, 0], pp=1, microbatches=1, world=1)

CASES = {
    "save": {"plan": PP2, "epochs": 1, "save": "pp2.ckpt", **ADAM},
    "uninterrupted": {"plan": PP2, "epochs": 2, **ADAM},
    "resume_same_plan": {"plan": PP2, "epochs": 2, "resume": "pp2.ckpt", **ADAM},
    "resume_other_plan": {"plan": OTHER, "epochs": 2, "resume": "pp2.ckpt", "export": "full.pt", **ADAM},
    # a plain single-file Lightning checkpoint (one device) loaded into a sharded plan
    "from_single_file": {"plan": OTHER, "validate_only": True, "resume": "single.ckpt", "limit_val_batches": 2},
}


def _single_device_checkpoint(path: Path) -> dict[str, Any]:
    import lightning.pytorch as pl

    module = h.make_module()
    trainer = pl.Trainer(devices=1, **h.trainer_kwargs({"epochs": 1, "limit_val_batches": 2}))
    trainer.fit(module, h.make_data(16), val_dataloaders=h.make_data(16))
    trainer.save_checkpoint(path)
    return {"state": {k: v.clone() for k, v in module.state_dict().items()},
            "val_loss": trainer.validate(module, h.make_data(16))[0]["val_loss"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two-rank save/resume runs, a one-process resume, and a single-device checkpoint to load."""
    out = tmp_path_factory.mktemp("ckpt")
    single = _single_device_checkpoint(out / "single.ckpt")
    two = h.spawn(2, CASES, out)
    for res in two:
        for name, r in res.items():
            assert "error" not in r, f"{name}: {r.get('traceback')}"
    one_out = tmp_path_factory.mktemp("ckpt_one")
    one = h.spawn(1, {"resume_one_process": {"plan": ONE, "epochs": 2, "resume": str(out / "pp2.ckpt"), **ADAM}},
                  one_out)
    assert "error" not in one[0]["resume_one_process"], one[0]["resume_one_process"].get("traceback")
    return two, one, out, single


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


def test_resume_same_plan_is_exact(runs: Any) -> None:
    two, *_ = runs
    full, resumed = h.merge_states(two, "uninterrupted"), h.merge_states(two, "resume_same_plan")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert two[0]["resume_same_plan"]["losses"] == two[0]["uninterrupted"]["losses"][4:]


def test_resume_under_another_plan_reshards(runs: Any) -> None:
    two, *_ = runs
    full = h.merge_states(two, "uninterrupted")
    assert _max_rel(h.merge_states(two, "resume_other_plan"), full) < 1e-5
    torch.testing.assert_close(
        torch.tensor(two[0]["resume_other_plan"]["losses"]), torch.tensor(two[0]["uninterrupted"]["losses"][4:]),
        rtol=1e-5, atol=1e-7,
    )


def test_resume_on_fewer_processes(runs: Any) -> None:
    two, one, *_ = runs
    assert _max_rel(one[0]["resume_one_process"]["state"], h.merge_states(two, "uninterrupted")) < 1e-5


def test_uninterrupted_matches_single_process(runs: Any) -> None:
    two, *_ = runs
    ref = h.reference({"epochs": 2, **ADAM})
    assert _max_rel(h.merge_states(two, "uninterrupted"), ref["state"]) < 1e-5


def test_consolidated_exports(runs: Any, tmp_path: Path) -> None:
    from uniap_lightning.runtime.checkpoint import consolidate_checkpoint

    two, _, out, _ = runs
    live = torch.load(out / "full.pt")
    state = h.merge_states(two, "resume_other_plan")
    assert sorted(live) == sorted(state) and all(torch.equal(live[k], state[k]) for k in state)
    consolidate_checkpoint(out / "pp2.ckpt", tmp_path / "offline.pt")
    offline = torch.load(tmp_path / "offline.pt")
    saved = h.merge_states(two, "save")
    assert sorted(offline) == sorted(saved) and all(torch.equal(offline[k], saved[k]) for k in saved)


def test_single_file_checkpoint_loads_into_a_sharded_plan(runs: Any) -> None:
    two, _, _, single = runs
    assert h.merge_states(two, "from_single_file").keys() == single["state"].keys()
    assert _max_rel(h.merge_states(two, "from_single_file"), single["state"]) == 0.0
    for res in two:
        assert res["from_single_file"]["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_resume_pp2_x_dp2_under_tp2_x_dp2(tmp_path: Path) -> None:
    """The issue's example: saved under pp2 x dp2 (replicated), resumed under dp2 x tp2 (FSDP + TP, one stage)."""
    save = h.make_plan([(2, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2, world=4)
    resume = h.make_plan([(2, 2, True), (2, 2, False), (2, 2, True), (2, 2, False)], [0, 0, 0, 0], pp=1,
                         microbatches=1, world=4)
    cases = {
        "save": {"plan": save, "epochs": 1, "save": "pp2dp2.ckpt", **ADAM},
        "uninterrupted": {"plan": save, "epochs": 2, **ADAM},
        "resume_tp2_dp2": {"plan": resume, "epochs": 2, "resume": "pp2dp2.ckpt", **ADAM},
    }
    results = h.spawn(4, cases, tmp_path)
    for res in results:
        for name, r in res.items():
            assert "error" not in r, f"{name}: {r.get('traceback')}"
    assert _max_rel(h.merge_states(results, "resume_tp2_dp2"), h.merge_states(results, "uninterrupted")) < 1e-5
