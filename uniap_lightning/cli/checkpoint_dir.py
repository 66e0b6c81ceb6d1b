"""One run at a time in a checkpoint folder: ``uniap train`` holds a lock on ``checkpoint_dir`` while it runs.

Two runs writing into one folder would interleave their checkpoints (``resume=auto`` then resumes one run from
the other's step). The lead process (the launcher, or SLURM's task 0) takes an exclusive ``flock`` on
``<checkpoint_dir>/.uniap.lock`` before any rank starts; a second run is refused with the first one's pid. The
kernel drops the lock when the process ends, however it ends, so a crashed run never leaves the folder locked.
"""

from __future__ import annotations

import os
from pathlib import Path

from uniap_lightning.errors import UniAPError

LOCK_NAME = ".uniap.lock"


def is_lead_process() -> bool:
    """The process that starts a run's ranks (or SLURM's first task): the one that takes the lock."""
    env = os.environ
    return env.get("LOCAL_RANK", "0") == "0" and env.get("SLURM_PROCID", "0") == "0" and env.get("RANK", "0") == "0"


class CheckpointDirLock:
    """``flock`` on ``<folder>/.uniap.lock`` (created with the folder); ``release()`` or process exit frees it."""

    def __init__(self, folder: str | Path) -> None:
        import fcntl

        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise UniAPError(f"checkpoint_dir={str(self.folder)!r} is a file, not a folder: give a folder for the "
                             "checkpoints this run writes on preemption")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise UniAPError(f"checkpoint_dir={str(self.folder)!r} cannot be written ({err.strerror or err}): a "
                             "checkpoint on preemption would be lost; give a writable folder") from err
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self._fd, 64).decode(errors="replace").strip() or "unknown"
            self.release()
            raise UniAPError(f"checkpoint_dir={str(self.folder)!r} is in use by another run (pid {holder}); two runs "
                             "would mix their checkpoints: give this one its own checkpoint_dir=...") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def lock_checkpoint_dir(folder: str | Path) -> CheckpointDirLock | None:
    """The lock, taken by the lead process only (the other ranks of the same run share the lead's)."""
    return CheckpointDirLock(folder) if is_lead_process() else None
