"""Spark + Ray sessions: embedded (``local``), Spark on Ray (``raydp``), or ``attach``.

Runs on the driver. A session stops only what it started: a SparkSession or Ray
instance that was already running is used and left running.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from ._errors import SessionError
from ._ray_util import NAMESPACE, force_loopback, is_loopback_address

__all__ = ["Session"]

log = logging.getLogger("hybrid_iter")


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
    from pyspark import SparkContext

    active = SparkContext._active_spark_context
    if active is not None:
        raise SessionError(
            f"Session.raydp needs its own SparkContext, but one is already running in this "
            f"process (master {active.master!r}); stop it first, or use "
            f"Session.attach(spark) to run on it"
        )
    gateway = SparkContext._gateway
    if gateway is not None:
        from py4j.java_gateway import JavaClass

        if not isinstance(gateway.jvm.org.apache.spark.deploy.raydp.RayAppMaster, JavaClass):
            raise SessionError(
                "Session.raydp must start the first Spark of this process: its JVM was "
                "already launched without RayDP's jars (an earlier Session.local or "
                "SparkSession) and a process keeps its JVM; run Spark on Ray in a fresh "
                "process"
            )


def _prepare_process_env() -> None:
    """Spark's Python workers must run this interpreter and stay on loopback."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


class Session:
    """A SparkSession and a Ray cluster that iterations run on.

    ``Session.local(parallelism=2)`` starts Ray on 127.0.0.1 and Spark ``local[2]``;
    ``Session.raydp(...)`` runs Spark executors as Ray actors through RayDP;
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
    ) -> None:
        self.spark = spark
        self.ray_address = ray_address
        self.kind = kind
        self._owns_spark = owns_spark
        self._owns_ray = owns_ray
        self._stopped = False
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
    ) -> Session:
        """Embedded default: Ray on 127.0.0.1 and Spark ``local[parallelism]``, UI off."""
        cores = os.cpu_count() or 1
        if parallelism is None:
            parallelism = cores
        if not isinstance(parallelism, int) or isinstance(parallelism, bool) or parallelism < 1:
            raise SessionError(
                f"Session.local(parallelism) must be an int >= 1, got {parallelism!r}"
            )
        _prepare_process_env()
        force_loopback()
        import ray
        from pyspark.sql import SparkSession

        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(
                address="local",  # our own instance, even if a `ray start` cluster runs here
                num_cpus=cores,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                namespace=NAMESPACE,
                object_store_memory=object_store_memory,
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
        address = ray.get_runtime_context().gcs_address
        from pyspark import SparkContext

        owns_spark = SparkContext._active_spark_context is None
        if not owns_spark:
            spark = SparkSession.builder.getOrCreate()  # the running one; left running
            log.info("Session.local uses the running SparkSession (%s)", spark.sparkContext.master)
        else:
            conf = {
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
            builder = SparkSession.builder
            for k, v in conf.items():
                builder = builder.config(k, v)
            try:
                spark = builder.getOrCreate()
            except Exception as ex:
                if owns_ray:
                    ray.shutdown()
                raise SessionError(f"could not start Spark local[{parallelism}]: {ex}") from ex
            spark.sparkContext.setLogLevel("ERROR")
        return cls(spark, address, owns_spark=owns_spark, owns_ray=owns_ray, kind="local")

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
    ) -> Session:
        """Spark on Ray through RayDP: executors are Ray actors, the driver is here.

        ``address``: a Ray cluster to join (``"auto"`` on a cluster node); ``None``
        starts an embedded Ray on 127.0.0.1 (the laptop case, and tests) with at least
        ``num_executors * executor_cores`` CPUs. On a loopback Ray everything binds to
        127.0.0.1: Ray, RayDP's app master and executors (they bind to the Ray node's
        address), and the Spark driver. Returns once every executor has registered.
        It must be the first Spark of the process (RayDP's jars go on the driver JVM's
        classpath when it starts).
        """
        for name, v in (("num_executors", num_executors), ("executor_cores", executor_cores)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SessionError(f"Session.raydp({name}) must be an int >= 1, got {v!r}")
        _check_spark_jvm_for_raydp()
        _prepare_process_env()
        import ray

        owns_ray = not ray.is_initialized()
        if owns_ray:
            if address is None or address == "local":
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
                if is_loopback_address(address):
                    force_loopback()
                ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        gcs = ray.get_runtime_context().gcs_address
        try:
            import raydp
        except ImportError as ex:  # pragma: no cover - raydp is a dependency
            raise SessionError("Session.raydp needs RayDP: pip install 'raydp>=1.6.5'") from ex
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
        session = cls(spark, gcs, owns_spark=True, owns_ray=owns_ray, kind="raydp")
        session._wait_for_slots(num_executors * executor_cores, executor_wait_seconds)
        return session

    @classmethod
    def attach(cls, spark: Any, ray_address: str | None = None) -> Session:
        """Use a running SparkSession and Ray cluster; stops neither on exit.

        ``ray_address``: the cluster's GCS address (``host:port``) that Spark tasks can
        reach; ``None`` uses the Ray instance this driver is already connected to.
        """
        from pyspark.sql import SparkSession

        if not isinstance(spark, SparkSession):
            raise SessionError(
                f"Session.attach(spark) needs a pyspark.sql.SparkSession, got {type(spark).__name__}"
            )
        import ray

        owns_ray = False
        if ray_address is not None and ray_address.startswith("ray://"):
            raise SessionError(
                "Session.attach(ray_address) needs the GCS address (host:6379) that Spark "
                "tasks join directly; Ray Client addresses (ray://...) are not supported"
            )
        if not ray.is_initialized():
            if ray_address is None:
                raise SessionError(
                    "Session.attach: Ray is not running in this process; pass "
                    "ray_address='host:port' of the cluster, or call ray.init() first"
                )
            if is_loopback_address(ray_address):
                force_loopback()
            ray.init(address=ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
            owns_ray = True  # we connected this driver; disconnect it, the cluster stays
        address = ray_address or ray.get_runtime_context().gcs_address
        return cls(spark, address, owns_spark=False, owns_ray=owns_ray, kind="attach")

    # -- lifecycle ----------------------------------------------------------------------

    @classmethod
    def current(cls) -> Session | None:
        """The innermost session that is not stopped, if any."""
        for s in reversed(cls._stack):
            if not s._stopped:
                return s
        return None

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
        if self in Session._stack:
            Session._stack.remove(self)
        if self._owns_spark:
            try:
                if self.kind == "raydp":
                    import raydp

                    raydp.stop_spark()
                else:
                    self.spark.stop()
            except Exception as ex:  # pragma: no cover - best effort on shutdown
                log.warning("stopping Spark failed: %s", ex)
        if self._owns_ray:
            import ray

            ray.shutdown()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        master = self.spark.sparkContext.master if not self._stopped else "stopped"
        return f"Session(kind={self.kind!r}, spark={master!r}, ray={self.ray_address!r})"
