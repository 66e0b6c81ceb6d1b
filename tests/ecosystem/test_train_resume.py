"""`uniap train` preempted by SIGTERM writes a checkpoint, says how to resume, and `resume=auto` ends exactly where
a run that was never stopped ends (same data order, same steps, same loss)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = ["trainer.devices=2", "trainer.max_steps=24", "trainer.val_check_interval=8", "trainer.limit_val_batches=2",
        "+trainer.enable_progress_bar=false", "strategy.measure_cluster=false"]


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "UNIAP_CACHE_DIR": str(cache)}


def _train(cwd: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", "train", *ARGS, *extra], cwd=cwd,
                          env=_env(cache), capture_output=True, text=True, timeout=600, check=False)


def _final(out: Path) -> dict:
    return json.loads((out / "rank0.json").read_text())


@pytest.mark.timeout(900)
def test_sigterm_then_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (tmp_path / "whole").mkdir()
    whole = _train(tmp_path / "whole", cache, f"out={tmp_path / 'whole_out'}")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]

    run = tmp_path / "preempted"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "uniap_lightning.cli.main", "train", *ARGS], cwd=run,
                            env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a process group of its own, as a scheduler would signal
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the monitor's first report comes after warm-up + one window of steps
        seen.append(line)
        if "UniAP monitor:" in line:
            os.killpg(proc.pid, signal.SIGTERM)
            break
    rest = proc.communicate(timeout=300)[0]
    output = "".join(seen) + rest
    assert proc.returncode == 143, output[-4000:]
    assert "stopped by SIGTERM at step" in output and "resume with: uniap train" in output, output[-4000:]
    step = int(output.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert 0 < step < 24
    assert (run / "checkpoints" / f"step-{step:08d}.ckpt" / ".metadata").is_file()
    assert not list((run / "checkpoints").glob(".*partial"))

    # what a resume must refuse, each with one line before any rank starts: another model, nothing left to train
    for extra, why in (("model.layers=3", "saved from another model.*3 shapes differ|weights of another model"),
                       ("data.seq_len=32", "saved from another model.*shapes differ"),
                       (f"trainer.max_steps={step}", f"is at step {step} and trainer.max_steps={step}: nothing")):
        refused = _train(run, cache, "resume=auto", extra)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert refused.returncode == 2 and len(errors) == 1 and re.search(why, errors[0]), refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr

    # SIGTERM while resume=auto reads the checkpoint: a stop (status 143, the stop's own line), never "damaged"
    proc = subprocess.Popen([sys.executable, "-m", "uniap_lightning.cli.main", "train", *ARGS, "resume=auto"], cwd=run,
                            env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if "resume=auto: resuming from" in line:
            os.killpg(proc.pid, signal.SIGTERM)
            break
    output = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, output[-4000:]
    assert "stopped by SIGTERM" in output and "damaged" not in output and "Traceback" not in output, output[-4000:]

    # a newer checkpoint that is damaged (a shard cut short) is skipped, with a warning naming it
    good = run / "checkpoints" / f"step-{step:08d}.ckpt"
    damaged = good.with_name(f"step-{step + 1:08d}.ckpt")
    shutil.copytree(good, damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:10])
    resumed = _train(run, cache, "resume=auto", f"out={tmp_path / 'resumed_out'}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {Path('checkpoints') / good.name}" in resumed.stdout, resumed.stdout[-3000:]
    assert f"skipping the damaged checkpoint {Path('checkpoints') / damaged.name}: the shard {shard.name} is truncated" \
        in resumed.stderr
    a, b = _final(tmp_path / "whole_out"), _final(tmp_path / "resumed_out")
    assert b["steps"] == a["steps"] == 24
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-5)


def test_resume_path_must_be_a_checkpoint(tmp_path: Path) -> None:
    res = _train(tmp_path, tmp_path / "cache", f"resume={tmp_path}")
    assert res.returncode == 2
    assert "is not a checkpoint" in res.stderr and "Traceback" not in res.stderr
