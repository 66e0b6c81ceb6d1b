"""``UniAPStrategy``: the Lightning lifecycle (checkpoint IO: :mod:`uniap_lightning.strategy_checkpoints`, the
step hooks: :mod:`uniap_lightning.strategy_steps`). What happens at setup is :mod:`uniap_lightning.setup`,
executing a plan :mod:`uniap_lightning.runtime`, planning :mod:`uniap_lightning.planner`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from uniap_lightning import error_hook
from uniap_lightning._autoregister import register
from uniap_lightning.callbacks import TrainLossLogger, fix_default_progress_bar
from uniap_lightning.monitor import UniAPMonitor
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.errors import UniAPError
from uniap_lightning.rebalance import plan_and_apply
from uniap_lightning.runtime.checks import (check_module_supported, check_pinned_world, check_slurm, check_slurm_task,
                                            clear_comm_errors)
from uniap_lightning.setup import Ranks, SetupOptions, SetupResult
from uniap_lightning.strategy_checkpoints import CheckpointIO
from uniap_lightning.strategy_steps import Steps
from uniap_lightning.planner.plan import Plan
from uniap_lightning.precision import global_norm_clipper, with_global_norm_clipping
from uniap_lightning.rebalance.decision import RebalanceOptions
from uniap_lightning.runtime.step import TrainStep
from uniap_lightning.sigterm import AgreedSigterm, SetupSigterm

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from uniap_lightning.runtime import Runtime


class UniAPStrategy(CheckpointIO, Steps, ModelParallelStrategy):
    """Automatic hybrid parallelism (pipeline x data x tensor, per layer) planned by UniAP's MILP.

    ``Trainer(strategy="uniap", devices=..., num_nodes=...)``, or an instance for options. At setup every rank
    profiles the model's chain of layers on a sample batch, rank 0 solves for the fastest plan that fits in memory
    (:mod:`uniap_lightning.setup`), every rank keeps its pipeline stage, applies tensor parallelism, FSDP or
    replication per layer, and trains. The dataloader's batch is the *global* batch: every rank loads it and takes
    its share, so training matches one device on the same batches. The model contract (a chain of layers, a loss,
    an ``(input, target)`` batch) is in :mod:`uniap_lightning.runtime.chain`; the strategy runs the chain itself
    (the module's ``*_step`` methods are not called) and logs ``train_loss`` / ``val_loss`` / ``test_loss`` on
    every rank. Optimizers, schedulers, callbacks, accumulation, clipping and checkpoints behave as usual.

    Arguments:
        cluster: the cluster the planner should assume: a :class:`~uniap_lightning.planner.cluster.Cluster`, a dict
            of its fields, the name of a shipped ``conf/cluster`` entry, the path of a cluster ``.yaml`` file (your
            own, relative to the current folder), or ``None`` for this machine (its
            collectives measured at setup when ``measure_cluster``).
        plan: a pinned plan (a :class:`~uniap_lightning.planner.plan.Plan` or the path of a plan JSON file); skips
            profiling and solving. It must be for this model (layer names, fingerprint) and world size. Its
            layer names are the chain's, or the chain's inside their container (``embed`` for ``chain.embed``):
            a plan from `uniap plan` pins into ``CausalLMModule(GPT(...).named_layers())`` of the same config (its
            ``analytic-`` fingerprint names the config; it is not compared with a measured profile).
        schedule: pipeline schedule when solving: ``"auto"`` (default: the planner prices every schedule torch runs and
            chooses, with the stage split and the micro-batch count), or one of ``"gpipe"``, ``"1f1b"``,
            ``"zb_h1"``, ``"interleaved_1f1b"``, ``"interleaved_zb"``, ``"zb_v"``, ``"dualpipe_v"`` (see the README's
            schedule table). ``virtual_stages``: pipeline stages per device (``None``: searched; interleaved
            schedules take 2 or more, the V schedules 2).
        pp: restrict the search to these pipeline degrees (an int or a list; each must divide the number of
            processes); ``None`` (default): every degree. Not with a pinned ``plan`` (it has its own), nor are
            ``schedule``, ``virtual_stages``, ``compression`` and ``compression_options`` (the plan fixes them).
        solver: MILP backend for the planner: ``"auto"`` (the best available), ``"cbc"``, ``"highs"``, ``"gurobi"``.
        time_limit: seconds the solver may spend.
        profile: path of a profile JSON file to plan with instead of measuring the model at setup.
        cache_dir: where solved plans are cached (default ``$UNIAP_CACHE_DIR`` or ``~/.cache/uniap-lightning/plans``).
        timeout_s: collective timeout; a rank whose peer died fails with a :class:`UniAPError` within this time
            (usually at once, when the peer's connection closes).
        process_group_backend: ``"nccl"``, ``"gloo"``, or ``None`` for the device's default.
        measure_cluster: when ``cluster`` is not given, time collectives on the job's own process group at setup
            (a few seconds, all ranks; cached on disk per world layout) so the planner uses measured bandwidth and
            latency instead of rough constants.
        profile_cache: reuse measured profiles from disk (``<cache>/profiles``, keyed by everything the numbers
            depend on: layer structure and code, ``uniap_*`` answers, sample shape, precision, device, world layout,
            library versions) instead of measuring again.
        profile_repeats: timed runs per layer and micro-batch size (the median is kept).
        profile_micro_batches: micro-batch sizes to time (default: half the sample batch and all of it, at most 16).
        compression: gradient compression the planner may choose per replicated / ZeRO-1 layer (opt-in: numerics
            change): ``None`` or ``"none"`` (off), ``"bf16"``, ``"powersgd"`` or ``"topk"`` (that method or none,
            per layer), ``"auto"`` (any), or a list of methods (any of those), as ``uniap plan compression=`` takes
            them (one check: ``planner.dimensions.compression.compression_methods``); see
            :mod:`uniap_lightning.runtime.compression`. ``compression_options``: their parameters,
            ``{"powersgd_rank": 1, "topk_ratio": 0.01}`` by default (higher: closer to uncompressed).
        fp8: float8 matmuls the planner may choose per layer (opt-in: numerics change; torchao's float8 training,
            the ``fp8`` extra): ``"off"`` (default), ``"auto"`` or ``"tensorwise"`` (tensorwise scales; ZeRO-3
            layers all-gather float8 weights), ``"rowwise"`` (rowwise scales). Offered only where the cluster's
            catalogue device has an fp8 peak (H100, H200, GH200); the layer's master weights, gradients and
            optimizer state stay in the run's precision. A pinned plan carries each layer's ``precision``.
        monitor: ``True`` (default) installs a :class:`~uniap_lightning.monitor.UniAPMonitor` with default settings
            (measured vs predicted step time and peak memory, logged as ``uniap/*`` metrics); pass a monitor
            instance for other settings or ``False`` for none.
        rebalance: re-plan from measured stage times every ``rebalance_check_every`` steps and switch plans inside
            the same ``fit`` when a new plan is predicted faster by more than ``rebalance_threshold``, at most
            ``max_rebalances`` times (:mod:`uniap_lightning.rebalance`; ``rebalances`` lists the switches).
    """

    strategy_name = "uniap"

    def __init__(
        self,
        *,
        cluster: Cluster | Mapping[str, Any] | str | None = None,
        plan: Plan | str | Path | None = None,
        schedule: str = "auto",
        pp: int | list[int] | None = None,
        virtual_stages: int | None = None,
        solver: str = "auto",
        time_limit: float = 60.0,
        profile: str | Path | None = None,
        cache_dir: str | Path | None = None,
        timeout_s: float = 1800.0,
        process_group_backend: str | None = None,
        measure_cluster: bool = True,
        profile_cache: bool = True,
        profile_repeats: int = 3,
        profile_micro_batches: list[int] | None = None,
        monitor: Any = True,
        compression: str | list[str] | None = None,
        compression_options: Mapping[str, float] | None = None,
        fp8: str = "off",
        rebalance: bool = False,
        rebalance_threshold: float = 0.10,
        rebalance_check_every: int = 50,
        max_rebalances: int = 3,
    ) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise UniAPError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        check_slurm_task()  # before the Trainer reads SLURM_NTASKS (Lightning's RuntimeError / KeyError otherwise)
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timedelta(seconds=timeout_s))
        self._setup_options = SetupOptions.from_arguments(
            cluster=cluster, plan=plan, schedule=schedule, pp=pp, virtual_stages=virtual_stages, solver=solver, time_limit=time_limit, profile=profile,
            cache_dir=cache_dir, measure_cluster=measure_cluster, profile_cache=profile_cache,
            profile_repeats=profile_repeats, profile_micro_batches=profile_micro_batches, compression=compression,
            compression_options=compression_options, fp8=fp8,
        )
        self._setup_result: SetupResult | None = None  # what setup decided (frozen), read by the properties below
        self._runtime: Runtime | None = None
        self._step: TrainStep | None = None  # one training batch's gradients, loss and accumulation window
        # SIGTERM agreed on without Lightning's blocking per-batch broadcast (see uniap_lightning.sigterm)
        self._sigterm = AgreedSigterm(guard=self.guard)
        self._monitor = monitor
        self._rebalance = RebalanceOptions.from_arguments(rebalance=rebalance, rebalance_threshold=rebalance_threshold,
                                                          rebalance_check_every=rebalance_check_every,
                                                          max_rebalances=max_rebalances)
        self._rebalancer: Any = None  # the Rebalancer callback (rebalance=True, after setup)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Make ``Trainer(strategy="uniap")`` work (called by Lightning for its own strategies, and by us)."""
        register(strategy_registry)

    # ------------------------------------------------------------------ properties
    @property
    def plan(self) -> Plan:
        if self._runtime is None:
            raise RuntimeError("The UniAP plan is chosen in `setup`; it is not available before.")
        return self._runtime.plan

    @property
    def setup_options(self) -> SetupOptions:
        """The options setup plans with (frozen; from the constructor's arguments)."""
        return self._setup_options

    @property
    def setup_result(self) -> SetupResult | None:
        """What setup decided (frozen): plan, origin, planning cluster, profile origin, report; ``None`` before."""
        return self._setup_result

    @property
    def plan_origin(self) -> str:
        """Where the plan came from: ``"pinned"``, ``"cache <path>"`` or ``"solver"`` (``""`` before setup)."""
        return self._setup_result.origin if self._setup_result is not None else ""

    @property
    def planning_cluster(self) -> Cluster | None:
        """The cluster the planner used (measured at setup when ``cluster`` was not given)."""
        return self._setup_result.planning_cluster if self._setup_result is not None else None

    @property
    def setup_report(self) -> dict[str, Any]:
        """A copy of how setup went: ``profile_origin`` ("file <path>", "cache <path>", "measured", "structural"),
        ``profile_path``, ``cluster_origin``, ``precision`` and timings in seconds (``*_s``)."""
        return dict(self._setup_result.report) if self._setup_result is not None else {}

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            raise RuntimeError("Accessing the UniAP runtime before the strategy's setup is not allowed.")
        return self._runtime

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank loads the global batch and takes its share (see pipeline.lane_slice), so the sampler must
        # give all ranks the same samples in the same order.
        return {"num_replicas": 1, "rank": 0}

    # ------------------------------------------------------------------ environment
    @override
    def setup_environment(self) -> None:
        check_slurm(self.cluster_environment, num_nodes=self.num_nodes, devices=self.num_processes)
        check_pinned_world(self._setup_options.pinned_plan, num_nodes=self.num_nodes, devices=self.num_processes)
        SetupSigterm.install_once(forward=self._forward_sigterm)  # until Lightning registers its handlers
        self._setup_distributed()  # process group only; meshes depend on the plan, built in `setup`
        self._keep_users_sampler()

    def _forward_sigterm(self, signum: int) -> None:
        """A SIGTERM during setup reaches the processes Lightning's launcher started, as Lightning's handler does."""
        if self.launcher is not None:
            self.launcher.kill(signum)

    def _keep_users_sampler(self) -> None:
        """Every rank loads the whole global batch and takes its share, so the data order must be the one a single
        device sees. Lightning would otherwise put in a ``DistributedSampler``, which always shuffles training data
        (``DataLoader(shuffle=False)`` would train on other batches than one device) and has no public way for a
        strategy to decline it: the flag it reads is cleared before any dataloader is built."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        connector = getattr(trainer, "_accelerator_connector", None)
        if connector is not None:
            connector.use_distributed_sampler = False

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._runtime is not None and self._runtime.chain.module is not self.lightning_module:
            raise UniAPError("this UniAPStrategy already parallelized another LightningModule; use a new Trainer "
                             "(and strategy) for each model")
        check_module_supported(self.lightning_module, self.precision_plugin)
        if self._runtime is None:
            fix_default_progress_bar(trainer)
            error_hook.install(rank=self.global_rank)  # a setup refusal ends the script with one line, on rank 0
            _materialize_distributed_module(self.model, self.root_device)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            # planning and wrapping draw no random numbers the user's run would see: a shuffling sampler or dropout
            # then follows the same random stream as on one device
            with torch.random.fork_rng(devices=[self.root_device] if self.root_device.type == "cuda" else []), \
                    error_hook.raised_on_every_rank():  # setup agrees on failures: rank 0's line says it for all
                self.install_runtime(self._plan_and_apply(trainer))
        self._install_callbacks(trainer)
        self.precision_plugin.bind_global_norm(global_norm_clipper(self.runtime.plan.devices_per_stage,
                                                                   device=self.root_device, guard=self.guard))
        self._sigterm.install(trainer)  # before Lightning registers its signal handlers (later in Trainer._run)
        self.train_step_state.reset()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _plan_and_apply(self, trainer: pl.Trainer) -> Runtime:
        """Setup's decision (agreed on by every rank, printed on rank 0), then the plan applied on this rank; with
        ``rebalance=True`` also what re-planning needs (:func:`uniap_lightning.rebalance.plan_and_apply`)."""
        ranks = Ranks(rank=self.global_rank, world_size=self.world_size, num_nodes=self.num_nodes,
                      devices_per_node=self.num_processes, device=self.root_device)
        self._setup_result, runtime, self._rebalancer = plan_and_apply(self, trainer, ranks=ranks,
                                                                       options=self._setup_options,
                                                                       rebalance=self._rebalance)
        return runtime

    def _install_callbacks(self, trainer: pl.Trainer) -> None:
        if not any(isinstance(cb, TrainLossLogger) for cb in trainer.callbacks):
            # first, so every later callback (progress bar, checkpointing, the user's) sees this batch's loss
            trainer.callbacks.insert(0, TrainLossLogger(self))
        if self._monitor not in (False, None) and not any(isinstance(cb, UniAPMonitor) for cb in trainer.callbacks):
            trainer.callbacks.append(self._monitor if isinstance(self._monitor, UniAPMonitor) else UniAPMonitor())
        if self._rebalancer is not None and self._rebalancer not in trainer.callbacks:
            trainer.callbacks.append(self._rebalancer)  # last: the batch's loss is reduced when it switches
            self._rebalancer.attach(self)

    def install_runtime(self, runtime: Runtime) -> None:
        """Run ``runtime`` from now on (a plan switch, :mod:`uniap_lightning.rebalance.switch`)."""
        self._runtime, self._step = runtime, None
        self._device_mesh = self.lightning_module._device_mesh = runtime.meshes.world
        runtime.replicated.bind(self.lightning_module._trainer)  # compression warm-up: the run's step and length

    @property
    def rebalances(self) -> list[dict[str, Any]]:
        """The plan switches of this run (step, reason, speeds, plans, predicted and measured gain, seconds)."""
        return [e.to_dict() for e in self._rebalancer.events] if self._rebalancer is not None else []

    @property
    def train_step_state(self) -> TrainStep:
        """This strategy's :class:`~uniap_lightning.runtime.step.TrainStep` (after setup)."""
        if self._step is None:
            self._step = TrainStep(self.runtime, self.guard)
        return self._step

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.guard(lambda: super(UniAPStrategy, self).barrier(*args, **kwargs))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.guard(lambda: super(UniAPStrategy, self).broadcast(obj, src))

    def guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a collective or a wait on one); a failure, usually a peer process that died, becomes a
        :class:`UniAPError` naming this rank instead of a backend traceback. For callbacks that issue collectives
        of their own (the monitor does)."""
        return clear_comm_errors(fn, rank=self.global_rank)

    # ------------------------------------------------------------------ clipping
    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = with_global_norm_clipping(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # clipping by the norm of the whole model, whatever the precision (see uniap_lightning.precision)
        self._precision_plugin = None if precision_plugin is None else with_global_norm_clipping(precision_plugin)

    @override
    def on_train_end(self) -> None:
        self._sigterm.finish()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self._step is not None:
            self._step.reset()
        super().teardown()


def _register_on_import() -> None:
    register(StrategyRegistry)


_register_on_import()  # importing the strategy is enough for Trainer(strategy="uniap")
