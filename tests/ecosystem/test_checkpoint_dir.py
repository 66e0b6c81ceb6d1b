"""One run at a time per checkpoint folder: a second `uniap train` on the same `checkpoint_dir` is refused with
the first one's pid, before any rank starts; a checkpoint_dir that cannot hold checkpoints is refused too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from uniap_lightning.cli.checkpoint_dir import CheckpointDirLock
from uniap_lightning.errors import UniAPError


def test_the_lock_refuses_a_second_holder_and_is_free_after_release(tmp_path: Path) -> None:
    first = CheckpointDirLock(tmp_path / "ckpts")
    with pytest.raises(UniAPError, match=rf"in use by another run \(pid {os.getpid()}\).*own checkpoint_dir"):
        CheckpointDirLock(tmp_path / "ckpts")
    first.release()
    CheckpointDirLock(tmp_path / "ckpts").release()


def test_release_removes_the_lock_file_and_a_folder_it_created_empty(tmp_path: Path) -> None:
    CheckpointDirLock(tmp_path / "new").release()
    assert not (tmp_path / "new").exists()  # created for the lock, left empty: gone
    (tmp_path / "kept").mkdir()
    CheckpointDirLock(tmp_path / "kept").release()
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / ".uniap.lock").exists()
    held = CheckpointDirLock(tmp_path / "used")
    (tmp_path / "used" / "step-00000001.ckpt").mkdir()  # a checkpoint written during the run
    held.release()
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == ["step-00000001.ckpt"]


def test_a_lock_file_a_finished_run_removed_is_not_taken_for_the_lock(tmp_path: Path) -> None:
    """A run that opened the lock file just before the holder ended and removed it would flock a file without a
    name, which a third run would not see: such a file is not the lock (the run locks the file under the name)."""
    path = tmp_path / "ckpts" / ".uniap.lock"
    first = CheckpointDirLock(tmp_path / "ckpts")
    stale = os.open(path, os.O_RDWR)
    try:
        first.release()
        assert os.fstat(stale).st_nlink == 0 and not CheckpointDirLock._is_named(os.fstat(stale), path)
        second = CheckpointDirLock(tmp_path / "ckpts")
        try:
            assert CheckpointDirLock._is_named(os.fstat(second._fd), path)
            with pytest.raises(UniAPError, match="in use by another run"):
                CheckpointDirLock(tmp_path / "ckpts")
        finally:
            second.release()
    finally:
        os.close(stale)


@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_a_link_under_the_lock_name_is_replaced_never_written_into(tmp_path: Path, link: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    folder = tmp_path / "ckpts"
    folder.mkdir()
    lock = folder / ".uniap.lock"
    os.link(victim, lock) if link == "hard" else lock.symlink_to(victim)
    held = CheckpointDirLock(folder)
    try:
        assert victim.read_text() == "precious\n" and os.stat(victim).st_nlink == 1
        assert not lock.is_symlink() and lock.read_text() == f"{os.getpid()}\n"
        with pytest.raises(UniAPError, match="in use by another run"):  # the new lock file is the one held
            CheckpointDirLock(folder)
    finally:
        held.release()


def test_a_holder_that_is_not_a_pid_is_not_echoed(tmp_path: Path) -> None:
    import fcntl

    folder = tmp_path / "ckpts"
    folder.mkdir()
    (folder / ".uniap.lock").write_text("root:x:0:0:root:/root:/bin/bash\n")
    fd = os.open(folder / ".uniap.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(UniAPError, match=r"\(pid unknown\)") as err:
            CheckpointDirLock(folder)
        assert "root:" not in str(err.value)
    finally:
        os.close(fd)


def test_a_file_is_not_a_checkpoint_dir(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("x")
    with pytest.raises(UniAPError, match="is a file, not a folder"):
        CheckpointDirLock(tmp_path / "taken")


def test_uniap_train_refuses_a_checkpoint_dir_in_use(tmp_path: Path) -> None:
    held = CheckpointDirLock(tmp_path / "ckpts")  # as a running `uniap train` holds it
    try:
        res = subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", "train", "trainer.devices=2",
                              f"checkpoint_dir={tmp_path / 'ckpts'}"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "UNIAP_CACHE_DIR": str(tmp_path / "cache")})
    finally:
        held.release()
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-2000:]
    assert f"is in use by another run (pid {os.getpid()})" in errors[0]
    assert "Traceback" not in res.stderr and not (tmp_path / "cache").exists()  # refused before any profiling


def test_a_preemption_save_that_fails_says_what_is_lost(tmp_path: Path) -> None:
    """Disk full, a read-only mount or `ulimit -f` at SIGTERM: the run is stopping anyway, so the failure is
    recorded and reported as lost steps (with the checkpoint a resume would use), not raised as a traceback."""
    import errno
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from uniap_lightning.callbacks import CheckpointOnSigterm

    def full(path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), global_rank=0, global_step=7,
                              save_checkpoint=full)
    saver = CheckpointOnSigterm(tmp_path / "ckpts")
    saver.on_exception(trainer, None, SIGTERMException())
    assert saver.saved is None and "No space left on device" in (saver.failed or "")
    line = saver.lost_work(7)
    assert "could not be written" in line and "up to 7" in line and "there is no older checkpoint" in line
    saver.on_exception(trainer, None, RuntimeError("not a preemption"))  # other errors: not this callback's
