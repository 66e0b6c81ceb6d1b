"""``uniap train``: a shipped model on the shipped corpus with ``Trainer(strategy="uniap")``.

With ``trainer.devices > 1`` outside SLURM (and not already a launched rank), this process starts the other
ranks itself (same command, ``LOCAL_RANK`` set), as Lightning's launcher would (:mod:`uniap_lightning.cli.launch`),
then trains as rank 0. Under SLURM ``srun`` starts the ranks and Lightning's SLURM environment wires them.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from uniap_lightning.cli.checkpoint_dir import lock_checkpoint_dir
from uniap_lightning.cli.estimate import estimate
from uniap_lightning.cli.launch import (CHILD_GRACE_S, end_children, launch_other_ranks, stopped_by_sigterm,
                                        threads_per_rank)
from uniap_lightning.cli.own_configs import hydra_search_path, strategy_cluster
from uniap_lightning.cli.pinned_plan import pin_plan
from uniap_lightning.cli.train_checks import (check_environment, check_resume_state, check_train_config,
                                              check_trainer_arguments)
from uniap_lightning.cli.ranks import (
    PREEMPTED_EXIT_CODE,
    SETUP_STOP_LINE,
    RankWatch,
    close_process_group,
    rank_error,
    report_error_to_launcher,
    setup_stop_message,
)
from uniap_lightning.errors import UniAPError
from uniap_lightning.files import check_output_folder, write_json_atomic
from uniap_lightning.profiling.estimate import SAID
from uniap_lightning.sigterm import SetupSigterm, StoppedBySigterm


def check_config(cfg: DictConfig) -> list[str]:
    """Refuse what `uniap train` cannot run, before any other rank is started: every value of the config
    (:mod:`uniap_lightning.cli.train_checks`; the model through ``ModelSpec``, as `uniap plan` checks it). The
    ``auto`` Trainer values are resolved in ``cfg``; the returned lines say how, where that matters."""
    notes = check_train_config(cfg)
    if cfg.get("out"):  # a folder of rank<N>.json: refused now if it cannot be one, not after training
        check_output_folder(str(cfg.out), "out=")
    return notes


def build_module(cfg: DictConfig) -> tuple[Any, Any, int]:
    """The LightningModule, the data module and the sequence length of a checked config."""
    check_config(cfg)
    return _module_and_data(cfg)


def _module_and_data(cfg: DictConfig) -> tuple[Any, Any, int]:
    from uniap_lightning.data import TextDataModule  # deferred: loads lightning; the estimate prints before it

    module, seq_len = _module(cfg)
    data = TextDataModule(seq_len=seq_len, batch_size=int(cfg.data.batch_size), shuffle=bool(cfg.data.shuffle),
                          seed=int(cfg.seed))
    return module, data, seq_len


def _module(cfg: DictConfig) -> tuple[Any, int]:
    """The model alone (no data, no checks: the caller has checked the config)."""
    from uniap_lightning.adapters import CausalLMModule  # deferred: loads lightning; the estimate prints before it
    from uniap_lightning.adapters.gpt import GPT, GPTConfig  # deferred: loads lightning, as above
    from uniap_lightning.data import VOCAB_SIZE  # deferred: loads lightning, as above

    spec = cfg.model
    seq_len = int(cfg.data.seq_len or spec.seq_len)
    gpt = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=seq_len, n_layer=int(spec.layers), n_head=int(spec.heads),
                        n_embd=int(spec.hidden)))
    # named as the analytic model names its layers (embed, block0 .., lm_head): a plan by `uniap plan` pins
    return CausalLMModule(gpt.named_layers(), lr=float(cfg.lr)), seq_len


def _one_copy_of_each_log_line() -> None:
    """Lightning gives its loggers (``lightning``, ``lightning.pytorch``) handlers of their own; Hydra's logging
    setup gives the root logger one too, and messages that propagate printed every line twice. Keep only Hydra's."""
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        log = logging.getLogger(name)
        for handler in list(log.handlers):
            log.removeHandler(handler)
        log.propagate = True


def _quiet_library_warnings() -> None:
    """Warnings a `uniap train` user can do nothing about: Lightning 2.6 calls a torch API that torch 2.13
    deprecates (``isinstance(treespec, LeafSpec)``), once per rank; and at a mid-epoch resume Lightning calls the
    loader "not resumable" (it has no ``state_dict``), but the shipped data module builds a loader that starts at
    the checkpoint's batch (:class:`uniap_lightning.data.ResumableOrder`)."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended "
                            r"and your dataloader is not resumable")


def run_train(cfg: DictConfig, overrides: list[str]) -> dict[str, Any]:
    """Train as this rank (starting the other ranks first when this process is the launcher), holding the lock on
    ``checkpoint_dir`` (:mod:`uniap_lightning.cli.checkpoint_dir`) for the whole run."""
    notes = pin_plan(cfg, overrides) + check_config(cfg)  # a plan file's batch and processes first: checked as set
    said = None
    check_environment(cfg)  # a bad environment is refused before anything is said or measured
    if os.environ.get("LOCAL_RANK", "0") == "0":
        for note in notes:
            print(f"note: {note}", flush=True)
        # before Lightning loads (seconds): how long setup will measure, and how to shorten it (issue 42)
        said = estimate(cfg, threads=int(threads_per_rank(int(cfg.trainer.devices))))
        if said is not None:
            print(said, flush=True)
    check_before_launch(cfg)
    lock = lock_checkpoint_dir(str(cfg.checkpoint_dir))
    saved_env, saved_threads = dict(os.environ), _torch_threads()
    try:
        if said is None:
            return _run_train_locked(cfg, overrides)
        with SAID:  # setup says no estimate of its own
            return _run_train_locked(cfg, overrides)
    finally:
        if lock is not None:
            lock.release()
        # a sweep (-m) runs its jobs in this process: the next job must start its ranks anew, not find this job's
        # LOCAL_RANK / MASTER_PORT / WORLD_SIZE (it then took itself for a launched rank and waited alone)
        os.environ.clear()
        os.environ.update(saved_env)
        if saved_threads is not None:
            import torch

            torch.set_num_threads(saved_threads)


def _torch_threads() -> int | None:
    """This process's torch thread count when torch is imported already (the launcher changes it), else None."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _run_train_locked(cfg: DictConfig, overrides: list[str]) -> dict[str, Any]:
    children: list[subprocess.Popen] = []
    # SIGTERM before training: this rank and the ranks it started stop at once (see SetupSigterm)
    SetupSigterm.install_once(forward=lambda signum: [c.send_signal(signum) for c in children if c.poll() is None])
    resume: Path | None = None
    try:
        resume = resume_from(cfg)  # (reads the checkpoint's meta.pt: a SIGTERM here is a stop too)
        _one_copy_of_each_log_line()
        _quiet_library_warnings()
        children.extend(launch_other_ranks(cfg, overrides))
        with RankWatch(children):  # a started rank that fails ends the run (rank 0 may wait in C for it)
            result = _train(cfg, overrides, resume)
            close_process_group()
    except StoppedBySigterm:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(setup_stop_message(resume), file=sys.stderr, flush=True)
        else:
            report_error_to_launcher(SETUP_STOP_LINE)  # rank 0 says it once, as the run's stop
        end_children(children, grace_s=CHILD_GRACE_S)
        raise
    except SystemExit as stop:
        # preempted: every rank writes its part of the checkpoint, then stops by itself
        end_children(children, grace_s=None if stop.code == PREEMPTED_EXIT_CODE else CHILD_GRACE_S)
        raise
    except BaseException:
        # this rank's error is the one to report; the others got the same (setup agrees on failures) or stop
        # because of it. One still waiting (e.g. in a rendezvous this rank never reached) is ended. But when a
        # started rank was stopped by SIGTERM before training, this error (a peer gone from a collective) is that
        # stop seen from here: the run ends as stopped, with the preemption status, not with this traceback.
        stopped = None if isinstance(sys.exc_info()[1], UniAPError) else stopped_by_sigterm(children)
        end_children(children, grace_s=CHILD_GRACE_S)
        if stopped is not None:
            print(setup_stop_message(resume, rank=stopped), file=sys.stderr, flush=True)
            raise StoppedBySigterm() from None
        raise
    bad = [(rank, child, code) for rank, child in enumerate(children, start=1) if (code := child.wait())]
    if bad:
        rank, child, code = bad[0]
        said = rank_error(child)
        raise UniAPError(f"training rank {rank} exited with status {code}: {said}" if said else
                         f"training rank {rank} exited with status {code}; see its output above")
    return result


def _train(cfg: DictConfig, overrides: list[str], resume: Path | None) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

    from uniap_lightning.callbacks import (  # deferred: loads lightning; the estimate prints before it
        CheckpointOnSigterm, PerplexityLogger, StepProgressBar, ThroughputTimer)

    pl.seed_everything(int(cfg.seed), verbose=False)
    module, data, _ = _module_and_data(cfg)  # checked by run_train before any rank started
    strategy = build_strategy(cfg)
    ppl, timer = PerplexityLogger(window=5), ThroughputTimer(int(cfg.data.batch_size))
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    saver = CheckpointOnSigterm(cfg.checkpoint_dir)
    callbacks = [ppl, timer, saver]
    if trainer_kwargs.get("enable_progress_bar", True):
        callbacks.append(StepProgressBar())
    try:
        # where Lightning's own default logger writes: <default_root_dir>/lightning_logs/version_N/
        logger = pl.loggers.CSVLogger(trainer_kwargs.get("default_root_dir") or ".", name="lightning_logs")
        trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, logger=logger, **trainer_kwargs)
    except (TypeError, ValueError, MisconfigurationException) as err:
        raise UniAPError(f"trainer.*: Lightning refuses these Trainer arguments: {err}") from err
    try:
        trainer.fit(module, data, ckpt_path=str(resume) if resume is not None else None)
    except SIGTERMException:
        if trainer.global_rank == 0:
            again = " ".join([a for a in overrides if not a.startswith("resume=")] + ["resume=auto"])
            if saver.failed is not None:
                print(f"error: stopped by SIGTERM at step {trainer.global_step}: {saver.lost_work(trainer.global_step)}",
                      file=sys.stderr, flush=True)
            else:
                print(f"stopped by SIGTERM at step {trainer.global_step}; checkpoint {saver.saved}", flush=True)
            print(f"resume with: uniap train {again}", flush=True)
        close_process_group()  # every rank stopped at the same batch and saved together: end as a finished run does
        raise SystemExit(PREEMPTED_EXIT_CODE) from None
    loss = trainer.callback_metrics.get("train_loss")
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "model": cfg.model.name,
        "steps": trainer.global_step,
        "final_loss": float(loss) if loss is not None else None,
        "train_ppl": ppl.last_train_ppl,
        "val_ppl": ppl.last_val_ppl,
        "measured_samples_per_s": timer.samples_per_s,
        "samples_per_s": strategy.plan.estimate.samples_per_s if strategy.plan.estimate else None,
        "plan_origin": strategy.plan_origin,
        "plan": strategy.plan.to_dict(),
    }
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / f"rank{trainer.global_rank}.json", result)
    if trainer.global_rank == 0 and result["final_loss"] is None:
        print(_no_training_line(trainer), flush=True)
    elif trainer.global_rank == 0:
        predicted = f"{result['samples_per_s'] or float('nan'):.1f}"
        rate = (f"{timer.samples_per_s:.1f} samples/s measured{_plan_work_rate(trainer, timer.batch)} ({predicted} "
                "predicted)" if timer.samples_per_s else
                f"throughput not measured (the first {timer.warmup} steps are warm-up; {predicted} samples/s predicted)")
        print(f"final train loss {result['final_loss']:.4f}, perplexity {result['train_ppl'] or float('nan'):.2f}, "
              f"{rate}")
    return result


def _no_training_line(trainer: Any) -> str:
    """The last line of a fit that ran no training step (a resumed checkpoint already at ``max_steps``)."""
    step, limit = trainer.global_step, trainer.max_steps
    if limit is not None and limit >= 0 and step >= limit:
        return f"no training steps ran: the checkpoint is at step {step} >= max_steps {limit}"
    return f"no training steps ran (at step {step})"


def check_before_launch(cfg: DictConfig) -> None:
    """What needs Lightning, checked before any other rank starts (the environment the ranks inherit was checked
    before the estimate line, in :func:`run_train`): the Trainer's argument names, the strategy's arguments (built
    once and dropped)."""
    check_trainer_arguments(OmegaConf.to_container(cfg.trainer, resolve=True))  # type: ignore[arg-type]
    build_strategy(cfg)


def _plan_work_rate(trainer: Any, batch: int) -> str:
    """", N in the plan's work": the monitor's last figure for the part of a step the plan predicts (on a CPU the
    prediction is compared with it, see uniap_lightning.monitor); empty without one."""
    from uniap_lightning.monitor import UniAPMonitor  # deferred: loads lightning; the estimate prints before it

    for cb in trainer.callbacks:
        if isinstance(cb, UniAPMonitor) and cb.last and cb.last.get("plan_work_s"):
            return f", {batch / cb.last['plan_work_s']:.1f} in the plan's work"
    return ""


def resume_from(cfg: DictConfig) -> Path | None:
    """The checkpoint to resume: ``resume=auto`` (the newest usable one in ``checkpoint_dir``: damaged ones are
    skipped with a warning, and a fresh start says what was lost; none at all: a fresh start) or ``resume=PATH``
    (must be a usable checkpoint). Either is then checked against this run (:func:`check_resume`) before any rank
    starts: one error line for a checkpoint of another model or one already past ``trainer.max_steps``."""
    from uniap_lightning.callbacks import newest_checkpoint  # deferred: loads lightning; the estimate prints before it
    from uniap_lightning.runtime.checkpoint import (  # deferred: loads torch.distributed (~1 s), as lightning above
        is_complete_checkpoint, partial_path)
    from uniap_lightning.runtime.checkpoint_safety import checkpoint_problem  # deferred: loads torch.distributed

    if not cfg.resume:
        return None
    lead = os.environ.get("LOCAL_RANK", "0") == "0"
    if str(cfg.resume) == "auto":
        folder = Path(str(cfg.checkpoint_dir))
        skipped: list[tuple[Path, str]] = []
        found = newest_checkpoint(folder, skipped=skipped)
        if lead:
            for path, why in skipped:
                print(f"warning: resume=auto: skipping the damaged checkpoint {path}: {why}", file=sys.stderr, flush=True)
            half = sorted(folder.glob(partial_path(Path("step-*.ckpt")).name)) if folder.is_dir() else []
            if found is not None:
                later = f" (the steps after it, in {len(skipped)} damaged checkpoint(s), are trained again)" if skipped else ""
                print(f"resume=auto: resuming from {found}{later}", flush=True)
            elif skipped or half:
                print(f"resume=auto: no usable checkpoint in {folder}/ ({len(skipped)} damaged, {len(half)} "
                      "half-written): starting fresh; the steps they held are lost", flush=True)
            else:
                print(f"resume=auto: no checkpoint in {folder}/, starting fresh", flush=True)
        path = found
    else:
        path = Path(str(cfg.resume))
        if not (path.is_file() or is_complete_checkpoint(path)):
            raise UniAPError(f"resume={str(path)!r} is not a checkpoint (a checkpoint file, or a folder with .metadata "
                             "and meta.pt); use resume=auto for the newest one in checkpoint_dir")
        why = checkpoint_problem(path) if path.is_dir() else None
        if why is not None:
            raise UniAPError(f"resume={str(path)!r}: the checkpoint is damaged: {why}; use an older one, or resume=auto "
                             "(which skips damaged checkpoints)")
    if path is not None:
        check_resume(cfg, path)
    return path


def check_resume(cfg: DictConfig, path: Path) -> None:
    """Refuse a checkpoint this run cannot continue: one at or past ``trainer.max_steps`` (nothing would train), or
    one of another model (weights missing, extra or of other shapes: layer count, sizes, sequence length). The
    model is built on the meta device, so this costs no memory."""
    import torch

    from uniap_lightning.runtime.checkpoint import load_plain  # deferred: loads torch.distributed (~1 s)
    from uniap_lightning.runtime.checkpoint_safety import check_meta, read_metadata  # deferred: loads torch.distributed

    meta = load_plain(path / "meta.pt" if path.is_dir() else path)
    check_meta(meta, path / "meta.pt" if path.is_dir() else path, require_loops=path.is_dir())
    check_resume_state(cfg, meta, f"resume: {path / 'meta.pt' if path.is_dir() else path}")  # version, counters
    step, max_steps = meta["global_step"], cfg.trainer.get("max_steps")
    if max_steps is not None and int(max_steps) >= 0 and step >= int(max_steps):
        raise UniAPError(f"resume: {path} is at step {step} and trainer.max_steps={int(max_steps)}: nothing would "
                         f"train; give trainer.max_steps above {step}")
    with torch.device("meta"):
        module, _ = _module(cfg)
    mine = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if path.is_dir():
        saved = {k[len("state_dict."):]: tuple(getattr(v, "size", ()))
                 for k, v in read_metadata(path).state_dict_metadata.items() if k.startswith("state_dict.")}
    else:
        weights = meta.get("state_dict") if isinstance(meta.get("state_dict"), dict) else {}
        saved = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    shapes = [f"{k}: saved {list(saved[k])}, model {list(mine[k])}" for k in sorted(set(mine) & set(saved))
              if saved[k] != mine[k]]
    problems = ([f"{len(missing)} weights missing (e.g. {', '.join(missing[:2])})"] if missing else []) + (
        [f"{len(extra)} weights of another model (e.g. {', '.join(extra[:2])})"] if extra else []) + (
        [f"{len(shapes)} shapes differ (e.g. {shapes[0]})"] if shapes else [])
    if missing and any(k.startswith("chain.") and k.split(".")[1].isdigit() for k in extra):
        problems.append("its layers are numbered (chain.0, chain.1, ...): it was saved by a `uniap train` before "
                        "its layers were named as the analytic model's (chain.embed, chain.block0, ...), which "
                        "cannot resume it")
    if problems:
        raise UniAPError(f"resume: {path} was saved from another model than model={cfg.model.name} "
                         f"(layers={cfg.model.layers}, hidden={cfg.model.hidden}, seq_len={cfg.data.seq_len or cfg.model.seq_len}): "
                         f"{'; '.join(problems)}")


def build_strategy(cfg: DictConfig) -> Any:
    """``UniAPStrategy`` from the ``strategy`` group: every argument of the class is a ``strategy.*`` override."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from uniap_lightning.strategy import UniAPStrategy  # deferred: loads lightning; the estimate prints before it

    own = {"cluster": strategy_cluster(cfg.strategy.get("cluster"), list(hydra_search_path().dirs))}  # --config-dir's
    try:
        strategy = instantiate(cfg.strategy, _convert_="all", **{k: v for k, v in own.items() if v is not None})
    except InstantiationException as err:
        cause = err.__cause__ if isinstance(err.__cause__, UniAPError) else None
        raise cause or UniAPError(f"strategy.*: {'; '.join(str(err).split(chr(10))[:2])}") from err  # one line
    if not isinstance(strategy, UniAPStrategy):
        raise UniAPError(f"strategy._target_ must be uniap_lightning.strategy.UniAPStrategy (or a subclass), got "
                         f"{type(strategy).__name__}")
    return strategy
