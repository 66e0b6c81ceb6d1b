"""No plan given: rank 0 profiles and solves, every rank trains the broadcast plan; the plan is cached on disk and
reused. Validation (pipeline ``eval``) and ``trainer.predict`` give the single-process numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import uniap_rt_helpers as h
from uniap_lightning.monitor import UniAPMonitor

PP2 = h.make_plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2, schedule="gpipe")
MIXED = h.make_plan([(2, 1, True), (1, 2, False), (2, 1, False), (1, 2, False)], [0, 0, 0, 0], pp=1, microbatches=2)
EVAL = {"limit_val_batches": 2, "predict": True}


def _profile_file(path: Path) -> Path:
    """A measured profile saved to a file: the strategy plans from it instead of profiling at setup."""
    from uniap_lightning.profiling.module import profile_layers
    from uniap_lightning.planner.profile import save_profile
    from uniap_lightning.runtime import extract_chain

    chain = extract_chain(h.make_module())
    profile = profile_layers(chain.layers, chain.names, torch.randn(16, h.IN), repeats=1, model="from-file")
    save_profile(profile, path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    out = tmp_path_factory.mktemp("planning")
    solver = {"cache_dir": str(out / "cache"), "time_limit": 30}
    profile_file = _profile_file(out / "profile.json")
    cases = {
        "solved": {"strategy": solver, **EVAL},
        "solved_again": {"strategy": solver},
        "from_profile_file": {"strategy": {"cache_dir": str(out / "cache2"), "profile": str(profile_file)}},
        "pp2_eval": {"plan": PP2, **EVAL},
        "mixed_eval": {"plan": MIXED, **EVAL},
        "monitored": {"plan": PP2, "strategy": {"monitor": UniAPMonitor(warmup_steps=1, window=2,
                                                                        metrics_file=out / "measured.json")}},
        # UniAPStrategy(pp=2): the search keeps to that pipeline degree
        "solved_pp2": {"strategy": {"cache_dir": str(out / "cache3"), "time_limit": 30, "pp": 2}},
        "different_batches": {"plan": PP2, "skew_data": True},  # last: it fails on purpose
    }
    results = h.spawn(2, cases, out)
    for res in results:
        for name, r in res.items():
            assert name == "different_batches" or "error" not in r, f"{name}: {r.get('traceback')}"
    return results, cases


def test_solved_plan_trains_like_one_process(runs: Any) -> None:
    results, cases = runs
    assert results[0]["solved"]["origin"] == "solver"
    assert results[0]["solved"]["plan"] == results[1]["solved"]["plan"]  # broadcast: one plan everywhere
    assert results[0]["solved"]["plan"]["model_fingerprint"]
    h.assert_close_to_reference(results, "solved", h.reference_for(cases["solved"]))


def test_solved_plan_is_cached_and_reused(runs: Any) -> None:
    results, _ = runs
    assert results[0]["solved_again"]["origin"].startswith("cache ")
    assert results[1]["solved_again"]["origin"] == results[0]["solved_again"]["origin"]
    assert results[0]["solved_again"]["plan"]["layers"] == results[0]["solved"]["plan"]["layers"]


def test_plan_from_a_profile_file(runs: Any) -> None:
    results, cases = runs
    assert results[0]["from_profile_file"]["origin"] == "solver"
    assert results[0]["from_profile_file"]["plan"]["model"] == "from-file"
    h.assert_close_to_reference(results, "from_profile_file", h.reference_for(cases["from_profile_file"]))


@pytest.mark.parametrize("name", ["solved", "pp2_eval", "mixed_eval"])
def test_validation_and_predict_match_one_process(name: str, runs: Any) -> None:
    results, cases = runs
    ref = h.reference_for(cases[name])
    for res in results:
        assert res[name]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
        torch.testing.assert_close(res[name]["predictions"], ref["predictions"], rtol=1e-5, atol=1e-6)


def test_monitor_gathers_every_rank_without_blocking(runs: Any) -> None:
    """The monitor's gather runs in the background: a window's report appears a batch later, the last one at the
    end of training (5 batches, 1 warm-up, windows of 2: batches 2-3 and 4-5), identical on every rank."""
    results, cases = runs
    h.assert_close_to_reference(results, "monitored", h.reference_for(cases["monitored"]))
    reports = [res["monitored"]["monitor"] for res in results]
    assert reports[0] is not None and reports[0].pop("file").endswith("measured.json")  # rank 0 writes the file
    assert reports[0] == reports[1]
    rep = reports[0]
    assert rep["steps"] == 2 and rep["global_step"] == 5  # the second window, reported at the end of training
    assert len(rep["rank_step_time_s"]) == 2 and all(t > 0 for t in rep["rank_step_time_s"])
    assert rep["tpi_s"] == max(rep["rank_step_time_s"]) and len(rep["stage_peak_memory_bytes"]) == 2


def test_the_pipeline_degree_can_be_restricted(runs: Any) -> None:
    results, cases = runs
    assert results[0]["solved_pp2"]["origin"] == "solver" and results[0]["solved_pp2"]["plan"]["pp"] == 2
    h.assert_close_to_reference(results, "solved_pp2", h.reference_for(cases["solved_pp2"]))


def test_bad_pipeline_degrees_are_refused_before_any_work() -> None:
    from uniap_lightning import UniAPStrategy
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.setup import _check_pipeline_degrees

    assert UniAPStrategy(pp=[4, 2, 2]).setup_options.pp == (2, 4)
    for bad in (0, [], [2, "4"], True, 1.5):
        with pytest.raises(UniAPError, match="must be a pipeline degree from 1 to 16,777,216 or a non-empty list"):
            UniAPStrategy(pp=bad)
    with pytest.raises(UniAPError, match="a pinned plan .* has its own pp"):
        UniAPStrategy(pp=2, plan=PP2)
    _check_pipeline_degrees((1, 2), world_size=4, layers=4)
    with pytest.raises(UniAPError, match=r"pp=\[3\]: 3 is not a pipeline degree for 4 processes and a chain of 4"):
        _check_pipeline_degrees((3,), world_size=4, layers=4)
    with pytest.raises(UniAPError, match="8 is not a pipeline degree for 8 processes and a chain of 4 layers"):
        _check_pipeline_degrees((8,), world_size=8, layers=4)


@pytest.mark.parametrize(("options", "message"), [
    ({"schedule": "1f1b"}, r"^schedule='1f1b' steers the planner's search; a pinned plan \(plan=\) is not searched and "
                           r"has its own schedule: give one of them \(drop schedule= to run the plan, or plan= to "
                           r"solve\)$"),
    ({"virtual_stages": 2}, r"^virtual_stages=2 steers the planner's search; .* has its own virtual_stages"),
    ({"compression": "auto"}, r"^compression='auto' steers .* has each layer's compression"),
    ({"compression_options": {"powersgd_rank": 4}}, r"^compression_options=\{'powersgd_rank': 4\} steers .* has its "
                                                    r"own compression_options \(edit the plan file's\)"),
])
def test_search_options_next_to_a_pinned_plan_are_refused(options: dict[str, Any], message: str) -> None:
    """Each option the pinned plan fixes is refused as pp= is, in one line (it ran the plan's own without a word);
    their defaults pass."""
    from uniap_lightning import UniAPStrategy
    from uniap_lightning.errors import UniAPError

    UniAPStrategy(plan=PP2, schedule="auto", virtual_stages=None, compression="none", compression_options={})
    with pytest.raises(UniAPError, match=message):
        UniAPStrategy(plan=PP2, **options)
    UniAPStrategy(**options)  # without a plan they steer the search


def test_ranks_with_different_batches_are_refused(runs: Any) -> None:
    results, _ = runs
    for res in results:
        assert res["different_batches"]["error"].startswith("UniAPError: ranks received different batches")
