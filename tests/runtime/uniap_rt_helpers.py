"""Shared pieces of the runtime tests: a tiny chain model, plans, and a multi-process runner.

Multi-process runs use ``torch.multiprocessing`` from a fork server that has imported torch and Lightning once
(``tests/uniap_launch.py``); each process sets the environment
variables of Lightning's ``LightningEnvironment`` (so Lightning does not launch processes itself) and trains with
``accelerator="cpu"`` and the gloo backend. Several cases run one after the other in the same processes (the
process group is created once), which keeps start-up cost low on a 2-core machine.

A *case* is a dict: ``plan`` (a pinned Plan; absent: the strategy solves), ``strategy`` (more UniAPStrategy
arguments), ``module`` (``make_module`` arguments, e.g. ``{"lm": "llama"}`` or ``{"factory": "mod:fn", ...}``),
``data`` (``{"factory": "mod:fn", ...}``: a loader of ``batch`` samples instead of the tiny regression data), ``steps`` or ``epochs``,
``accumulate``, ``clip``, ``limit_val_batches`` and ``predict`` (collect validation loss / predictions),
``save`` / ``resume`` / ``export`` (checkpoint paths relative to the output folder; ``export_format``: the
``save_consolidated`` format), ``validate_only`` (also returns ``local``: this rank's own pieces of the parameters),
``die_at`` / ``hang_s`` (rank 1 dies or hangs at that batch), ``die_while_saving`` (rank ``die_rank``, default 1,
dies as the ``save`` checkpoint starts), ``sigterm_at`` (rank ``sigterm_rank``, default 1,
sends itself SIGTERM at the end of that batch), ``sigterm_in_setup`` (the same, in the ``setup`` hook), ``skew_data`` (ranks load different data).
"""

from __future__ import annotations

from uniap_lightning.planner.decision import Strategy
import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import uniap_launch
from torch import nn

IN, HID, OUT = 8, 16, 4
N_SAMPLES = 64
NAMES = ["net.0", "net.1", "net.2", "net.3"]


def benchmark(name: str) -> Any:
    """The script ``benchmarks/<name>.py`` as module ``name`` (spawned ranks import it by that name: the
    benchmarks folder is on their path), loaded once."""
    import importlib.util
    import sys

    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VOCAB, SEQ = 64, 8


def make_lm_module(kind: str) -> Any:
    """A tiny causal LM through an adapter: Hugging Face GPT-2 / Llama (random weights) or the plain GPT."""
    from uniap_lightning.adapters import CausalLMModule, hf_layers

    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        layers = hf_layers(GPT2LMHeadModel(cfg))
    elif kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                          tie_word_embeddings=False)
        layers = hf_layers(LlamaForCausalLM(cfg))
    else:
        from uniap_lightning.adapters.gpt import GPT, GPTConfig

        layers = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)).layers()

    class SGDLM(CausalLMModule):
        # Adam turns rounding noise in near-zero gradients (e.g. GPT-2's key bias) into visible weight
        # differences; SGD keeps the comparison with one process well-conditioned.
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return SGDLM(layers)


def _factory(path: str) -> Any:
    """``"module:function"`` imported (models and data of other test files, e.g. ``uniap_models:tuple_module``)."""
    import importlib

    mod, _, fn = path.partition(":")
    return getattr(importlib.import_module(mod), fn)


def make_module(lr: float | None = None, optimizer: str = "sgd", lm: str | None = None, factory: str | None = None,
                **kwargs: Any) -> Any:
    """The case's LightningModule: a factory's (given the case's ``lr`` when it names one), the LM chain or the MLP
    chain (SGD with momentum or Adam + StepLR, ``lr`` 0.1 unless named)."""
    import lightning.pytorch as pl

    if factory is not None:
        torch.manual_seed(0)
        return _factory(factory)(**kwargs, **({} if lr is None else {"lr": lr}))
    lr = 0.1 if lr is None else lr
    if lm is not None:
        return make_lm_module(lm)

    class ChainModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(IN, HID),
                nn.Sequential(nn.Linear(HID, 2 * HID), nn.GELU(), nn.Linear(2 * HID, HID)),
                nn.Sequential(nn.Linear(HID, 2 * HID), nn.Tanh(), nn.Linear(2 * HID, HID)),
                nn.Linear(HID, OUT),
            )
            self.loss_fn = nn.MSELoss()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
            self.log("val_loss", loss)
            return loss

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0])

        def configure_optimizers(self) -> Any:
            if optimizer == "adam":
                opt = torch.optim.Adam(self.parameters(), lr=lr)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
                return {"optimizer": opt, "lr_scheduler": sched}
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    torch.manual_seed(0)
    return ChainModel()


def make_data(batch_size: int, n: int = N_SAMPLES, lm: bool = False, seed: int = 1, shuffle: bool = False) -> Any:
    """A loader as users write it; ``shuffle=True`` draws its order from the global random state at each epoch."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    if lm:
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return DataLoader(TensorDataset(ids, ids), batch_size=batch_size, shuffle=shuffle, drop_last=True)
    x = torch.randn(n, IN, generator=g)
    y = torch.randn(n, OUT, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, drop_last=True)


def strategy(s: Any) -> Any:
    """The tests' shorthand for a layer's strategy: ``(dp, tp, shard)`` with a bool (True: zero3), or ``(dp, tp,
    dp_mode, recompute, compression)``; a dict of ``Strategy.of`` arguments (``{"dp": 1, "tp": 1, "cp": 2}``: the
    sequence over cp ranks, Ulysses unless ``cp_method`` says; ``"sp": True``); a Strategy passes through."""
    from uniap_lightning.planner.decision import Strategy

    if isinstance(s, Strategy):
        return s
    if isinstance(s, dict):
        kw = {"dp": 1, "tp": 1, **s}
        if kw.get("cp", 1) > 1:
            kw.setdefault("cp_method", "ulysses")
        return Strategy.of(**kw)
    d, t, *rest = s
    if rest and isinstance(rest[0], bool):
        rest = ["zero3" if rest[0] else "replicate"]
    return Strategy.of(d, t, *rest)


def make_plan(strategies: list[Any], stage_of_layer: list[int], *, pp: int, microbatches: int,
              schedule: str = "1f1b", batch: int = 16, world: int = 2, names: list[str] | None = None,
              virtual_stages: int = 1) -> Any:
    from uniap_lightning.planner.plan import Plan

    return Plan.from_assignment(
        stage_of_layer=stage_of_layer, strategies=[strategy(s) for s in strategies], layer_names=names or NAMES,
        pp=pp, microbatches=microbatches, schedule=schedule, global_batch_size=batch, num_devices=world,
        virtual_stages=virtual_stages,
    )


class LossRecorder:
    """Records the loss Lightning sees for every batch (a Callback, built lazily to keep imports light)."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl

        class _Rec(pl.Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                self.losses.append(float(outputs["loss"]))

        return _Rec()


class DieAt:
    """Kills its process abruptly at the start of a given batch (a rank dying mid-training)."""

    @staticmethod
    def make(batch_idx: int, hang_s: float = 0.0) -> Any:
        import lightning.pytorch as pl

        class _Die(pl.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
                if idx == batch_idx and hang_s:
                    time.sleep(hang_s)  # a stuck rank: the others must give up after the collective timeout
                elif idx == batch_idx:
                    os._exit(17)

        return _Die()


class DieWhileSaving:
    """Kills its process abruptly when Lightning starts writing a checkpoint (a launcher killed mid-save)."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl

        class _Die(pl.Callback):
            def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
                os._exit(17)

        return _Die()


class SigtermAt:
    """Sends its own process SIGTERM at the end of a given batch (a preempted job: SLURM, Kubernetes)."""

    @staticmethod
    def make(batch_idx: int) -> Any:
        import signal

        import lightning.pytorch as pl

        class _Term(pl.Callback):
            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                if idx == batch_idx:
                    os.kill(os.getpid(), signal.SIGTERM)

        return _Term()

    @staticmethod
    def make_in_setup() -> Any:
        """Sends SIGTERM from the ``setup`` hook: after the process group is up, before the strategy's setup."""
        import signal

        import lightning.pytorch as pl

        class _TermInSetup(pl.Callback):
            def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
                os.kill(os.getpid(), signal.SIGTERM)

        return _TermInSetup()


def trainer_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments of a case. Lightning's defaults (the distributed sampler among them) are kept, as users
    keep them; ``"defaults": True`` keeps *every* default (logger, checkpointing, progress bar, model summary)."""
    # Checkpoint tests count epochs: Lightning resumes a run stopped by max_steps at a different batch.
    if "epochs" in case:
        limits = {"max_epochs": case["epochs"], "max_steps": -1}
    else:
        limits = {"max_steps": case.get("steps", 5)}
    if case.get("defaults"):
        return dict(accelerator="cpu", **limits)
    return dict(
        accelerator="cpu",
        **limits,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=case.get("accumulate", 1),
        gradient_clip_val=case.get("clip"),
        limit_val_batches=case.get("limit_val_batches", 0),
        num_sanity_val_steps=0,
    )


def _data(case: dict[str, Any]) -> Any:
    if "data" in case:  # {"factory": "module:function", ...keyword arguments}
        spec = dict(case["data"])
        return _factory(spec.pop("factory"))(batch_size=case.get("batch", 16), **spec)
    seed = 1 + int(os.environ.get("LOCAL_RANK", 0)) if case.get("skew_data") else 1  # a broken sampler
    return make_data(case.get("batch", 16), lm="lm" in case.get("module", {}), seed=seed,
                     shuffle=case.get("shuffle", False))


def reference(case: dict[str, Any]) -> dict[str, Any]:
    """Single process, no UniAP: what every plan must reproduce."""
    import lightning.pytorch as pl

    torch.set_num_threads(1)
    module = make_module(**case.get("module", {}))
    rec = LossRecorder.make()
    import tempfile

    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:  # for Lightning's default logger and checkpoints
        os.chdir(scratch)
        try:
            trainer = pl.Trainer(devices=1, callbacks=[rec], **trainer_kwargs(case))
            extra = _fit(trainer, module, case, ckpt=None)
        finally:
            os.chdir(here)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"losses": rec.losses, "state": state, **extra}


def _fit(trainer: Any, module: Any, case: dict[str, Any], ckpt: str | None) -> dict[str, Any]:
    """Fit, then collect the validation loss and predictions when the case asks for them."""
    val = _data(case) if case.get("limit_val_batches") else None
    trainer.fit(module, _data(case), val_dataloaders=val, ckpt_path=ckpt)
    extra: dict[str, Any] = {}
    if "train_loss" in trainer.callback_metrics:  # the last batch's logged loss, on this rank
        extra["train_loss"] = float(trainer.callback_metrics["train_loss"])
    if val is not None:
        extra["val_loss"] = float(trainer.callback_metrics["val_loss"])
    if case.get("predict"):
        extra["predictions"] = torch.cat(trainer.predict(module, _data(case)))
    return extra


_REFERENCES: dict[str, dict[str, Any]] = {}


def reference_for(case: dict[str, Any]) -> dict[str, Any]:
    """Single-process results for a case (cached: several plans share one reference)."""
    key = json.dumps({k: v for k, v in case.items() if k not in ("plan", "strategy")}, sort_keys=True, default=str)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference({k: v for k, v in case.items() if k != "plan"})
    return _REFERENCES[key]


def _run_case(rank: int, world: int, case: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    import lightning.pytorch as pl

    from uniap_lightning.runtime.checkpoint import full_local_state
    from uniap_lightning.strategy import UniAPStrategy

    os.environ["WORLD_SIZE"] = str(world)
    module = make_module(**case.get("module", {}))
    rec = LossRecorder.make()
    strategy = UniAPStrategy(plan=case.get("plan"), **case.get("strategy", {}))
    callbacks = [rec]
    if "die_at" in case and rank == case.get("die_rank", 1):
        callbacks.append(DieAt.make(case["die_at"], case.get("hang_s", 0.0)))
    if case.get("die_while_saving") and rank == case.get("die_rank", 1):
        callbacks.append(DieWhileSaving.make())
    if "sigterm_at" in case and rank == case.get("sigterm_rank", 1):
        callbacks.append(SigtermAt.make(case["sigterm_at"]))
    if case.get("sigterm_in_setup") and rank == case.get("sigterm_rank", 1):
        callbacks.append(SigtermAt.make_in_setup())
    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=callbacks, **trainer_kwargs(case))
    ckpt = str(out_dir / case["resume"]) if "resume" in case else None
    if case.get("validate_only"):
        metrics = trainer.validate(module, _data(case), ckpt_path=ckpt)
        from uniap_lightning.runtime.data_parallel import local_tensor

        local = {k: local_tensor(p).detach().clone() for k, p in module.named_parameters()}  # this rank's pieces
        return {"val_loss": metrics[0]["val_loss"], "state": full_local_state(module), "origin": strategy.plan_origin,
                "local": local}
    try:
        extra = _fit(trainer, module, case, ckpt)
    except SystemExit as stop:  # Lightning's SIGTERMException
        return {"stopped": type(stop).__name__, "global_step": trainer.global_step, "losses": rec.losses,
                "received_sigterm": trainer.received_sigterm}
    if "save" in case:
        trainer.save_checkpoint(out_dir / case["save"])
    if "export" in case:
        strategy.save_consolidated(out_dir / case["export"], format=case.get("export_format"))
    from uniap_lightning.monitor import UniAPMonitor

    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, UniAPMonitor)), None)
    from uniap_lightning.runtime.data_parallel import local_tensor

    shapes = {k: tuple(local_tensor(p).shape) for k, p in module.named_parameters()}  # this rank's pieces
    runtime = strategy._runtime  # None where the fit stopped before setup
    exchanges = [] if runtime is None else [(r.name, r.bytes_sent) for r in runtime.all_to_all.records]
    return {"losses": rec.losses, "state": full_local_state(module), "plan": strategy.plan.to_dict(),
            "origin": strategy.plan_origin, "monitor": monitor.last if monitor is not None else None,
            "local_shapes": shapes, "all_to_all": exchanges, **extra}


def worker(rank: int, world: int, port: int, cases: dict[str, dict[str, Any]], out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        NODE_RANK="0", GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    os.chdir(out_dir)  # Lightning's default logger and checkpoints write to the working directory
    if os.environ.get("UNIAP_TEST_DUMP_S"):  # debugging aid: where is each rank after this many seconds?
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["UNIAP_TEST_DUMP_S"]), exit=False)
    results: dict[str, Any] = {}
    for name, case in cases.items():
        start = time.monotonic()
        try:
            results[name] = _run_case(rank, world, case, Path(out_dir))
        except Exception as err:  # recorded, so one broken case does not hide the others
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(),
                             "failed_after_s": time.monotonic() - start}
            break  # the process group may be unusable after a failure
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def spawn_and_watch(world: int, cases: dict[str, dict[str, Any]], out_dir: Path, timeout_s: float) -> dict[int, Any]:
    """Start the ranks without tearing the others down when one dies; wait for each at most ``timeout_s``.

    Returns ``{rank: exit code or None if still running}``; survivors are killed after the wait.
    """
    ctx = uniap_launch.start_processes(worker, args=(world, free_port(), cases, str(out_dir)), nprocs=world,
                                       join=False)
    codes: dict[int, Any] = {}
    for rank, proc in enumerate(ctx.processes):
        proc.join(timeout_s)
        codes[rank] = proc.exitcode
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return codes


def spawn(world: int, cases: dict[str, dict[str, Any]], out_dir: Path, fn: Any = worker) -> list[dict[str, Any]]:
    uniap_launch.start_processes(fn, args=(world, free_port(), cases, str(out_dir)), nprocs=world)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def merge_states(results: list[dict[str, Any]], name: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for res in results:
        merged.update(res[name]["state"])
    return merged


def assert_close_to_reference(
    results: list[dict[str, Any]], name: str, ref: dict[str, Any], rtol: float = 1e-5
) -> None:
    for r, res in enumerate(results):
        if "error" in res.get(name, {}):
            raise AssertionError(f"rank {r} failed in case {name}: {res[name]['error']}\n{res[name]['traceback']}")
        if name not in res:
            raise AssertionError(f"rank {r} did not run case {name} (an earlier case failed)")
    for r, res in enumerate(results):
        losses = torch.tensor(res[name]["losses"])
        expected = torch.tensor(ref["losses"])
        assert losses.shape == expected.shape, (r, losses, expected)
        torch.testing.assert_close(losses, expected, rtol=rtol, atol=1e-7)
        if "train_loss" in ref:  # logged on every rank (also ranks without the last stage): the global mean
            assert res[name].get("train_loss") == pytest.approx(ref["train_loss"], rel=rtol), (r, res[name], ref)
    merged = merge_states(results, name)
    assert set(merged) == set(ref["state"]), (sorted(merged), sorted(ref["state"]))
    for k, v in ref["state"].items():
        torch.testing.assert_close(merged[k], v, rtol=rtol, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
