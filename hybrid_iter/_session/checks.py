"""What the start modes of a session check and set alike (driver, before anything
starts): the Spark line, a Spark Connect client, a JVM RayDP can use, numeric
arguments, and the share of cores each Spark task's BLAS gets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from spark_ops import _spark_compat

from .._errors import SessionError

__all__ = [
    "blas_threads",
    "check_connect",
    "check_positive_ints",
    "check_seconds",
    "check_spark_jvm_for_raydp",
    "check_spark_version",
    "task_cpus",
    "worker_env",
]


def blas_threads(cores: int, tasks: int) -> str:
    return str(max(1, cores // max(tasks, 1)))


def worker_env(threads: str) -> dict[str, str]:
    # Each Spark task gets its share of cores for numpy's BLAS, not all of them.
    return {
        f"spark.executorEnv.{v}": threads
        for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    }


def task_cpus(conf: Mapping[str, str]) -> int:
    try:
        return max(1, int(conf.get("spark.task.cpus", 1)))
    except (TypeError, ValueError):
        return 1


def check_spark_jvm_for_raydp() -> None:
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


def check_spark_version(where: str) -> None:
    """A PySpark outside the supported lines fails the session before anything starts."""
    try:
        _spark_compat.check_spark_version()
    except _spark_compat.UnsupportedSparkVersion as ex:
        raise SessionError(f"{where}: {ex}") from ex


def check_connect(spark: Any) -> None:
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


def check_positive_ints(where: str, **values: int | None) -> None:
    """Each given value an int >= 1 (None: not given), else ``SessionError`` naming it."""
    for name, v in values.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise SessionError(f"{where}({name}) must be an int >= 1, got {v!r}")


def check_seconds(where: str, **values: float) -> None:
    """Each value a finite number of seconds > 0, else ``SessionError`` naming it."""
    for name, t in values.items():
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise SessionError(f"{where}({name}) must be seconds > 0, got {t!r}")
