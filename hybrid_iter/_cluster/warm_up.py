"""The warm-up: what every run of a session needs, started in the background once Spark
and Ray are up, so that a first run pays only for its data (docs/sessions.md). It only
starts what a run would otherwise start on its critical path, and a run takes it whether
it is ready or still starting: nothing waits for the warm-up, and nothing it does
changes a result. Runs on the driver, in a thread of the session.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from spark_ops import _class_archive, _spark_compat

from .context import ClusterContext
from .ray_util import NAMESPACE
from .spares import warmers

__all__ = ["QUIET_BEFORE_WARM_UP", "WORKER_MODULES", "WarmUp", "short"]

log = logging.getLogger("hybrid_iter")


def short(ex: BaseException) -> str:
    """An exception's text without a JVM stack trace (the lines that say what failed)."""
    lines = [ln.strip() for ln in str(ex).splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("at "))[:1000]


#: what a Spark Python worker of a run imports (the warm-up imports them ahead)
WORKER_MODULES = (
    "numpy",
    "pyarrow",
    "ray",
    "hybrid_iter",
    "hybrid_iter._runtime.task",
    "hybrid_iter.ml",
)
#: seconds Spark must have run no job before the warm-up starts: its Spark job's tasks
#: hold every task slot while they import, its actors' starts take CPU, and a user's first
#: action right after the session returns (a cold JVM plans its first query for a second
#: or more) must not queue behind them. A run of ours coming counts as a job
#: (``Session._runs_coming``): it starts what it needs itself, and the warm-up's other
#: steps (the store, spare shards, its Spark job) would only take CPU from it.
QUIET_BEFORE_WARM_UP = 5.0


def _warm_python_worker(
    address: str, modules: tuple[str, ...], batches: Iterator[Any]
) -> Iterator[Any]:
    """One task of the warm-up job (Spark Python worker): import ``modules`` (what a
    run's subtask imports) and join Ray as a subtask does, so that the worker Spark
    reuses for the run has done both. Yields this worker's pid."""
    import importlib

    import pyarrow as pa

    for module in modules:
        importlib.import_module(module)
    from .ray_util import connect

    connect(address, namespace=NAMESPACE)
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pydict({"pid": pa.array([os.getpid()], pa.int64())})


def _active_jobs(spark: Any) -> list[int]:
    return list(spark.sparkContext.statusTracker().getActiveJobsIds())


class WarmUp:
    """What every run on a cluster needs, made ready in a thread of the session once Spark
    and Ray are up (docs/sessions.md, "Warm-up"): the spares every registered ``Warmer``
    starts (a spare coordinator, spare parameter shards of ``ps.train``'s default kind,
    the array store), and Spark's Python workers with our modules imported and Ray
    joined; for ``Session.local``, the JVM class archive of the next starts.

    It only starts processes a run would otherwise start on its critical path, and a
    run takes them whether they are ready or still starting (``take_spare``, the array
    store's lock): nothing waits for the warm-up, and nothing it does changes a result.
    ``stop()`` cancels its Spark job and waits for the thread to end."""

    def __init__(
        self, ctx: ClusterContext, class_archive: tuple[str, dict[str, str]] | None = None
    ) -> None:
        self.ctx = ctx
        #: (key, conf) of the JVM class archive to make in the background, if any
        self.class_archive = class_archive
        self.tag_name = f"hybrid_iter.warm_up.{id(self):x}"
        self._lock = threading.Lock()
        self._stopping = False
        #: when a run of ours last said it was coming (``run_coming``), monotonic
        self._run_coming_at = float("-inf")
        self._wake = threading.Event()  # a stop
        #: Spark jobs that run for the session's whole life (Ray on Spark's nodes are the
        #: tasks of one): running before the session returned, they are not a user's
        self._background_jobs = set(_active_jobs(ctx.spark))
        self._tag: Any = None  # the JobTag of its Spark job, once submitted
        self._creator: _class_archive.Creator | None = None
        self._done = threading.Event()
        #: what was warmed: ``spare`` and ``store`` (actor names), ``shard_spares``
        #: (the spare parameter shards' actor names), ``python_workers``
        #: (pids), ``errors`` (what could not be warmed, by step), ``seconds``
        self.report: dict[str, Any] = {
            "spare": None,
            "store": None,
            "shard_spares": [],
            "python_workers": [],
            "class_archive": None,
            "errors": {},
            "seconds": None,
        }
        self._thread = threading.Thread(target=self._run, name="hybrid_iter-warm-up", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _step(self, name: str, fn: Any) -> Any:
        if self._stopping:
            return None
        try:
            return fn()
        except Exception as ex:  # an optimisation only: a run starts what it needs
            self.report["errors"][name] = f"{type(ex).__name__}: {short(ex)}"
            log.debug("warm-up %s: %s", name, ex)
            return None

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            # every step waits for a quiet Spark and no run of ours coming: its processes'
            # starts and imports are CPU that a user's first action needs on a small machine
            self._step("quiet", lambda: self._wait_for_quiet_spark(self.ctx.spark))
            ready: list[Any] = []
            for warmer in warmers():
                got = self._step(warmer.name, functools.partial(warmer.start, self.ctx))
                if got is not None:
                    self.report[warmer.name], refs = got
                    ready += refs
            self._step("python_workers", self._python_workers)
            self._step("ready", lambda: self._wait_ready(ready))
            self._step("class_archive", self._class_archive)
        finally:
            self.report["seconds"] = time.perf_counter() - started
            self._done.set()

    def _class_archive(self) -> None:
        """Start making the JVM class archive the next ``Session.local`` maps, when this
        one's JVM found none (a background process at the lowest CPU priority; a stop
        before it ends ends it, and the next session tries again)."""
        wanted = self.class_archive
        if wanted is None:
            return
        with self._lock:
            if self._stopping:
                return
            self._creator = _class_archive.Creator(*wanted)
        self.report["class_archive"] = "making"

    def _python_workers(self) -> None:
        from pyspark.sql import types as T

        from spark_ops import available_task_slots

        spark = self.ctx.spark
        n = max(1, available_task_slots(spark))
        schema = T.StructType([T.StructField("pid", T.LongType())])
        fn = functools.partial(_warm_python_worker, self.ctx.ray_address, WORKER_MODULES)
        tag = _spark_compat.JobTag(spark, self.tag_name)
        with self._lock:
            if self._stopping:
                return
            self._tag = tag
        with tag.on_this_thread("hybrid_iter: warming Python workers"):
            rows = spark.range(0, n, 1, n).mapInArrow(fn, schema).collect()
        self.report["python_workers"] = sorted({int(r.pid) for r in rows})

    def _wait_for_quiet_spark(self, spark: Any) -> None:
        """Until neither Spark has run a job (but the background ones) nor a run of ours
        has said it was coming (``run_coming``) for ``QUIET_BEFORE_WARM_UP`` seconds,
        or the session stops."""
        quiet_since = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if set(_active_jobs(spark)) - self._background_jobs:
                quiet_since = now
            elif now - max(quiet_since, self._run_coming_at) >= QUIET_BEFORE_WARM_UP:
                return
            self._wake.wait(0.05)  # polling Spark's job list; a stop wakes it

    def run_coming(self) -> None:
        """A run of this session is about to start: the warm-up yet to start waits for a
        quiet Spark after it (the run's driver-side start comes before its Spark job)."""
        self._run_coming_at = time.monotonic()

    def _wait_ready(self, refs: list[Any]) -> None:
        import ray

        pending = refs
        while pending and not self._stopping:
            # bounded steps: a stop() is seen within a second
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        ray.get([r for r in refs if r not in pending], timeout=60)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """The report, once the warm-up has ended (``TimeoutError`` after ``timeout``)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the session's warm-up did not end within {timeout}s")
        return dict(self.report)

    def stop(self, timeout: float = 120.0) -> None:
        """Cancel what still runs and wait for the thread (driver)."""
        with self._lock:
            self._stopping = True
            tag = self._tag
        self._wake.set()
        if tag is not None:
            with contextlib.suppress(Exception):
                tag.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():  # pragma: no cover - a daemon thread; reported
                log.warning("the session's warm-up did not end within %.0fs", timeout)
        with self._lock:
            creator = self._creator
        if creator is not None:
            creator.stop()
