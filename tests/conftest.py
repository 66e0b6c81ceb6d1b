"""What every test starts from: the environment of a plain ``python -m pytest`` run, left as each test found it.

- pytest-xdist's workers inherit ``COLUMNS``/``LINES`` of the controlling terminal (80 x 24 when there is none);
  a plain run has neither, and the CLI's consoles are wide unless ``COLUMNS`` says otherwise: dropped in workers.
- Lightning's environments write ``MASTER_PORT`` (and a run may write ``LOCAL_RANK`` and friends) into
  ``os.environ`` of the process that calls ``Trainer.fit``; a worker runs many files one after the other, so a
  later test's subprocess (a ``uniap train``, an ``sbatch`` job: both export the environment) would inherit a port
  another process still holds. Each test's changes to ``os.environ`` are undone after it.
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


@pytest.fixture(autouse=True)
def _environment_restored():
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left():
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
