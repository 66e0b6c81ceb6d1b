"""``UniAPStrategy``: plan at setup, apply the plan, train with Lightning's usual semantics.

The strategy holds the lifecycle only; the work is in :mod:`uniap_lightning.runtime` (executing a plan),
:mod:`uniap_lightning.profiling.module` (measuring the chain) and :mod:`uniap_lightning.planner.solver` (planning).
The model contract is described in :mod:`uniap_lightning.runtime.chain`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.errors import UniAPError
from uniap_lightning.setup import SetupOptions, SetupResult
from uniap_lightning.planner.plan import SCHEDULES, Plan
from uniap_lightning.precision import with_global_norm_clipping
from uniap_lightning.sigterm import AgreedSigterm

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

    from uniap_lightning.runtime import Runtime

SOLVERS = ("auto", "cbc", "highs", "gurobi")


class UniAPStrategy(ModelParallelStrategy):
    """Automatic hybrid parallelism (pipeline x data x tensor, per layer) planned by UniAP's MILP.

    Use ``Trainer(strategy="uniap", devices=..., num_nodes=...)`` or pass an instance for options.
    At setup, rank 0 profiles the model's chain of layers on a sample batch, solves for the fastest plan that
    fits in memory, and broadcasts it; every rank then keeps its pipeline stage, applies tensor parallelism,
    FSDP or replication per layer, and trains. The plan is printed on rank 0.

    The dataloader's batch is the *global* batch: every rank loads the same batch and takes its share, so the
    result matches one device training on the same batches (within float rounding).

    Model contract (details in :mod:`uniap_lightning.runtime.chain`): the network is one ``nn.Sequential``
    attribute or is listed by a ``uniap_layers()`` method; the loss is ``uniap_loss(output, target)`` or a
    ``loss_fn`` attribute; a batch is ``(input, target)`` or split by ``uniap_split_batch(batch)``. The strategy
    runs the chain itself, so the module's ``training_step`` / ``validation_step`` / ``test_step`` /
    ``predict_step`` are not called (Lightning still requires ``training_step`` to exist); it logs ``train_loss``,
    ``val_loss`` and ``test_loss`` on every rank. Everything else - ``configure_optimizers``, LR schedulers,
    callbacks, gradient accumulation and clipping, ``max_steps``, checkpoints - behaves as usual. Hugging Face
    GPT-2 / Llama and a plain GPT go through :mod:`uniap_lightning.adapters`.

    Arguments:
        cluster: the cluster the planner should assume: a :class:`~uniap_lightning.planner.cluster.Cluster`, a dict
            of its fields, the name of a shipped ``conf/cluster`` entry, or ``None`` for this machine (its
            collectives measured at setup when ``measure_cluster``).
        plan: a pinned plan (a :class:`~uniap_lightning.planner.plan.Plan` or the path of a plan JSON file); skips
            profiling and solving. It must be for this model (layer names, fingerprint) and world size.
        schedule: pipeline schedule when solving: ``"1f1b"`` (default, less activation memory) or ``"gpipe"``.
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
        profile_cache: reuse measured profiles from disk (``<cache>/profiles``, keyed by model structure, sample
            shape, device, world layout and library versions) instead of measuring again.
        profile_repeats: timed runs per layer and micro-batch size (the median is kept).
        profile_micro_batches: micro-batch sizes to time (default: half the sample batch and all of it, at most 16).
        monitor: ``True`` (default) installs a :class:`~uniap_lightning.monitor.UniAPMonitor` with default settings
            (measured vs predicted step time and peak memory, logged as ``uniap/*`` metrics); pass a monitor
            instance for other settings or ``False`` for none.
    """

    strategy_name = "uniap"

    def __init__(
        self,
        *,
        cluster: Cluster | Mapping[str, Any] | str | None = None,
        plan: Plan | str | Path | None = None,
        schedule: str = "1f1b",
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
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        if schedule not in SCHEDULES:
            raise UniAPError(f"schedule={schedule!r} must be one of {list(SCHEDULES)}")
        if solver not in SOLVERS:
            raise UniAPError(f"solver={solver!r} must be one of {list(SOLVERS)}")
        if not time_limit > 0:
            raise UniAPError(f"time_limit must be > 0 seconds, got {time_limit!r}")
        if not timeout_s > 0:
            raise UniAPError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if isinstance(cluster, (str, Mapping)):
            from uniap_lightning.planner.config import cluster_from

            cluster = cluster_from(cluster if isinstance(cluster, str) else dict(cluster))
        elif cluster is not None and not isinstance(cluster, Cluster):
            raise UniAPError(f"cluster must be a Cluster, a dict, a conf/cluster name or None, got "
                             f"{type(cluster).__name__}")
        if plan is not None and not isinstance(plan, Plan):
            plan = Plan.from_json(Path(plan))
        self._pinned_plan: Plan | None = plan
        self._setup_options = SetupOptions(
            cluster=cluster, pinned_plan=plan, schedule=schedule, solver=solver, time_limit_s=float(time_limit),
            profile_path=Path(profile) if profile is not None else None,
            cache_dir=Path(cache_dir) if cache_dir is not None else None, measure_cluster=bool(measure_cluster),
            profile_cache=bool(profile_cache), profile_repeats=max(int(profile_repeats), 1),
            profile_micro_batches=tuple(profile_micro_batches) if profile_micro_batches else None,
        )
        self._setup_result: SetupResult | None = None  # what setup decided (frozen), read by the properties below
        self._runtime: Runtime | None = None
        self._fresh_grads: list[Any] = []
        self._pending_loss: Any = None  # runtime.pipeline.PendingLoss of the last training batch
        self._batch_checked = False
        # SIGTERM agreed on without Lightning's blocking per-batch broadcast (see uniap_lightning.sigterm)
        self._sigterm = AgreedSigterm(guard=self.guard)
        self._monitor = monitor

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Make ``Trainer(strategy="uniap")`` work (called by Lightning for its own strategies, and by us)."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="UniAP automatic hybrid parallelism")

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
        from uniap_lightning.runtime.checks import check_slurm

        world_size = self.num_nodes * self.num_processes
        check_slurm(self.cluster_environment, num_nodes=self.num_nodes, devices=self.num_processes)
        if self._pinned_plan is not None and self._pinned_plan.num_devices != world_size:
            raise UniAPError(
                f"the pinned plan is for num_devices={self._pinned_plan.num_devices} processes but the Trainer has "
                f"{world_size} (devices={self.num_processes} x num_nodes={self.num_nodes})"
            )
        self._setup_distributed()  # process group only; meshes depend on the plan, built in `setup`
        self._keep_users_sampler()

    def _keep_users_sampler(self) -> None:
        """Leave the user's sampler as it is: every rank loads the whole global batch and takes its own share
        (``pipeline.lane_slice``), so the data order must be exactly the one a single device sees.

        Lightning would otherwise replace the sampler of every loader by a ``DistributedSampler``, which for training
        loaders always shuffles (Lightning assumes training data is shuffled), so ``DataLoader(shuffle=False)``
        would train on other batches than one device. Lightning has no public way for a strategy to decline the
        sampler, so the flag it reads is cleared here, before any dataloader is built. A shuffling sampler stays
        the user's: every rank draws the same order from the same seed (checked on the first batch).
        """
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        connector = getattr(trainer, "_accelerator_connector", None)
        if connector is not None:
            connector.use_distributed_sampler = False

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._runtime is not None and self._runtime.chain.module is not self.lightning_module:
            raise UniAPError(
                "this UniAPStrategy already parallelized another LightningModule; use a new Trainer (and strategy) "
                "for each model"
            )
        if not self.lightning_module.automatic_optimization:
            raise UniAPError(
                "UniAPStrategy runs the forward and backward passes itself and needs automatic optimization; "
                "remove `self.automatic_optimization = False` from the LightningModule"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise UniAPError(
                "fp16 mixed precision with a gradient scaler is not supported by UniAPStrategy (the pipeline computes "
                "gradients inside training_step); use precision='bf16-mixed' or '32-true'"
            )
        if self._runtime is None:
            _materialize_distributed_module(self.model, self.root_device)
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            # planning and wrapping draw no random numbers the user's run would see: a shuffling sampler or dropout
            # then follows the same random stream as on one device
            with torch.random.fork_rng(devices=[self.root_device] if self.root_device.type == "cuda" else []):
                self._runtime = self._plan_and_apply(trainer)
            self._device_mesh = self._runtime.meshes.world
            self.lightning_module._device_mesh = self._device_mesh
        self._install_monitor(trainer)
        self._install_loss_logger(trainer)
        self._bind_clipping()
        self._sigterm.install(trainer)  # before Lightning registers its signal handlers (later in Trainer._run)
        self._batch_checked = False
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _plan_and_apply(self, trainer: pl.Trainer) -> Runtime:
        """Setup's decision (:mod:`uniap_lightning.setup`, agreed on by every rank), then the plan applied."""
        import time

        from uniap_lightning.runtime import apply_plan, extract_chain
        from uniap_lightning.setup import Ranks, run_setup

        t0 = time.perf_counter()
        chain = extract_chain(self.lightning_module)
        ranks = Ranks(rank=self.global_rank, world_size=self.world_size, num_nodes=self.num_nodes,
                      devices_per_node=self.num_processes, device=self.root_device)
        result = run_setup(chain, trainer, ranks=ranks, options=self._setup_options,
                           precision=str(self.precision_plugin.precision),
                           forward_context=self.precision_plugin.train_step_context)
        if self.global_rank == 0:
            _print_plan(result.plan, result.origin)
        runtime = apply_plan(chain, result.plan, rank=self.global_rank, device=self.root_device)
        self._setup_result = result.with_timing(setup_s=time.perf_counter() - t0)
        rank_zero_info(self._setup_result.summary())
        return runtime

    def _install_monitor(self, trainer: pl.Trainer) -> None:
        from uniap_lightning.monitor import UniAPMonitor

        if self._monitor is False or self._monitor is None:
            return
        if any(isinstance(cb, UniAPMonitor) for cb in trainer.callbacks):
            return
        mon = self._monitor if isinstance(self._monitor, UniAPMonitor) else UniAPMonitor()
        trainer.callbacks.append(mon)

    def _install_loss_logger(self, trainer: pl.Trainer) -> None:
        if not any(isinstance(cb, _TrainLossLogger) for cb in trainer.callbacks):
            # first, so every later callback (progress bar, checkpointing, the user's) sees this batch's loss
            trainer.callbacks.insert(0, _TrainLossLogger(self))

    def _finish_loss(self) -> torch.Tensor | None:
        """The global mean loss of the last training batch (waits for its background all-reduce), once."""
        pending, self._pending_loss = self._pending_loss, None
        return None if pending is None else self.guard(pending.wait)

    # ------------------------------------------------------------------ steps
    #: True while ``optimizer_step`` runs Lightning's closure: this batch is the last of its accumulation window
    _closing_window = False
    #: True when ``.grad`` holds gradients of the current window (an earlier batch of it ran without stepping);
    #: False on a window's first batch, where Lightning's closure zeroes ``.grad`` before ``backward``
    _window_open = False

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of the whole batch through the plan (the module's ``training_step`` is not called).

        On the last batch of an accumulation window the replicated layers' gradients are averaged during this
        backward, bucket by bucket as they become final (see ``runtime.data_parallel.ReplicatedGrads``); the
        window's earlier gradients go into the buckets with the fresh ones, unless this batch opens the window."""
        from uniap_lightning.runtime.grads import put_grads, take_grads

        rt = self.runtime
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        x, y = rt.chain.split_batch(args[0])
        if not self._batch_checked:
            from uniap_lightning.runtime.checks import check_same_batch

            self.guard(lambda: check_same_batch(x, y))
            self._batch_checked = True
        self._finish_loss()  # a previous batch that never reached on_train_batch_end (an exception in between)
        params = rt.local_parameters()
        previous = take_grads(params)  # kept apart from the fresh ones until `backward` (see runtime.grads)
        closing = self._closing_window
        if closing:
            kept = dict(previous) if self._window_open else {}
            rt.replicated.arm(backward_passes=rt.plan.microbatches, previous=kept)
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        try:
            with self.precision_plugin.train_step_context():
                self._pending_loss = self.guard(lambda: rt.runner.train_step(x, y, rt.chain.loss_fn, scale))
            self.guard(rt.replicated.flush)
        finally:
            rt.replicated.disarm()
        self._window_open = not closing
        self._fresh_grads = take_grads(params)
        put_grads(previous)
        # Lightning needs a tensor now; the global mean replaces it in on_train_batch_end (_TrainLossLogger), where
        # it is also logged, after the gradient averaging and optimizer step had time to overlap its all-reduce.
        return self._pending_loss.local

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Hand the gradients computed in ``training_step`` back (Lightning zeroed ``.grad`` in between), then put
        the replicated layers' averages in, so ``on_after_backward``, clipping and the optimizer see averaged
        gradients (as with DDP)."""
        from uniap_lightning.runtime.grads import add_grads

        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        add_grads(self._fresh_grads)
        self._fresh_grads = []
        self.guard(self.runtime.replicated.finish)  # no-op unless this batch closes the window
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning calls this only on the last batch of an accumulation window and runs that batch's
        ``training_step`` and ``backward`` inside ``closure``: mark them, so the replicated gradients are reduced
        once per optimizer step, overlapped with that batch's backward."""

        def closing_closure() -> Any:
            self._closing_window = True
            try:
                return closure()
            finally:
                self._closing_window = False

        return super().optimizer_step(optimizer, closing_closure, model, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.precision_plugin.val_step_context():
            return self._eval_step("val_loss", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test_loss", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The chain's output for the whole batch, on every rank (the module's ``predict_step`` is not called)."""
        rt = self.runtime
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        batch = args[0]
        if isinstance(batch, (tuple, list)) and len(batch) == 1:
            x = batch[0]
        else:
            x = rt.chain.split_batch(batch)[0] if isinstance(batch, (tuple, list, dict)) else batch
        with self.precision_plugin.predict_step_context():
            return self.guard(lambda: rt.runner.predict_step(x))

    def _eval_step(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        rt = self.runtime
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        x, y = rt.chain.split_batch(args[0])
        loss = self.guard(lambda: rt.runner.eval_step(x, y, rt.chain.loss_fn))
        # the same global mean on every rank; sync_dist averages the epoch's value once, at the epoch's end
        self.lightning_module.log(name, loss, prog_bar=True, sync_dist=True)
        return loss

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
        try:
            return fn()
        except RuntimeError as err:
            if not _is_comm_failure(err):
                raise
            raise UniAPError(
                f"rank {self.global_rank}: a collective or pipeline transfer failed ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}). Another rank probably died or stopped responding; "
                "see its log for the cause."
            ) from err

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

    def _bind_clipping(self) -> None:
        from uniap_lightning.runtime.grads import clip_grad_norm

        n = self.runtime.plan.devices_per_stage

        def clip(params: list[Any], max_norm: float) -> None:
            self.guard(lambda: clip_grad_norm(params, max_norm, n, device=self.root_device))

        self.precision_plugin.bind_global_norm(clip)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from uniap_lightning.runtime.checkpoint import model_state

        return model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from lightning.pytorch.core.optimizer import LightningOptimizer

        from uniap_lightning.runtime.checkpoint import optimizer_state

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer_state(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write the distributed checkpoint into a hidden ``.<name>.partial`` folder, then rename it: a checkpoint
        under its real name is always complete (every shard, ``.metadata`` and ``meta.pt``), even if a rank is
        killed mid-write. A rank whose peer dies meanwhile fails with a :class:`UniAPError`."""
        from uniap_lightning.runtime.checkpoint import partial_path, publish, remove_path

        checkpoint["uniap_plan"] = self.plan.to_dict()
        final = Path(self.broadcast(str(filepath)))
        partial = partial_path(final)
        if self.global_rank == 0:
            remove_path(partial)  # left by a run killed while writing
        self.barrier()
        self.guard(lambda: super(UniAPStrategy, self).save_checkpoint(checkpoint, partial, storage_options))
        self.barrier()  # every rank's shards and rank 0's meta.pt are on disk
        if self.global_rank == 0:
            publish(partial, final)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint saved under any plan (or by any other strategy) into this plan.

        A UniAP / distributed checkpoint folder restores weights and optimizer states, resharded by parameter name.
        A single-file Lightning checkpoint (e.g. from one device or DDP) restores the weights and everything
        Lightning keeps (loops, schedulers, callbacks) but not the optimizer states, whose keys are positions in
        the original optimizer, not names.

        Files are always read with ``weights_only=True`` semantics (tensors and plain data), and a distributed
        checkpoint's pickled ``.metadata`` only with DCP's own classes: a crafted file is refused with a
        :class:`UniAPError` and runs nothing, whatever ``weights_only`` says.
        """
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        from uniap_lightning.runtime import checkpoint as ckpt

        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_file():
            checkpoint = ckpt.load_plain(path)  # never unpickles code, whatever `weights_only` says
            ckpt.load_full_weights(checkpoint["state_dict"], self.lightning_module,
                                   strict=self.lightning_module.strict_loading)
            if checkpoint.pop("optimizer_states", None) and self.optimizers:
                rank_zero_warn(f"{path.name} is a single-file checkpoint: optimizer states start fresh under UniAP")
            return checkpoint
        if not (path / _METADATA_FILENAME).is_file():
            raise UniAPError(f"{path} is neither a checkpoint file nor a distributed checkpoint folder with "
                             f"{_METADATA_FILENAME}")
        ckpt.check_dcp_metadata(path)  # both refused before any weight is touched
        metadata = ckpt.load_plain(path / _METADATA_FILENAME)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        self.guard(lambda: ckpt.load(path, self.lightning_module, optimizers,
                                      strict=self.lightning_module.strict_loading))
        return metadata

    def save_consolidated(self, path: str | Path) -> None:
        """Write all weights, unsharded, into one ``torch.save`` file (on rank 0). Call on every rank."""
        from uniap_lightning.runtime.checkpoint import save_consolidated

        save_consolidated(self.lightning_module, path, rank=self.global_rank)

    @override
    def on_train_end(self) -> None:
        self._sigterm.finish()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._fresh_grads = []
        super().teardown()


class _TrainLossLogger(Callback):
    """Logs ``train_loss`` (the global mean, on every rank) and puts it in the batch's ``outputs["loss"]``.

    Installed by the strategy ahead of every other callback, so later callbacks and the LightningModule's
    ``on_train_batch_end`` see the same value that one process would compute.
    """

    def __init__(self, strategy: UniAPStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.strategy is not self.strategy:
            return
        loss = self.strategy._finish_loss()
        if loss is None:
            return
        if isinstance(outputs, dict) and "loss" in outputs:
            outputs["loss"] = loss / trainer.accumulate_grad_batches  # as Lightning normalizes a returned loss
        pl_module.log("train_loss", loss, prog_bar=True)


def _print_plan(plan: Plan, origin: str) -> None:
    try:
        from uniap_lightning.planner.report import print_plan
    except ImportError:  # the rich report is optional here; the compact summary says the essentials
        from uniap_lightning.runtime.planning import describe

        print(describe(plan, origin), flush=True)
        return
    print_plan(plan, title=f"UniAP plan ({origin})")


def _is_comm_failure(err: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(err, (dist.DistError,)):
        return True
    text = str(err).lower()
    return any(k in text for k in ("connection closed", "connection reset", "timed out", "timeout", "gloo", "nccl",
                                   "broken pipe", "peer"))


def _register_on_import() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from uniap_lightning._autoregister import register

    register(StrategyRegistry)


_register_on_import()  # importing the strategy is enough for Trainer(strategy="uniap")
