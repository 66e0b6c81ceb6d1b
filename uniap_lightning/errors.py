"""Errors raised for bad user input.

Everything the user can get wrong (configs, profile files, plan files, batch sizes, cluster shapes) raises
:class:`UniAPError`, a :class:`ValueError` whose message names the offending field and what would be accepted.
The CLI prints the message alone (no traceback); library users can catch it like any ``ValueError``.
"""

from __future__ import annotations


class UniAPError(ValueError):
    """A user-facing error with an actionable message."""


class InfeasibleError(UniAPError):
    """No plan fits the cluster (usually: memory). The message says by how much."""
