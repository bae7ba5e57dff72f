"""``Session.attach``: a running SparkSession (classic or a Spark Connect client) and Ray
cluster, used and left running (driver)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spark_ops import _spark_compat

from .._cluster.placement import check_resources
from .._cluster.ray_join import (
    DEFAULT_CONNECT_TIMEOUT,
    check_offered,
    check_ray_address,
    join_ray,
)
from .._errors import SessionError
from .checks import check_connect, check_spark_version

if TYPE_CHECKING:
    from . import Session

__all__ = ["attach"]


def attach(
    cls: type[Session],
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

    check_spark_version("Session.attach")
    if coordinator_resources is not None:
        coordinator_resources = check_resources(
            coordinator_resources, "Session.attach(coordinator_resources)"
        )

    if _spark_compat.is_connect(spark):
        check_connect(spark)
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
        join_ray(ray_address, connect_timeout)
        owns_ray = True  # we connected this driver; disconnect it, the cluster stays
    address: str = (
        ray.get_runtime_context().gcs_address
        if ray_address is None or ray_address == "auto"
        else ray_address
    )
    if coordinator_resources:
        check_offered(coordinator_resources, owns_ray)
    return cls(
        spark,
        address,
        owns_spark=False,
        owns_ray=owns_ray,
        kind="attach",
        coordinator_resources=coordinator_resources,
    )
