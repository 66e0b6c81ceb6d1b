"""A setup error on any rank ends every rank within seconds with that rank's message (2 gloo processes), and
unreadable cache entries are discarded with a warning instead of failing or hanging the job."""

from __future__ import annotations

import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

import uniap_launch
import uniap_rt_helpers as h

SECONDS = 90  # the whole run, start-up of two spawned processes included; a hang would last 1800 s


def _module(fail_rank: int | None) -> Any:
    """The helpers' chain; on ``fail_rank`` one layer's ``uniap_tp_degrees`` raises (an error on one rank only)."""
    module = h.make_module()
    if fail_rank is not None and int(os.environ["LOCAL_RANK"]) == fail_rank:
        def degrees() -> list[int]:
            raise RuntimeError(f"boom on rank {fail_rank}")

        module.net[1].uniap_tp_degrees = degrees
    return module


def _worker(rank: int, world: int, port: int, case: dict[str, Any], out_dir: str, done: Any) -> None:
    import lightning.pytorch as pl

    from uniap_lightning import UniAPStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    if case.get("other_code_rank") == rank:  # as a node with another install of the package would be
        import uniap_lightning.setup.agree as agree

        version, _, torch_version = agree.code_identity()
        agree.code_identity = lambda: (version, "0123456789ab", torch_version)
    start = time.monotonic()
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            strategy = UniAPStrategy(monitor=False, **case.get("strategy", {}))
            trainer = pl.Trainer(devices=world, strategy=strategy, accelerator="cpu", max_steps=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(_module(case.get("fail_rank")), h.make_data(16))
            result["origin"] = strategy.plan_origin
            result["report"] = strategy.setup_report
        except Exception as err:  # noqa: BLE001 - recorded for the test
            result["error"] = f"{type(err).__name__}: {err}"
            result["traceback"] = traceback.format_exc()
    result["warnings"] = [str(w.message) for w in caught]
    result["seconds"] = time.monotonic() - start
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # a failed rank stays alive until every rank is done, as `uniap train`'s launcher (rank 0) does: a peer that
    # still waits in a collective then hangs instead of seeing the connection close
    done.wait(timeout=SECONDS)


def _run(case: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    done = uniap_launch.context().Barrier(2)
    ctx = uniap_launch.start_processes(_worker, args=(2, h.free_port(), case, str(out), done), nprocs=2, join=False)
    for proc in ctx.processes:
        proc.join(SECONDS)
    alive = [r for r, proc in enumerate(ctx.processes) if proc.is_alive()]
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert not alive, f"ranks {alive} still running after {SECONDS} s: setup hangs"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_an_error_on_one_rank_ends_every_rank_with_its_message(tmp_path: Path) -> None:
    results = _run({"fail_rank": 1, "strategy": {"cache_dir": str(tmp_path / "cache")}}, tmp_path)
    for res in results:
        assert res["error"].startswith("UniAPError: UniAP setup failed on rank 1 while "), res
        assert res["error"].endswith("RuntimeError: boom on rank 1"), res
        assert res["seconds"] < SECONDS / 2


def test_a_corrupt_file_read_on_rank_0_ends_every_rank_with_its_message(tmp_path: Path) -> None:
    bad = tmp_path / "profile.json"
    bad.write_bytes(b"\xff\xfe" + os.urandom(256))
    results = _run({"strategy": {"cache_dir": str(tmp_path / "cache"), "profile": str(bad),
                                 "measure_cluster": False}}, tmp_path)
    for res in results:
        assert "UniAP setup failed on rank 0 while choosing a plan" in res["error"], res
        assert str(bad) in res["error"] or "Unicode" in res["error"], res


def test_ranks_running_other_code_are_refused_before_any_other_collective(tmp_path: Path) -> None:
    """Two installs that differ (or sources edited while a job starts) would call other collectives and hang."""
    results = _run({"other_code_rank": 1, "strategy": {"cache_dir": str(tmp_path / "cache")}}, tmp_path)
    for res in results:
        assert "the ranks run different code" in res.get("error", ""), res
        assert "ranks [1]: uniap-lightning" in res["error"] and "sources 0123456789ab" in res["error"]
        assert res["seconds"] < SECONDS


def test_corrupt_cache_entries_are_discarded_with_a_warning_and_rebuilt(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _run({"strategy": {"cache_dir": str(cache)}}, tmp_path)
    assert all("error" not in r for r in first), first[0].get("traceback") or first[1].get("traceback")
    entries = sorted(cache.rglob("*.json"))
    assert {p.name.split("-")[0] for p in entries} == {"cluster", "profile", "plan"}
    for path in entries:
        path.write_bytes(b"\xff\xfe" + os.urandom(128))  # random bytes, not UTF-8
    second = _run({"strategy": {"cache_dir": str(cache)}}, tmp_path)
    for res in second:
        assert "error" not in res, res.get("traceback")
        assert res["origin"] == "solver" and res["report"]["profile_origin"] == "measured"
    # the cluster and profile entries are read again and named; the plan's key then differs (the links and the
    # profile were measured again), so its entry is not read (test_setup_checks covers a corrupt plan entry)
    lead_warnings = " ".join(second[0]["warnings"])
    for path in entries:
        if not path.name.startswith("plan-"):
            assert f"ignoring the cache entry {path}" in lead_warnings, (path, second[0]["warnings"])
