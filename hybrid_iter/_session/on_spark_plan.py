"""``Session.on_spark``'s plan before anything starts, and its checks while it runs
(driver only): the Spark cluster Ray on Spark can use, the executors and their task
slots, the probe job that finds the executors' ``ray``, and the raylet each executor
that runs a subtask needs beside it. The start and stop are ``ray_on_spark.py``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import shutil
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spark_ops import _spark_compat

from .._cluster.slots import wait_for
from .._errors import SessionError

__all__ = [
    "Executor",
    "check_master",
    "check_spark",
    "executors_without_raylet",
    "expected_executors",
    "missing_raylet_message",
    "plan_slots",
    "probe_executors",
    "ray_path",
    "resolve_host",
    "slots_of",
    "task_cpus",
    "wait_for_executors",
]

log = logging.getLogger("hybrid_iter")

WHERE = "Session.on_spark"
_SUPPORTED = "spark://HOST:PORT (standalone), yarn, or local-cluster[N, CORES, MEMORY]"


@dataclass(frozen=True)
class Executor:
    """A Spark executor as the driver sees it: id, host, cores, tasks running now."""

    id: str
    host: str
    cores: int
    active_tasks: int = 0


# -- 1. refusals before anything runs ---------------------------------------------------


def check_master(master: str) -> None:
    """``SessionError`` unless Ray on Spark can start worker nodes under ``master``."""
    if master == "yarn" or master.startswith(("spark://", "local-cluster[")):
        return
    if master == "local" or master.startswith("local["):
        raise SessionError(
            f"{WHERE}: master {master!r} runs every task inside the driver's JVM, so Ray on "
            f"Spark has no executor to start Ray worker nodes on; use "
            f"hybrid_iter.Session.local(parallelism=N) (Ray and Spark local[N] on this "
            f"machine), or a cluster master: {_SUPPORTED}"
        )
    if master.startswith("k8s://"):
        raise SessionError(
            f"{WHERE}: master {master!r} is Spark on Kubernetes, which Ray on Spark cannot "
            f"start Ray worker nodes on; run Ray beside it with KubeRay (k8s/ has the "
            f"manifests) and use hybrid_iter.Session.attach(spark, ray_address='HEAD:6379')"
        )
    raise SessionError(
        f"{WHERE}: master {master!r} is not one Ray on Spark supports; it needs {_SUPPORTED}"
    )


def check_spark(spark: Any) -> str:
    """The master of ``spark`` once it is a classic SparkSession Ray on Spark can use."""
    kind = type(spark)
    if kind.__module__.startswith("pyspark.sql.connect"):
        raise SessionError(
            f"{WHERE}(spark): a Spark Connect session runs no Python on the executors that "
            f"this process controls, so Ray on Spark cannot start Ray there; use a classic "
            f"SparkSession on the cluster's driver, or run Ray beside the cluster and use "
            f"hybrid_iter.Session.attach"
        )
    from pyspark.sql import SparkSession

    if not isinstance(spark, SparkSession):
        raise SessionError(f"{WHERE}(spark) needs a pyspark.sql.SparkSession, got {kind.__name__}")
    master = str(spark.sparkContext.master)
    check_master(master)
    conf = spark.sparkContext.getConf()
    if conf.get("spark.dynamicAllocation.enabled", "false").strip().lower() == "true":
        raise SessionError(
            f"{WHERE}: spark.dynamicAllocation.enabled=true; Spark runs no barrier stage "
            f"(one task per subtask, all at once) with dynamic allocation, and Ray worker "
            f"nodes need executors that stay; start the SparkSession with "
            f"spark.dynamicAllocation.enabled=false and a fixed number of executors"
        )
    return master


def task_cpus(spark: Any) -> int:
    try:
        return max(1, int(spark.sparkContext.getConf().get("spark.task.cpus", "1")))
    except ValueError:
        return 1


def slots_of(executor: Executor, cpus_per_task: int) -> int:
    return executor.cores // cpus_per_task


def plan_slots(
    executors: Sequence[Executor],
    cpus_per_task: int,
    worker_nodes: int,
    worker_node_cpus: int,
    parallelism: int | None,
) -> int:
    """The task slots left for subtasks once ``worker_nodes`` Ray worker nodes of
    ``worker_node_cpus`` cores each run, or ``SessionError`` naming what is short."""
    if not executors:
        raise SessionError(f"{WHERE}: no executor is registered with the Spark driver")
    biggest = max(e.cores for e in executors)
    if worker_node_cpus > biggest:
        raise SessionError(
            f"{WHERE}(worker_node_cpus={worker_node_cpus}): a Ray worker node is one Spark "
            f"task holding that many cores, but the largest executor has {biggest}; give "
            f"worker_node_cpus <= {biggest}"
        )
    total = sum(slots_of(e, cpus_per_task) for e in executors)
    busy = sum(e.active_tasks for e in executors)
    free = max(0, total - busy)
    per_node = math.ceil(worker_node_cpus / cpus_per_task)
    held = worker_nodes * per_node
    wanted = 1 if parallelism is None else parallelism
    if held + wanted > free:
        running = f" ({busy} running now)" if busy else ""
        raise SessionError(
            f"{WHERE}: {worker_nodes} Ray worker node(s) hold {held} Spark task slot(s) "
            f"for the cluster's life and the subtasks need {wanted} more at once (one "
            f"barrier stage), but the {len(executors)} executor(s) have {total} slot(s), "
            f"{free} free{running} (spark.task.cpus={cpus_per_task}); lower worker_nodes "
            f"or parallelism, or give the cluster more executors or cores"
        )
    return free - held


# -- raylets beside the executors --------------------------------------------------------


def resolve_host(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def executors_without_raylet(
    executors: Sequence[Executor],
    raylet_addresses: Sequence[str],
    cpus_per_task: int,
    resolve: Any = resolve_host,
) -> list[Executor]:
    """The executors that can run a subtask but have no live raylet on their host.

    A subtask is a Ray driver inside a Spark task: it joins Ray through the raylet of
    its own host (Unix socket, shared-memory object store). An executor too small for a
    task (fewer cores than ``spark.task.cpus``) runs no subtask and is not counted."""
    raylets = {resolve(a) for a in raylet_addresses}
    return [
        e
        for e in executors
        if slots_of(e, cpus_per_task) > 0
        and e.host not in raylets
        and resolve(e.host) not in raylets
    ]


# -- 2. the probe job ---------------------------------------------------------------------


def _probe_task(_: Any) -> Iterator[dict[str, Any]]:
    """Runs in a Spark task on an executor: what its Python worker would run ``ray``
    with (Ray on Spark's ``start_ray_node`` calls ``shutil.which("ray")``)."""
    exe_dir = os.path.dirname(sys.executable)
    beside = os.path.join(exe_dir, "ray")
    try:
        version: str | None = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        version = None
    yield {
        "host": socket.gethostname(),
        "python": sys.executable,
        "path": os.environ.get("PATH", ""),
        "which_ray": shutil.which("ray"),
        "beside": beside if os.access(beside, os.X_OK) else None,
        "ray_version": version,
    }


def probe_executors(spark: Any, tasks: int) -> list[dict[str, Any]]:
    """One small job over ``tasks`` partitions; the distinct answers."""
    rdd = spark.sparkContext.parallelize(range(tasks), tasks)
    sc = spark.sparkContext
    sc.setJobDescription("hybrid_iter Session.on_spark: probe the executors for Ray")
    try:
        answers = rdd.mapPartitions(_probe_task).collect()
    except Exception as ex:
        raise SessionError(
            f"{WHERE}: probing the executors' Python failed: {type(ex).__name__}: {str(ex)[:2000]}"
        ) from ex
    finally:
        sc.setJobDescription(None)
    distinct: dict[tuple[Any, ...], dict[str, Any]] = {}
    for a in answers:
        distinct.setdefault(
            (a["host"], a["python"], a["which_ray"], a["beside"], a["ray_version"]), a
        )
    return list(distinct.values())


def _split_path(value: str) -> list[str]:
    return [p for p in value.split(os.pathsep) if p]


def ray_path(probes: Sequence[Mapping[str, Any]], launcher_dir: str | None) -> str | None:
    """The ``PATH`` the Ray nodes must run with, None when theirs already reaches ``ray``;
    ``SessionError`` naming the executor's host and Python when none can."""
    import ray

    wrong = [p for p in probes if p["ray_version"] not in (None, ray.__version__)]
    if wrong:
        p = wrong[0]
        raise SessionError(
            f"{WHERE}: the executors' Python on {p['host']} ({p['python']}) has Ray "
            f"{p['ray_version']}, the driver has Ray {ray.__version__}; a Ray cluster needs "
            f"one Ray version: install ray=={ray.__version__} in the executors' Python "
            f"environment"
        )
    lacking = [p for p in probes if p["which_ray"] is None and p["beside"] is None]
    if lacking:
        p = lacking[0]
        raise SessionError(
            f"{WHERE}: no `ray` executable on the PATH of the executors' Python workers "
            f"(host {p['host']}, Python {p['python']}, PATH={p['path']!r}) nor beside that "
            f"Python; Ray on Spark runs `ray start` on every executor: install Ray there "
            f"(pip install 'hybrid-iter[on_spark]' in the executors' environment), or "
            f"start the SparkSession with spark.executorEnv.PATH including the directory "
            f"of its `ray`"
        )
    driver_ray = shutil.which("ray")
    if (
        launcher_dir is None
        and driver_ray is not None
        and all(p["which_ray"] is not None for p in probes)
    ):
        return None
    dirs: list[str] = [launcher_dir] if launcher_dir else []
    dirs += [os.path.dirname(p["beside"]) for p in probes if p["beside"] and not p["which_ray"]]
    if driver_ray is None:
        dirs.append(os.path.dirname(sys.executable))
    for p in probes:
        dirs += _split_path(p["path"])
    dirs += _split_path(os.environ.get("PATH", ""))
    return os.pathsep.join(dict.fromkeys(dirs))


def missing_raylet_message(missing: Sequence[Executor], nodes: Sequence[Any], started: bool) -> str:
    names = ", ".join(f"executor {e.id} on {e.host}" for e in missing)
    hosts = sorted({str(n["NodeManagerAddress"]) for n in nodes})
    cores = max(e.cores for e in missing)
    fix = (
        f"Spark places each Ray worker node (one Spark task) on any executor with free "
        f"cores, so several can land on one executor: give Session.on_spark("
        f"worker_node_cpus={cores // 2 + 1}) (more than half of an executor's {cores} cores: "
        f"then no two fit on one executor and each executor gets one), or more "
        f"worker_nodes"
        if started
        else "start a Ray node on each executor host (ray start --address=...), or let "
        "Session.on_spark(spark) start Ray on Spark itself"
    )
    return (
        f"{WHERE}: {names} can run a subtask but has no raylet on its host (Ray nodes run "
        f"on {hosts}); a subtask joins Ray through the raylet of its own host; {fix}"
    )


def expected_executors(master: str, conf: Mapping[str, str]) -> int:
    """How many executors the application asked for, as far as its settings say: the N
    of ``local-cluster[N, ...]``, else ``spark.executor.instances``, else 1."""
    if master.startswith("local-cluster["):
        try:
            return max(1, int(master[len("local-cluster[") :].split(",", 1)[0]))
        except ValueError:
            return 1
    try:
        return max(1, int(conf.get("spark.executor.instances", "1")))
    except ValueError:
        return 1


def wait_for_executors(spark: Any, seconds: float) -> list[Executor]:
    """The executors, once as many as the application asked for have registered (Ray
    worker nodes are placed by the executors there are), at most ``seconds``."""
    sc = spark.sparkContext
    wanted = expected_executors(str(sc.master), dict(sc.getConf().getAll()))
    executors = wait_for(lambda: jvm_executors(spark), lambda e: len(e) >= wanted, seconds)
    if not executors:
        raise SessionError(
            f"{WHERE}: no executor registered with the Spark driver within {seconds:.0f}s; "
            f"check that the cluster has workers with free cores and memory for this "
            f"application"
        )
    if len(executors) < wanted:
        log.warning(
            "%s: %d of %d executors registered within %.0fs; Ray goes on those",
            WHERE,
            len(executors),
            wanted,
            seconds,
        )
    return executors


def jvm_executors(spark: Any) -> list[Executor]:
    """The live executors (not the driver): id, host, cores, running tasks."""
    found = [Executor(*e) for e in _spark_compat.executor_statuses(spark)]
    return sorted(found, key=lambda e: (len(e.id), e.id))
