"""SIGTERM before the first training step is a stop, never a failure: the run ends with the preemption status and
one line, whichever rank got the signal, and an interrupted checkpoint read is never called damaged."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from uniap_lightning.errors import UniAPError
from uniap_lightning.sigterm import StoppedBySigterm, interruption_in, reraise_interruption


def test_the_stop_survives_a_pickle_round_trip() -> None:
    """DCP gathers each rank's failure through pickle: a copy that raised TypeError read as a damaged checkpoint."""
    copy = pickle.loads(pickle.dumps(StoppedBySigterm()))
    assert isinstance(copy, StoppedBySigterm) and copy.code == 143


def test_an_interruption_behind_a_read_error_is_raised_again_as_a_stop() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = CheckpointException("read", {0: StoppedBySigterm()})
    assert isinstance(interruption_in(wrapped), StoppedBySigterm)
    with pytest.raises(StoppedBySigterm):
        reraise_interruption(wrapped)
    try:
        raise RuntimeError("gloo: connection closed") from KeyboardInterrupt()
    except RuntimeError as err:
        with pytest.raises(KeyboardInterrupt):
            reraise_interruption(err)
    reraise_interruption(ValueError("a bad byte"))  # a failure of its own: returns, the caller says "damaged"


def test_a_read_interrupted_by_sigterm_is_not_called_damaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from uniap_lightning.runtime.checkpoint import dcp_read, load_plain

    def interrupted(*args: object, **kwargs: object) -> None:
        raise CheckpointException("read", {0: pickle.loads(pickle.dumps(StoppedBySigterm()))})

    monkeypatch.setattr(dcp, "load", interrupted)
    with pytest.raises(StoppedBySigterm):
        dcp_read({}, tmp_path, planner=None, no_dist=True)

    def damaged(*args: object, **kwargs: object) -> None:
        raise CheckpointException("read", {0: ValueError("bad bytes")})

    monkeypatch.setattr(dcp, "load", damaged)
    with pytest.raises(UniAPError, match="is damaged"):
        dcp_read({}, tmp_path, planner=None, no_dist=True)

    import torch

    (tmp_path / "meta.pt").write_bytes(b"x" * 16)
    monkeypatch.setattr("uniap_lightning.sigterm._received", True)  # the handler ran: a torn read is the stop's
    monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(EOFError("cut short")))
    with pytest.raises(StoppedBySigterm):
        load_plain(tmp_path / "meta.pt")


def _child_with_rank(pid: int, rank: int) -> int | None:
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={rank}".encode() in env:
            return int(child)
    return None


@pytest.mark.timeout(600)
def test_sigterm_to_rank_1_during_setup_stops_the_run_with_the_preemption_status(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "uniap_lightning.cli.main", "train", "trainer.devices=2",
                             "trainer.max_steps=4", "strategy.measure_cluster=false"], cwd=tmp_path,
                            env={**os.environ, "UNIAP_CACHE_DIR": str(tmp_path / "cache")}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if "UniAP: profiling" in line:  # setup has begun on every rank (rank 1 is waiting for rank 0's profile)
            rank1 = _child_with_rank(proc.pid, 1)
            assert rank1 is not None, "".join(seen)
            os.kill(rank1, signal.SIGTERM)
            break
    output = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, output[-4000:]
    assert "Traceback" not in output and "RuntimeError" not in output, output[-4000:]
    stops = [line for line in output.splitlines() if "stopped by SIGTERM" in line]
    assert len(stops) == 1 and "before the first training step" in stops[0], output[-4000:]
