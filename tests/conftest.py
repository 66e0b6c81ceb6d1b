"""What every test starts from: the environment of a plain ``python -m pytest`` run, left as each test found it.

- pytest-xdist's workers inherit ``COLUMNS``/``LINES`` of the controlling terminal (80 x 24 when there is none);
  a plain run has neither, and the CLI's consoles are wide unless ``COLUMNS`` says otherwise: dropped in workers.
- Lightning's environments write ``MASTER_PORT`` (and a run may write ``LOCAL_RANK`` and friends) into
  ``os.environ`` of the process that calls ``Trainer.fit``; a worker runs many files one after the other, so a
  later test's subprocess (a ``uniap train``, an ``sbatch`` job: both export the environment) would inherit a port
  another process still holds, or a ``LOCAL_RANK`` that tells Lightning the processes were launched already (it
  then starts no rank 1 and rank 0 waits for it forever). Each test's changes to ``os.environ`` are undone after
  it, and each file's (its module-scoped fixtures run before the per-test snapshot is taken) after the file; a
  test starts without the launcher variables the plain run did not have.
- A default process group a file's in-process runs leave behind is destroyed after that file (the next file's
  first ``Trainer.fit`` would otherwise meet "initialize the default process group twice").
- The files with the longest runs go first (:data:`LONG_FIRST`), the rest by number of tests, most first.
  ``--dist loadfile`` hands whole files to the two workers in collection order (``--no-loadscope-reorder`` in
  pyproject's addopts: xdist's own reordering by number of tests put these files, of 1-3 tests but 1-2 minutes
  each, last, so that one worker still ran one while the other had nothing left).
"""

from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


#: the environment ``python -m pytest`` started with (this file is imported before any test module)
PRISTINE = dict(os.environ)
#: what a launcher (Lightning, torchrun, SLURM's srun) sets for the processes it starts
LAUNCHER_KEYS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")


#: the files whose tests ran longest in the last clean-checkout CI run (its ``--durations``), longest first
LONG_FIRST = (
    "tests/ecosystem/test_train_resume.py", "tests/runtime/test_zero_recompute.py",
    "tests/runtime/test_sequence_plans.py", "tests/ecosystem/test_slurm.py", "tests/planner/test_cli.py",
    "tests/planner/test_baselines.py", "tests/ecosystem/test_concurrent_runs.py", "tests/ecosystem/test_examples.py",
    "tests/ecosystem/test_transformers_oldest.py", "tests/planner/test_experts.py",
    "tests/runtime/test_hf_families.py", "tests/runtime/test_expert_plans.py", "tests/runtime/test_schedules_run.py",
    "tests/runtime/test_hf_generic.py", "tests/runtime/test_setup_agreement.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files for the workers: :data:`LONG_FIRST`, then the others by number of tests (each file's tests
    keep their order: the sort is stable and its key is the file)."""
    count: dict[str, int] = {}
    for item in items:
        count[item.nodeid.split("::")[0]] = count.get(item.nodeid.split("::")[0], 0) + 1
    first = {name: i for i, name in enumerate(LONG_FIRST)}

    def key(item: pytest.Item) -> tuple[int, int]:
        name = item.nodeid.split("::")[0]
        return (first[name], 0) if name in first else (len(first), -count[name])

    items.sort(key=key)


def _restore(saved: dict[str, str]) -> None:
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True, scope="module")
def _file_environment_restored():
    saved = dict(os.environ)
    yield
    _restore(saved)


@pytest.fixture(autouse=True)
def _environment_restored():
    for key in LAUNCHER_KEYS:
        if key in PRISTINE:
            os.environ[key] = PRISTINE[key]
        else:
            os.environ.pop(key, None)
    saved = dict(os.environ)
    yield
    _restore(saved)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left():
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
