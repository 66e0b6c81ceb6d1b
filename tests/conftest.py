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
