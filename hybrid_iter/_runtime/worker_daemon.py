"""Spark's Python worker daemon with what a task of ours imports already imported.

PySpark starts one daemon per executor (``python -m pyspark.daemon``) and forks a worker
from it for each Python task slot; each worker then imports what its task needs. A
subtask of ours needs numpy, pyarrow, pandas, Ray and our runtime: about 2 CPU-seconds
of imports in every worker, paid again whenever Spark ends an idle worker and forks a
new one (after a minute without tasks). ``Session.local`` names this module as the
daemon (``spark.python.daemon.module``), so the daemon imports them once and every
worker forked from it starts with them.

Only imports happen before the fork: nothing here starts a Python thread, connects to
Ray or opens a file. The native threads two of these libraries start on import are
fork-safe by their own design (OpenBLAS's pool and jemalloc's background thread have
fork handlers; in the child the pool restarts, the background thread stays off).
A module that fails to import is left to the worker, which fails on it as it would
without this daemon. The daemon itself is PySpark's: ``pyspark.daemon.manager()``,
with the worker module Spark passes in ``sys.argv``.
"""

from __future__ import annotations

import gc
import importlib
import warnings

from .._cluster.warm_up import WORKER_MODULES

#: imported by the daemon before it forks: PySpark's worker and pandas (its Arrow
#: serializers), then what a subtask of ours imports (the warm-up's list, which it imports
#: in workers of a daemon that is not this one)
PRELOAD = ("pyspark.worker", "pandas", *WORKER_MODULES)


def preload(modules: tuple[str, ...] = PRELOAD) -> list[str]:
    """Import ``modules``; the names of those that failed (each left to the worker)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # the worker imports it itself, and fails on it there
            failed.append(name)
    return failed


def main() -> None:
    preload()
    # PySpark's daemon runs a full gc.collect() in a worker after each task it reuses it
    # for: over every object of the modules imported here, ~60 ms a task (measured: a
    # one-partition Python job took 213-224 ms against 151-156 ms on PySpark's own
    # daemon). What the imports made lives as long as the process, so it goes to the
    # permanent generation, which no collection scans (its pages also stay shared with
    # the daemon, not copied into each worker by the collector's writes).
    gc.freeze()
    # Python 3.12+ warns on a fork of a process with threads (the native ones above):
    # under PYTHONWARNINGS=error that warning would fail every fork, so every task
    warnings.filterwarnings(
        "ignore", message=r"This process \(pid=\d+\) is multi-threaded", category=DeprecationWarning
    )
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()
