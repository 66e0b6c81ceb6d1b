"""Fixtures for the runtime tests: multi-process results computed once per group of cases."""

from __future__ import annotations

from typing import Any

import pytest

import uniap_rt_helpers as h


@pytest.fixture(scope="session")
def spawn_cases(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``spawn_cases(world, cases)`` runs the cases in one set of processes, once per session per group."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def run(world: int, cases: dict[str, dict[str, Any]], group: str) -> list[dict[str, Any]]:
        if group not in cache:
            out = tmp_path_factory.mktemp(group)
            cache[group] = h.spawn(world, cases, out)
        return cache[group]

    return run
