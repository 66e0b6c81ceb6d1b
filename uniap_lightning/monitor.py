"""Closing the loop: measured step time and peak memory per rank against the plan's prediction.

:class:`UniAPMonitor` is a Lightning callback that :class:`~uniap_lightning.strategy.UniAPStrategy` installs by
default. After ``warmup_steps`` training batches it times ``window`` batches (``on_train_batch_start`` to
``on_train_batch_end``: forward, backward, gradient sync and optimizer step), gathers every rank's median step
time and peak memory, and logs through Lightning's loggers (CSV, TensorBoard, ...):

- ``uniap/step_time_s``: measured seconds per iteration (the slowest rank's median),
- ``uniap/predicted_tpi_s``: the plan's predicted time per iteration,
- ``uniap/plan_work_s`` (under UniAPStrategy): the plan's part of a step - the schedule's forward and backward,
  gradient sync, optimizer step, the loss's wait (``TrainStep.work_s``) - apart from Lightning's loop, logging
  and callbacks: the step time less the most any rank spends outside the plan's work per step (medians). In a
  pipeline the first stage's loop time reaches the later stages as waiting inside their work, so the largest
  per-rank loop time is what the step holds beyond the plan,
- ``uniap/step_time_error``: (measured - predicted) / predicted, where "measured" is ``plan_work_s`` on a CPU (the
  loop's own work adds to each step there and is the same for every plan: on the README demo's 24 ms step it was
  2-4 ms, mostly logging and ``on_train_batch_end`` callbacks, which the plan does not predict) and the whole step
  on a GPU (where the loop's host work overlaps the queued kernels),
- ``uniap/peak_memory_bytes``: the largest per-rank peak, and ``uniap/peak_memory_bytes/rank<r>`` per rank,
- ``uniap/predicted_memory_bytes``: the plan's largest per-stage memory,
- ``uniap/grad_sync_bytes`` / ``uniap/predicted_grad_sync_bytes``: the largest per-rank payload of the last
  optimizer step's gradient collectives (replicated / ZeRO-1 layers, compressed or not), counted, and the formula's
  figure for the same tensors (:mod:`uniap_lightning.runtime.compression`).

Gathering the ranks' figures does not stop training: the gather is started at the end of a window and finished
at the end of the next batch (or of training), so the figures are logged one batch after their window.

It warns once (rank 0) when the time error exceeds ``time_error_threshold`` (naming the command to run), and writes
a JSON file (``<log dir>/uniap_measured.json``, e.g. ``lightning_logs/version_0/``) that ``uniap explain
measured=FILE`` reads: ``run`` (what it belongs to: the plan, and the cluster description, model profile and
training settings it was planned with; see :func:`run_record`), ``tpi_s``, ``stage_time_s`` (per stage and micro-batch: the predicted
stage times scaled by measured / predicted time per iteration - an approximation, stages are not timed
separately), ``stage_peak_memory_bytes`` (the largest peak of each stage's ranks), plus per-rank figures, and
``rebalances``: the plan switches of a ``rebalance=True`` run so far (:mod:`uniap_lightning.rebalance`). A switch
starts a new window after ``warmup_steps`` (figures of one window never mix two plans).

What "peak memory" measures: tensor bytes, the quantity the plan predicts.

- CUDA: ``torch.cuda.max_memory_allocated`` over the window (the caching allocator's peak of live tensors).
- CPU: this rank's parameters, optimizer state and gradients at the start of the window's first step, plus the
  most bytes of storages that step's ops hold at once (:class:`~uniap_lightning.monitor_memory.CpuStepMemory`).
  Next to it the report gives the process's growth over that step (``rank_process_growth_bytes``: resident-set
  high-water mark less the resident set before, after ``malloc_trim``), which adds what glibc keeps beyond live
  tensors. That growth was the figure before; on the demo's two-stage plan it read 13.0-13.4 MiB against
  10.6 MiB of tensors and a 10.9 MiB prediction.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import write_json_atomic
from uniap_lightning.monitor_memory import CpuStepMemory


def _plan_work_s(trainer: pl.Trainer) -> tuple[int, float] | None:
    """``(id, seconds)`` of the seconds this rank has spent in the plan's work so far (UniAPStrategy's
    ``TrainStep.work_s``), or None under another strategy or before setup."""
    strategy = trainer.strategy
    if getattr(strategy, "setup_result", None) is None:
        return None
    state = strategy.train_step_state
    return id(state), state.work_s


def _grad_sync_bytes(trainer: pl.Trainer) -> tuple[int, int]:
    """This rank's gradient-collective payload of the last optimizer step: (counted, formula); 0s when unknown."""
    strategy = trainer.strategy  # UniAPStrategy once set up; another strategy: nothing to count
    if getattr(strategy, "setup_result", None) is None:
        return 0, 0
    replicated = strategy.runtime.replicated
    return replicated.counter.step_bytes, replicated.wire_bytes_per_step()


def _error_parts(plan: Any, report: dict[str, Any]) -> str:
    """What the compared times are made of: the prediction's pipeline and per-step parts, the measured plan's work
    and Lightning's loop around it."""
    est = plan.estimate
    sync = max(est.stage_sync_s) if est.stage_sync_s else 0.0
    pipe = est.tpi_s - sync
    slowest = max(est.stage_time_s) if est.stage_time_s else 0.0
    text = (f"Predicted: {pipe * 1e3:.2f} ms of pipeline ({plan.microbatches} micro-batch(es), the slowest stage "
            f"{slowest * 1e3:.2f} ms each, from the profile's layer timings) + {sync * 1e3:.2f} ms of gradient sync "
            "and optimizer step. Measured:")
    if "plan_work_s" in report:
        text += (f" {report['plan_work_s'] * 1e3:.2f} ms of the plan's work (compared) + {report['loop_s'] * 1e3:.2f}"
                 " ms of Lightning's loop, logging and callbacks (not predicted).")
    else:
        text += f" {report['tpi_s'] * 1e3:.2f} ms per step."
    return text


def run_record(setup_result: Any, plan: Any) -> dict[str, Any]:
    """What a measured file belongs to (``run``): the plan, and where setup had them, the cluster description, the
    model profile and the training settings it was planned with, so ``uniap explain measured=FILE`` re-scores the
    same problem (and refuses another model or cluster)."""
    record: dict[str, Any] = {"model": plan.model, "cluster": plan.cluster, "devices": plan.num_devices,
                              "model_fingerprint": plan.model_fingerprint, "plan": plan.to_dict()}
    cluster = getattr(setup_result, "planning_cluster", None)
    profile = getattr(setup_result, "profile", None)
    if cluster is not None and profile is not None:
        record["cluster"] = cluster.name
        record["cluster_spec"] = asdict(cluster)
        record["profile"] = profile.to_dict()
        training = dict(getattr(setup_result, "report", {}).get("training") or {})
        record["training"] = training or {"global_batch_size": plan.global_batch_size, "schedule": plan.schedule}
    return record


class UniAPMonitor(pl.Callback):
    """Measured vs predicted step time and peak memory (see the module docstring)."""

    def __init__(self, *, warmup_steps: int = 3, window: int = 10, time_error_threshold: float = 0.25,
                 metrics_file: str | Path | None = None, repeat: bool = True) -> None:
        if warmup_steps < 0 or window < 1:
            raise ValueError("warmup_steps must be >= 0 and window >= 1")
        self.warmup_steps, self.window = int(warmup_steps), int(window)
        self.time_error_threshold = float(time_error_threshold)
        self.metrics_file = Path(metrics_file) if metrics_file is not None else None
        self.repeat = repeat
        self._seen = 0
        self._times: list[float] = []
        self._work: list[float] = []  # per step: seconds in the plan's work (UniAPStrategy)
        self._work0: tuple[int, float] | None = None
        self._peaks: list[float] = []
        self._t0 = 0.0
        self._cpu_memory = CpuStepMemory()
        self._process_peaks: list[float] = []  # CPU: the process's growth over the measured step
        self._warned = False
        self._run: tuple[Any, dict[str, Any]] | None = None  # (plan, its run record): built once per plan
        self._done = False
        self._pending: tuple[Any, list[torch.Tensor], int] | None = None  # (work, gathered, steps) of a window
        self._path: Path | None = None
        #: the last report (identical on every rank), or None
        self.last: dict[str, Any] | None = None

    # ---------------------------------------------------------------- measuring
    def _cuda(self, trainer: pl.Trainer) -> torch.device | None:
        dev = trainer.strategy.root_device
        return dev if dev.type == "cuda" else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Trainer.log_dir broadcasts from rank 0: resolve it here, on every rank, once (not inside a window)
        self._path = self._metrics_path(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish_report(trainer, pl_module, log=False)  # Lightning forbids self.log here; loggers get it

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._measuring = self._seen >= self.warmup_steps and not self._done
        if not self._measuring:
            return
        dev = self._cuda(trainer)
        if dev is not None:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        elif not self._times:  # the window's first step (see monitor_memory)
            self._cpu_memory.start(pl_module, trainer.optimizers)
        self._work0 = _plan_work_s(trainer)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._seen += 1
        self._finish_report(trainer, pl_module)  # the previous window's gather (started a batch ago)
        if not getattr(self, "_measuring", False):
            return
        dev = self._cuda(trainer)
        if dev is not None:
            torch.cuda.synchronize(dev)
        self._times.append(time.perf_counter() - self._t0)
        work = _plan_work_s(trainer)
        if work is not None and self._work0 is not None and work[0] == self._work0[0]:
            self._work.append(work[1] - self._work0[1])
        if dev is not None:
            self._peaks.append(float(torch.cuda.max_memory_allocated(dev)))
        elif self._cpu_memory.active:
            tensors, process = self._cpu_memory.stop()
            self._peaks.append(tensors)
            self._process_peaks.append(process)
        if len(self._times) >= self.window:
            self._sync = _grad_sync_bytes(trainer)
            self._start_report(trainer.strategy.root_device)
            self._times, self._peaks, self._work, self._process_peaks = [], [], [], []
            self._done = not self.repeat
            if not self._distributed():
                self._finish_report(trainer, pl_module)

    def on_plan_switch(self, trainer: pl.Trainer, event: dict[str, Any]) -> None:
        """The strategy switched plans (``rebalance=True``): drop the window in progress, warm up again."""
        self._times, self._peaks, self._work, self._seen, self._measuring = [], [], [], 0, False
        self._process_peaks = []
        self._cpu_memory.abandon()
        self._done = False

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._cpu_memory.abandon()  # a step that failed while measured must not leave the dispatch mode on

    # ---------------------------------------------------------------- reporting
    @staticmethod
    def _distributed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _start_report(self, device: torch.device) -> None:
        """Start gathering every rank's (median step time, peak memory) of the window just measured (on the
        strategy's device: NCCL gathers CUDA tensors, gloo CPU ones)."""
        work = statistics.median(self._work) if len(self._work) == len(self._times) else -1.0
        process = max(self._process_peaks) if self._process_peaks else -1.0
        mine = torch.tensor([statistics.median(self._times), max(self._peaks), *getattr(self, "_sync", (0, 0)), work,
                             process], dtype=torch.float64, device=device)
        if self._distributed():
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            work = dist.all_gather(gathered, mine, async_op=True)
        else:
            gathered, work = [mine], None
        self._pending = (work, gathered, len(self._times))

    def _finish_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, log: bool = True) -> None:
        """Wait for a started gather (if any) and report it."""
        if self._pending is None:
            return
        (work, gathered, steps), self._pending = self._pending, None
        if work is not None:
            guard = getattr(trainer.strategy, "guard", None)  # UniAPStrategy's: a dead peer is a clear error
            guard(work.wait) if guard is not None else work.wait()
        work = [float(t[4]) for t in gathered]
        self._report(trainer, pl_module, [float(t[0]) for t in gathered], [float(t[1]) for t in gathered], steps,
                     log=log, sync=[(float(t[2]), float(t[3])) for t in gathered],
                     rank_work=work if min(work) >= 0 else None,
                     rank_process=[float(t[5]) for t in gathered] if min(float(t[5]) for t in gathered) >= 0 else None)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rank_time: list[float],
                rank_peak: list[float], steps: int, log: bool = True,
                sync: list[tuple[float, float]] | None = None, rank_work: list[float] | None = None,
                rank_process: list[float] | None = None) -> None:
        report: dict[str, Any] = {
            "tpi_s": max(rank_time),
            "rank_step_time_s": rank_time,
            "rank_peak_memory_bytes": rank_peak,
            "steps": steps,
            "warmup_steps": self.warmup_steps,
            "global_step": trainer.global_step,
            "memory_measure": "cuda max_memory_allocated" if self._cuda(trainer) is not None else
            "cpu: params+optimizer state+grads + the step's live tensor peak (dispatch mode)",
        }
        if rank_process is not None:
            report["rank_process_growth_bytes"] = rank_process
            report["process_growth_measure"] = ("params+optimizer state + step RSS growth ("
                                                + ("VmHWM" if self._cpu_memory.hwm_reset else "ru_maxrss") + "-VmRSS)")
        strategy = trainer.strategy  # UniAPStrategy once set up: the plan running now; another strategy: none
        plan = strategy.plan if getattr(strategy, "setup_result", None) is not None else None
        metrics = {"uniap/step_time_s": report["tpi_s"], "uniap/peak_memory_bytes": max(rank_peak)}
        compared = report["tpi_s"]
        if rank_work is not None:
            # the plan's part of a step: the step less the most any rank spends outside the plan's work (a
            # pipeline's later stages wait, inside their work, for the first stage's loop and callbacks)
            loop = max(max(t - w, 0.0) for t, w in zip(rank_time, rank_work))
            report["rank_plan_work_s"] = rank_work
            report["plan_work_s"] = max(report["tpi_s"] - loop, 0.0)
            report["loop_s"] = loop
            metrics["uniap/plan_work_s"] = report["plan_work_s"]
            if self._cuda(trainer) is None:  # on a CPU the loop's own work adds to the step; on a GPU it overlaps
                compared = report["plan_work_s"]
        for r, m in enumerate(rank_peak):
            metrics[f"uniap/peak_memory_bytes/rank{r}"] = m
        if plan is not None:
            report["stage_peak_memory_bytes"] = plan.per_group(rank_peak)
            est = plan.estimate
            if est is not None and est.tpi_s > 0:
                ratio = compared / est.tpi_s
                report["stage_time_s"] = [t * ratio for t in est.stage_time_s]
                report["predicted_tpi_s"] = est.tpi_s
                report["predicted_stage_time_s"] = list(est.stage_time_s)
                report["predicted_stage_memory_bytes"] = list(est.stage_memory_bytes)
                report["step_time_error"] = ratio - 1
                metrics.update({
                    "uniap/predicted_tpi_s": est.tpi_s,
                    "uniap/step_time_error": ratio - 1,
                    "uniap/predicted_memory_bytes": max(est.stage_memory_bytes),
                })
        if sync and max(p for _, p in sync) > 0:  # counted vs formula bytes of the gradient collectives, per rank
            report["rank_grad_sync_bytes"] = [c for c, _ in sync]
            report["rank_predicted_grad_sync_bytes"] = [p for _, p in sync]
            metrics["uniap/grad_sync_bytes"] = max(c for c, _ in sync)
            metrics["uniap/predicted_grad_sync_bytes"] = max(p for _, p in sync)
        rebalances = getattr(strategy, "rebalances", None)
        if rebalances:
            report["rebalances"] = rebalances
        if plan is not None:
            if self._run is None or self._run[0] is not plan:  # (a re-plan switches plans inside the fit)
                self._run = (plan, run_record(strategy.setup_result, plan))
            report["run"] = self._run[1]
        self.last = report
        if log:
            for k, v in metrics.items():
                pl_module.log(k, float(v), on_step=True, on_epoch=False, sync_dist=False, logger=True)
        elif trainer.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=trainer.global_step)
        if trainer.global_rank == 0:
            assert self._path is not None  # resolved in on_train_start, on every rank
            self._write(self._path, report)
            err = report.get("step_time_error")

            mem = f"peak memory {max(rank_peak) / 2**20:,.1f} MiB"
            if plan is not None and plan.estimate is not None:
                mem += f" (predicted {max(plan.estimate.stage_memory_bytes) / 2**20:,.1f} MiB)"
            if rank_process is not None:
                mem += f", process growth {max(rank_process) / 2**20:,.1f} MiB"
            if "uniap/grad_sync_bytes" in metrics:
                mem += (f", gradient sync {metrics['uniap/grad_sync_bytes'] / 2**20:,.3f} MiB/step (predicted "
                        f"{metrics['uniap/predicted_grad_sync_bytes'] / 2**20:,.3f} MiB)")
            if err is not None:
                what = f"{report['tpi_s'] * 1e3:.2f} ms/step measured"
                if compared != report["tpi_s"]:
                    what += (f", {compared * 1e3:.2f} ms of it in the plan's work (the rest: Lightning's loop, "
                             "logging, callbacks)")
                rank_zero_info(f"UniAP monitor: {what} vs {report['predicted_tpi_s'] * 1e3:.2f} ms predicted "
                               f"({err:+.0%}), {mem}")
                if abs(err) > self.time_error_threshold and not self._warned:
                    self._warned = True
                    where = report.get("file")
                    rank_zero_warn(
                        f"UniAP: measured step time {compared * 1e3:.2f} ms differs from the plan's prediction "
                        f"{report['predicted_tpi_s'] * 1e3:.2f} ms by {err:+.0%} (threshold "
                        f"{self.time_error_threshold:.0%}); the plan may not be the fastest here. "
                        f"{_error_parts(plan, report)} Per stage and layer, with the model, cluster and plan this "
                        "run used: "
                        + (f"uniap explain measured={where}" if where else "uniap explain measured=<metrics file> "
                           "(this run's could not be written)")
                    )
            else:
                rank_zero_info(f"UniAP monitor: {report['tpi_s'] * 1e3:.2f} ms/step measured, {mem}")

    def _metrics_path(self, trainer: pl.Trainer) -> Path:
        """Collective (``trainer.log_dir``): call on every rank."""
        if self.metrics_file is not None:
            return Path(self.metrics_file)
        return Path(trainer.log_dir or trainer.default_root_dir) / "uniap_measured.json"

    @staticmethod
    def _write(path: Path, report: dict[str, Any]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, report)
            report["file"] = str(path.resolve())
        except (OSError, UniAPError):  # UniAPError: a device, FIFO or folder under the name (never replaced)
            pass
