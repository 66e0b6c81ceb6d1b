"""The gradient compressors' state (error feedback, PowerSGD's Q) in checkpoints, on 2 gloo ranks.

Resuming under the same plan continues exactly as the uninterrupted run (within 1e-6); the same resume without the
saved state does not (so the comparison can tell); resuming under another compression layout warns and trains.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from uniap_lightning.planner.decision import Strategy
import uniap_rt_helpers as h

ADAM = {"module": {"optimizer": "adam", "lr": 0.01}}
#: compression from the third optimizer step on (a fixed warm-up: the saving run is shorter than the others)
OPTIONS = {"powersgd_rank": 2, "topk_ratio": 0.2, "start_iter": 2, "start_fraction": 0.0}


def _plan(methods: list[str]) -> Any:
    from uniap_lightning.planner.plan import Plan

    return Plan.from_assignment(
        stage_of_layer=[0] * 4, strategies=[Strategy(2, 1, "replicate", False, m) for m in methods], layer_names=h.NAMES,
        pp=1, microbatches=2, schedule="1f1b", global_batch_size=16, num_devices=2, compression_options=OPTIONS)


SAME = _plan(["powersgd", "topk", "bf16", "powersgd"])
OTHER = _plan(["topk", "powersgd", "none", "topk"])
FIRST = {"save": {"plan": SAME, "epochs": 2, "save": "c.ckpt", **ADAM},  # 8 steps
         "uninterrupted": {"plan": SAME, "epochs": 4, **ADAM}}
SECOND = {"resume": {"plan": SAME, "epochs": 4, "resume": "c.ckpt", **ADAM},
          "resume_without_state": {"plan": SAME, "epochs": 4, "resume": "bare.ckpt", **ADAM},
          "resume_other_plan": {"plan": OTHER, "epochs": 4, "resume": "c.ckpt", **ADAM}}


def _worker(rank: int, world: int, port: int, cases: dict[str, Any], out_dir: str) -> None:
    """uniap_rt_helpers' worker, recording the warnings each case raised."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    os.chdir(out_dir)
    results: dict[str, Any] = {}
    for name, case in cases.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results[name] = h._run_case(rank, world, case, Path(out_dir))
        results[name]["warnings"] = [str(w.message) for w in caught]
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("compression_ckpt")
    first = h.spawn(2, FIRST, out, fn=_worker)
    shutil.copytree(out / "c.ckpt", out / "bare.ckpt")
    shutil.rmtree(out / "bare.ckpt" / "uniap_compression")
    second = h.spawn(2, SECOND, out, fn=_worker)
    files = sorted(p.name for p in (out / "c.ckpt" / "uniap_compression").iterdir())
    return {"runs": [{**a, **b} for a, b in zip(first, second)], "files": files}  # type: ignore[dict-item]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_every_rank_saves_its_own_state(runs: dict[str, Any]) -> None:
    assert runs["files"] == ["rank0.pt", "rank1.pt"]


def test_resume_under_the_same_plan_continues_exactly(runs: dict[str, Any]) -> None:
    two = runs["runs"]
    full, resumed = h.merge_states(two, "uninterrupted"), h.merge_states(two, "resume")
    assert _max_diff(full, resumed) <= 1e-6
    for res in two:  # the resumed epochs' losses are the uninterrupted run's last 8
        assert res["resume"]["losses"] == pytest.approx(res["uninterrupted"]["losses"][8:], abs=1e-6)
        assert not any("compression" in w for w in res["resume"]["warnings"])


def test_resume_without_the_state_differs_and_says_why(runs: dict[str, Any]) -> None:
    two = runs["runs"]
    full, bare = h.merge_states(two, "uninterrupted"), h.merge_states(two, "resume_without_state")
    assert _max_diff(full, bare) > 1e-5  # error feedback matters: the exactness test above can fail
    assert any("zero error feedback" in w and "no compression state" in w
               for w in two[0]["resume_without_state"]["warnings"])


def test_resume_under_another_layout_starts_from_zero_with_a_warning(runs: dict[str, Any]) -> None:
    res = runs["runs"][0]["resume_other_plan"]
    assert "error" not in res, res.get("traceback")
    assert any("zero error feedback" in w and "another plan" in w for w in res["warnings"])
    assert len(res["losses"]) == 8 and all(torch.isfinite(torch.tensor(res["losses"])))
