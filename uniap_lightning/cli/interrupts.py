"""Ctrl-C in the CLI: the first one interrupts as usual (``KeyboardInterrupt``: cleanup runs, the ranks this process
started are ended) and says how to stop at once; the second one ends the process at once (exit status 130).

Python runs a signal handler only between bytecodes of the main thread, so while that thread is blocked in a C call
(a MILP solve, a gloo rendezvous or collective) a handler alone would neither print nor exit. The C-level handler
also writes the signal number to a wakeup fd (``signal.set_wakeup_fd``), which a small thread reads at once: it
prints the hint on the first Ctrl-C and ends the process on the second, whatever the main thread is doing.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Any

#: exit status of a process stopped by Ctrl-C (128 + SIGINT, as a shell reports it)
INTERRUPTED_EXIT_CODE = 130
HINT = "interrupted; press Ctrl-C again to stop at once"


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.installed = False
        self.raised = False  # the handler raised KeyboardInterrupt once already
        self.hinted = False
        self.wakeup: tuple[socket.socket, socket.socket] | None = None  # kept open for the life of the process


_state = _State()


def install() -> None:
    """Take over SIGINT for this process (main thread only; later calls only put the handler back, e.g. after
    Lightning set SIGINT to be ignored during its own shutdown)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _on_sigint)
    if _state.installed:
        return
    _state.installed = True
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):  # no wakeup fd here: the handler alone counts the presses
        reader.close()
        writer.close()
        return
    _state.wakeup = (reader, writer)
    threading.Thread(target=_read_wakeups, args=(reader,), name="uniap-ctrl-c", daemon=True).start()


def reinstall() -> None:
    """Put the handler back where :func:`install` ran (Lightning ignores SIGINT while it shuts a fit down; the
    ranks are ended after that, and a second Ctrl-C must still stop at once)."""
    if _state.installed:
        install()


def hinted() -> bool:
    """Whether the first Ctrl-C's line was printed (then a ``KeyboardInterrupt`` reaching ``main`` adds none)."""
    return _state.hinted


def interrupted() -> bool:
    """Whether Ctrl-C was pressed in this process."""
    return _state.raised or _state.hinted


def _on_sigint(signum: int, frame: Any) -> None:
    """The Python-level handler (main thread): the first press raises ``KeyboardInterrupt``, a later one ends the
    process (when the reader thread has not already)."""
    with _state.lock:
        again, _state.raised = _state.raised, True
    if again:
        stop_now()
    _hint()
    raise KeyboardInterrupt


def _read_wakeups(reader: socket.socket) -> None:
    """Count Ctrl-C presses as they arrive, whatever the main thread is doing."""
    presses = 0
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum == signal.SIGINT:
                presses += 1
                if presses >= 2:
                    stop_now()
                _hint()


def _hint() -> None:
    with _state.lock:
        if _state.hinted:
            return
        _state.hinted = True
    if is_launching_rank():
        print(HINT, file=sys.stderr, flush=True)


def is_launching_rank() -> bool:
    """Only the process the user started speaks for the run: ranks it launched (``LOCAL_RANK`` > 0) keep quiet."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def stop_now(code: int = INTERRUPTED_EXIT_CODE) -> None:
    """End the process at once: flush what was printed, skip the interpreter's teardown (which would wait for
    solver threads and process groups)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
