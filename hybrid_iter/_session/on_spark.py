"""``Session.on_spark``: Ray started on the Spark cluster you have (Ray on Spark: the head
beside the driver, worker nodes as long-running Spark tasks), or joined there (driver).
The checks of its arguments are here; the cluster's start and stop, ``ray_on_spark.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._cluster.placement import check_resources
from .._cluster.ray_join import DEFAULT_CONNECT_TIMEOUT, check_ray_address
from .._errors import SessionError
from . import ray_on_spark
from .checks import check_positive_ints, check_seconds, check_spark_version

if TYPE_CHECKING:
    from . import Session

__all__ = ["on_spark"]


def on_spark(
    cls: type[Session],
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
    check_spark_version("Session.on_spark")
    if coordinator_resources is not None:
        coordinator_resources = check_resources(
            coordinator_resources, "Session.on_spark(coordinator_resources)"
        )
    check_positive_ints(
        "Session.on_spark",
        worker_nodes=worker_nodes,
        worker_node_cpus=worker_node_cpus,
        parallelism=parallelism,
    )
    check_seconds(
        "Session.on_spark",
        executor_wait_seconds=executor_wait_seconds,
        connect_timeout=connect_timeout,
    )
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
        stops=handle,
    )
    if warm_up:
        session._start_warm_up()
    return session
