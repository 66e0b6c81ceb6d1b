"""One line for a :class:`~uniap_lightning.errors.UniAPError` that ends a user's own script.

A ``Trainer(strategy="uniap", devices=N)`` run whose setup refuses the model (no loss, not a chain, a plan for
another world size) raised the same error on every rank; each printed a 25-line traceback, torch prefixing every
line with ``[rankN]:``, and the one line that matters came last. Setup agrees on failures (every rank raises
the same error: :mod:`uniap_lightning.setup.agree`), so rank 0 alone prints it, as ``error: <message>``; the other
ranks end with the same exit status and print nothing. An error raised outside setup (on one rank, perhaps) is
printed by every rank that has it, as ``error: (rank N) <message>`` on the others. Other exceptions keep their
tracebacks, and ``UNIAP_TRACEBACK=1`` keeps them for UniAPError too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from uniap_lightning.errors import UniAPError

#: set to 1 for the full traceback of a UniAPError
TRACEBACK_VARIABLE = "UNIAP_TRACEBACK"


def install(*, rank: int) -> None:
    """Make an uncaught UniAPError one ``error:`` line on rank 0 (nothing on the other ranks). Installed on top of
    whatever hook is there (torch's ``[rankN]:`` prefixer among them), which still prints every other exception.
    Installing again only updates the rank."""
    current = sys.excepthook
    previous = getattr(current, "uniap_previous", current)

    def hook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, UniAPError) or os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            previous(kind, err, tb)
            return
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        elif not getattr(err, _EVERY_RANK, False):
            print(f"error: (rank {rank}) {err}", file=sys.stderr, flush=True)

    hook.uniap_previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


_EVERY_RANK = "uniap_raised_on_every_rank"


@contextmanager
def raised_on_every_rank() -> Iterator[None]:
    """A UniAPError leaving the block was raised on every rank alike (the strategy's setup, which agrees on
    failures): only rank 0 prints it."""
    try:
        yield
    except UniAPError as err:
        setattr(err, _EVERY_RANK, True)
        raise


def installed() -> Any:
    """The hook in place when it is this module's, else None (for tests)."""
    return sys.excepthook if hasattr(sys.excepthook, "uniap_previous") else None
