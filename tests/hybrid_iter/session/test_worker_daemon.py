"""Spark's Python workers of a ``Session.local`` are forked from a daemon that imported
what a task of ours needs (``hybrid_iter/_runtime/worker_daemon.py``): a worker starts
with them imported instead of paying ~2 CPU-s for them, and a task that imports
nothing of them still runs as on PySpark's own daemon. What the imports made is in the
garbage collector's permanent generation: PySpark's daemon runs a full collection in a
worker after each task, which would otherwise scan all of it (~60 ms a task)."""

from __future__ import annotations

import sys

from hybrid_iter._runtime import worker_daemon
from hybrid_iter._session.local import WORKER_DAEMON

#: native libraries of the preloaded modules, as the daemon maps them
LIBRARIES = ("_multiarray_umath", "libarrow.so", "_raylet.so")


def test_the_sessions_workers_fork_from_a_daemon_that_imported_the_tasks_modules(spark):
    # the suite's warm-up imported them in its workers too: what shows the daemon's
    # work is what the worker's parent, the daemon, has loaded
    assert WORKER_DAEMON == worker_daemon.__name__
    sc = spark.sparkContext
    assert sc.getConf().get("spark.python.daemon.module") == WORKER_DAEMON
    daemon, libraries = WORKER_DAEMON, LIBRARIES

    def the_workers_daemon(_: object) -> list[tuple[bool, ...]]:
        # nested, so pickled by value; it names only the stdlib, since a module it named
        # would be imported in the worker as it is unpickled, whatever the daemon did
        import gc
        import os

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().decode().split("\0")
        with open(f"/proc/{os.getppid()}/maps") as f:
            mapped = f.read()
        # the modules' objects, frozen before the fork: tens of thousands at least
        frozen = gc.get_freeze_count() > 20_000
        return [(daemon in parent, *(lib in mapped for lib in libraries), frozen)]

    got = sc.parallelize(range(4), 4).mapPartitions(the_workers_daemon).collect()
    assert got == [(True,) * (2 + len(LIBRARIES))] * 4


def test_a_module_that_fails_to_import_is_left_to_the_worker():
    assert worker_daemon.preload(("json", "no_such_module_of_hybrid_iter")) == [
        "no_such_module_of_hybrid_iter"
    ]
    assert "json" in sys.modules
