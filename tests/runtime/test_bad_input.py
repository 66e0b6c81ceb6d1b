"""Bad input fails with a clear UniAPError before anything can hang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import uniap_rt_helpers as h
from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.chain import extract_chain
from uniap_lightning.runtime.pipeline import lane_slice
from uniap_lightning.runtime.planning import check_plan_matches
from uniap_lightning.runtime.tensor_parallel import check_tp_supported


def _lm(**attrs: Any) -> Any:
    import lightning.pytorch as pl

    module = pl.LightningModule()
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


# ---------------------------------------------------------------------------------------------- the model contract
def test_model_that_is_not_a_chain_is_refused() -> None:
    with pytest.raises(UniAPError, match="not a chain.*found no nn.Sequential.*adapter"):
        extract_chain(_lm(body=nn.Linear(2, 2), loss_fn=nn.MSELoss()))
    with pytest.raises(UniAPError, match="found 2 nn.Sequential attributes \\(a, b\\)"):
        extract_chain(_lm(a=nn.Sequential(nn.Linear(2, 2)), b=nn.Sequential(nn.Linear(2, 2)), loss_fn=nn.MSELoss()))


def test_model_without_loss_is_refused() -> None:
    with pytest.raises(UniAPError, match="uniap_loss\\(output, target\\) or a loss_fn"):
        extract_chain(_lm(net=nn.Sequential(nn.Linear(2, 2))))


def test_tied_and_stray_parameters_are_refused() -> None:
    emb, head = nn.Linear(4, 4), nn.Linear(4, 4)
    head.weight = emb.weight
    with pytest.raises(UniAPError, match="share a parameter \\(tied weights\\)"):
        extract_chain(_lm(net=nn.Sequential(emb, head), loss_fn=nn.MSELoss()))
    with pytest.raises(UniAPError, match="outside the chain.*extra"):
        extract_chain(_lm(net=nn.Sequential(nn.Linear(2, 2)), extra=nn.Linear(2, 2), loss_fn=nn.MSELoss()))


def test_bad_batch_layout_is_refused() -> None:
    chain = extract_chain(_lm(net=nn.Sequential(nn.Linear(2, 2)), loss_fn=nn.MSELoss()))
    with pytest.raises(UniAPError, match="expects \\(input, target\\).*uniap_split_batch"):
        chain.split_batch({"x": torch.zeros(2, 2)})


def test_layer_without_tensor_parallel_plan_is_refused() -> None:
    with pytest.raises(UniAPError, match="layer 'net.0' \\(Conv1d\\) has no tensor-parallel plan.*tp=2"):
        check_tp_supported(nn.Conv1d(2, 2, 1), "net.0", 2)
    with pytest.raises(UniAPError, match="supports tp in \\[1, 3\\]"):
        check_tp_supported(nn.Linear(2, 3), "net.1", 2)


# ---------------------------------------------------------------------------------------------- plans and batches
def test_plan_for_another_model_or_world_is_refused() -> None:
    plan = h.make_plan([(2, 1, False)] * 4, [0, 0, 0, 0], pp=1, microbatches=1)
    check_plan_matches(plan, h.NAMES, world_size=2, profile=None)
    with pytest.raises(UniAPError, match="num_devices=2 processes but the job has 4"):
        check_plan_matches(plan, h.NAMES, world_size=4, profile=None)
    with pytest.raises(UniAPError, match="plan has 4 layers but the model's chain has 3"):
        check_plan_matches(plan, h.NAMES[:3], world_size=2, profile=None)
    with pytest.raises(UniAPError, match="first mismatch: plan 'net.0' vs model 'body.0'"):
        check_plan_matches(plan, ["body.0", "body.1", "body.2", "body.3"], world_size=2, profile=None)


def test_plan_fingerprint_from_another_model_is_refused() -> None:
    from uniap_lightning.profiling.module import profile_layers

    module = h.make_module()
    chain = extract_chain(module)
    profile = profile_layers(chain.layers, chain.names, torch.randn(4, h.IN), repeats=1)
    plan = h.make_plan([(2, 1, False)] * 4, [0, 0, 0, 0], pp=1, microbatches=1)
    from dataclasses import replace

    plan = replace(plan, model_fingerprint=profile.fingerprint())
    check_plan_matches(plan, h.NAMES, world_size=2, profile=profile)
    plan = replace(plan, model_fingerprint="0123456789abcdef")
    with pytest.raises(UniAPError, match="model_fingerprint 0123456789abcdef differs"):
        check_plan_matches(plan, h.NAMES, world_size=2, profile=profile)


def test_profiling_leaves_the_model_unchanged() -> None:
    from uniap_lightning.profiling.module import profile_layers

    module = h.make_module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    chain = extract_chain(module)
    x = torch.randn(4, h.IN)
    rng = torch.get_rng_state()
    profile = profile_layers(chain.layers, chain.names, x, repeats=2)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert [lp.name for lp in profile.layers] == h.NAMES and profile.layers[1].params == 2 * (16 * 32) + 32 + 16
    assert profile.layers[0].output_bytes == 16 * 4


def test_batch_not_divisible_by_microbatches_times_dp() -> None:
    plan = h.make_plan([(2, 1, False)] * 4, [0, 0, 0, 0], pp=1, microbatches=2, batch=16)
    assert lane_slice(torch.arange(16), plan, 1).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    with pytest.raises(UniAPError, match="batch of 10 samples cannot be split into microbatches=2 x 2 devices"):
        lane_slice(torch.zeros(10, 3), plan, 0)


def test_pinned_plan_file_checks(tmp_path: Path) -> None:
    from uniap_lightning.strategy import UniAPStrategy

    with pytest.raises(UniAPError, match="does not exist"):
        UniAPStrategy(plan=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pp": 1}))
    with pytest.raises(UniAPError, match="missing or has a malformed field"):
        UniAPStrategy(plan=bad)
    with pytest.raises(UniAPError, match="schedule='zb' must be one of"):
        UniAPStrategy(schedule="zb")
    with pytest.raises(UniAPError, match="schedule='zb_v' runs with virtual_stages 2, got 3"):
        UniAPStrategy(schedule="zb_v", virtual_stages=3)
    with pytest.raises(UniAPError, match="virtual_stages=0 must be an integer from 1 to 64"):
        UniAPStrategy(schedule="auto", virtual_stages=0)
    with pytest.raises(UniAPError, match="solver='glpk' must be one of"):
        UniAPStrategy(solver="glpk")
    with pytest.raises(UniAPError, match="time_limit=0: give the search's time limit in seconds, a number > 0"):
        UniAPStrategy(time_limit=0)
    with pytest.raises(UniAPError, match="cluster config is missing"):
        UniAPStrategy(cluster={"name": "x"})


# ---------------------------------------------------------------------------------------------- through the Trainer
def test_world_size_not_matching_pinned_plan(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from uniap_lightning.strategy import UniAPStrategy

    path = tmp_path / "plan.json"
    h.make_plan([(2, 1, False)] * 4, [0, 0, 0, 0], pp=1, microbatches=1).to_json(path)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=UniAPStrategy(plan=path), logger=False,
                         enable_checkpointing=False, max_steps=1)
    with pytest.raises(UniAPError, match="pinned plan is for num_devices=2 processes but the Trainer has 1"):
        trainer.fit(h.make_module(), h.make_data(16))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1", "SLURM_NTASKS": "4"},
         "devices=2\\) but SLURM runs 4 tasks"),
        ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "4"},
         "num_nodes=1\\) but SLURM allocated 2"),
    ],
)
def test_devices_disagreeing_with_slurm(env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl

    from uniap_lightning.strategy import UniAPStrategy

    base = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "1234",
            "SLURM_NODELIST": "localhost", "SLURM_JOB_NAME": "train"}
    for k, v in {**base, **env}.items():
        monkeypatch.setenv(k, v)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=UniAPStrategy(), logger=False, max_steps=1)
    with pytest.raises(UniAPError, match=message):
        trainer.fit(h.make_module(), h.make_data(16))


def test_rank_dying_mid_step_gives_clear_error_on_survivors(tmp_path: Path) -> None:
    plan = h.make_plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2)
    cases = {"die": {"plan": plan, "die_at": 2, "strategy": {"timeout_s": 30}}}
    codes = h.spawn_and_watch(2, cases, tmp_path, timeout_s=120)
    assert codes[1] == 17, codes  # the rank that died
    assert codes[0] == 0, codes  # the survivor finished by itself (with an error recorded): it did not hang
    survivor = torch.load(tmp_path / "rank0.pt", weights_only=False)["die"]
    assert survivor["error"].startswith("UniAPError: rank 0: a collective or pipeline transfer failed")
    assert "Another rank probably died" in survivor["error"]


def test_rank_dying_while_a_checkpoint_is_written_gives_clear_error_and_no_checkpoint(tmp_path: Path) -> None:
    plan = h.make_plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2)
    cases = {"save": {"plan": plan, "steps": 2, "save": "run.ckpt", "die_while_saving": True, "die_rank": 0,
                      "strategy": {"timeout_s": 30}}}
    codes = h.spawn_and_watch(2, cases, tmp_path, timeout_s=120)
    assert codes[0] == 17, codes  # the launcher-like rank killed mid-save
    assert codes[1] == 0, codes  # the survivor ended with an error recorded, it did not hang
    survivor = torch.load(tmp_path / "rank1.pt", weights_only=False)["save"]
    assert survivor["error"].startswith("UniAPError: rank 1: a collective or pipeline transfer failed"), survivor
    assert not (tmp_path / "run.ckpt").exists()  # nothing half-written under the checkpoint's name


@pytest.mark.slow
def test_stuck_rank_times_out_with_clear_error(tmp_path: Path) -> None:
    plan = h.make_plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2)
    cases = {"hang": {"plan": plan, "die_at": 2, "hang_s": 40.0, "strategy": {"timeout_s": 5}}}
    h.spawn_and_watch(2, cases, tmp_path, timeout_s=120)
    survivor = torch.load(tmp_path / "rank0.pt", weights_only=False)["hang"]
    assert survivor["error"].startswith("UniAPError: rank 0: a collective or pipeline transfer failed")
    assert "Timed out" in survivor["error"]
    assert survivor["failed_after_s"] < 40.0  # gave up after the 5 s timeout, not when the stuck rank woke up


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_batch(tmp_path: Path) -> None:
    """A SIGTERM that reaches rank 1 only (Lightning heeds rank 0's alone, and rank 1 would leave rank 0 waiting in
    the next collective) stops both ranks at the start of the second batch after it, agreed without a per-batch
    barrier (uniap_lightning.sigterm)."""
    plan = h.make_plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2)
    cases = {"term": {"plan": plan, "steps": 8, "sigterm_at": 2, "strategy": {"timeout_s": 30}}}
    codes = h.spawn_and_watch(2, cases, tmp_path, timeout_s=120)
    assert codes == {0: 0, 1: 0}, codes
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["term"] for r in range(2)]
    for r, res in enumerate(results):
        assert "error" not in res, (r, res.get("traceback"))
        assert res["stopped"] == "SIGTERMException", res
        assert res["received_sigterm"] is True, res
        # signal after batch 2 -> sent with batch 3's exchange -> read at the start of batch 4: 4 steps done
        assert res["global_step"] == 4, (r, res)
        assert len(res["losses"]) == 4, (r, res)


def test_sigterm_in_the_first_step_stops_every_rank_with_a_checkpoint_step(tmp_path: Path) -> None:
    """The first batch is the earliest a SIGTERM can be agreed on (Lightning's handler is registered just before
    it): signal at the end of batch 0 -> sent with batch 1's exchange -> read at the start of batch 2."""
    plan = h.make_plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2)
    cases = {"term": {"plan": plan, "steps": 8, "sigterm_at": 0, "strategy": {"timeout_s": 30}}}
    codes = h.spawn_and_watch(2, cases, tmp_path, timeout_s=120)
    assert codes == {0: 0, 1: 0}, codes
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["term"]
        assert res.get("stopped") == "SIGTERMException" and res["global_step"] == 2, (r, res)


def test_sigterm_during_setup_ends_every_rank_within_the_guard(tmp_path: Path) -> None:
    """Before Lightning registers its handlers (profiling, solving, wrapping) a SIGTERM used to kill the rank with
    the default action (-15, no message) and leave the others in a collective until the timeout. Now the signalled
    rank stops with status 143 and the other fails at its next collective with the guard's error."""
    cases = {"term": {"steps": 4, "sigterm_in_setup": True, "strategy": {"timeout_s": 60}}}
    codes = h.spawn_and_watch(2, cases, tmp_path, timeout_s=200)
    assert codes == {0: 0, 1: 0}, codes  # both ended by themselves (the watcher kills the ones still running)
    stopped = torch.load(tmp_path / "rank1.pt", weights_only=False)["term"]
    assert stopped.get("stopped") == "StoppedBySigterm" and stopped["global_step"] == 0, stopped
    survivor = torch.load(tmp_path / "rank0.pt", weights_only=False)["term"]
    assert "Another rank probably died" in survivor.get("error", ""), survivor
    assert "Timed out" not in survivor["error"], survivor  # the peer's exit was seen at once, not at timeout_s
