"""What a resumed checkpoint's loop state must agree with before training continues from it.

``meta.pt`` (or a single-file checkpoint) carries Lightning's loop counters and the version of Lightning that
wrote it. :mod:`~uniap_lightning.runtime.checkpoint_safety` checks that each counter is a plain count and that the
fit loop's optimizer steps equal ``global_step``; here the rest of what a resume relies on:

- :func:`check_lightning_version`: Lightning upgrades a checkpoint from the version it names, assuming that
  version's layout; a version it cannot read, or one whose upgrade does not apply to the loop state the file holds
  (``"0.0.1"`` next to this version's loops), ended in a ``KeyError`` on every rank. Refused in one line instead;
- :func:`check_resume_counters`: the counters agree with each other (the batch counters advance in order, the
  current epoch's never ahead of the run's, ``epoch`` the fit loop's count of epochs, no more optimizer steps than
  batches) and, where the run's batches per epoch are known, with the data: the epoch's batch counter is where the
  data loader resumes (the shipped data module skips that many batches), so a counter beyond an epoch, or totals
  that do not add up to whole epochs plus it, would train on other data than the run that wrote it.

Each refusal is a :class:`~uniap_lightning.errors.UniAPError` of one line naming the counters.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from uniap_lightning.errors import UniAPError

_VERSION_KEY = "pytorch-lightning_version"
_BATCHES = "epoch_loop.batch_progress"
_STAGES = ("ready", "started", "processed", "completed")
#: entries Lightning's upgrades never read: left out of the trial upgrade (weights are large)
_WEIGHTS = ("state_dict", "optimizer_states")


def check_lightning_version(meta: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """The loop state as Lightning will see it: ``meta`` itself when its ``pytorch-lightning_version`` is this
    Lightning's or newer (Lightning then upgrades nothing), else a copy upgraded as Lightning will upgrade it
    (without the weights). A version that is missing, not a version, or whose upgrade fails on what the file holds
    is refused in one line."""
    import lightning.pytorch as pl

    version = meta.get(_VERSION_KEY)
    if not isinstance(version, str):
        raise UniAPError(f"{where}: {_VERSION_KEY} is {_short(version)}, not the version of Lightning that wrote the "
                         "checkpoint: not a Lightning checkpoint, or the field was altered; resume from another one")
    try:
        older = Version(version) < Version(pl.__version__)
    except InvalidVersion:
        raise UniAPError(f"{where}: {_VERSION_KEY} is {_short(version)}, not a version number: Lightning could not "
                         "upgrade the checkpoint; restore the field (e.g. \"2.6.0\") or resume from another one") from None
    if not older:
        return meta
    from lightning.pytorch.utilities.migration import migrate_checkpoint

    trial = copy.deepcopy({k: v for k, v in meta.items() if k not in _WEIGHTS})
    try:
        upgraded, _ = migrate_checkpoint(trial)
    except Exception as err:  # noqa: BLE001 - any failure of the upgrade is the same refusal
        why = f"{type(err).__name__}: {err}".splitlines()[0][:120]
        raise UniAPError(f"{where}: {_VERSION_KEY} is {_short(version)}, but the loop state is not that version's: "
                         f"Lightning's upgrade from it fails ({why}); the field was altered - restore the version "
                         "that wrote the checkpoint, or resume from another one") from None
    return upgraded


def check_resume_counters(meta: dict[str, Any], where: str | Path, *, batches_per_epoch: int | None = None,
                          accumulate: int = 1) -> None:
    """Refuse loop counters that disagree with each other or (``batches_per_epoch``: this run's batches per epoch;
    ``accumulate``: its ``accumulate_grad_batches``) with the data the run would resume on. A checkpoint without
    Lightning's fit loop state (a bare weights file) has nothing to check."""
    fit = (meta.get("loops") or {}).get("fit_loop") if isinstance(meta.get("loops"), dict) else None
    if not isinstance(fit, dict) or not isinstance(fit.get(_BATCHES), dict):
        return
    total, current = (_stages(fit[_BATCHES].get(part), f"loops.fit_loop.{_BATCHES}.{part}", where)
                      for part in ("total", "current"))
    for name, counts in (("total", total), ("current", current)):
        ready, started, processed, completed = (counts[s] for s in _STAGES)
        if not completed <= processed <= started <= ready <= completed + 1:
            raise UniAPError(f"{where}: the fit loop's batch counters ({_BATCHES}.{name}: {_shown(counts)}) are out of "
                             "order: Lightning advances ready, started, processed and completed one batch at a time; the "
                             "counters were altered - resume from another checkpoint")
    ahead = [s for s in _STAGES if current[s] > total[s]]
    if ahead:
        raise UniAPError(f"{where}: the current epoch's batch counter {_BATCHES}.current.{ahead[0]}={current[ahead[0]]:,} "
                         f"is beyond the run's ({_BATCHES}.total.{ahead[0]}={total[ahead[0]]:,}); the counters were "
                         "altered - resume from another checkpoint")
    epoch, step = meta.get("epoch"), meta.get("global_step")
    epochs_done = _count(((fit.get("epoch_progress") or {}).get("current") or {}).get("completed"))
    if epochs_done is not None and type(epoch) is int and epoch != epochs_done:
        raise UniAPError(f"{where}: epoch={epoch:,} but the fit loop counts {epochs_done:,} epochs "
                         "(loops.fit_loop.epoch_progress.current.completed); the counters were altered - resume from "
                         "another checkpoint")
    automatic = _manual_steps(fit) == 0
    batches, in_epoch = total["processed"], current["processed"]
    if automatic and type(step) is int and step > batches:
        raise UniAPError(f"{where}: global_step={step:,} optimizer steps but only {batches:,} batches trained "
                         f"({_BATCHES}.total.processed); the counters were altered - resume from another checkpoint")
    if batches_per_epoch is None or batches_per_epoch < 1 or type(epoch) is not int:
        return
    n = batches_per_epoch
    if in_epoch > n:
        raise UniAPError(f"{where}: the current epoch's batch counter ({_BATCHES}.current.processed={in_epoch:,}) is "
                         f"beyond the {n:,} batches an epoch of this run's data has: the data would resume elsewhere "
                         "than where the checkpoint stopped; resume with the data settings it was trained with, or "
                         "from another checkpoint")
    before = batches - in_epoch  # the batches of the epochs before this one (the last epoch counted whole when a
    # fit ended and Lightning closed the epoch: `epoch` is then one ahead)
    if before not in (epoch * n, (epoch - 1) * n):
        raise UniAPError(f"{where}: the batch counters ({_BATCHES}.total.processed={batches:,}, current."
                         f"processed={in_epoch:,}) do not add up to epoch={epoch:,} epochs of the {n:,} batches this "
                         "run's data has: the checkpoint was trained with other data settings (data.batch_size, "
                         "data.seq_len, trainer.limit_train_batches) or its counters were altered; resume with the "
                         "settings it was trained with, or from another checkpoint")
    if not automatic or type(step) is not int or accumulate < 1:
        return
    per_epoch = math.ceil(n / accumulate)  # Lightning steps at the epoch's last batch whatever the window
    expected = before // n * per_epoch + (per_epoch if in_epoch == n else in_epoch // accumulate)
    if step != expected:
        raise UniAPError(f"{where}: global_step={step:,} but {batches:,} batches at {n:,} per epoch with "
                         f"accumulate_grad_batches={accumulate} make {expected:,} optimizer steps: the checkpoint was "
                         "trained with another trainer.accumulate_grad_batches or other data settings, or its counters "
                         "were altered; resume with the settings it was trained with")


def _stages(record: Any, name: str, where: str | Path) -> dict[str, int]:
    counts = {s: _count(record.get(s)) if isinstance(record, dict) else None for s in _STAGES}
    missing = [s for s, v in counts.items() if v is None]
    if missing:
        raise UniAPError(f"{where}: the fit loop's {name}.{missing[0]} is missing or not a count; the loop state was "
                         "altered - resume from another checkpoint")
    return counts  # type: ignore[return-value]


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _manual_steps(fit: dict[str, Any]) -> int:
    record = fit.get("epoch_loop.manual_optimization.optim_step_progress")
    total = record.get("total") if isinstance(record, dict) else None
    return _count(total.get("completed") if isinstance(total, dict) else None) or 0


def _shown(counts: dict[str, int]) -> str:
    return ", ".join(f"{s}={counts[s]:,}" for s in _STAGES)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
