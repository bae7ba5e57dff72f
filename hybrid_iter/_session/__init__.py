"""Spark + Ray sessions: embedded (``local``), Spark on Ray (``raydp``), Ray on the
user's Spark cluster (``on_spark``), or ``attach``.

Runs on the driver. A session is the owner of a cluster: it starts it (each start mode in
a module of its own here), publishes the ``ClusterContext`` that runs read
(``hybrid_iter._cluster``), warms what runs will need, and stops what it started: a
SparkSession or Ray instance that was already running is used and left running. Nothing
below the session imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from spark_ops import _spark_compat

from .._cluster import context as cluster
from .._cluster.placement import head_node
from .._cluster.ray_join import (
    ADDRESS_ENV_VARS,
    DEFAULT_CONNECT_TIMEOUT,
    check_ray_address,
    probe_ray_cluster,
    ray_address_from_env,
)
from .._cluster.ray_util import live_nodes
from .._cluster.spares import drop_spares
from .._cluster.warm_up import WarmUp
from . import attach as _attach
from . import local as _local
from . import on_spark as _on_spark
from . import raydp as _raydp

__all__ = [
    "ADDRESS_ENV_VARS",
    "DEFAULT_CONNECT_TIMEOUT",
    "Session",
    "check_ray_address",
    "probe_ray_cluster",
    "ray_address_from_env",
]

log = logging.getLogger("hybrid_iter")


class Session:
    """A SparkSession and a Ray cluster that iterations run on.

    ``Session.local(parallelism=2)`` starts Ray on 127.0.0.1 and Spark ``local[2]``;
    ``Session.raydp(...)`` runs Spark executors as Ray actors through RayDP;
    ``Session.on_spark(spark)`` starts Ray on the Spark cluster you have (Ray on Spark);
    ``Session.attach(spark, ray_address)`` uses what is already running.
    Use it as a context manager: leaving the block stops what the session started.
    """

    _stack: ClassVar[list[Session]] = []

    local = classmethod(_local.local)
    raydp = classmethod(_raydp.raydp)
    attach = classmethod(_attach.attach)
    on_spark = classmethod(_on_spark.on_spark)

    def __init__(
        self,
        spark: Any,
        ray_address: str,
        *,
        owns_spark: bool = False,
        owns_ray: bool = False,
        kind: str = "attach",
        coordinator_resources: Mapping[str, float] | None = None,
        stops: Any = None,
        class_archive: tuple[str, dict[str, str]] | None = None,
    ) -> None:
        #: what runs read: the published description of this cluster
        self.context = cluster.ClusterContext(
            spark=spark,
            ray_address=ray_address,
            kind=kind,
            coordinator_resources=coordinator_resources,
            connect=_spark_compat.is_connect(spark),
            run_coming=self._runs_coming,
        )
        self._owns_spark = owns_spark
        self._owns_ray = owns_ray
        self._stopped = False
        #: what else this session started and stops with it (``Session.on_spark``'s Ray
        #: cluster: an object with ``stop()``)
        self._stops = stops
        #: (key, conf) of the JVM class archive the warm-up makes for the next starts
        self._class_archive = class_archive
        #: the background warm-up, once started
        self._warm: WarmUp | None = None
        Session._stack.append(self)
        cluster.publish(self.context)

    @property
    def spark(self) -> Any:
        """The SparkSession (or Spark Connect client) the data lives in."""
        return self.context.spark

    @property
    def ray_address(self) -> str:
        """The GCS address of the Ray cluster that Spark's tasks reach."""
        return self.context.ray_address

    @property
    def kind(self) -> str:
        """How the session started: ``local``, ``raydp``, ``on_spark`` or ``attach``."""
        return self.context.kind

    @property
    def coordinator_resources(self) -> dict[str, float] | None:
        """Ray resources for the coordinator and PS shards (``None``: the head node when
        the cluster has several nodes; see ``hybrid_iter._cluster.placement``)."""
        found = self.context.coordinator_resources
        return None if found is None else dict(found)

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
        from spark_ops import available_task_slots

        nodes = live_nodes()
        if self.context.connect:  # a client sees no executor list or slots
            hosts, executors, slots = None, None, None
        else:
            hosts, executors = _spark_compat.executor_hosts(self.spark)  # the driver's too
            slots = available_task_slots(self.spark)
        return {
            "kind": self.kind,
            "ray_address": self.ray_address,
            "ray_nodes": len(nodes),
            "ray_head": head_node(nodes),
            "spark_master": _spark_compat.spark_master(self.spark),
            "executors": executors,
            "spark_hosts": hosts,
            "task_slots": slots,
        }

    def _start_warm_up(self) -> None:
        self._warm = WarmUp(self.context, self._class_archive)
        self._warm.start()

    def _runs_coming(self) -> None:
        """A run is about to start: a warm-up not started yet waits until Spark is quiet
        after it (``WarmUp.run_coming``); the run starts what it needs itself."""
        if self._warm is not None:
            self._warm.run_coming()

    def warmed(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Wait for the background warm-up to end and say what it made ready: ``spare``
        (the spare coordinator's actor name), ``shard_spares`` (the spare parameter
        shards'), ``store`` (the array store's), ``python_workers`` (the pids of Spark's
        Python workers that imported our modules and joined Ray), ``class_archive``
        (``"making"`` when this session's JVM found no class archive and a background
        process makes one for the next sessions, which this session's ``stop`` ends if
        it still runs), ``errors`` (what could not be warmed, by step: a run then starts
        it itself), ``seconds``. None when the session was made with ``warm_up=False``.
        A run never needs to call this; benchmarks and tests do."""
        return None if self._warm is None else self._warm.wait(timeout)

    def stop(self) -> None:
        """Stop what this session started (Spark first, then Ray); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        cluster.withdraw(self.context)
        if self._warm is not None:
            self._warm.stop()  # before Spark and Ray go: its job and calls end first
        if self in Session._stack:
            Session._stack.remove(self)
        if self._owns_ray or self._stops is not None:
            # the spares and the array store end with this Ray: forget their handles (a
            # later Ray of this process may reuse the job id they are kept under)
            drop_spares()
        if self._owns_spark:
            try:
                if self.kind == "raydp":
                    import raydp

                    raydp.stop_spark()
                else:
                    self.spark.stop()
            except Exception as ex:  # pragma: no cover - best effort on shutdown
                log.warning("stopping Spark failed: %s", ex)
        if self._stops is not None:
            self._stops.stop()
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
