"""The ranks ``uniap train`` starts itself: watched while rank 0 works, and a clean end of the process group.

A rank that dies while rank 0 sets up or trains leaves rank 0 waiting: in the rendezvous (a C call that no Python
signal or exception interrupts) or in a collective, up to the collective timeout (30 minutes). :class:`RankWatch`
waits on each started rank in a thread of its own; when one fails, rank 0 gets a moment to fail by itself (setup
agrees on errors, and then rank 0's own message is the one to show), after which the watcher ends the other ranks,
prints one ``error:`` line with the failed rank's status and ends rank 0 at once (``os._exit``, the only exit that
works while the main thread is blocked in C).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType

from uniap_lightning.cli.interrupts import INTERRUPTED_EXIT_CODE, reinstall

#: seconds rank 0 gets to end by itself after a rank it started failed, before the watcher ends it
FAILED_RANK_GRACE_S = 3.0


class RankWatch:
    """``with RankWatch(children): ...``: while the block runs, a started rank that exits with an error ends the
    whole run within :data:`FAILED_RANK_GRACE_S` seconds (exit status 2; 130 when it was interrupted by Ctrl-C).
    A rank that ends with 0 or with the preemption status is not a failure."""

    def __init__(self, children: list[subprocess.Popen], *, grace_s: float = FAILED_RANK_GRACE_S) -> None:
        self._children = list(children)
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._left = threading.Event()  # rank 0 left the block (returned or raised): it reports by itself
        self._threads = [threading.Thread(target=self._wait_for, args=(rank, child), name=f"uniap-watch-rank{rank}",
                                          daemon=True) for rank, child in enumerate(self._children, start=1)]

    def __enter__(self) -> RankWatch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        with self._lock:  # a watcher already ending the run holds the lock until the process is gone
            self._left.set()
        if kind is not None:
            reinstall()  # Ctrl-C: Lightning's shutdown set SIGINT to be ignored; the ranks are ended next

    def _wait_for(self, rank: int, child: subprocess.Popen) -> None:
        code = child.wait()
        stopped = code == PREEMPTED_EXIT_CODE and rank_error(child) == SETUP_STOP_LINE  # SIGTERM before training
        if code == 0 or (code == PREEMPTED_EXIT_CODE and not stopped) or self._left.wait(self._grace_s):
            return
        with self._lock:
            if self._left.is_set():
                return
            self._end_run(rank, child, code)

    def _end_run(self, rank: int, failed: subprocess.Popen, code: int) -> None:
        for child in self._children:
            if child is not failed and child.poll() is None:
                child.kill()
        for child in self._children:
            child.wait()

        if code == PREEMPTED_EXIT_CODE and rank_error(failed) == SETUP_STOP_LINE:
            print(setup_stop_message(None, rank=rank), file=sys.stderr)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(PREEMPTED_EXIT_CODE)
        interrupted = code in (INTERRUPTED_EXIT_CODE, -signal.SIGINT)
        said = rank_error(failed)
        why = f": {said}" if said else ("" if interrupted else "; see its output above")
        print(f"error: {describe_exit(rank, code)} while rank 0 was still running{why} (the other ranks were "
              "stopped)", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(INTERRUPTED_EXIT_CODE if interrupted else 2)


#: exit status of every rank of a run stopped by SIGTERM after writing its checkpoint (128 + SIGTERM, as a shell
#: reports a process ended by that signal): schedulers and scripts can tell preemption from completion
PREEMPTED_EXIT_CODE = 143

#: what a started rank stopped by SIGTERM before training hands to rank 0 (which then ends the run as stopped, with
#: the preemption status, instead of reporting the collective that failed when this rank left)
SETUP_STOP_LINE = "stopped by SIGTERM before the first training step"

#: set by `uniap train` for each rank it starts: where that rank writes its error line instead of printing it, so a
#: run shows one error line (rank 0's own, or a started rank's, printed by rank 0)
ERROR_FILE_VARIABLE = "UNIAP_RANK_ERROR_FILE"


def setup_stop_message(resume: Path | None, *, rank: int | None = None) -> str:
    """The one line for a run stopped by SIGTERM before its first training step."""
    who = f" (training rank {rank})" if rank else ""
    again = f" to resume from {resume}" if resume is not None else ""
    return (f"stopped by SIGTERM{who} before the first training step: no step ran, nothing to save; run the same "
            f"command again{again}")


def error_file_for(rank: int) -> Path:
    """A fresh file name for a started rank's error line (in a private temporary folder of this run)."""
    global _ERROR_DIR
    if _ERROR_DIR is None:
        _ERROR_DIR = Path(tempfile.mkdtemp(prefix="uniap-ranks-"))
        atexit.register(shutil.rmtree, _ERROR_DIR, True)
    return _ERROR_DIR / f"rank{rank}.error"


_ERROR_DIR: Path | None = None


def report_error_to_launcher(message: str) -> bool:
    """On a rank `uniap train` started: hand the error line to rank 0 (which prints it when this rank's failure is
    what ended the run) instead of printing a second copy. False on any other process."""
    target = os.environ.get(ERROR_FILE_VARIABLE)
    if not target:
        return False
    try:
        Path(target).write_text(message + "\n", encoding="utf-8")
    except OSError:
        return False
    return True


def rank_error(child: subprocess.Popen) -> str | None:
    """The error line a started rank handed over, if any."""
    path = getattr(child, "uniap_error_file", None)
    try:
        text = Path(path).read_text(encoding="utf-8").strip() if path is not None else ""
    except OSError:
        return None
    return text.splitlines()[0][:2000] if text else None


def describe_exit(rank: int, code: int) -> str:
    """``training rank 1 exited with status 3`` / ``... was killed by SIGKILL (out of memory?)``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory, or killed by hand?)" if -code == signal.SIGKILL else ""
        return f"training rank {rank} was killed by {name}{hint}"
    if code == INTERRUPTED_EXIT_CODE:
        return f"training rank {rank} was interrupted (exit status {code})"
    return f"training rank {rank} exited with status {code}"


def close_process_group() -> None:
    """End the process group on this rank after a successful fit: a barrier (every rank's collectives, those
    issued in the background included, are complete), then ``destroy_process_group``.

    Without it the groups (the world, the pipeline / data-parallel / SIGTERM subgroups) outlive the interpreter's
    finalization, and a gloo group destroyed then, with a background collective's work still referenced, ends the
    process in ``std::terminate`` ("terminate called without an active exception", status 134) now and then: a
    successful run that exits with an error. Lightning registers this only for NCCL."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed support
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:
        try:
            dist.barrier()
        except RuntimeError:  # a rank already gone after its fit: its exit status is what the launcher reports
            pass
    dist.destroy_process_group()
