"""Start a test's ranks from a fork server that has imported torch, Lightning and transformers once.

Why: a rank started with ``spawn`` imports torch, Lightning (which pulls in torchmetrics, transformers and
``torch._dynamo``) and the package afresh: about 8 s of CPU per rank, 16 s per 2-rank group, the largest single cost
of the multi-process tests on 2 cores. ``multiprocessing``'s ``forkserver`` start method imports :data:`PRELOAD`
once per pytest process, in a fresh interpreter that has run nothing else, and forks every rank from it: a rank
starts in a fraction of a second and inherits no state of the test process (no threads, no OpenMP pool, no process
group), which ``fork`` from the test process would not guarantee.

What differs from ``spawn``, and is undone here:

- a child of the fork server inherits the environment the server started with, not the launching process's
  environment of now (which the tests change: ``UNIAP_CACHE_DIR``, launcher variables); :func:`_in_env` gives each
  rank the launcher's ``os.environ`` at launch, as ``spawn`` does;
- the server outlives nothing: :func:`_stop_server` ends and reaps it at exit, so its CPU time (and its ranks')
  counts in the pytest process's, as the ranks' did under ``spawn`` (``/usr/bin/time`` measures it).

``sys.path``, the working directory and the test module the rank function lives in reach the rank as under
``spawn`` (``multiprocessing`` sends them with each start).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
from typing import Any, Callable

import torch.multiprocessing as mp

#: ``UNIAP_TEST_START_METHOD=spawn`` starts every rank afresh, as before (to compare, or to rule the server out)
START_METHOD = os.environ.get("UNIAP_TEST_START_METHOD", "forkserver")
#: the third-party modules every rank imports anyway (6-7 s of CPU; transformers' modeling code another 1 s). Not the
#: package: it imports in 0.3 s, and a rank that imports it itself reports a broken edit with its traceback (the
#: server would die of it) and sees the package as it is now. A module that fails to import here is imported by the
#: rank itself, as before.
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "transformers", "transformers.modeling_utils",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"]


def context() -> Any:
    """The ``multiprocessing`` context of the ranks (for a ``Queue`` or ``Barrier`` they share)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first start)
    return multiprocessing.get_context(START_METHOD)


def start_processes(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, join: bool = True) -> Any:
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join)`` from the fork server: ``fn(rank, *args)``."""
    context()
    return mp.start_processes(_in_env, args=(fn, dict(os.environ), *args), nprocs=nprocs, join=join,
                              start_method=START_METHOD)


def _in_env(rank: int, fn: Callable[..., Any], env: dict[str, str], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def _stop_server() -> None:
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)  # CPython 3.8+; private, hence getattr
    if stop is not None:
        stop()


atexit.register(_stop_server)
