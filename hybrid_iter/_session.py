"""Spark + Ray sessions: embedded (``local``), Spark on Ray (``raydp``), Ray on the
user's Spark cluster (``on_spark``), or ``attach``.

Runs on the driver. A session stops only what it started: a SparkSession or Ray
instance that was already running is used and left running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from spark_ops import _class_archive, _spark_compat

from ._errors import ClassArchiveWarning, SessionError
from ._runtime.leftovers import end_ray_processes_of_a_failed_start, end_spark_jvm_launch
from ._runtime.placement import check_resources
from ._runtime.ray_util import NAMESPACE, force_loopback, is_loopback_address

__all__ = [
    "ADDRESS_ENV_VARS",
    "DEFAULT_CONNECT_TIMEOUT",
    "Session",
    "check_ray_address",
    "probe_ray_cluster",
    "ray_address_from_env",
]

log = logging.getLogger("hybrid_iter")

#: Where ``Session.raydp(address=None)`` and ``hybrid-iter run --session raydp`` look for
#: the Ray cluster, in order: ours, then Ray's own (``ray job submit`` sets it for the
#: entrypoint to the cluster's GCS address).
ADDRESS_ENV_VARS = ("HYBRID_ITER_RAY_ADDRESS", "RAY_ADDRESS")
#: Seconds to reach a Ray cluster's GCS before giving up with a SessionError.
DEFAULT_CONNECT_TIMEOUT = 30.0
_SUBMIT_HINT = (
    "run the driver on the cluster instead: `ray job submit --address http://<head>:8265 "
    "-- hybrid-iter run MODULE:FUNCTION --session raydp` (Ray Jobs set RAY_ADDRESS for it), "
    "or a KubeRay RayJob"
)
_AUTH_HINT = (
    "the cluster requires Ray token authentication: set RAY_AUTH_MODE=token and the "
    "cluster's token in RAY_AUTH_TOKEN (or a file named by RAY_AUTH_TOKEN_PATH, default "
    "~/.ray/auth_token) in this process's environment; on KubeRay the token is key "
    "auth_token of the Secret named after the RayCluster, and jobs submitted with `ray job "
    "submit` or a RayJob get it from the head"
)


def check_ray_address(address: str, where: str = "address") -> str:
    """The address as given, or ``SessionError`` when it cannot work (driver).

    Spark's driver and executors join the cluster's GCS directly: Ray Client addresses
    (``ray://``) and dashboard URLs (``http://``, what ``ray job submit`` takes) cannot.
    """
    text = address.strip()
    if not text:
        raise SessionError(f"{where} must not be empty: give host:port of the GCS, auto or local")
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme == "ray":
        raise SessionError(
            f"{where}={text!r} is a Ray Client address; Spark on Ray needs the driver on a "
            f"node of the cluster, joining its GCS (host:6379) directly: {_SUBMIT_HINT}"
        )
    if scheme in ("http", "https"):
        raise SessionError(
            f"{where}={text!r} is a Ray dashboard / job-submission URL, not a GCS address; "
            f"{_SUBMIT_HINT}"
        )
    if scheme:
        raise SessionError(
            f"{where}={text!r}: unknown scheme {scheme!r}; give host:port of the GCS, auto or local"
        )
    if text not in ("auto", "local"):
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SessionError(
                f"{where}={text!r} is not host:port of a Ray GCS (e.g. 10.0.0.5:6379), auto "
                f"(the cluster of this node) or local (an embedded Ray)"
            )
    return text


def ray_address_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``(address, variable)`` from ``HYBRID_ITER_RAY_ADDRESS`` then ``RAY_ADDRESS``."""
    environ = os.environ if environ is None else environ
    for name in ADDRESS_ENV_VARS:
        value = environ.get(name, "").strip()
        if value:
            return check_ray_address(value, name), name
    return None


def probe_ray_cluster(address: str, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> str:
    """Check that a Ray GCS answers at ``address`` and lets this process in (driver).

    Returns the GCS ``host:port`` (``auto`` resolved). Raises ``SessionError`` naming
    the address and what to check, within about ``timeout`` seconds: ``ray.init`` itself
    retries an unreachable GCS for minutes and reports a token-protected cluster as a
    bare ``ConnectionError`` after ~20 s.
    """
    deadline = time.monotonic() + timeout
    from ray._private import services

    if address == "auto":
        try:
            gcs = services.canonicalize_bootstrap_address_or_die("auto")
        except (ConnectionError, ValueError) as ex:
            raise SessionError(
                f"Ray address 'auto': no Ray cluster found on this node ({ex}); run on a "
                f"node of the cluster (where `ray start` ran), or give host:port of its GCS"
            ) from None
    else:
        gcs = address
    host, _, port = gcs.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=min(10.0, timeout)):
            pass
    except OSError as ex:
        raise SessionError(
            f"no Ray cluster reachable at {gcs} ({type(ex).__name__}: {ex}); check the "
            f"address (host:port of the head's GCS, port 6379 by default; `ray status "
            f"--address {gcs}` on a cluster node), that the cluster is up, and that no "
            f"firewall or NetworkPolicy blocks this host"
        ) from None

    # The GCS client retries in C++ for up to a minute; ask from a thread and stop waiting
    # at the deadline (the thread ends on its own; it holds nothing of ours).
    outcome: dict[str, BaseException | None] = {}

    def ask() -> None:
        try:
            # a Cython class that ray's _raylet.pyi does not declare
            from ray._raylet import GcsClient  # type: ignore[attr-defined]

            GcsClient(address=gcs).internal_kv_get(b"hybrid_iter_probe", None, timeout=5)
            outcome["error"] = None
        except BaseException as ex:  # reported to the caller below
            outcome["error"] = ex

    thread = threading.Thread(target=ask, name="hybrid_iter-ray-probe", daemon=True)
    thread.start()
    thread.join(max(0.1, deadline - time.monotonic()))
    if "error" not in outcome:
        raise SessionError(
            f"something accepts connections at {gcs} but no Ray GCS answered within "
            f"{timeout:.0f}s; check that the address is the head's GCS port (6379 by "
            f"default), not the dashboard (8265) or client (10001) port"
        )
    error = outcome["error"]
    if error is not None:
        if type(error).__name__ == "AuthenticationError":
            raise SessionError(f"the Ray cluster at {gcs} refused this driver: {_AUTH_HINT}")
        raise SessionError(
            f"the Ray GCS at {gcs} did not answer: {type(error).__name__}: {error}; check "
            f"that the cluster is healthy (`ray status --address {gcs}`)"
        ) from None
    return gcs


def _check_offered(resources: Mapping[str, float], owns_ray: bool) -> None:
    """Fail at session start, not at the first iteration, on a resource nobody offers."""
    import ray

    offered: dict[str, float] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for name, amount in node.get("Resources", {}).items():
                offered[name] = max(offered.get(name, 0.0), amount)
    missing = {k: v for k, v in resources.items() if offered.get(k, 0.0) < v}
    if missing:
        if owns_ray:
            ray.shutdown()
        raise SessionError(
            f"coordinator_resources {missing}: no live node of the Ray cluster offers that "
            f"much (nodes offer {sorted(k for k in offered if not k.startswith('node:'))}); "
            f"give a node the resource (`ray start --resources`, KubeRay "
            f"rayStartParams.resources) or change coordinator_resources"
        )


def _join_ray(address: str, connect_timeout: float) -> None:
    """``ray.init`` to an existing cluster, after the probe; Ray's errors as SessionError."""
    import ray

    gcs = probe_ray_cluster(address, connect_timeout)
    if is_loopback_address(gcs):
        force_loopback()
    try:
        ray.init(address=gcs, namespace=NAMESPACE, logging_level=logging.WARNING)
    except Exception as ex:
        hint = (
            _AUTH_HINT
            if type(ex).__name__ == "AuthenticationError"
            else ("a driver must run on a node of the cluster; " + _SUBMIT_HINT)
        )
        raise SessionError(
            f"could not join the Ray cluster at {gcs}: {type(ex).__name__}: {ex}; {hint}"
        ) from ex


def _blas_threads(cores: int, tasks: int) -> str:
    return str(max(1, cores // max(tasks, 1)))


def _worker_env(threads: str) -> dict[str, str]:
    # Each Spark task gets its share of cores for numpy's BLAS, not all of them.
    return {
        f"spark.executorEnv.{v}": threads
        for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    }


def _task_cpus(conf: Mapping[str, str]) -> int:
    try:
        return max(1, int(conf.get("spark.task.cpus", 1)))
    except (TypeError, ValueError):
        return 1


def _check_spark_jvm_for_raydp() -> None:
    """Fail early when this process cannot host RayDP's Spark driver.

    RayDP puts its jars on the driver JVM's classpath when that JVM is launched, and a
    process has one JVM for good; ``builder.getOrCreate()`` would hand back a running
    SparkSession (with its own master) instead of a Spark on Ray one.
    """
    master = _spark_compat.running_spark_master()
    if master is not None:
        raise SessionError(
            f"Session.raydp needs its own SparkContext, but one is already running in this "
            f"process (master {master!r}); stop it first, or use "
            f"Session.attach(spark) to run on it"
        )
    if _spark_compat.jvm_has_class("org.apache.spark.deploy.raydp.RayAppMaster") is False:
        raise SessionError(
            "Session.raydp must start the first Spark of this process: its JVM was "
            "already launched without RayDP's jars (an earlier Session.local or "
            "SparkSession) and a process keeps its JVM; run Spark on Ray in a fresh "
            "process"
        )


def _check_spark_version(where: str) -> None:
    """A PySpark outside the supported lines fails the session before anything starts."""
    try:
        _spark_compat.check_spark_version()
    except _spark_compat.UnsupportedSparkVersion as ex:
        raise SessionError(f"{where}: {ex}") from ex


def _check_connect(spark: Any) -> None:
    """A Spark Connect client session for ``Session.attach``: its server's tasks reach
    the coordinator by the coordinator endpoint (``transport="auto"`` picks it), which
    needs the barrier stage's DataFrame paths (``repartitionById``, Spark >= 4.1)."""
    if not _spark_compat.dataframe_barrier_paths(spark):
        raise SessionError(
            f"Session.attach(spark) got a Spark Connect session of PySpark "
            f"{_spark_compat.spark_version_string()}: a Connect client runs the barrier "
            f"stage by DataFrame operations only (DataFrame.repartitionById, Spark >= 4.1); "
            f"use Spark >= 4.1, or a classic SparkSession"
        )
    # pyspark.sql.functions build Connect columns only in Connect mode, which
    # SparkSession.builder.remote(...) turns on and pyspark.sql.connect's own builder
    # does not; a process without a classic SparkContext can only mean Connect
    if _spark_compat.running_spark_master() is None:
        os.environ.setdefault("SPARK_CONNECT_MODE_ENABLED", "1")


def _short(ex: BaseException) -> str:
    """An exception's text without a JVM stack trace (the lines that say what failed)."""
    lines = [ln.strip() for ln in str(ex).splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("at "))[:1000]


def _raylet_wait_ran_out(ex: BaseException) -> bool:
    """``ray.init`` gave up waiting for its own node to register (a fixed 30 s in
    ``ray._private.node``), not refused a setting."""
    return "timed out during startup" in str(ex)


def _prepare_process_env() -> None:
    """Spark's Python workers must run this interpreter and stay on loopback."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


class _SparkStart:
    """``Session.local``'s Spark, started in a thread of its own while Ray starts."""

    def __init__(
        self,
        parallelism: int,
        app_name: str,
        driver_memory: str,
        cores: int,
        spark_conf: Mapping[str, str] | None,
    ) -> None:
        self.parallelism = parallelism
        self.conf = {
            "spark.master": f"local[{parallelism}]",
            "spark.app.name": app_name,
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.driver.memory": driver_memory,
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": str(parallelism),
            "spark.default.parallelism": str(parallelism),
            **_worker_env(_blas_threads(cores, parallelism)),
            **dict(spark_conf or {}),
        }
        self.launched_jvm = not _spark_compat.jvm_launched()
        #: the user's own ``spark.driver.extraJavaOptions`` (a start without the archive)
        self._own_options = self.conf.get("spark.driver.extraJavaOptions")
        #: the JVM class archive to map, and the key of the one a background process of
        #: the session's warm-up makes for the next starts (``spark_ops._class_archive``)
        self._archive = _class_archive.Choice()
        if self.launched_jvm:
            self._archive = _class_archive.java_options(self.conf)
            if self._archive.options is not None:
                self.conf["spark.driver.extraJavaOptions"] = self._archive.options
        #: none was found, or the one found crashed the JVM (then set by the start)
        self.archive_key = self._archive.key
        #: what the caller is warned of (``ClassArchiveWarning``)
        self.notes = list(self._archive.notes)
        #: what becomes of Ray if Spark fails (said in the error)
        self.ray_fate = "was stopped"
        self._spark: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        #: set when the start has ended, well or not. Waited for instead of joining the
        #: thread: CPython 3.11's ``Thread.join`` interrupted by a KeyboardInterrupt
        #: marks the thread ended while it runs on, so a later join returns at once and
        #: the interpreter exits under the running start (spark-submit left behind).
        self._done = threading.Event()

    def begin(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="hybrid_iter-spark-start", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._spark = self._get_or_create()
        except BaseException as ex:  # handed to the caller's thread
            self._error = ex
        finally:
            self._done.set()

    def _get_or_create(self) -> Any:
        from pyspark.sql import SparkSession

        def build() -> Any:
            builder = SparkSession.builder
            for k, v in self.conf.items():
                builder = builder.config(k, v)
            return builder.getOrCreate()

        archive = self._archive.archive
        if archive is None:
            return build()
        since = time.time()
        try:
            return build()
        except Exception as ex:
            if not _class_archive.gateway_exited(ex):
                raise
            # the JVM launched with the archive died before its gateway port (the file
            # changed after its check, a JVM bug): once more without it, and the archive
            # goes if that JVM starts
            if self._own_options is None:
                del self.conf["spark.driver.extraJavaOptions"]
            else:
                self.conf["spark.driver.extraJavaOptions"] = self._own_options
            spark = build()
            self.notes.append(_class_archive.crashed(archive, since))
            self.archive_key = _class_archive.archive_key(self.conf)
            return spark

    def wait(self) -> None:
        """Until the start has ended, well or not."""
        if self._thread is not None:
            self._done.wait()

    def result(self) -> Any:
        """The SparkSession, made the active one of the calling thread (the JVM keeps
        the active session per thread); ``SessionError`` naming Spark if it failed."""
        assert self._thread is not None
        self._done.wait()
        for note in self.notes:
            warnings.warn(note, ClassArchiveWarning, stacklevel=3)  # Session.local's caller
        if self._error is not None:
            raise SessionError(
                f"Session.local: Spark local[{self.parallelism}] did not start: "
                f"{_short(self._error)} (Ray, started beside it, {self.ray_fate})"
            ) from self._error
        spark = self._spark
        _spark_compat.make_active_session(spark)
        spark.sparkContext.setLogLevel("ERROR")
        return spark

    def abandon(self) -> None:
        """Wait for the start to end, then stop what it started (its JVM too, if this
        start launched it): a session that failed leaves no Spark behind."""
        if self._thread is None or self._thread.ident is None:  # never started
            return
        if self.launched_jvm and not self._done.is_set():
            end_spark_jvm_launch()  # the start then ends now, not after the JVM's start
        self._done.wait()
        if self.launched_jvm:
            _spark_compat.shut_down_jvm()
        elif self._spark is not None:
            self._spark.stop()


#: what a Spark Python worker of a run imports (the warm-up imports them ahead)
_WORKER_MODULES = (
    "numpy",
    "pyarrow",
    "ray",
    "hybrid_iter",
    "hybrid_iter._runtime.task",
    "hybrid_iter.ml",
)
#: what a spare coordinator imports ahead: the coordinator operators of the fits
_COORDINATOR_MODULES = ("hybrid_iter.ml",)
#: seconds Spark must have run no job before the warm-up starts: its Spark job's tasks
#: hold every task slot while they import, its actors' starts take CPU, and a user's first
#: action right after the session returns (a cold JVM plans its first query for a second
#: or more) must not queue behind them. A run of ours coming counts as a job
#: (``Session._runs_coming``): it starts what it needs itself, and the warm-up's other
#: steps (the store, spare shards, its Spark job) would only take CPU from it.
_QUIET_BEFORE_WARM_UP = 5.0


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
    from ._runtime.ray_util import connect

    connect(address, namespace=NAMESPACE)
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pydict({"pid": pa.array([os.getpid()], pa.int64())})


def _coordinator_kind() -> Any:
    """The coordinator actor class and options of a run without checkpoints of up to
    984 subtasks, as ``_runtime.iterate`` launches it: the spare that run takes."""
    from coordinator import IterationCoordinator

    from ._runtime.placement import actor_class

    return actor_class(
        IterationCoordinator,
        max_restarts=0,
        max_concurrency=1000,
        concurrency_groups={"watch": 1},
    )


def _active_jobs(spark: Any) -> list[int]:
    return list(spark.sparkContext.statusTracker().getActiveJobsIds())


class _WarmUp:
    """What every run of a session needs, made ready in a thread of the session once
    Spark and Ray are up (DESIGN.md section 8): a spare coordinator, spare parameter
    shards of ``ps.train``'s default kind, the array store, and Spark's Python workers with our modules imported and Ray joined.

    It only starts processes a run would otherwise start on its critical path, and a
    run takes them whether they are ready or still starting (``take_spare``, the array
    store's lock): nothing waits for the warm-up, and nothing it does changes a result.
    ``stop()`` cancels its Spark job and waits for the thread to end."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.tag_name = f"hybrid_iter.warm_up.{id(self):x}"
        self._lock = threading.Lock()
        self._stopping = False
        #: when a run of ours last said it was coming (``run_coming``), monotonic
        self._run_coming_at = float("-inf")
        self._wake = threading.Event()  # a stop
        #: Spark jobs that run for the session's whole life (Ray on Spark's nodes are the
        #: tasks of one): running before the session returned, they are not a user's
        self._background_jobs = set(_active_jobs(session.spark))
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
            self.report["errors"][name] = f"{type(ex).__name__}: {_short(ex)}"
            log.debug("warm-up %s: %s", name, ex)
            return None

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            # every step waits for a quiet Spark and no run of ours coming: its processes'
            # starts and imports are CPU that a user's first action needs on a small machine
            self._step("quiet", lambda: self._wait_for_quiet_spark(self.session.spark))
            ready = [
                r
                for r in (
                    self._step("spare", self._spare),
                    self._step("store", self._store),
                    *(self._step("shard_spares", self._shard_spares) or ()),
                )
                if r is not None
            ]
            self._step("python_workers", self._python_workers)
            self._step("ready", lambda: self._wait_ready(ready))
            self._step("class_archive", self._class_archive)
        finally:
            self.report["seconds"] = time.perf_counter() - started
            self._done.set()

    def _spare(self) -> Any:
        from ._runtime.placement import keep_spare, spares

        kind = _coordinator_kind()
        started = keep_spare(kind, _COORDINATOR_MODULES, count=1)
        names = spares(kind)
        self.report["spare"] = names[0] if names else None
        return started[0].__ray_ready__.remote() if started else None

    def _shard_spares(self) -> list[Any]:
        """Spare parameter shards of ``ps.train``'s default kind (sync, through Ray, never
        restarted), as many as its default shard count of a model with tables: idle
        processes a run configures."""
        import ray

        from spark_ops import available_task_slots

        from ._runtime.placement import spares
        from .ps._train import keep_shard_spares, shard_kind, table_shards

        slots = max(1, available_task_slots(self.session.spark))
        count = table_shards(slots, float(ray.cluster_resources().get("CPU", 0.0)))
        kind = shard_kind(True, None, False, slots)
        started = keep_shard_spares(kind, count)
        self.report["shard_spares"] = spares(kind)
        return [h.__ray_ready__.remote() for h in started]

    def _class_archive(self) -> None:
        """Start making the JVM class archive the next ``Session.local`` maps, when this
        one's JVM found none (a background process at the lowest CPU priority; a stop
        before it ends ends it, and the next session tries again)."""
        wanted = self.session._class_archive
        if wanted is None:
            return
        with self._lock:
            if self._stopping:
                return
            self._creator = _class_archive.Creator(*wanted)
        self.report["class_archive"] = "making"

    def _store(self) -> Any:
        from ._runtime.array_store import start_store

        got = start_store()
        if got is None:
            return None
        handle, self.report["store"] = got
        return handle.ready.remote()

    def _python_workers(self) -> None:
        import functools

        from pyspark.sql import types as T

        from spark_ops import available_task_slots

        spark = self.session.spark
        n = max(1, available_task_slots(spark))
        schema = T.StructType([T.StructField("pid", T.LongType())])
        fn = functools.partial(_warm_python_worker, self.session.ray_address, _WORKER_MODULES)
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
        has said it was coming (``run_coming``) for ``_QUIET_BEFORE_WARM_UP`` seconds,
        or the session stops."""
        quiet_since = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if set(_active_jobs(spark)) - self._background_jobs:
                quiet_since = now
            elif now - max(quiet_since, self._run_coming_at) >= _QUIET_BEFORE_WARM_UP:
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


class Session:
    """A SparkSession and a Ray cluster that iterations run on.

    ``Session.local(parallelism=2)`` starts Ray on 127.0.0.1 and Spark ``local[2]``;
    ``Session.raydp(...)`` runs Spark executors as Ray actors through RayDP;
    ``Session.on_spark(spark)`` starts Ray on the Spark cluster you have (Ray on Spark);
    ``Session.attach(spark, ray_address)`` uses what is already running.
    Use it as a context manager: leaving the block stops what the session started.
    """

    _stack: ClassVar[list[Session]] = []

    def __init__(
        self,
        spark: Any,
        ray_address: str,
        *,
        owns_spark: bool = False,
        owns_ray: bool = False,
        kind: str = "attach",
        coordinator_resources: Mapping[str, float] | None = None,
    ) -> None:
        self.spark = spark
        self.ray_address = ray_address
        self.kind = kind
        #: Ray resources for the coordinator and PS shards (``None``: the head node when
        #: the cluster has several nodes; see ``hybrid_iter._runtime.placement``).
        self.coordinator_resources = (
            None if coordinator_resources is None else dict(coordinator_resources)
        )
        self._owns_spark = owns_spark
        self._owns_ray = owns_ray
        self._stopped = False
        #: ``Session.on_spark``'s Ray cluster and what it handed out (stopped with us)
        self._on_spark: Any = None
        #: the background warm-up (``_WarmUp``), once started
        self._warm: _WarmUp | None = None
        #: (key, conf) of the JVM class archive to make in the background (Session.local)
        self._class_archive: tuple[str, dict[str, str]] | None = None
        Session._stack.append(self)

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def local(
        cls,
        parallelism: int | None = None,
        *,
        spark_conf: Mapping[str, str] | None = None,
        driver_memory: str = "2g",
        object_store_memory: int | None = None,
        app_name: str = "hybrid_iter",
        warm_up: bool = True,
    ) -> Session:
        """Embedded default: Ray on 127.0.0.1 and Spark ``local[parallelism]``, UI off.

        Spark's JVM and Ray start side by side. ``warm_up``: once both are up, a thread
        of the session starts what a first run would otherwise wait for (a spare
        coordinator, the array store, Spark's Python workers with our modules imported:
        see ``warmed()`` and docs/sessions.md); the session returns without waiting.
        """
        cores = os.cpu_count() or 1
        if parallelism is None:
            parallelism = cores
        if not isinstance(parallelism, int) or isinstance(parallelism, bool) or parallelism < 1:
            raise SessionError(
                f"Session.local(parallelism) must be an int >= 1, got {parallelism!r}"
            )
        _check_spark_version("Session.local")
        _prepare_process_env()
        force_loopback()
        import ray
        from pyspark.sql import SparkSession

        owns_ray = not ray.is_initialized()
        owns_spark = _spark_compat.running_spark_master() is None
        # Spark's JVM starts in a thread while Ray starts here: they need nothing of each
        # other until the session is made, so the session costs the slower of the two.
        spark_start = _SparkStart(parallelism, app_name, driver_memory, cores, spark_conf)
        if not owns_ray:
            spark_start.ray_fate = "is left running"
        env_before = dict(os.environ)
        try:
            if owns_spark:
                spark_start.begin()
            if owns_ray:

                def start_ray() -> None:
                    ray.init(
                        address="local",  # our own instance, even if a `ray start` runs here
                        num_cpus=cores,
                        include_dashboard=False,
                        _node_ip_address="127.0.0.1",
                        namespace=NAMESPACE,
                        object_store_memory=object_store_memory,
                        logging_level=logging.WARNING,
                        log_to_driver=True,
                    )

                try:
                    try:
                        start_ray()
                    except Exception as ex:
                        end_ray_processes_of_a_failed_start(ray.shutdown)
                        if not (owns_spark and _raylet_wait_ran_out(ex)):
                            raise
                        # Ray waits a fixed 30 s for its raylet to register; on a loaded
                        # machine the JVM starting beside it can take them: once more,
                        # alone, after Spark has started
                        spark_start.wait()
                        log.warning(
                            "Ray's node did not register in time beside Spark's start; once more"
                        )
                        start_ray()
                except Exception as ex:
                    end_ray_processes_of_a_failed_start(ray.shutdown)
                    beside = "was stopped" if owns_spark else "is left running"
                    raise SessionError(
                        f"Session.local: Ray did not start on 127.0.0.1: {_short(ex)} "
                        f"(Spark, started beside it, {beside})"
                    ) from ex
            address = ray.get_runtime_context().gcs_address
            if not owns_spark:
                spark = SparkSession.builder.getOrCreate()  # the running one; left running
                log.info(
                    "Session.local uses the running SparkSession (%s)", spark.sparkContext.master
                )
            else:
                spark = spark_start.result()
            # What ray.init put in this process's environment (e.g. RAY_AUTH_MODE=token)
            # is what Spark's Python workers need to join Ray; the JVM started beside it
            # (or before) did not see it, so it goes to every later task's workers.
            handed = {
                k: v
                for k, v in os.environ.items()
                if k.startswith("RAY_") and env_before.get(k) != v
            }
            spark.sparkContext.environment.update(handed)
        except BaseException:
            if owns_spark:
                spark_start.abandon()
            if owns_ray:  # e.g. interrupted midway: its processes too
                end_ray_processes_of_a_failed_start(ray.shutdown)
            raise
        session = cls(spark, address, owns_spark=owns_spark, owns_ray=owns_ray, kind="local")
        if owns_spark and spark_start.archive_key is not None:
            session._class_archive = (spark_start.archive_key, spark_start.conf)
        if warm_up:
            session._start_warm_up()
        return session

    @classmethod
    def raydp(
        cls,
        *,
        address: str | None = None,
        num_executors: int = 1,
        executor_cores: int = 1,
        executor_memory: str = "1g",
        app_name: str = "hybrid_iter",
        spark_conf: Mapping[str, str] | None = None,
        executor_wait_seconds: float = 120.0,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        coordinator_resources: Mapping[str, float] | None = None,
        warm_up: bool = True,
    ) -> Session:
        """Spark on Ray through RayDP: executors are Ray actors, the driver is here.

        ``address``: the Ray cluster to join: ``host:port`` of its GCS, ``"auto"`` (the
        cluster of this node) or ``"local"`` (an embedded Ray on 127.0.0.1 with at least
        ``num_executors * executor_cores`` CPUs: the laptop case, and tests). ``None``
        follows Ray's conventions: ``HYBRID_ITER_RAY_ADDRESS``, then ``RAY_ADDRESS`` (what
        ``ray job submit`` sets for the entrypoint), else ``"local"``. Ray Client
        (``ray://``) and dashboard (``http://``) addresses are refused: submit the driver
        with ``ray job submit`` instead. A cluster that does not answer, or wants a Ray
        auth token this process lacks, is a ``SessionError`` naming the address and the
        fix within about ``connect_timeout`` seconds (before any JVM starts). On a
        loopback Ray everything binds to 127.0.0.1: Ray, RayDP's app master and
        executors (they bind to the Ray node's address), and the Spark driver. Returns
        once every executor has registered (at most ``executor_wait_seconds``). It must
        be the first Spark of the process (RayDP's jars go on the driver JVM's classpath
        when it starts). ``coordinator_resources``: Ray resources the coordinator and
        parameter-server shards ask for (default: the head node; ``{}``: any node).
        ``warm_up`` as in ``local``, once every executor has registered.
        """
        _check_spark_version("Session.raydp")
        if coordinator_resources is not None:
            coordinator_resources = check_resources(
                coordinator_resources, "Session.raydp(coordinator_resources)"
            )
        for name, v in (("num_executors", num_executors), ("executor_cores", executor_cores)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SessionError(f"Session.raydp({name}) must be an int >= 1, got {v!r}")
        for name, t in (
            ("executor_wait_seconds", executor_wait_seconds),
            ("connect_timeout", connect_timeout),
        ):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
                raise SessionError(f"Session.raydp({name}) must be seconds > 0, got {t!r}")
        if address is None:
            found = ray_address_from_env()
            address = found[0] if found is not None else "local"
        else:
            address = check_ray_address(address, "Session.raydp(address)")
        problem = _spark_compat.raydp_problem()  # before reaching out to any cluster
        if problem is not None:
            raise SessionError(problem)
        import ray

        owns_ray = not ray.is_initialized()
        gcs_target: str | None = None
        if address != "local":
            current = ray.get_runtime_context().gcs_address if not owns_ray else None
            if current is None or address not in ("auto", current):
                # Before any JVM or Ray starts: a bad address fails fast and leaves nothing.
                gcs_target = probe_ray_cluster(address, connect_timeout)
            if current is not None and gcs_target not in (None, current):
                raise SessionError(
                    f"Session.raydp(address={address!r}): this process is already connected "
                    f"to the Ray cluster at {current}; call ray.shutdown() first, or run in "
                    f"a fresh process"
                )
        _check_spark_jvm_for_raydp()
        _prepare_process_env()

        if owns_ray:
            if gcs_target is None:
                force_loopback()
                ray.init(
                    address="local",  # our own instance, even if a `ray start` cluster runs
                    num_cpus=max(os.cpu_count() or 1, num_executors * executor_cores),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    namespace=NAMESPACE,
                    logging_level=logging.WARNING,
                )
            else:
                _join_ray(gcs_target, connect_timeout)
        if coordinator_resources:
            _check_offered(coordinator_resources, owns_ray)
        gcs = ray.get_runtime_context().gcs_address
        try:
            import raydp
        except ImportError as ex:  # installed (raydp_problem) but not importable
            raise SessionError(
                f"Session.raydp could not import RayDP: {ex}; {_spark_compat.RAYDP_INSTALL}"
            ) from ex
        user_conf = dict(spark_conf or {})
        # An executor runs executor_cores / spark.task.cpus tasks at once: each task's
        # BLAS gets the spark.task.cpus cores it holds, not all of the executor's.
        configs = {
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            **_worker_env(_blas_threads(executor_cores, executor_cores // _task_cpus(user_conf))),
            **user_conf,
        }
        if is_loopback_address(gcs):
            configs.setdefault("spark.driver.host", "127.0.0.1")
            configs.setdefault("spark.driver.bindAddress", "127.0.0.1")
        # RayDP's app master owns the executor actors: when the node it runs on is lost,
        # Ray ends every executor with it and none comes back (a run can then only fail).
        # It goes where the coordinator goes (the head by default) unless spark_conf
        # places it (spark.ray.raydp_spark_master.actor.resource.<name>).
        from ._runtime.placement import coordinator_resources as placed

        master = dict(coordinator_resources) if coordinator_resources else placed()
        if master:  # with resources, RayDP's master asks 1 CPU unless told (a head has 0)
            master.setdefault("CPU", 0.0)
        for name, amount in master.items():
            configs.setdefault(f"spark.ray.raydp_spark_master.actor.resource.{name}", str(amount))
        try:
            spark = raydp.init_spark(
                app_name, num_executors, executor_cores, executor_memory, configs=configs
            )
        except Exception as ex:
            try:  # RayDP keeps its context when its own cleanup fails; drop it
                raydp.stop_spark()
            except Exception as cleanup:  # pragma: no cover - best effort
                log.warning("cleaning up RayDP failed: %s", cleanup)
            if owns_ray:
                ray.shutdown()
            raise SessionError(f"RayDP could not start Spark on Ray: {ex}") from ex
        spark.sparkContext.setLogLevel("ERROR")
        session = cls(
            spark,
            gcs,
            owns_spark=True,
            owns_ray=owns_ray,
            kind="raydp",
            coordinator_resources=coordinator_resources,
        )
        session._wait_for_slots(num_executors * executor_cores, executor_wait_seconds)
        if warm_up:
            session._start_warm_up()
        return session

    @classmethod
    def attach(
        cls,
        spark: Any,
        ray_address: str | None = None,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        coordinator_resources: Mapping[str, float] | None = None,
    ) -> Session:
        """Use a running SparkSession and Ray cluster; stops neither on exit.

        ``ray_address``: the cluster's GCS address (``host:port``) that Spark tasks can
        reach; ``None`` uses the Ray instance this driver is already connected to. An
        unreachable or token-protected cluster is a ``SessionError`` within about
        ``connect_timeout`` seconds. ``coordinator_resources`` as in ``raydp``.

        ``spark`` may be a Spark Connect client session (Spark >= 4.1): this process
        holds the Ray connection and the coordinators; the server's tasks reach their
        coordinator by its endpoint (``IterationConfig(transport="auto")``), with no Ray
        of their own. Bounded iterations and the ``hybrid_iter.ml`` estimators run
        there; ``ps.train`` and ``iterate_unbounded_streams`` are refused before any job
        (``docs/sessions.md``).
        """

        _check_spark_version("Session.attach")
        if coordinator_resources is not None:
            coordinator_resources = check_resources(
                coordinator_resources, "Session.attach(coordinator_resources)"
            )

        if _spark_compat.is_connect(spark):
            _check_connect(spark)
        elif not _spark_compat.is_session(spark):
            raise SessionError(
                f"Session.attach(spark) needs a pyspark.sql.SparkSession, got {type(spark).__name__}"
            )
        import ray

        owns_ray = False
        if ray_address is not None:
            ray_address = check_ray_address(ray_address, "Session.attach(ray_address)")
        if not ray.is_initialized():
            if ray_address is None or ray_address == "local":
                raise SessionError(
                    "Session.attach: Ray is not running in this process; pass "
                    "ray_address='host:port' of the cluster, or call ray.init() first"
                )
            _join_ray(ray_address, connect_timeout)
            owns_ray = True  # we connected this driver; disconnect it, the cluster stays
        address: str = (
            ray.get_runtime_context().gcs_address
            if ray_address is None or ray_address == "auto"
            else ray_address
        )
        if coordinator_resources:
            _check_offered(coordinator_resources, owns_ray)
        return cls(
            spark,
            address,
            owns_spark=False,
            owns_ray=owns_ray,
            kind="attach",
            coordinator_resources=coordinator_resources,
        )

    @classmethod
    def on_spark(
        cls,
        spark: Any,
        *,
        ray_address: str | None = None,
        worker_nodes: int | None = None,
        worker_node_cpus: int | None = None,
        parallelism: int | None = None,
        ray_temp_root_dir: str | None = None,
        setup_options: Mapping[str, Any] | None = None,
        executor_wait_seconds: float = 120.0,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        coordinator_resources: Mapping[str, float] | None = None,
        warm_up: bool = True,
    ) -> Session:
        """Run on the Spark cluster you have (standalone, YARN, Databricks classic or
        dedicated): Ray started on it with Ray on Spark, or a Ray already there.

        ``spark``: a classic SparkSession whose master is ``spark://...``, ``yarn`` or
        ``local-cluster[...]``; Spark Connect, ``k8s://`` and plain ``local[N]`` (use
        ``Session.local``) are refused, as is dynamic allocation (barrier stages need
        fixed executors). Spark is used, never stopped.

        Ray: with ``ray_address=None`` the Ray on Spark cluster this process started on
        ``spark`` is joined if there is one, else one is started: its head beside the
        driver (no CPUs, no dashboard), and ``worker_nodes`` Ray worker nodes (default:
        one per executor), each a Spark task holding ``worker_node_cpus`` cores (default
        ``spark.task.cpus``: one task slot) for the cluster's life. ``ray_address``
        (``host:port``) joins that cluster instead. ``ray_temp_root_dir`` and
        ``setup_options`` (e.g. ``memory_worker_node``, ``object_store_memory_worker_node``,
        ``collect_log_to_path``, ``head_node_options``) go to
        ``ray.util.spark.setup_ray_cluster``. Needs the ``on_spark`` extra (``ray[client]``).

        Before anything starts: the worker nodes plus ``parallelism`` subtask slots
        (default 1) must fit the executors' free slots, else ``SessionError``. Then one
        probe job checks that the executors' Python reaches a ``ray`` executable of the
        driver's Ray version (``SessionError`` naming the host, else). Iterations and
        fits see only the slots the worker nodes leave (``parallelism=None`` there means
        all of those), and before each barrier stage every executor that can run a
        subtask must have a raylet on its host, else ``SessionError`` naming it.

        Token authentication stays on: ``RAY_AUTH_TOKEN`` (or the file
        ``RAY_AUTH_TOKEN_PATH``) of this process, else a new random token for a cluster
        started here, handed to the Ray nodes and, through ``SparkContext.environment``,
        to the Python workers of every later Spark task (so nothing needs setting before
        the SparkSession starts); ``RAY_AUTH_MODE=disabled`` turns it off. On
        ``spark.driver.host=127.0.0.1`` every Ray process binds 127.0.0.1 only. The
        coordinator and the PS shards go to the driver's Ray node (the head), unless
        ``coordinator_resources`` says otherwise. Leaving the block stops the cluster if
        it was started here and puts the environment back. ``warm_up`` as in ``local``
        (its Spark job runs on the executors the Ray worker nodes leave). See
        docs/sessions.md.
        """
        from ._runtime import ray_on_spark

        _check_spark_version("Session.on_spark")
        if coordinator_resources is not None:
            coordinator_resources = check_resources(
                coordinator_resources, "Session.on_spark(coordinator_resources)"
            )
        for name, v, low in (
            ("worker_nodes", worker_nodes, 1),
            ("worker_node_cpus", worker_node_cpus, 1),
            ("parallelism", parallelism, 1),
        ):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
                raise SessionError(f"Session.on_spark({name}) must be an int >= {low}, got {v!r}")
        for name, t in (
            ("executor_wait_seconds", executor_wait_seconds),
            ("connect_timeout", connect_timeout),
        ):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
                raise SessionError(f"Session.on_spark({name}) must be seconds > 0, got {t!r}")
        if ray_address is not None:
            ray_address = check_ray_address(ray_address, "Session.on_spark(ray_address)")
            if ray_address == "local":
                raise SessionError(
                    "Session.on_spark(ray_address='local') would start a Ray of this process "
                    "only, which Spark's executors cannot join; leave ray_address=None to "
                    "start Ray on Spark, or use Session.local()"
                )
        if setup_options is not None and not isinstance(setup_options, Mapping):
            raise SessionError(
                f"Session.on_spark(setup_options) must be a mapping of "
                f"ray.util.spark.setup_ray_cluster arguments, got {type(setup_options).__name__}"
            )
        owned = {
            "max_worker_nodes": "worker_nodes",
            "min_worker_nodes": "worker_nodes",
            "num_cpus_worker_node": "worker_node_cpus",
            "ray_temp_root_dir": "ray_temp_root_dir",
        }
        for key in set(setup_options or {}) & set(owned):
            raise SessionError(
                f"Session.on_spark(setup_options={{{key!r}: ...}}): give it as "
                f"Session.on_spark({owned[key]}=...)"
            )
        if setup_options and ray_address is not None:
            raise SessionError(
                "Session.on_spark(setup_options=...) configures a Ray on Spark cluster "
                "started here; with ray_address the cluster already runs: drop one of them"
            )
        import importlib.util

        # Ray on Spark's head always serves Ray Client (grpcio); its worker-port lock
        # uses psutil
        missing = [m for m in ("grpc", "psutil") if importlib.util.find_spec(m) is None]
        if missing:
            raise SessionError(
                f"Session.on_spark needs Ray on Spark's dependencies ({', '.join(missing)} "
                f"missing): pip install 'hybrid-iter[on_spark]'"
            )
        handle = ray_on_spark.start(
            spark,
            ray_address=ray_address,
            worker_nodes=worker_nodes,
            worker_node_cpus=worker_node_cpus,
            parallelism=parallelism,
            ray_temp_root_dir=ray_temp_root_dir,
            setup_options=dict(setup_options or {}),
            executor_wait_seconds=float(executor_wait_seconds),
            connect_timeout=float(connect_timeout),
            coordinator_resources=coordinator_resources,
        )
        session = cls(
            spark,
            handle.address,
            owns_spark=False,
            owns_ray=False,  # the handle disconnects this driver and stops the cluster
            kind="on_spark",
            coordinator_resources=handle.coordinator_resources,
        )
        session._on_spark = handle
        if warm_up:
            session._start_warm_up()
        return session

    # -- lifecycle ----------------------------------------------------------------------

    @classmethod
    def current(cls) -> Session | None:
        """The innermost session that is not stopped, if any."""
        for s in reversed(cls._stack):
            if not s._stopped:
                return s
        return None

    def describe(self) -> dict[str, Any]:
        """Where this session runs (driver): the Ray cluster, its nodes, the executors.

        ``{"kind", "ray_address", "ray_nodes", "ray_head", "spark_master", "executors",
        "spark_hosts", "task_slots"}`` (``spark_hosts``: the driver's and executors'; these
        three are None for a Spark Connect client, which cannot see them); the CLI prints
        it before running anything.
        """
        import ray

        from spark_ops import available_task_slots

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        head = next(
            (n["NodeManagerAddress"] for n in nodes if "node:__internal_head__" in n["Resources"]),
            None,
        )
        if _spark_compat.is_connect(self.spark):  # a client sees no executor list or slots
            hosts, executors, slots = None, None, None
        else:
            hosts, executors = _spark_compat.executor_hosts(self.spark)  # the driver's too
            slots = available_task_slots(self.spark)
        return {
            "kind": self.kind,
            "ray_address": self.ray_address,
            "ray_nodes": len(nodes),
            "ray_head": head,
            "spark_master": _spark_compat.spark_master(self.spark),
            "executors": executors,
            "spark_hosts": hosts,
            "task_slots": slots,
        }

    def _start_warm_up(self) -> None:
        self._warm = _WarmUp(self)
        self._warm.start()

    def _runs_coming(self) -> None:
        """A run is about to start: a warm-up not started yet waits until Spark is quiet
        after it (``_WarmUp.run_coming``); the run starts what it needs itself."""
        if self._warm is not None:
            self._warm.run_coming()

    def warmed(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Wait for the background warm-up to end and say what it made ready: ``spare``
        (the spare coordinator's actor name), ``shard_spares`` (the spare parameter
        shards'), ``store`` (the array store's),
        ``python_workers`` (the pids of Spark's Python workers that imported our modules
        and joined Ray), ``class_archive`` (``"making"`` when this session's JVM found no
        class archive and a background process makes one for the next sessions, which
        this session's ``stop`` ends if it still runs), ``errors`` (what could not be
        warmed, by step: a run then starts it itself), ``seconds``. None when the
        session was made with ``warm_up=False``.
        A run never needs to call this; benchmarks and tests do."""
        return None if self._warm is None else self._warm.wait(timeout)

    def _wait_for_slots(self, wanted: int, seconds: float) -> None:
        from spark_ops import available_task_slots

        deadline = time.monotonic() + seconds
        while available_task_slots(self.spark) < wanted:
            if time.monotonic() > deadline:
                have = available_task_slots(self.spark)
                self.stop()
                raise SessionError(
                    f"Spark on Ray registered {have} task slot(s) of {wanted} within "
                    f"{seconds:.0f}s; the Ray cluster may lack CPUs or memory for the executors"
                )
            time.sleep(0.2)  # polling an external registration, not test synchronisation

    def stop(self) -> None:
        """Stop what this session started (Spark first, then Ray); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._warm is not None:
            self._warm.stop()  # before Spark and Ray go: its job and calls end first
        if self in Session._stack:
            Session._stack.remove(self)
        if self._owns_ray or self._on_spark is not None:
            # the spares and the array store end with this Ray: forget their handles (a
            # later Ray of this process may reuse the job id they are kept under)
            from ._runtime.array_store import drop_store
            from ._runtime.placement import drop_spares

            drop_spares()
            drop_store()
        if self._owns_spark:
            try:
                if self.kind == "raydp":
                    import raydp

                    raydp.stop_spark()
                else:
                    self.spark.stop()
            except Exception as ex:  # pragma: no cover - best effort on shutdown
                log.warning("stopping Spark failed: %s", ex)
        if self._on_spark is not None:
            self._on_spark.stop()
        if self._owns_ray:
            import ray

            ray.shutdown()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        master = _spark_compat.spark_master(self.spark) if not self._stopped else "stopped"
        return f"Session(kind={self.kind!r}, spark={master!r}, ray={self.ray_address!r})"
