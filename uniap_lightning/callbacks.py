"""Callbacks: the strategy's train-loss logger; for training runs, perplexity (torchmetrics), steady-state
throughput, a step-bounded progress bar, and a checkpoint written on preemption."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

import torch
# submodules, not `lightning.pytorch` itself: the strategy imports this module while Lightning may still be importing
# its strategies (the registration hook), when `lightning.pytorch.Callback` does not exist yet
from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint.api import CheckpointException

from uniap_lightning.runtime.checkpoint_safety import checkpoint_problem

if TYPE_CHECKING:
    import lightning.pytorch as pl


class PerplexityLogger(Callback):
    """Logs ``train_ppl`` = exp(mean training loss over the last ``window`` steps) and ``val_ppl``."""

    def __init__(self, window: int = 10) -> None:
        from torchmetrics.aggregation import MeanMetric

        self.window = window
        # the losses are global (equal on every rank): nothing to sync, and the metrics' CPU state could not go
        # over a CUDA job's NCCL group ("No backend type associated with device type cpu" on every GPU run)
        self.train = MeanMetric(sync_on_compute=False)
        self.val = MeanMetric(sync_on_compute=False)
        self.last_train_ppl: float | None = None
        self.last_val_ppl: float | None = None

    @staticmethod
    def _loss(outputs: Any) -> torch.Tensor | None:
        if isinstance(outputs, dict):
            outputs = outputs.get("loss")
        return outputs.detach().float().cpu() if isinstance(outputs, torch.Tensor) else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = self._loss(outputs)
        if loss is None:
            return
        self.train.update(loss)
        if (trainer.global_step % self.window == 0) or trainer.global_step >= (trainer.max_steps or 0):
            self.last_train_ppl = math.exp(float(self.train.compute()))
            pl_module.log("train_ppl", self.last_train_ppl, prog_bar=True, rank_zero_only=True)
            self.train.reset()

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        loss = self._loss(outputs)
        if loss is not None:
            self.val.update(loss)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.val.update_count:
            self.last_val_ppl = math.exp(float(self.val.compute()))
            pl_module.log("val_ppl", self.last_val_ppl, sync_dist=True)  # equal on every rank (global losses)
            self.val.reset()


class ThroughputTimer(Callback):
    """Wall time per training step after ``warmup`` steps; ``samples_per_s`` for a global batch."""

    def __init__(self, global_batch_size: int, warmup: int = 2) -> None:
        self.batch, self.warmup = global_batch_size, warmup
        self.times: list[float] = []
        self._t0: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._t0 is not None and trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._t0)

    @property
    def step_s(self) -> float | None:
        if not self.times:
            return None
        ordered = sorted(self.times)
        return ordered[len(ordered) // 2]

    @property
    def samples_per_s(self) -> float | None:
        return self.batch / self.step_s if self.step_s else None


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, without the "Epoch 0/-2" it shows for a run bounded by ``max_steps``
    (Lightning sets ``max_epochs=-1`` there and prints ``max_epochs - 1``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)


def fix_default_progress_bar(trainer: pl.Trainer) -> None:
    """Lightning's default rich progress bar, made a :class:`StepProgressBar` (a subclass that only changes the
    train description, no state of its own) so a user's ``Trainer(max_steps=N)`` shows "Epoch 0", not "Epoch 0/-2".
    A bar the user chose (any other class) is left alone."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if type(bar) is RichProgressBar:
        bar.__class__ = StepProgressBar


class CheckpointOnSigterm(Callback):
    """On preemption (SIGTERM: SLURM, Kubernetes, ``kill``), write a checkpoint before the run exits.

    Under ``UniAPStrategy`` a SIGTERM that reaches any rank stops every rank at the same batch (see
    :mod:`uniap_lightning.sigterm`), so all of them take part in this (collective) save. The checkpoint is named
    ``step-<global step>.ckpt`` in ``dirpath`` and published only once complete; :func:`newest_checkpoint`
    finds it again (``uniap train resume=auto``).
    """

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)
        self.saved: Path | None = None
        #: why the checkpoint could not be written (disk full, read-only, file size limit), or None
        self.failed: str | None = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        path = self.dirpath / f"step-{trainer.global_step:08d}.ckpt"
        try:
            if trainer.global_rank == 0:
                self.dirpath.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(path)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
            # the run is stopping anyway: say what is lost and why, instead of a traceback that hides it
            failures = getattr(err, "failures", None)
            cause = next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else err
            self.failed = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:200]}"
            return
        self.saved = path

    def lost_work(self, global_step: int) -> str:
        """One line for a failed save: which steps are lost, and from where a resume would start."""
        older = newest_checkpoint(self.dirpath)
        since = f"the newest intact checkpoint is {older}" if older else "there is no older checkpoint"
        return (f"the preemption checkpoint could not be written to {self.dirpath}/ ({self.failed}); the steps up to "
                f"{global_step} since the last checkpoint are lost ({since})")


def newest_checkpoint(dirpath: str | Path, *, skipped: list[tuple[Path, str]] | None = None) -> Path | None:
    """The usable checkpoint with the highest step in ``dirpath`` (written by :class:`CheckpointOnSigterm` or any
    ``step-*.ckpt``), or ``None``. Half-written ones (a run killed mid-save) never carry a real name; damaged ones
    (a shard missing or truncated, metadata or loop state refused, see
    :func:`~uniap_lightning.runtime.checkpoint_safety.checkpoint_problem`) are passed over, newest first, and
    listed in ``skipped`` as (path, why) when given."""
    for _, path in sorted(step_checkpoints(dirpath), reverse=True):
        why = checkpoint_problem(path)
        if why is None:
            return path
        if skipped is not None:
            skipped.append((path, why))
    return None


def step_checkpoints(dirpath: str | Path) -> list[tuple[int, Path]]:
    """Every ``step-<N>.ckpt`` entry in ``dirpath`` with its step, whatever its state."""
    folder = Path(dirpath)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.glob("step-*.ckpt"):
        step = path.name[len("step-"):-len(".ckpt")]
        if step.isdigit() and len(step) < 18:
            found.append((int(step), path))
    return found


class TrainLossLogger(Callback):
    """Logs ``train_loss`` (the global mean, on every rank) and puts it in the batch's ``outputs["loss"]``.

    Installed by the strategy ahead of every other callback, so later callbacks and the LightningModule's
    ``on_train_batch_end`` see the same value that one process would compute.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.strategy is not self.strategy:
            return
        loss = self.strategy.train_step_state.finish_loss()
        if loss is None:
            return
        if isinstance(outputs, dict) and "loss" in outputs:
            outputs["loss"] = loss / trainer.accumulate_grad_batches  # as Lightning normalizes a returned loss
        pl_module.log("train_loss", loss, prog_bar=True)
