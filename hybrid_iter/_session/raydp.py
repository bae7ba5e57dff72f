"""``Session.raydp``: Spark executors as Ray actors through RayDP, the driver here
(the ``raydp`` extra, Spark 3.5)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from spark_ops import _spark_compat

from .._cluster.placement import check_resources
from .._cluster.placement import coordinator_resources as placed
from .._cluster.processes import prepare_process_env, start_own_ray
from .._cluster.ray_join import (
    DEFAULT_CONNECT_TIMEOUT,
    check_offered,
    check_ray_address,
    join_ray,
    probe_ray_cluster,
    ray_address_from_env,
)
from .._cluster.ray_util import NAMESPACE, force_loopback, is_loopback_address
from .._cluster.slots import wait_for_task_slots
from .._cluster.warm_up import short
from .._errors import SessionError
from .checks import (
    blas_threads,
    check_positive_ints,
    check_seconds,
    check_spark_jvm_for_raydp,
    check_spark_version,
    task_cpus,
    worker_env,
)

if TYPE_CHECKING:
    from . import Session

__all__ = ["raydp"]

log = logging.getLogger("hybrid_iter")


def raydp(
    cls: type[Session],
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
    check_spark_version("Session.raydp")
    if coordinator_resources is not None:
        coordinator_resources = check_resources(
            coordinator_resources, "Session.raydp(coordinator_resources)"
        )
    check_positive_ints("Session.raydp", num_executors=num_executors, executor_cores=executor_cores)
    check_seconds(
        "Session.raydp",
        executor_wait_seconds=executor_wait_seconds,
        connect_timeout=connect_timeout,
    )
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
    check_spark_jvm_for_raydp()
    prepare_process_env()

    if owns_ray:
        if gcs_target is None:
            force_loopback()

            def start_ray() -> None:
                ray.init(
                    address="local",  # our own instance, even if a `ray start` cluster runs
                    num_cpus=max(os.cpu_count() or 1, num_executors * executor_cores),
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    namespace=NAMESPACE,
                    logging_level=logging.WARNING,
                )

            try:
                start_own_ray(start_ray)  # a loaded machine: once more
            except Exception as ex:
                raise SessionError(
                    f"Session.raydp: Ray did not start on 127.0.0.1: {short(ex)}"
                ) from ex
        else:
            join_ray(gcs_target, connect_timeout)
    if coordinator_resources:
        check_offered(coordinator_resources, owns_ray)
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
        **worker_env(blas_threads(executor_cores, executor_cores // task_cpus(user_conf))),
        **user_conf,
    }
    if is_loopback_address(gcs):
        configs.setdefault("spark.driver.host", "127.0.0.1")
        configs.setdefault("spark.driver.bindAddress", "127.0.0.1")
    # RayDP's app master owns the executor actors: when the node it runs on is lost,
    # Ray ends every executor with it and none comes back (a run can then only fail).
    # It goes where the coordinator goes (the head by default) unless spark_conf
    # places it (spark.ray.raydp_spark_master.actor.resource.<name>).

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
    wanted = num_executors * executor_cores
    have = wait_for_task_slots(spark, wanted, executor_wait_seconds)
    if have < wanted:
        session.stop()
        raise SessionError(
            f"Spark on Ray registered {have} task slot(s) of {wanted} within "
            f"{executor_wait_seconds:.0f}s; the Ray cluster may lack CPUs or memory for "
            f"the executors"
        )
    if warm_up:
        session._start_warm_up()
    return session
