"""The :class:`Rebalancer` callback: measure, decide and switch plans inside ``Trainer.fit`` (``rebalance=True``).

Installed by :class:`~uniap_lightning.strategy.UniAPStrategy` (last among its callbacks, so the batch's loss is
already reduced and logged when it runs). After every optimizer step it notes the step's wall time; every
``rebalance_check_every`` steps (the window's first step, which builds schedules, is not counted) it gathers every
rank's median stage forward / backward time per micro-batch (:mod:`.timing`, one all-gather) on rank 0, which
decides (:mod:`.decision`), re-solves on the cluster with the measured speeds when some rank's speed moved, and
sends every rank its verdict (one broadcast); on "switch" every rank switches at this step boundary
(:mod:`.switch`). The next check measures the gain the switch actually brought.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.problem import Problem
from uniap_lightning.rebalance.decision import RebalanceOptions, assess, predicted_gain, should_switch
from uniap_lightning.rebalance.switch import Pristine, switch_plan
from uniap_lightning.rebalance.timing import StageTimer
from uniap_lightning.runtime.planning import solve_plan

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from uniap_lightning.planner.cluster import Cluster
    from uniap_lightning.planner.plan import Plan
    from uniap_lightning.planner.problem import TrainingConfig
    from uniap_lightning.planner.profile import ModelProfile
    from uniap_lightning.setup import SetupOptions


def describe(plan: Plan) -> str:
    """One line: pipeline degree, micro-batches, each stage's layers and strategies."""
    parts = []
    for s in plan.stages:
        first, last = s.layers
        kinds = sorted({(lp.strategy.dp, lp.strategy.tp, lp.strategy.dp_mode) for lp in plan.layers[first:last + 1]})
        label = "/".join(f"dp{d}" + (f"tp{t}" if t > 1 else "") + ("" if m == "replicate" or d == 1 else f"-{m}")
                         for d, t, m in kinds)
        parts.append(f"[{first}-{last}] {label}")
    return f"pp={plan.pp} c={plan.microbatches}: " + ", ".join(parts)


def _layout(plan: Plan) -> Any:
    d = plan.to_dict()
    return d["pp"], d["microbatches"], d["schedule"], d["stages"], d["layers"]


@dataclass
class RebalanceEvent:
    """One switch: when, why, what it predicted and (one check later) what it measured."""

    step: int
    reason: str
    speeds: tuple[float, ...]
    old_plan: str
    new_plan: str
    predicted_tpi_old_s: float
    predicted_tpi_new_s: float
    predicted_gain: float
    switch_s: float
    solve_s: float
    step_time_before_s: float | None
    step_time_after_s: float | None = None
    measured_gain: float | None = None
    plan: Plan | None = field(default=None, repr=False)  # the plan switched to (not in ``to_dict``)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        d["speeds"] = list(self.speeds)
        return d


@dataclass
class Verdict:
    """Rank 0's answer at a check, sent to every rank."""

    replan: bool
    speeds: tuple[float, ...]
    reason: str
    plan: Plan | None = None  # set when every rank must switch to it
    tpi_old_s: float = 0.0
    tpi_new_s: float = 0.0
    gain: float = 0.0
    solve_s: float = 0.0
    measured: list[Any] = field(default_factory=list)


class Rebalancer(Callback):
    """See the module docstring. ``events`` lists the switches (:class:`RebalanceEvent`), ``checks`` every check."""

    def __init__(self, options: RebalanceOptions, setup: SetupOptions, pristine: Pristine, profile: ModelProfile,
                 cluster: Cluster, training: TrainingConfig) -> None:
        self.options, self.setup, self.pristine = options, setup, pristine
        self.profile, self.base_cluster, self.training = profile, cluster, training
        self.cluster = cluster
        given = getattr(cluster, "rank_speed", None)
        self.speeds: tuple[float, ...] = tuple(given) if given else (1.0,) * cluster.num_devices
        self.events: list[RebalanceEvent] = []
        self.checks: list[dict[str, Any]] = []
        self.timer: StageTimer | None = None
        self._predicted: tuple[int, list[float]] | None = None  # (id of the plan, its stage times on self.cluster)
        self._fresh = True
        self._last_step = -1
        self._last_t: float | None = None
        self._step_times: list[float] = []

    def attach(self, strategy: Any) -> None:
        """Time the stage module of the strategy's current runtime (at setup and after each switch)."""
        if self.timer is not None:
            self.timer.remove()
        self.timer = None
        self._fresh = True
        if strategy.runtime.plan.virtual_stages > 1:
            # the timer measures one module per rank; a device holding several stages would be judged by one of
            # them, so rebalancing is off for such a plan (said once, on rank 0)
            if strategy.global_rank == 0:
                warnings.warn(f"UniAP: rebalance=True is off for this plan: it runs "
                              f"{strategy.runtime.plan.virtual_stages} pipeline stages per device "
                              f"({strategy.runtime.plan.schedule}), and the re-planning timer measures one stage per "
                              "device", stacklevel=2)
            return
        self.timer = StageTimer(strategy.runtime.stage_modules[0], strategy.root_device)  # v = 1: the stage

    # ---------------------------------------------------------------- per step
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # no optimizer step in this batch (gradient accumulation)
            return
        self._last_step = step
        now = time.perf_counter()
        if self._last_t is not None and not self._fresh:
            self._step_times.append(now - self._last_t)
        self._last_t = now
        if self._fresh:  # the first step after setup or a switch builds schedules and buckets: not measured
            self._fresh = False
            self._step_times = []
            if self.timer is not None:
                self.timer.clear()
            return
        if step % self.options.check_every or step >= _total_steps(trainer):  # not after the last step
            return
        if self.timer is None:  # off for this plan (several stages per device, see attach); the same on every rank
            return
        self._check(trainer, pl_module)
        self._step_times = []
        if self.timer is not None:
            self.timer.clear()
        self._last_t = time.perf_counter()  # the check (and a switch) is not part of the next step's time

    # ---------------------------------------------------------------- the check
    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch.distributed as dist

        strategy = trainer.strategy
        assert self.timer is not None
        mine = (self.timer.medians(), statistics.median(self._step_times) if self._step_times else None)
        gathered: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            strategy.guard(lambda: dist.all_gather_object(gathered, mine))
        verdict = None
        if strategy.global_rank == 0:
            verdict = self._decide(strategy.plan, gathered)
        verdict = strategy.broadcast(verdict)
        step_time = gathered[0][1]
        self._measured_gain(pl_module, trainer.global_step, step_time)
        self.checks.append({"step": trainer.global_step, "replan": verdict.replan, "reason": verdict.reason,
                            "speeds": list(verdict.speeds), "switch": verdict.plan is not None,
                            "predicted_gain": verdict.gain, "step_time_s": step_time,
                            "stage_s_per_microbatch": verdict.measured})
        if verdict.replan:
            self.speeds = verdict.speeds
            self.cluster = self.base_cluster.with_rank_speed(self.speeds)
            self._predicted = None
        if verdict.plan is not None:
            self._switch(trainer, pl_module, verdict, step_time)

    def _predicted_stage_s(self, plan: Plan) -> list[float]:
        if self._predicted is None or self._predicted[0] != id(plan):
            est = evaluate(Problem(model=self.profile, cluster=self.cluster, training=self.training), plan)
            self._predicted = (id(plan), list(est.stage_time_s))
        return self._predicted[1]

    def _decide(self, plan: Plan, gathered: list[Any]) -> Verdict:
        """Rank 0: assess the measurements, re-solve when speeds moved; never raises (a failed re-plan keeps the
        running plan, with the reason)."""
        measured = [None if m is None else m[0] + m[1] for m, _ in gathered]
        try:
            check = assess(measured_s=measured, predicted_stage_s=self._predicted_stage_s(plan),
                           plan=plan, speeds=self.speeds,
                           threshold=self.options.threshold, switches=len(self.events),
                           max_rebalances=self.options.max_rebalances)
            if not check.replan:
                return Verdict(False, self.speeds, check.reason, measured=measured)
            return self._solve(plan, check.speeds, check.reason, measured)
        except Exception as err:  # noqa: BLE001 - re-planning is an optimization: training goes on regardless
            rank_zero_warn(f"UniAP rebalance: re-planning failed, keeping the running plan ({type(err).__name__}: "
                           f"{err})")
            return Verdict(False, self.speeds, f"re-planning failed: {err}", measured=measured)

    def _solve(self, plan: Plan, speeds: tuple[float, ...], reason: str, measured: list[Any]) -> Verdict:
        cluster = self.base_cluster.with_rank_speed(speeds)
        t0 = time.perf_counter()
        new, _ = solve_plan(profile=self.profile, cluster=cluster, training=self.training, solver=self.setup.solver,
                            time_limit_s=self.setup.time_limit_s, cache_dir=self.setup.plan_cache_dir(),
                            compression=self.setup.compression,
                            compression_options=self.setup.compression_options_dict, opt_ins=self.setup.opt_ins_dict,
                            warm_start=plan, baselines=False)  # the running plan is the incumbent to beat
        solve_s = time.perf_counter() - t0
        problem = Problem(model=self.profile, cluster=cluster, training=self.training)
        old_tpi, new_tpi = evaluate(problem, plan).tpi_s, evaluate(problem, new).tpi_s
        gain = predicted_gain(old_tpi, new_tpi)
        switch = should_switch(gain, self.options.threshold, same_plan=_layout(new) == _layout(plan))
        verdict = f"{reason}; re-solved in {solve_s:.1f} s: {describe(new)}, predicted gain {gain:+.1%}"
        if not switch:
            verdict += f" (not above the threshold {self.options.threshold:.0%}: keeping the running plan)"
        return Verdict(True, speeds, verdict, new if switch else None, old_tpi, new_tpi, gain, solve_s, measured)

    # ---------------------------------------------------------------- switching and reporting
    def _switch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: Verdict,
                step_time: float | None) -> None:
        strategy = trainer.strategy
        assert verdict.plan is not None
        old = describe(strategy.plan)
        seconds = switch_plan(strategy, trainer, verdict.plan, self.pristine)
        self.attach(strategy)
        event = RebalanceEvent(step=trainer.global_step, reason=verdict.reason, speeds=verdict.speeds, old_plan=old,
                               new_plan=describe(verdict.plan), predicted_tpi_old_s=verdict.tpi_old_s,
                               predicted_tpi_new_s=verdict.tpi_new_s, predicted_gain=verdict.gain,
                               switch_s=seconds, solve_s=verdict.solve_s, step_time_before_s=step_time,
                               plan=verdict.plan)
        self.events.append(event)
        for cb in trainer.callbacks:
            if hasattr(cb, "on_plan_switch"):
                cb.on_plan_switch(trainer, event.to_dict())
        pl_module.log("uniap/rebalances", float(len(self.events)), on_step=True, on_epoch=False, logger=True)
        pl_module.log("uniap/rebalance_predicted_gain", float(verdict.gain), on_step=True, on_epoch=False, logger=True)
        rank_zero_info(f"UniAP rebalance at step {event.step}: {old} -> {event.new_plan} ({verdict.reason}); "
                       f"switched in {seconds:.2f} s")

    def _measured_gain(self, pl_module: pl.LightningModule, step: int, step_time: float | None) -> None:
        """The check after a switch: the step time it brought, against the one before."""
        last = self.events[-1] if self.events else None
        if last is None or last.step_time_after_s is not None or step_time is None:
            return
        last.step_time_after_s = step_time
        if last.step_time_before_s:
            last.measured_gain = last.step_time_before_s / step_time - 1
            pl_module.log("uniap/rebalance_measured_gain", float(last.measured_gain), on_step=True, on_epoch=False,
                          logger=True)
            rank_zero_info(f"UniAP rebalance at step {last.step}: measured gain {last.measured_gain:+.1%} "
                           f"({last.step_time_before_s * 1e3:.1f} -> {step_time * 1e3:.1f} ms/step; predicted "
                           f"{last.predicted_gain:+.1%})")


def _total_steps(trainer: pl.Trainer) -> float:
    try:
        return float(trainer.estimated_stepping_batches)
    except Exception:  # noqa: BLE001 - e.g. an iterable dataloader without a length: checks go on to the end
        return float(trainer.max_steps) if trainer.max_steps > 0 else float("inf")
