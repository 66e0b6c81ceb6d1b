"""Plan offline, then run it (issue 42, item 9): a plan `uniap plan` writes for a shipped model pins into `uniap
train` of the same model (real CLI processes, 2 ranks) and into `UniAPStrategy(plan=...)`; a plan for another run
is one error line naming what to change, before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def uniap(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "UNIAP_CACHE_DIR": str(cwd / "cache")})


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`uniap plan` for a 2-device cluster (local_cpu has 4), at the default global batch (32)."""
    folder = tmp_path_factory.mktemp("planned")
    res = uniap("plan", "model=tiny_gpt", "cluster=local_cpu", "cluster.devices_per_node=2", "out=plan.json",
                cwd=folder)
    assert res.returncode == 0, res.stderr[-3000:]
    return folder / "plan.json"


def test_a_plan_from_uniap_plan_trains_pinned(tmp_path: Path, plan_file: Path) -> None:
    # the shipped default batch (16) is not the plan's (32): taken from the plan, said in a note
    res = uniap("train", "model=tiny_gpt", f"strategy.plan={plan_file}", "trainer.devices=2", "trainer.max_steps=3",
                "trainer.limit_val_batches=0", "out=res", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"note: data.batch_size=32: the global batch of strategy.plan={plan_file}" in res.stdout
    planned = json.loads(plan_file.read_text())
    for rank in (0, 1):
        got = json.loads((tmp_path / "res" / f"rank{rank}.json").read_text())
        assert got["plan_origin"] == "pinned" and got["steps"] == 3 and got["world_size"] == 2
        assert [lp["name"] for lp in got["plan"]["layers"]] == ["embed", "block0", "block1", "block2", "block3",
                                                                "lm_head"]
        assert got["plan"]["model_fingerprint"] == planned["model_fingerprint"]
    assert not (tmp_path / "cache").exists()  # nothing profiled or solved


@pytest.mark.parametrize(("override", "says"), [
    ("trainer.devices=4", "is for 2 processes but trainer.devices=4 x trainer.num_nodes=1 is 4: give "
                          "trainer.devices=2, or plan for a cluster of 4 devices"),
    ("data.batch_size=16", "is for a global batch of 32 samples but data.batch_size=16: drop data.batch_size (the "
                           "plan's 32 is taken) or plan with batch_size=16"),
    ("model.hidden=128", "was made by `uniap plan` for other layer sizes than model=tiny_gpt (hidden=128"),
])
def test_a_plan_for_another_run_is_one_error_line(tmp_path: Path, plan_file: Path, override: str, says: str) -> None:
    res = uniap("train", "model=tiny_gpt", f"strategy.plan={plan_file}", override, cwd=tmp_path)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith(f"error: strategy.plan={plan_file} ") and says in errors[0], errors[0]
    assert "Traceback" not in res.stderr and not (tmp_path / "lightning_logs").exists()  # before any rank started


@pytest.fixture
def own_environment():
    """A fit in this process sets LOCAL_RANK and the like, which the CLI processes of later tests would inherit."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.usefixtures("own_environment")
def test_the_same_plan_pins_into_the_strategy(tmp_path: Path) -> None:
    """`UniAPStrategy(plan=...)` with the model `uniap train` builds (its layers named as the analytic model's); the
    same layers as an anonymous list are another chain, refused by name."""
    import lightning.pytorch as pl

    from uniap_lightning.adapters import CausalLMModule
    from uniap_lightning.adapters.gpt import GPT, GPTConfig
    from uniap_lightning.data import TextDataModule
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.strategy import UniAPStrategy

    res = uniap("plan", "model=tiny_gpt", "model.layers=1", "cluster=local_cpu", "cluster.devices_per_node=1",
                "batch_size=4", "out=plan.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]

    def fit(named: bool) -> pl.Trainer:
        gpt = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=1, n_head=4, n_embd=64))
        module = CausalLMModule(gpt.named_layers() if named else gpt.layers())
        trainer = pl.Trainer(strategy=UniAPStrategy(plan=str(tmp_path / "plan.json"), monitor=False),
                             accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path)
        trainer.fit(module, TextDataModule(seq_len=64, batch_size=4))
        return trainer

    trainer = fit(named=True)
    assert trainer.global_step == 2 and trainer.strategy.plan_origin == "pinned"
    with pytest.raises(UniAPError, match="first mismatch: plan 'embed' vs model 'chain.0'"):
        fit(named=False)
