"""A real one-node SLURM cluster (Debian slurm-wlm + munge, started by scripts/slurm_local.sh): the shipped
sbatch example trains on 2 tasks, one rank solves, both use the same plan; a task/devices mismatch fails with
the clear error. Installs the packages when missing (needs root, as in CI); skip with `-m "not slurm"`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]


def sh(*args: str, timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False, **kw)


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("slurmctld") is None and os.geteuid() != 0:
        pytest.skip("SLURM is not installed and this is not root")
    had_srun = shutil.which("srun") is not None
    up = sh("bash", str(ROOT / "scripts" / "slurm_local.sh"), "start", timeout=900)
    if up.returncode != 0:
        sh("bash", str(ROOT / "scripts" / "slurm_local.sh"), "stop")
        pytest.fail(f"could not start SLURM:\n{up.stdout}\n{up.stderr}")
    yield
    sh("scancel", "--user", os.environ.get("USER", "root"))
    down = sh("bash", str(ROOT / "scripts" / "slurm_local.sh"), "stop", timeout=600)
    assert down.returncode == 0, down.stderr
    # what the start installed is gone: later Lightning runs would warn about an unused srun
    assert had_srun or shutil.which("srun") is None
    assert subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 1


# what a launcher or an in-process Trainer leaves in the environment; sbatch exports the environment to the job,
# and a stale MASTER_PORT there made rank 0 fail with EADDRINUSE (a user submits from a clean shell)
LAUNCH_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
               "LOCAL_WORLD_SIZE")


def _job_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}, **extra}


def sbatch(tmp_path: Path, *extra: str) -> tuple[int, str]:
    log = tmp_path / "job.out"
    env = _job_env(UNIAP_CACHE_DIR=str(tmp_path / "cache"))
    res = sh("sbatch", "--wait", f"--output={log}", str(ROOT / "examples" / "slurm" / "train.sbatch"),
             *extra, cwd=tmp_path, env=env)
    text = log.read_text() if log.exists() else ""
    return res.returncode, text + res.stdout + res.stderr


def test_sbatch_example_trains_with_one_plan(slurm, tmp_path):
    code, log = sbatch(tmp_path, "trainer.max_steps=6", "trainer.val_check_interval=null",
                       "trainer.limit_val_batches=0", f"out={tmp_path / 'res'}")
    assert code == 0, log[-5000:]
    ranks = [json.loads((tmp_path / "res" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["plan"] == ranks[1]["plan"]  # one plan, broadcast
    assert ranks[0]["plan_origin"] == "solver"
    assert log.count("UniAP plan (solver)") == 1  # printed by the one rank that solved
    assert ranks[0]["steps"] == 6 and ranks[0]["final_loss"] is not None


def test_tasks_not_matching_devices_fail_clearly(slurm, tmp_path):
    # 2 tasks per node, but the Trainer is told devices=1: both ranks must stop with the explanation
    log_file = tmp_path / "bad.out"
    res = sh("sbatch", "--wait", f"--output={log_file}", "--wrap",
             "srun python -m uniap_lightning.cli.main train trainer.devices=1 trainer.max_steps=2",
             "--ntasks-per-node=2", "--nodes=1", cwd=tmp_path, env=_job_env())
    text = log_file.read_text() if log_file.exists() else res.stderr
    assert res.returncode != 0
    assert "SLURM runs 2 tasks per node" in text
    assert "Traceback" not in text.split("error:")[-1]


def test_submitit_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    from uniap_lightning.planner.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="fit", overrides=["hydra/launcher=uniap_slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == 2 and launcher.nodes == 1
