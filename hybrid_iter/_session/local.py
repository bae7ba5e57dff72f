"""``Session.local``: Ray on 127.0.0.1 and Spark ``local[N]`` in this process, started
side by side (driver)."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spark_ops import _class_archive, _spark_compat

from .._cluster.processes import (
    end_ray_processes_of_a_failed_start,
    end_spark_jvm_launch,
    prepare_process_env,
    start_own_ray,
)
from .._cluster.ray_util import NAMESPACE, force_loopback
from .._cluster.warm_up import short
from .._errors import ClassArchiveWarning, SessionError
from .checks import blas_threads, check_spark_version, worker_env

if TYPE_CHECKING:
    from . import Session

__all__ = ["SparkStart", "local"]

log = logging.getLogger("hybrid_iter")

#: Spark's Python worker daemon for the session (``hybrid_iter/_runtime/worker_daemon.py``):
#: named, not imported, since ``python -m`` must be the first to import it in the daemon
WORKER_DAEMON = "hybrid_iter._runtime.worker_daemon"


class SparkStart:
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
            # each Python worker forked with our task's modules imported (2 CPU-s less
            # per worker; the daemon is PySpark's own otherwise)
            "spark.python.daemon.module": WORKER_DAEMON,
            **worker_env(blas_threads(cores, parallelism)),
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
        #: set by ``abandon``: the launch it ends must not be taken for a JVM that the
        #: archive crashed (and launched again, never to end)
        self._abandoned = threading.Event()

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
            if self._abandoned.is_set() or not _class_archive.gateway_exited(ex):
                raise
            # the JVM launched with the archive died before its gateway port (the file
            # changed after its check, a JVM bug): once more without it, and the archive
            # goes if that JVM starts
            if self._own_options is None:
                del self.conf["spark.driver.extraJavaOptions"]
            else:
                self.conf["spark.driver.extraJavaOptions"] = self._own_options
            if self._abandoned.is_set():
                raise
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
                f"{short(self._error)} (Ray, started beside it, {self.ray_fate})"
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
        self._abandoned.set()
        if self.launched_jvm and not self._done.is_set():
            end_spark_jvm_launch()  # the start then ends now, not after the JVM's start
        self._done.wait()
        if self.launched_jvm:
            _spark_compat.shut_down_jvm()
        elif self._spark is not None:
            self._spark.stop()


def local(
    cls: type[Session],
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
        raise SessionError(f"Session.local(parallelism) must be an int >= 1, got {parallelism!r}")
    check_spark_version("Session.local")
    prepare_process_env()
    force_loopback()
    import ray
    from pyspark.sql import SparkSession

    owns_ray = not ray.is_initialized()
    owns_spark = _spark_compat.running_spark_master() is None
    # Spark's JVM starts in a thread while Ray starts here: they need nothing of each
    # other until the session is made, so the session costs the slower of the two.
    spark_start = SparkStart(parallelism, app_name, driver_memory, cores, spark_conf)
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

            def alone() -> None:
                # the JVM starting beside Ray can take the raylet's fixed wait on a loaded
                # machine: once more, alone, after Spark has started
                spark_start.wait()
                log.warning("Ray did not start beside Spark; once more, alone")

            try:
                start_own_ray(start_ray, once_more=owns_spark, before_retry=alone)
            except Exception as ex:
                beside = "was stopped" if owns_spark else "is left running"
                raise SessionError(
                    f"Session.local: Ray did not start on 127.0.0.1: {short(ex)} "
                    f"(Spark, started beside it, {beside})"
                ) from ex
        address = ray.get_runtime_context().gcs_address
        if not owns_spark:
            spark = SparkSession.builder.getOrCreate()  # the running one; left running
            log.info("Session.local uses the running SparkSession (%s)", spark.sparkContext.master)
        else:
            spark = spark_start.result()
        # What ray.init put in this process's environment (e.g. RAY_AUTH_MODE=token)
        # is what Spark's Python workers need to join Ray; the JVM started beside it
        # (or before) did not see it, so it goes to every later task's workers.
        handed = {
            k: v for k, v in os.environ.items() if k.startswith("RAY_") and env_before.get(k) != v
        }
        spark.sparkContext.environment.update(handed)
    except BaseException:
        if owns_spark:
            spark_start.abandon()
        if owns_ray:  # e.g. interrupted midway: its processes too
            end_ray_processes_of_a_failed_start(ray.shutdown)
        raise
    archive = (
        (spark_start.archive_key, spark_start.conf)
        if owns_spark and spark_start.archive_key is not None
        else None
    )
    session = cls(
        spark,
        address,
        owns_spark=owns_spark,
        owns_ray=owns_ray,
        kind="local",
        class_archive=archive,
    )
    if warm_up:
        session._start_warm_up()
    return session
