"""Hostile command lines and environments: each is one ``error:`` line and exit status 2 before any work (no
profiling, no rank started), or works. Most cases call the checks in-process (the CLI runs the same functions);
a handful run the CLI as a user does, to check the whole path: one error line, no traceback, no solver banner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from uniap_lightning.errors import UniAPError

HUGE = "9" * 5000  # a 5,000-digit number


def uniap(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout, check=False)


def assert_one_error_line(res: subprocess.CompletedProcess[str], message: str) -> None:
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
    assert len(errors) == 1 and message in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert "Python-MIP" not in res.stdout + res.stderr  # python-mip's import banner
    # before any work: no Lightning banner, no profiling, no rank started
    assert "GPU available" not in res.stdout + res.stderr and "profil" not in res.stdout.lower()


def _train_config(*overrides: str):
    from uniap_lightning.cli.overrides import compose_checked

    return compose_checked("fit", list(overrides))


# ---------------------------------------------------------------------------------------------- uniap train config
@pytest.mark.parametrize(("overrides", "message"), [
    (["model.layers=nan"], "layers=nan must be an integer from 1 to 100,000"),
    (["model.layers=2.5"], "layers=2.5 must be an integer"),
    (["model.layers=abc"], "layers='abc' must be an integer"),
    (["model.layers=-3"], "layers=-3 must be an integer"),
    (["model.layers=100000000"], "layers=100000000 must be an integer from 1 to 100,000"),
    (["model.hidden=nan"], "hidden=nan must be an integer"),
    (["model.heads=3"], "hidden=64 is not divisible by heads=3"),
    (["+model.kv_heads=-1"], "kv_heads=-1 must be an integer from 1 to 4"),
    (["+model.kv_heads=3"], "heads=4 is not divisible by kv_heads=3"),
    (["lr=nan"], "lr=nan must be a finite number > 0"),
    (["lr=-1"], "lr=-1 must be a finite number > 0"),
    (["lr=1e400"], "lr=inf must be a finite number"),
    (["seed=-1"], "seed=-1 must be an integer from 0 to 4,294,967,295"),
    (["data.seq_len=-1"], "data.seq_len=-1 must be an integer from 1 to 94,406"),
    (["data.seq_len=100000"], "data.seq_len=100000 must be an integer from 1 to 94,406"),
    (["data.seq_len=400", "trainer.limit_val_batches=1"],
     "the corpus's validation split (4,969 tokens) gives 12 samples, fewer than one batch"),
    (["data.batch_size=0"], "data.batch_size=0 must be an integer"),
    (["data.batch_size=2000", "trainer.limit_val_batches=0"],
     "the corpus's training split (94,406 tokens) gives 1,475"),
    (["data.shuffle=maybe"], "data.shuffle='maybe' must be true or false"),
    (["+data.rows=3"], "data.rows=3: `uniap train` has no data setting 'rows'; its data settings: name, seq_len"),
    (["trainer.devices=auto"], "trainer.devices='auto' must be an integer from 1 to 1,024"),
    (["trainer.devices=0"], "trainer.devices=0 must be an integer"),
    (["trainer.num_nodes=nan"], "trainer.num_nodes=nan must be an integer"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 must be an integer from 1 to 1,000,000,000 (or -1)"),
    pytest.param([f"trainer.max_steps={HUGE[:4000]}"], "trainer.max_steps=an integer of about 4,000 digits must be an "
                 "integer", id="max_steps-4000-digits"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be an integer from 1"),
    (["trainer.val_check_interval=1000"], "trainer.val_check_interval=1000: an epoch has 92 training batches"),
    (["trainer.val_check_interval=1.5"], "trainer.val_check_interval=1.5 must be a finite number > 0 and <= 1"),
    (["trainer.limit_val_batches=nan"], "trainer.limit_val_batches=nan must be a finite number >= 0 and <= 1"),
    (["trainer.precision=17"], "trainer.precision=17 must be one of"),
    (["+trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 must be an integer from 1"),
    (["+trainer.gradient_clip_val=nan"], "trainer.gradient_clip_val=nan must be a finite number >= 0"),
    (["+trainer.gradient_clip_algorithm=max"], "trainer.gradient_clip_algorithm='max' must be one of 'norm', 'value'"),
    (["+trainer.max_epochs=0"], "trainer.max_epochs=0 must be an integer"),
    (["+trainer.strategy=ddp"], "trainer.strategy: `uniap train` sets the Trainer's strategy itself"),
    (["trainer=3"], "trainer=3 must be a mapping of trainer.* settings"),
])
def test_bad_train_values_are_refused_before_any_rank_starts(overrides: list[str], message: str) -> None:
    from uniap_lightning.cli.train import check_config

    with pytest.raises(UniAPError, match=None) as err:
        check_config(_train_config(*overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    [], ["model=tiny_llama"], ["trainer.max_steps=-1"], ["trainer.val_check_interval=0.5"], ["model.layers=2.0"],
    ["trainer.val_check_interval=null", "trainer.limit_val_batches=0", "data.batch_size=500"],
    ["+trainer.gradient_clip_val=1.0", "+trainer.deterministic=warn", "+trainer.max_time=00:00:01:00"],
    ["trainer.precision=bf16-mixed", "+trainer.fast_dev_run=true", "data.seq_len=32"],
])
def test_sane_train_values_pass(overrides: list[str]) -> None:
    """Accepted, and changed only where the config said ``auto`` (resolved to a number): every value the user set
    is kept as set."""
    from omegaconf import OmegaConf

    from uniap_lightning.cli.train import check_config

    cfg = _train_config(*overrides)
    before = OmegaConf.to_container(cfg, resolve=False)
    notes = check_config(cfg)
    after = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(notes, list) and all(isinstance(n, str) and "\n" not in n for n in notes), notes
    changed = _changed_values(before, after)
    assert all(old == "auto" and type(new) in (int, float) and new >= 0 for old, new in changed.values()), changed
    for override in overrides:
        key = override.lstrip("+").partition("=")[0]
        where = "model.name" if key == "model" else key  # a config group: the chosen config's name
        assert key not in changed and OmegaConf.select(cfg, where) == _value_as_composed(override), override
    assert "auto" not in (after["trainer"]["limit_val_batches"], after["trainer"]["val_check_interval"])


def _changed_values(before: object, after: object, key: str = "") -> dict[str, tuple[object, object]]:
    """``{dotted key: (before, after)}`` of every leaf that differs (a key added or removed counts)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: dict[str, tuple[object, object]] = {}
        for k in sorted(set(before) | set(after), key=str):
            out.update(_changed_values(before.get(k, "<absent>"), after.get(k, "<absent>"), f"{key}{k}."))
        return out
    return {} if before == after else {key.rstrip("."): (before, after)}


def _value_as_composed(override: str) -> object:
    """The value Hydra's override grammar reads from ``key=value`` (``00:00:01:00`` stays a string, ``2.0`` a
    float, ``null`` None)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([override])[0].value()


def test_unknown_trainer_argument_names_a_close_one() -> None:
    from uniap_lightning.cli.train_checks import check_trainer_arguments

    with pytest.raises(UniAPError, match=r"trainer.max_step: Lightning refuses .*did you mean trainer.max_steps"):
        check_trainer_arguments({"max_step": 3})


def test_corpus_sizes_match_the_data_module() -> None:
    from uniap_lightning.cli.train_checks import corpus_tokens
    from uniap_lightning.data import TextDataModule

    train_tokens, val_tokens = corpus_tokens()
    data = TextDataModule(seq_len=64, batch_size=16)
    assert len(data.train_set) == train_tokens // 64 and len(data.val_set) == val_tokens // 64


# ---------------------------------------------------------------------------------------------- uniap plan records
@pytest.mark.parametrize(("field", "value", "message"), [
    ("layers", float("nan"), "layers=nan must be an integer"),
    pytest.param("layers", 10**5000 - 1, "layers=an integer of about 5,000 digits must be an integer from 1 to 100,000",
                 id="layers-5000-digits"),
    ("seq_len", float("inf"), "seq_len=inf must be an integer"),
    ("kv_heads", 3, "heads=8 is not divisible by kv_heads=3"),
    ("kv_heads", 16, "kv_heads=16 must be an integer from 1 to 8"),
    ("dtype", [1], "dtype=[1] must be one of"),
    ("gated_mlp", "false", "gated_mlp='false' must be true or false"),
    ("vocab", -5, "vocab=-5 must be an integer"),
    ("segments", [{"layers": 2}], "segments[0] lacks the field(s)"),
])
def test_model_spec_refuses_hostile_fields(field: str, value: object, message: str) -> None:
    from uniap_lightning.planner.analytic import ModelSpec
    from uniap_lightning.planner.config import load_group

    with pytest.raises(UniAPError) as err:
        ModelSpec.from_dict({**load_group("model", "tiny_llama"), field: value})
    assert message in str(err.value)


@pytest.mark.parametrize(("fields", "message"), [
    ({"global_batch_size": 10**18}, "batch_size (global_batch_size) must be a positive integer up to 1,000,000,000"),
    ({"global_batch_size": float("nan")}, "got nan"),
    ({"global_batch_size": 8, "weight_bytes": float("nan")}, "weight_bytes=nan must be a finite number"),
    ({"global_batch_size": 8, "max_microbatches": 0}, "max_microbatches=0 must be an integer"),
    ({"global_batch_size": 8, "microbatches": (True,)}, "microbatches=[True]: each candidate"),
    ({"global_batch_size": 8, "schedule": ["1f1b"]}, "schedule=['1f1b'] must be one of"),
])
def test_training_config_refuses_hostile_fields(fields: dict, message: str) -> None:
    from uniap_lightning.planner.problem import TrainingConfig

    with pytest.raises(UniAPError) as err:
        TrainingConfig(**fields)
    assert message in str(err.value)


@pytest.mark.timeout(60)  # a safety net: trial division to the square root of 10**18 would run for hours
def test_divisors_of_huge_numbers_return() -> None:
    from uniap_lightning.planner.problem import MAX_GLOBAL_BATCH_SIZE, TrainingConfig, divisors

    assert len(divisors(10**18)) == 19 * 19 and divisors(10**18)[-1] == 10**18
    assert divisors(999_999_937) == [1, 999_999_937]  # the largest prime below the bound: ~16,000 trial divisions
    big = TrainingConfig(global_batch_size=MAX_GLOBAL_BATCH_SIZE)
    assert big.microbatch_candidates() == [1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64]


# ---------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize(("command", "args", "message"), [
    ("train", ["trainer.enable_progress_bar=false"], "use +trainer.enable_progress_bar=false to add a key"),
    ("train", ["modèle=1"], "the character 'è' at position 3 is not in Hydra's override grammar"),
    ("train", ["model.name=é"], "a value with other characters must be quoted"),
    ("plan", ["a=[1,"], "a=[1, is not a valid override"),
    ("train", ["lr=${nope}"], "lr: the interpolation ${nope} names no key of the config"),
    pytest.param("plan", [f"model.layers={HUGE}"], "the value cannot be read", id="layers-5000-digits"),
    ("plan", ["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("plan", ["model=nope"], "unknown model 'nope'"),
])
def test_bad_command_lines_are_one_line(command: str, args: list[str], message: str) -> None:
    from uniap_lightning.cli.overrides import check_command_line

    with pytest.raises(UniAPError) as err:
        check_command_line(command, args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_sweeps_and_hydra_flags_still_parse() -> None:
    from uniap_lightning.cli.overrides import check_command_line

    sweep = ["-m", "model=gpt2_small,llama_7b", "batch_size=16,32"]
    flags = ["--cfg", "job", "+trainer.enable_progress_bar=false", "hydra.verbose=true"]
    assert check_command_line("plan", sweep) == sweep  # handed to Hydra as written (no file path to rename)
    assert check_command_line("train", flags) == flags
    with pytest.raises(UniAPError, match="unknown model 'nope'"):  # the sweep's values are each checked
        check_command_line("plan", ["-m", "model=gpt2_small,nope"])


# a key added with `+` (or given without it) that nothing reads is refused, and no message suggests such a `+` form
@pytest.mark.parametrize(("command", "args", "message"), [
    ("plan", ["+cp_method=x"], "cp_method=x: `uniap plan` (and evaluate, explain) has no setting 'cp_method': the "
                               "planner chooses each layer's context-parallel method among 'ulysses', 'ring' itself "
                               "('x' is none of them); restrict the search with pp="),
    ("plan", ["+cp=-1"], "cp=-1: `uniap plan` (and evaluate, explain) has no setting 'cp': the planner chooses each "
                         "layer's context-parallel degree itself"),
    ("evaluate", ["++cp=2"], "cp=2: `uniap plan` (and evaluate, explain) has no setting 'cp'"),
    ("plan", ["cp_method=x"], "cp_method=x: `uniap plan` (and evaluate, explain) has no setting 'cp_method'"),
    ("plan", ["+shedule=gpipe"], "shedule=gpipe: `uniap plan` (and evaluate, explain) has no setting 'shedule' (did "
                                 "you mean schedule?); its settings: batch_size, schedule"),
    ("plan", ["-m", "seed=1,2"], "seed=1: `uniap plan` (and evaluate, explain) has no setting 'seed'"),
    ("train", ["+lr2=1"], "lr2=1: `uniap train` has no setting 'lr2' (did you mean lr?)"),
    ("train", ["+cp=2"], "cp=2: `uniap train` has no setting 'cp': the planner chooses each layer's context-parallel "
                         "degree itself; restrict its search with strategy.pp="),
    ("train", ["+strategy.cp_method=x"], "strategy.cp_method=x: UniAPStrategy has no argument 'cp_method'; the planner "
                                         "chooses each layer's context-parallel method among 'ulysses', 'ring'"),
    ("train", ["strategy.shedule=gpipe"], "strategy.shedule=gpipe: UniAPStrategy has no argument 'shedule' (did you "
                                          "mean strategy.schedule?)"),
])
def test_keys_nothing_reads_are_refused_without_a_plus_hint(command: str, args: list[str], message: str) -> None:
    from uniap_lightning.cli.overrides import check_command_line

    with pytest.raises(UniAPError) as err:
        check_command_line(command, args)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value) and "use +" not in str(err.value) and "=+" not in str(err.value)


def test_plus_keys_something_reads_still_compose() -> None:
    from uniap_lightning.cli.overrides import check_command_line, known_settings

    assert set(known_settings("fit")) == set(_train_config())  # the settings are conf/fit.yaml's
    check_command_line("plan", ["+model.kv_heads=2", "+hydra.job.env_set.X=1"])
    check_command_line("train", ["+trainer.enable_progress_bar=false", "strategy._target_=my.Subclass",
                                 "+strategy.my_option=1"])


def test_cli_refuses_an_added_key_nothing_reads() -> None:
    assert_one_error_line(uniap("plan", "model=tiny_gpt", "cluster=local_cpu", "+cp_method=x"),
                          "cp_method=x: `uniap plan` (and evaluate, explain) has no setting 'cp_method'")


def _pinned_plan_file(tmp_path: Path) -> Path:
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.plan import Plan

    plan = Plan.from_assignment(stage_of_layer=[0, 0, 1, 1], strategies=[Strategy(1, 1)] * 4,
                                layer_names=["a", "b", "c", "d"], pp=2, microbatches=2, schedule="1f1b",
                                global_batch_size=16, num_devices=2)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    return path


@pytest.mark.parametrize(("override", "message"), [
    ("strategy.schedule=gpipe", "schedule='gpipe' steers the planner's search; a pinned plan (plan=) is not searched "
                                "and has its own schedule: give one of them"),
    ("strategy.virtual_stages=2", "virtual_stages=2 steers the planner's search; a pinned plan (plan=) is not searched "
                                  "and has its own virtual_stages"),
    ("strategy.pp=2", "pp=2 steers the planner's search; a pinned plan (plan=) is not searched and has its own pp"),
    ("strategy.compression=powersgd", "compression='powersgd' steers the planner's search; a pinned plan (plan=) is "
                                      "not searched and has each layer's compression"),
    ("strategy.compression_options={start_iter:5}", "compression_options={'start_iter': 5} steers the planner's "
                                                    "search; a pinned plan (plan=) is not searched and has its own "
                                                    "compression_options (edit the plan file's)"),
])
def test_train_refuses_search_options_next_to_a_pinned_plan(tmp_path: Path, override: str, message: str) -> None:
    """`uniap train strategy.plan=... strategy.schedule=gpipe` ran the plan's schedule without a word (while
    strategy.pp=2 was refused): every option the plan fixes is refused alike, before any rank starts."""
    from uniap_lightning.cli.train import build_strategy

    plan = _pinned_plan_file(tmp_path)
    build_strategy(_train_config(f"strategy.plan={plan}", "strategy.schedule=auto"))  # the defaults pass
    with pytest.raises(UniAPError) as err:
        build_strategy(_train_config(f"strategy.plan={plan}", override))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(("args", "message"), [
    (["train", "model.layers=nan"], "model 'tiny_gpt': layers=nan must be an integer from 1 to 100,000"),
    (["train", "trainer.enable_progress_bar=false"], "use +trainer.enable_progress_bar=false"),
    (["train", "trainer.devices=2", "+model.kv_heads=3"], "heads=4 is not divisible by kv_heads=3"),
    (["plan", "batch_size=1000000000000000000"], "must be a positive integer up to 1,000,000,000"),
    (["plan", "model.heads=7"], "hidden=768 is not divisible by heads=7"),
    (["plan", "pp=nan"], "pp=nan must be a pipeline degree from 1 to 16,777,216"),
])
def test_cli_prints_one_error_line(args: list[str], message: str) -> None:
    assert_one_error_line(uniap(*args), message)


# ---------------------------------------------------------------------------------------------- the environment
@pytest.mark.parametrize(("env", "message"), [
    # exported in a shell, outside any allocation: Lightning's RuntimeError about --ntasks before
    ({"SLURM_NTASKS": "2"}, "SLURM_NTASKS=2 is set but not SLURM_JOB_ID, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID: "
                            "this process is not a task srun started (Lightning would take it for one); unset "
                            "SLURM_NTASKS to run outside SLURM, or start the command with srun"),
    # inside an allocation (salloc) but not started by srun: Lightning would wait for tasks nobody starts
    ({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}, "SLURM_NTASKS=1 is set but not SLURM_PROCID, SLURM_LOCALID"),
    ({"SLURM_NTASKS": "two", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"},
     "SLURM_NTASKS=two is not a task count"),
    ({"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"},
     "SLURM_NTASKS=2 without SLURM_NTASKS_PER_NODE: Lightning needs the tasks per node; submit with --ntasks-per-node"),
])
def test_slurm_variables_outside_a_slurm_task_are_refused(env: dict[str, str], message: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`uniap train` (before any rank starts) and ``UniAPStrategy()`` (before the Trainer reads them) alike."""
    from uniap_lightning.cli.train_checks import check_environment
    from uniap_lightning.strategy import UniAPStrategy

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    with pytest.raises(UniAPError) as err:
        check_environment(_train_config("trainer.devices=2"), env)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UniAPError, match=message.split(":")[0]):
        UniAPStrategy()
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # Lightning does not take an interactive job for srun's
    UniAPStrategy()


@pytest.mark.parametrize(("env", "message"), [
    ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0' must be an integer from 1"),
    ({"OMP_NUM_THREADS": "abc"}, "OMP_NUM_THREADS='abc' must be an integer from 1"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 is set but not WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' must be an integer from 0 to 1"),
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "WORLD_SIZE='4' must be 2"),
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, "MASTER_PORT='99999'"),
])
def test_bad_environments_are_refused(env: dict[str, str], message: str) -> None:
    from uniap_lightning.cli.train_checks import check_environment

    with pytest.raises(UniAPError) as err:
        check_environment(_train_config("trainer.devices=2"), env)
    assert message in str(err.value)


def test_launcher_environments_pass() -> None:
    from uniap_lightning.cli.train_checks import check_environment

    """Each launcher's environment passes, and the same environment with one value off is refused: the check read
    it (it does not pass everything)."""
    cfg = _train_config("trainer.devices=2")
    torchrun = {"OMP_NUM_THREADS": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500", "NODE_RANK": "0"}
    srun = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "LOCAL_RANK": "0"}  # srun wires the ranks
    for env, off, message in [({}, {"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0'"),
                              (torchrun, {"WORLD_SIZE": "3"}, "WORLD_SIZE='3' must be 2"),
                              (torchrun, {"NODE_RANK": "1"}, "NODE_RANK='1'"),
                              (srun, {"OMP_NUM_THREADS": "-2"}, "OMP_NUM_THREADS='-2'")]:
        assert check_environment(cfg, env) is None
        with pytest.raises(UniAPError) as err:
            check_environment(cfg, {**env, **off})
        assert message in str(err.value), (env, off, str(err.value))


@pytest.mark.parametrize(("env", "message"), [
    ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0'"),
    ({"OMP_NUM_THREADS": "abc"}, "OMP_NUM_THREADS='abc'"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 is set but not WORLD_SIZE"),
    ({"SLURM_NTASKS": "2"}, "SLURM_NTASKS=2 is set but not SLURM_JOB_ID"),
])
def test_cli_refuses_a_bad_environment_before_starting_ranks(env: dict[str, str], message: str) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                                "OMP_NUM_THREADS", "SLURM_NTASKS")}
    assert_one_error_line(uniap("train", "trainer.devices=2", env={**clean, **env}), message)


# ---------------------------------------------------------------------------------------------- ranks and exits
@pytest.mark.timeout(300)
def test_a_rank_that_dies_at_start_ends_the_run(tmp_path: Path) -> None:
    """Rank 1 dies as it starts (as if killed, or its interpreter broke); rank 0, waiting for it in the rendezvous,
    ends with rank 1's status instead of waiting the collective timeout (30 minutes)."""
    site = tmp_path / "site"
    site.mkdir()
    # a sitecustomize seen only by the rank launched with LOCAL_RANK=1 (rank 0 is started without it)
    (site / "sitecustomize.py").write_text("import os\nif os.environ.get('LOCAL_RANK') == '1':\n    os._exit(7)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "SLURM_NTASKS")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               UNIAP_CACHE_DIR=str(tmp_path / "cache"))
    res = uniap("train", "trainer.devices=2", "trainer.max_steps=2", "+trainer.enable_progress_bar=false",
                "strategy.measure_cluster=false", env=env, cwd=tmp_path, timeout=240)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert errors == ["error: training rank 1 exited with status 7 while rank 0 was still running; see its output "
                      "above (the other ranks were stopped)"], res.stderr[-3000:]
    assert "Traceback" not in res.stderr


def test_a_started_ranks_own_error_is_the_one_line_rank_0_prints(tmp_path: Path) -> None:
    """A started rank that fails with a clear error of its own (here: an environment only it sees) hands that line
    to rank 0, which prints it once; the started rank prints nothing itself."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nif os.environ.get('LOCAL_RANK') == '1':\n"
                                           "    os.environ['OMP_NUM_THREADS'] = 'abc'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "SLURM_NTASKS")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               UNIAP_CACHE_DIR=str(tmp_path / "cache"))
    res = uniap("train", "trainer.devices=2", "trainer.max_steps=2", "+trainer.enable_progress_bar=false",
                "strategy.measure_cluster=false", env=env, cwd=tmp_path, timeout=240)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: training rank 1 exited with status 2"), res.stderr[-3000:]
    assert "OMP_NUM_THREADS" in errors[0], errors


def test_rank_exit_descriptions() -> None:
    from uniap_lightning.cli.ranks import describe_exit

    assert describe_exit(1, 3) == "training rank 1 exited with status 3"
    assert describe_exit(2, -signal.SIGKILL).startswith("training rank 2 was killed by SIGKILL")
    assert describe_exit(1, 130) == "training rank 1 was interrupted (exit status 130)"


def test_the_final_line_without_training_steps() -> None:
    from uniap_lightning.cli.train import _no_training_line

    assert _no_training_line(SimpleNamespace(global_step=30, max_steps=20)) == (
        "no training steps ran: the checkpoint is at step 30 >= max_steps 20")


def test_close_process_group_destroys_every_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    from uniap_lightning.cli.ranks import close_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    dist.new_group([0])
    close_process_group()
    assert not dist.is_initialized()
    close_process_group()  # nothing to close: no error


# ---------------------------------------------------------------------------------------------- Ctrl-C
_BLOCKED_IN_C = """
from datetime import timedelta
from torch.distributed import TCPStore
from uniap_lightning.cli import interrupts

interrupts.install()
store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timedelta(seconds=600))
announced = False
while True:
    try:
        if not announced:  # inside the try: the first Ctrl-C may come while "ready" is still being printed
            announced = True
            print("ready", flush=True)
        store.get("never set")  # waits in C (no Python handler runs), as rank 0 waits for a rank that died
    except KeyboardInterrupt:
        pass  # the first Ctrl-C came while in Python: wait in C again for the second
"""

_IN_PYTHON = """
import sys
from uniap_lightning.cli import apps, main

def busy():
    print("ready", flush=True)
    while True:
        pass

apps.plan_main = busy
sys.exit(main.main(["plan"]))
"""


def _started(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.timeout(120)
def test_second_ctrl_c_stops_at_once_even_inside_a_c_call() -> None:
    proc = _started(_BLOCKED_IN_C)
    assert proc.stderr is not None
    proc.send_signal(signal.SIGINT)
    assert proc.stderr.readline() == "interrupted; press Ctrl-C again to stop at once\n"  # printed by the thread
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert proc.stderr.read() == ""


@pytest.mark.timeout(120)
def test_ctrl_c_reaching_main_is_one_line_and_status_130() -> None:
    proc = _started(_IN_PYTHON)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.splitlines() == ["interrupted; press Ctrl-C again to stop at once"], err
