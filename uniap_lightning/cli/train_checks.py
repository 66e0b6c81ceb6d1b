"""What ``uniap train`` checks before any rank starts: the config (data, model, trainer, seed, learning rate, what the
shipped corpus can give) and the environment it launches ranks in.

Lightning refuses some Trainer values only when ``fit`` starts (``val_check_interval`` beyond an epoch), others
never (``gradient_clip_val=nan`` trains on NaN); a rank started with a bad environment fails while the others wait
for it. Each check here is one :class:`~uniap_lightning.errors.UniAPError` naming the field and what it accepts.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.analytic import ModelSpec
from uniap_lightning.values import choice, flag, integer, number, short, text

#: the part of the corpus TextDataModule trains on (the rest validates); tests check the two agree
TRAIN_FRACTION = 0.95
#: the most processes `uniap train` starts on one machine, nodes it spans, steps and batches it counts
MAX_DEVICES = 1024
MAX_NODES = 100_000
MAX_STEPS = 10**9
MAX_THREADS = 4096
ACCELERATORS = ("auto", "cpu", "cuda", "gpu")
#: Lightning 2.x's precision values (``Trainer(precision=...)``)
PRECISIONS = (64, 32, 16, "64", "32", "16", "bf16", "64-true", "32-true", "16-true", "16-mixed", "bf16-true",
              "bf16-mixed", "transformer-engine", "transformer-engine-float16")
DATA_KEYS = ("name", "seq_len", "batch_size", "shuffle")
#: Trainer arguments `uniap train` passes itself
OWN_TRAINER_ARGUMENTS = ("strategy", "callbacks", "logger")


def corpus_tokens() -> tuple[int, int]:
    """(training, validation) tokens of the shipped corpus, split as ``TextDataModule`` splits it (one token per
    character), read without importing torch."""
    text_ = (Path(__file__).resolve().parents[1] / "data" / "corpus.txt").read_text()
    cut = int(len(text_) * TRAIN_FRACTION)
    return cut, len(text_) - cut


#: ``trainer.val_check_interval=auto``: validate every this many batches, at most once an epoch
AUTO_VAL_CHECK_INTERVAL = 10
#: ``trainer.limit_val_batches=auto``: validate on this many batches, fewer when the validation split holds fewer
AUTO_LIMIT_VAL_BATCHES = 4


def check_train_config(cfg: DictConfig) -> list[str]:
    """Every value of the `uniap train` config that needs no import of torch or Lightning. The ``auto`` values of
    ``trainer.limit_val_batches`` / ``trainer.val_check_interval`` are replaced in ``cfg`` by what the shipped
    corpus gives for this model and batch; the returned lines say where that differs from the usual figures."""
    data = _mapping(cfg, "data")
    seq_len, batch = _check_model_and_data(cfg, data)
    number(cfg.get("lr"), "lr", low=0, high=1e3, low_open=True, unit="the learning rate")
    integer(cfg.get("seed"), "seed", low=0, high=2**32 - 1)
    _mapping(cfg, "trainer")
    notes = _auto_validation_batches(cfg, seq_len, batch)
    check_trainer_values(_mapping(cfg, "trainer"))
    notes += _auto_val_check_interval(cfg, seq_len, batch)
    _check_corpus_fits(seq_len, batch, _mapping(cfg, "trainer"))
    return notes


def _auto_validation_batches(cfg: DictConfig, seq_len: int, batch: int) -> list[str]:
    """``trainer.limit_val_batches=auto``: :data:`AUTO_LIMIT_VAL_BATCHES`, at most what the corpus's validation
    split holds, and 0 (no validation, said in a note) when it holds less than one batch (llama_7b at 2,048 tokens,
    gpt2_small at 1,024 with batches of 16). A value given by hand is checked as given."""
    if cfg.trainer.get("limit_val_batches") != "auto":
        return []
    val_tokens = corpus_tokens()[1]
    held = (val_tokens // seq_len) // batch
    cfg.trainer.limit_val_batches = min(AUTO_LIMIT_VAL_BATCHES, held)
    if held:
        return []
    return [f"no validation (trainer.limit_val_batches=auto): the corpus's validation split ({val_tokens:,} tokens) "
            f"holds {val_tokens // seq_len:,} sequence(s) of {seq_len:,} tokens, less than one batch of {batch}"]


def _auto_val_check_interval(cfg: DictConfig, seq_len: int, batch: int) -> list[str]:
    """``trainer.val_check_interval=auto``: every :data:`AUTO_VAL_CHECK_INTERVAL` batches, at most once an epoch
    (gpt2_small at 1,024 tokens has 5 batches of 16), as Lightning demands. A value given by hand is checked as
    given (:func:`_check_corpus_fits`). Runs after :func:`check_trainer_values` (``limit_train_batches`` is valid)."""
    trainer = cfg.trainer
    if trainer.get("val_check_interval") != "auto":
        return []
    batches = max(1, _limited((corpus_tokens()[0] // seq_len) // batch, trainer.get("limit_train_batches")))
    trainer.val_check_interval = min(AUTO_VAL_CHECK_INTERVAL, batches)
    if batches >= AUTO_VAL_CHECK_INTERVAL or not _validates(_mapping(cfg, "trainer")):
        return []
    return [f"validating every {batches} batches (trainer.val_check_interval=auto): an epoch of the corpus has "
            f"{batches} batches of {batch} x {seq_len:,} tokens"]


def _mapping(cfg: DictConfig, key: str) -> dict[str, Any]:
    node = cfg.get(key)
    if not OmegaConf.is_dict(node):
        raise UniAPError(f"{key}={short(node)} must be a mapping of {key}.* settings (see `uniap train --help`)")
    return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]


def _check_model_and_data(cfg: DictConfig, data: dict[str, Any]) -> tuple[int, int]:
    unknown = sorted(set(data) - set(DATA_KEYS), key=str)
    if unknown:
        raise UniAPError(f"data.{unknown[0]}: not a data setting of `uniap train`; known: {', '.join(DATA_KEYS)}")
    if data.get("name") != "corpus":
        raise UniAPError(f"data.name={data.get('name')!r}: the shipped dataset is 'corpus'")
    model = _mapping(cfg, "model")
    if model.get("segments") or model.get("embedding", "token") != "token" or model.get("head", "lm") != "lm":
        raise UniAPError(f"model '{model.get('name')}': `uniap train` trains GPT-style language models (see examples/ "
                         "for more)")
    spec = ModelSpec.from_dict(model)
    seq_len = data.get("seq_len")
    if seq_len is None:
        seq_len = spec.seq_len
    else:
        seq_len = integer(seq_len, "data.seq_len", low=1, high=corpus_tokens()[0], unit="tokens per sample, or null "
                          "for model.seq_len")
    batch = integer(data.get("batch_size"), "data.batch_size", low=1, high=corpus_tokens()[0],
                    unit="samples per step, all ranks together")
    flag(data.get("shuffle"), "data.shuffle")
    return seq_len, batch


def _check_corpus_fits(seq_len: int, batch: int, trainer: dict[str, Any]) -> None:
    """The corpus must give at least one training batch (and one validation batch when validation is on), and
    ``val_check_interval`` must fit in an epoch, as Lightning will demand only once fit starts."""
    train_tokens, val_tokens = corpus_tokens()
    windows = train_tokens // seq_len
    if windows < batch:
        # (no sample at all: a smaller batch cannot help, only shorter sequences)
        fix = (f"data.batch_size <= {windows:,} or " if windows else "") + f"data.seq_len <= {train_tokens // batch:,}"
        raise UniAPError(f"data.batch_size={batch} with sequences of {seq_len} tokens: the corpus's training split "
                         f"({train_tokens:,} tokens) gives {windows:,} samples of {seq_len} tokens, fewer than one "
                         f"batch; use {fix}")
    batches = _limited(windows // batch, trainer.get("limit_train_batches"))
    if batches < 1:
        raise UniAPError(f"trainer.limit_train_batches={short(trainer.get('limit_train_batches'))} leaves no "
                         "training batch; give a count >= 1 or a fraction that keeps one")
    if _validates(trainer) and val_tokens // seq_len < batch:
        raise UniAPError(f"data.batch_size={batch} with sequences of {seq_len} tokens: the corpus's validation split "
                         f"({val_tokens:,} tokens) gives {val_tokens // seq_len:,} samples, fewer than one batch; use "
                         f"data.batch_size <= {val_tokens // seq_len:,}, data.seq_len <= {val_tokens // batch:,}, "
                         "or trainer.limit_val_batches=0")
    interval = trainer.get("val_check_interval")
    if (isinstance(interval, int) and not isinstance(interval, bool) and interval > batches
            and trainer.get("check_val_every_n_epoch", 1) is not None and _validates(trainer)):
        raise UniAPError(f"trainer.val_check_interval={interval}: an epoch has {batches:,} training batches "
                         f"(data.batch_size={batch}, data.seq_len={seq_len}); use at most {batches:,}, a fraction of "
                         "an epoch such as 0.5, or null")


def training_batches(cfg: DictConfig) -> int:
    """The training batches of one epoch of a checked config's data, as Lightning counts them (the loader drops
    the last partial batch; ``trainer.limit_train_batches`` cuts it)."""
    seq_len = int(cfg.data.seq_len or cfg.model.seq_len)
    return _limited(corpus_tokens()[0] // seq_len // int(cfg.data.batch_size),
                    _mapping(cfg, "trainer").get("limit_train_batches"))


def check_resume_state(cfg: DictConfig, meta: dict[str, Any], where: str) -> None:
    """A checkpoint's loop state before any rank resumes from it: the Lightning version it names, and its counters
    against each other and this run's data (:mod:`uniap_lightning.runtime.resume_checks`)."""
    from uniap_lightning.runtime.resume_checks import (  # deferred: loads torch; `uniap plan` imports this module
        check_lightning_version, check_resume_counters)

    accumulate = _mapping(cfg, "trainer").get("accumulate_grad_batches") or 1
    check_resume_counters(check_lightning_version(meta, where), where, batches_per_epoch=training_batches(cfg),
                          accumulate=int(accumulate))


def _limited(batches: int, limit: Any) -> int:
    if limit is None:
        return batches
    if isinstance(limit, float):
        return int(batches * limit)
    return min(batches, int(limit))


def _validates(trainer: dict[str, Any]) -> bool:
    limit = trainer.get("limit_val_batches")
    return limit is None or limit > 0


def check_trainer_values(trainer: dict[str, Any]) -> None:
    """The Trainer arguments `uniap train` passes on: each known one in its range (Lightning accepts NaN clipping,
    zero accumulation or a string device count only to fail later, or never)."""
    for key in OWN_TRAINER_ARGUMENTS:
        if key in trainer:
            raise UniAPError(f"trainer.{key}: `uniap train` sets the Trainer's {key} itself; configure the strategy "
                             "with strategy.* overrides")
    for key, value in trainer.items():
        rule = _TRAINER_RULES.get(key)
        if rule is not None:
            rule(value, f"trainer.{key}")
        else:
            _finite_everywhere(value, f"trainer.{key}")


def _optional(check: Any) -> Any:
    return lambda value, name: None if value is None else check(value, name)


def _count(low: int, high: int = MAX_STEPS, *, also: tuple[int, ...] = ()) -> Any:
    def check(value: Any, name: str) -> None:
        if value in also and not isinstance(value, bool) and isinstance(value, int):
            return
        integer(value, name, low=low, high=high, unit=f"or {', '.join(map(str, also))}" if also else "")
    return check


def _count_or_fraction(value: Any, name: str) -> None:
    """Lightning's ``limit_*_batches`` / ``overfit_batches``: a batch count, or a fraction of an epoch in [0, 1]."""
    if isinstance(value, float):  # Lightning: a float is a fraction (1.0: all batches), an int a count
        number(value, name, low=0, high=1, unit="a fraction of the batches, or a count")
    else:
        integer(value, name, low=0, high=MAX_STEPS, unit="batches, or a fraction in [0, 1]")


def _val_check_interval(value: Any, name: str) -> None:
    if value == "auto":  # resolved before this check (_auto_val_check_interval)
        return
    if isinstance(value, (str, dict)):  # a time span ("00:01:00:00"), Lightning checks it
        return
    if isinstance(value, float):  # Lightning: a float is a fraction of an epoch, an int a batch count
        number(value, name, low=0, high=1, low_open=True, unit="a fraction of an epoch, or a batch count")
    else:
        integer(value, name, low=1, high=MAX_STEPS, unit="training batches between validations, or a fraction")


def _fast_dev_run(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        integer(value, name, low=0, high=MAX_STEPS, unit="batches, or true/false")


def _deterministic(value: Any, name: str) -> None:
    if value != "warn":
        flag(value, name)


_TRAINER_RULES: dict[str, Any] = {
    "accelerator": lambda v, n: choice(v, n, ACCELERATORS),
    "devices": lambda v, n: integer(v, n, low=1, high=MAX_DEVICES, unit="processes `uniap train` starts per node"),
    "num_nodes": lambda v, n: integer(v, n, low=1, high=MAX_NODES),
    "precision": _optional(lambda v, n: choice(v, n, PRECISIONS)),
    "max_steps": _count(1, also=(-1,)),
    "min_steps": _optional(_count(0)),
    "max_epochs": _optional(_count(1, also=(-1,))),
    "min_epochs": _optional(_count(0)),
    "fast_dev_run": _fast_dev_run,
    "limit_train_batches": _optional(_count_or_fraction),
    "limit_val_batches": _optional(_count_or_fraction),
    "limit_test_batches": _optional(_count_or_fraction),
    "limit_predict_batches": _optional(_count_or_fraction),
    "overfit_batches": _count_or_fraction,
    "val_check_interval": _optional(_val_check_interval),
    "check_val_every_n_epoch": _optional(_count(1)),
    "num_sanity_val_steps": _optional(_count(0, also=(-1,))),
    "log_every_n_steps": _optional(_count(1)),
    "accumulate_grad_batches": _count(1, 10**6),
    "gradient_clip_val": _optional(lambda v, n: number(v, n, low=0, high=1e12, unit="0 or null: no clipping")),
    "gradient_clip_algorithm": _optional(lambda v, n: choice(v, n, ("norm", "value"))),
    "deterministic": _optional(_deterministic),
    "reload_dataloaders_every_n_epochs": _count(0),
    "default_root_dir": _optional(lambda v, n: text(v, n)),
    **{key: lambda v, n: flag(v, n) for key in ("inference_mode", "use_distributed_sampler", "detect_anomaly",
                                                 "barebones", "sync_batchnorm", "enable_autolog_hparams")},
    **{key: _optional(lambda v, n: flag(v, n)) for key in ("enable_checkpointing", "enable_progress_bar",
                                                            "enable_model_summary", "benchmark")},
}


def _finite_everywhere(value: Any, name: str) -> None:
    """Arguments without a rule of their own: no NaN or infinity anywhere inside."""
    if isinstance(value, float):
        number(value, name, low=-1e300, high=1e300)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _finite_everywhere(item, f"{name}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _finite_everywhere(item, f"{name}[{i}]")


def check_trainer_arguments(trainer: Mapping[str, Any]) -> None:
    """Every ``trainer.*`` key must be an argument of Lightning's ``Trainer`` (imports Lightning)."""
    import lightning.pytorch as pl

    known = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self", *OWN_TRAINER_ARGUMENTS}
    for key in trainer:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean trainer.{close[0]}?)" if close else ""
            raise UniAPError(f"trainer.{key}: Lightning refuses these Trainer arguments: {key!r} is not an argument "
                             f"of lightning.pytorch.Trainer{hint}")


def check_environment(cfg: DictConfig, env: Mapping[str, str] | None = None) -> None:
    """The environment the ranks inherit: ``OMP_NUM_THREADS`` a thread count, and a ``LOCAL_RANK`` set by hand only
    with the launcher's other variables (a lone one makes this process wait for ranks nobody starts)."""
    env = os.environ if env is None else env
    threads = env.get("OMP_NUM_THREADS")
    if threads:
        _env_int(threads, "OMP_NUM_THREADS", low=1, high=MAX_THREADS,
                 what="threads per rank; unset it and `uniap train` shares the cores among its ranks")
    from uniap_lightning.runtime.checks import check_slurm_task  # deferred: loads torch, as above

    check_slurm_task(env)  # SLURM_NTASKS only inside a task srun started
    if "SLURM_NTASKS" in env or "LOCAL_RANK" not in env:
        return  # srun wires the ranks (the strategy checks the allocation), or this process launches them
    devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.num_nodes)
    _env_int(env["LOCAL_RANK"], "LOCAL_RANK", low=0, high=devices - 1, what=f"trainer.devices={devices}")
    if devices * nodes == 1:
        return
    missing = [key for key in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(key)]
    if missing:
        others = devices * nodes - 1
        raise UniAPError(f"LOCAL_RANK={env['LOCAL_RANK']} is set but not {', '.join(missing)}: this process would wait "
                         f"for {others} other rank{'s' if others > 1 else ''} nobody starts. Unset LOCAL_RANK "
                         "(`uniap train` starts its ranks itself), or start every rank with a launcher that sets them "
                         "all (torchrun)")
    _env_int(env["WORLD_SIZE"], "WORLD_SIZE", low=devices * nodes, high=devices * nodes,
             what=f"trainer.devices x trainer.num_nodes")
    _env_int(env["MASTER_PORT"], "MASTER_PORT", low=1, high=65535, what="a TCP port")
    for key in ("NODE_RANK", "GROUP_RANK"):
        if env.get(key):
            _env_int(env[key], key, low=0, high=nodes - 1, what=f"trainer.num_nodes={nodes}")


def _env_int(value: str, name: str, *, low: int, high: int, what: str) -> int:
    stripped = value.strip()
    if not (stripped.isascii() and stripped.isdigit() and len(stripped) <= 12) or not low <= int(stripped) <= high:
        span = f"{low:,}" if low == high else f"an integer from {low:,} to {high:,}"
        raise UniAPError(f"environment variable {name}={short(value)} must be {span} ({what})")
    return int(stripped)
