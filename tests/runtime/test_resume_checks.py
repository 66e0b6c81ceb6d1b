"""A resumed checkpoint's loop state is checked before training continues (uniap_lightning.runtime.resume_checks):
the Lightning version it names must be one Lightning can upgrade it from, and its counters must agree with each
other and with the run's data. Every state a real Lightning fit writes passes (saved mid-epoch, at an epoch's end,
after validation, after the fit, and again after a resume); a counter altered by hand is one line naming it, in
the library (``UniAPStrategy.load_checkpoint``) and in `uniap train` (``check_resume``) before any rank starts."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.resume_checks import check_lightning_version, check_resume_counters

BATCHES = "epoch_loop.batch_progress"


def _fit_states(n: int, accumulate: int, steps: int, tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The loop state of every hook a checkpoint can be written from, in a fit of ``steps`` optimizer steps over a
    loader of ``n`` batches, and in a fit resumed from the middle of the first one."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch: Any, _: int) -> None:
            return None

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    states: list[tuple[str, dict[str, Any]]] = []

    class Grab(pl.Callback):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def grab(self, trainer: Any, hook: str) -> None:
            meta = trainer._checkpoint_connector.dump_checkpoint()
            states.append((f"{self.tag} {hook} at step {trainer.global_step}",
                           {k: v for k, v in meta.items() if k not in ("state_dict", "optimizer_states")}))

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:  # where a SIGTERM stops the fit
            self.grab(trainer, "on_train_batch_start")

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            self.grab(trainer, "on_train_batch_end")
            if self.tag == "first" and trainer.global_step == 2 and not (tmp_path / "mid.ckpt").exists():
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

        def on_train_epoch_end(self, trainer: Any, *_: Any) -> None:
            self.grab(trainer, "on_train_epoch_end")

        def on_validation_end(self, trainer: Any, *_: Any) -> None:
            if not trainer.sanity_checking:
                self.grab(trainer, "on_validation_end")

    data = DataLoader(TensorDataset(torch.randn(4 * n, 2)), batch_size=4)
    kw = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              accumulate_grad_batches=accumulate, val_check_interval=2, num_sanity_val_steps=0, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tag, extra, ckpt in (("first", {"max_steps": steps}, None),
                                 ("resumed", {"max_steps": steps + 3}, tmp_path / "mid.ckpt")):
            trainer = pl.Trainer(callbacks=[Grab(tag)], **kw, **extra)
            trainer.fit(Tiny(), data, data, ckpt_path=ckpt)
            trainer.save_checkpoint(tmp_path / f"{tag}.ckpt")
            last = torch.load(tmp_path / f"{tag}.ckpt", weights_only=False)
            states.append((f"{tag} after the fit", {k: v for k, v in last.items() if k != "state_dict"}))
    return states


@pytest.fixture(scope="module")
def fit_states(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], list[tuple[str, dict]]]:
    return {(n, acc): _fit_states(n, acc, steps, tmp_path_factory.mktemp(f"fit{n}x{acc}"))
            for n, acc, steps in ((3, 1, 7), (4, 3, 5))}


def test_every_state_lightning_writes_passes(fit_states: dict) -> None:
    from uniap_lightning.runtime.checkpoint_safety import check_meta

    for (n, accumulate), states in fit_states.items():
        assert len(states) > 20
        for where, meta in states:
            check_meta(meta, where)
            check_resume_counters(check_lightning_version(meta, where), where, batches_per_epoch=n,
                                  accumulate=accumulate)


def _mid_epoch(fit_states: dict) -> dict[str, Any]:
    """A checkpoint written in the second epoch (3 batches an epoch, no accumulation), at its first batch."""
    return copy.deepcopy(next(m for w, m in fit_states[(3, 1)] if w == "first on_train_batch_end at step 4"))


def _set(meta: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = meta["loops"]["fit_loop"]
    *parents, last = path.split("/")
    for key in parents:
        node = node[key]
    node[last] = value
    return meta


def _batch_counter(meta: dict[str, Any], value: int) -> dict[str, Any]:
    """What a hand edit of "the batch counter" does: every stage of the current epoch's count."""
    for stage in ("ready", "started", "processed", "completed"):
        _set(meta, f"{BATCHES}/current/{stage}", value)
    return meta


@pytest.mark.parametrize(("edit", "message"), [
    # the hostile case: 1e9 passes the 2**53 bound, and the data module would skip 1e9 batches of the epoch
    (lambda m: _batch_counter(m, 10**9),
     "is beyond the run's (epoch_loop.batch_progress.total.ready=4)"),
    (lambda m: _batch_counter(_set(m, f"{BATCHES}/total/processed", 10**9), 10**9),
     "epoch_loop.batch_progress.total: ready=4, started=4, processed=1,000,000,000, completed=3) are out of order"),
    (lambda m: m.update(epoch=10**9) or m,
     "epoch=1,000,000,000 but the fit loop counts 1 epochs (loops.fit_loop.epoch_progress.current.completed)"),
    (lambda m: _set(m, f"{BATCHES}/current/started", 0), "epoch_loop.batch_progress.current: ready=1, started=0"),
    (lambda m: m.update(global_step=10**9) or m, "global_step=1,000,000,000 optimizer steps but only 4 batches trained "
                                                 "(epoch_loop.batch_progress.total.processed)"),
    (lambda m: _set(m, f"{BATCHES}/total/completed", "3"), "epoch_loop.batch_progress.total.completed is missing or "
                                                          "not a count"),
])
def test_counters_that_disagree_with_each_other_are_refused(fit_states: dict, edit: Any, message: str) -> None:
    meta = edit(_mid_epoch(fit_states))
    with pytest.raises(UniAPError) as err:
        check_resume_counters(meta, "run/meta.pt")
    assert str(err.value).startswith("run/meta.pt: ") and message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def _all_batches(meta: dict[str, Any], total: int, current: int) -> dict[str, Any]:
    for stage in ("ready", "started", "processed", "completed"):
        _set(meta, f"{BATCHES}/total/{stage}", total)
        _set(meta, f"{BATCHES}/current/{stage}", current)
    return meta


@pytest.mark.parametrize(("edit", "n", "accumulate", "message"), [
    # consistent with each other (10**9 batches into the epoch, as many more in all), but beyond an epoch of 3
    (lambda m: _all_batches(m, 10**9 + 3, 10**9), 3, 1, "the current epoch's batch counter "
     "(epoch_loop.batch_progress.current.processed=1,000,000,000) is beyond the 3 batches an epoch of this run's data"),
    # the checkpoint of a run with 3 batches an epoch, resumed with 5 (another data.batch_size)
    (lambda m: m, 5, 1, "do not add up to epoch=1 epochs of the 5 batches this run's data has"),
    # the same run resumed with accumulate_grad_batches=2
    (lambda m: m, 3, 2, "global_step=4 but 4 batches at 3 per epoch with accumulate_grad_batches=2 make 2 optimizer "
     "steps"),
])
def test_counters_that_disagree_with_the_data_are_refused(fit_states: dict, edit: Any, n: int, accumulate: int,
                                                         message: str) -> None:
    meta = edit(_mid_epoch(fit_states))
    check_resume_counters(meta, "run/meta.pt")  # consistent in themselves: only the data tells
    with pytest.raises(UniAPError) as err:
        check_resume_counters(meta, "run/meta.pt", batches_per_epoch=n, accumulate=accumulate)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(("version", "message"), [
    ("0.0.1", "pytorch-lightning_version is '0.0.1', but the loop state is not that version's: Lightning's upgrade "
              "from it fails (KeyError"),
    ("soon", "pytorch-lightning_version is 'soon', not a version number"),
    (None, "pytorch-lightning_version is None, not the version of Lightning that wrote the checkpoint"),
    (2.6, "pytorch-lightning_version is 2.6, not the version"),
])
def test_an_unusable_lightning_version_is_refused(fit_states: dict, version: Any, message: str) -> None:
    meta = _mid_epoch(fit_states)
    assert check_lightning_version(meta, "run/meta.pt") is meta  # this Lightning's own: nothing to upgrade
    meta["pytorch-lightning_version"] = version
    if version is None:
        del meta["pytorch-lightning_version"]
    with pytest.raises(UniAPError) as err:
        check_lightning_version(meta, "run/meta.pt")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    newer = dict(_mid_epoch(fit_states), **{"pytorch-lightning_version": "99.0"})
    assert check_lightning_version(newer, "run/meta.pt") is newer  # Lightning only warns about a newer one


def test_the_strategy_refuses_them_when_lightning_restores(fit_states: dict, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``Trainer.fit(ckpt_path=...)`` under UniAPStrategy: the version is refused before Lightning's upgrade of the
    loop state raises a KeyError on every rank, and the counters before the fit loop resumes from them."""
    import uniap_lightning.runtime.checkpoint as checkpoint
    from uniap_lightning.strategy import UniAPStrategy

    meta = _mid_epoch(fit_states)
    monkeypatch.setattr(checkpoint, "load_any", lambda *a, **k: meta)  # the weights are not the point here
    assert UniAPStrategy().load_checkpoint(tmp_path / "a.ckpt") is meta
    meta["pytorch-lightning_version"] = "0.0.1"
    with pytest.raises(UniAPError, match=r"a.ckpt: pytorch-lightning_version is '0.0.1'"):
        UniAPStrategy().load_checkpoint(tmp_path / "a.ckpt")
    meta = _batch_counter(_mid_epoch(fit_states), 10**9)
    with pytest.raises(UniAPError, match=r"a.ckpt: the current epoch's batch counter"):
        UniAPStrategy().load_checkpoint(tmp_path / "a.ckpt")


def _uniap_train_meta(tmp_path: Path, *, n: int) -> dict[str, Any]:
    """The loop state of a fit over ``n`` batches an epoch (as `uniap train`'s data module gives), at step n + 2."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.layer(batch[0]).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(max_steps=n + 2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", limit_val_batches=0)
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=1))
    return {k: v for k, v in trainer._checkpoint_connector.dump_checkpoint().items()
            if k not in ("state_dict", "optimizer_states")}


def test_uniap_train_refuses_them_before_any_rank_starts(tmp_path: Path) -> None:
    """`uniap train resume=...`: ``check_resume`` reads meta.pt and refuses before a rank is started (the model,
    data and accumulation of the run decide what the counters must say)."""
    from uniap_lightning.cli.overrides import compose_checked
    from uniap_lightning.cli.train import check_resume
    from uniap_lightning.cli.train_checks import check_resume_state, training_batches

    cfg = compose_checked("fit", ["trainer.max_steps=500"])
    n = training_batches(cfg)
    assert n == 92  # tiny_gpt: 94,406 training tokens / 64 per sample / 16 per batch
    meta = _uniap_train_meta(tmp_path, n=n)
    check_resume_state(cfg, meta, "resume: x")  # the run it was written by passes
    folder = tmp_path / "step-00000094.ckpt"
    folder.mkdir()
    for edit, message in [
        (lambda m: _batch_counter(m, 10**9), "the current epoch's batch counter"),
        (lambda m: m.update({"pytorch-lightning_version": "0.0.1"}), "pytorch-lightning_version is '0.0.1'"),
    ]:
        bad = copy.deepcopy(meta)
        edit(bad)
        torch.save(bad, folder / "meta.pt")
        with pytest.raises(UniAPError) as err:
            check_resume(cfg, folder)
        assert str(err.value).startswith(f"resume: {folder / 'meta.pt'}: ") and message in str(err.value)
        assert "\n" not in str(err.value)
    # the fit closed its second epoch (epoch=2) two batches in; 1,475 samples / 24 a batch = 61 batches an epoch
    with pytest.raises(UniAPError, match="do not add up to epoch=2 epochs of the 61 batches"):
        check_resume_state(compose_checked("fit", ["data.batch_size=24"]), meta, "resume: x")
    with pytest.raises(UniAPError, match="accumulate_grad_batches=4 make 23 optimizer steps"):
        check_resume_state(compose_checked("fit", ["+trainer.accumulate_grad_batches=4"]), meta, "resume: x")
