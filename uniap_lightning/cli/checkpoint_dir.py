"""One run at a time in a checkpoint folder: ``uniap train`` holds a lock on ``checkpoint_dir`` while it runs.

Two runs writing into one folder would interleave their checkpoints (``resume=auto`` then resumes one run from
the other's step). The lead process (the launcher, or SLURM's task 0) takes an exclusive ``flock`` on
``<checkpoint_dir>/.uniap.lock`` before any rank starts; a second run is refused with the first one's pid. The
kernel drops the lock when the process ends, however it ends, so a crashed run never leaves the folder locked.
A run that ends by itself (finished, failed or preempted) also removes the lock file, and the folder when the run
created it and left it empty, so a finished demo leaves nothing behind in the clone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
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
        self.folder = Path(folder)
        self._created = not os.path.lexists(self.folder)  # removed again at release if the run left it empty
        if self.folder.exists() and not self.folder.is_dir():
            raise UniAPError(f"checkpoint_dir={str(self.folder)!r} is a file, not a folder: give a folder for the "
                             "checkpoints this run writes on preemption")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = self._open_own_lock()
        except OSError as err:
            raise UniAPError(f"checkpoint_dir={str(self.folder)!r} cannot be written ({err.strerror or err}): a "
                             "checkpoint on preemption would be lost; give a writable folder") from err
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def _open_own_lock(self) -> int:
        """A descriptor of the lock file, flocked, that is a regular file with this one name. An entry that is
        a hard link to some other file (or a FIFO, a device) is never written: it is unlinked as a name and the
        lock file created anew (``O_EXCL``); a symbolic link is refused by ``O_NOFOLLOW`` and replaced the same
        way. The flock comes first, so a running run's lock is never taken from it."""
        path = self.folder / LOCK_NAME
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        for _ in range(3):
            try:
                fd = os.open(path, flags | os.O_CREAT, 0o644)
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a symlink / socket / folder there
                    raise
                self._unlink_name(path)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip()
                os.close(fd)
                holder = holder if holder.isdigit() else "unknown"
                raise UniAPError(f"checkpoint_dir={str(self.folder)!r} is in use by another run (pid {holder}); "
                                 "two runs would mix their checkpoints: give this one its own checkpoint_dir=..."
                                 ) from None
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and self._is_named(st, path):
                return fd
            os.close(fd)  # a hard link to someone else's file, or a FIFO: drop the name, never write into it
            if stat.S_ISREG(st.st_mode) and not self._is_named(st, path):
                continue  # a run that ended removed this file after we opened it: lock the name's new file
            self._unlink_name(path)
        raise UniAPError(f"checkpoint_dir={str(self.folder)!r}: its lock file {LOCK_NAME} keeps being replaced "
                         "by something that is not a plain file; remove it and run again")

    @staticmethod
    def _is_named(st: os.stat_result, path: Path) -> bool:
        """The flocked file is still the one under ``path`` (a run that ended unlinks its lock file while holding
        the flock: a lock taken on the unlinked file would lock nothing)."""
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

    @staticmethod
    def _unlink_name(path: Path) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            raise UniAPError(f"{str(path)!r} is a folder, where this run keeps its lock file; remove it")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        """Remove the lock file (still holding the flock, so no other run can have taken it), drop the flock, and
        remove the folder if this run created it and nothing was written there."""
        if self._fd is None:
            return
        path = self.folder / LOCK_NAME
        try:
            if self._is_named(os.fstat(self._fd), path):
                os.unlink(path)
        except OSError:
            pass  # a folder that became read-only keeps the file: the next run locks it as before
        os.close(self._fd)  # closing the only descriptor drops the flock
        self._fd = None
        if self._created:
            try:
                self.folder.rmdir()  # only when empty
            except OSError:
                pass


def lock_checkpoint_dir(folder: str | Path) -> CheckpointDirLock | None:
    """The lock, taken by the lead process only (the other ranks of the same run share the lead's)."""
    return CheckpointDirLock(folder) if is_lead_process() else None
