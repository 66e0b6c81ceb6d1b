"""The test folders have no ``__init__.py`` (pytest's rootdir-relative imports put each folder on ``sys.path``), so two
test files with one basename in two folders collide: the second is reported as "import file mismatch" and none of its
tests run (CI failed on ``test_state_offload.py`` in planner/ and runtime/). Every test module's basename is unique."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_basename_is_unique():
    where: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        where[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1 and name != "conftest.py"}
    assert not shared, f"rename one of each: {shared}"
