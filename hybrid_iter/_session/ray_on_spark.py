"""Ray on the user's own Spark cluster, for ``Session.on_spark`` (driver only).

Ray on Spark (``ray.util.spark.setup_ray_cluster``) starts a Ray head beside the Spark
driver and each Ray worker node as a long-running Spark task on an executor. What this
module adds around it, in the order ``start`` runs it:

1. **Refusals before anything runs** (``check_spark``, ``plan_slots``): a Spark Connect
   session, a master Ray on Spark cannot use (``k8s://``, plain ``local[N]``), dynamic
   allocation (Spark runs no barrier stage with it), a Ray worker node larger than an
   executor, too few free task slots for the worker nodes *and* the subtasks. Each Ray
   worker node holds its Spark task slot for the cluster's life, and Spark's check at a
   barrier stage's submission counts total slots, not free ones: short of free slots, a
   stage would wait for ever instead of failing.
2. **One probe job** (``probe_executors``): what the executors' Python workers see (their
   Python, PATH, ``ray`` executable, Ray version). Ray on Spark runs ``ray`` from PATH
   on every executor; none there and none beside their Python is a ``SessionError``
   naming the host and the fix, and so is another Ray version than the driver's.
3. **What the executors get** (``Handover``): Ray's token authentication stays on. The
   token (``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else a new random
   one for a cluster started here; ``RAY_AUTH_MODE=disabled`` turns it off) goes to the
   Ray nodes through Ray on Spark's start hook, and to the Python workers that run the
   subtasks through ``SparkContext.environment``, the environment PySpark sends with
   every Python task (so it is set before their ``import ray``): the runtime equivalent
   of ``spark.executorEnv.*``, which a running SparkSession can no longer change. Both
   also get ``PATH`` when the executors' own does not reach ``ray``. All of it is put
   back when the session stops.
4. **Loopback**: Ray rewrites a head address of exactly ``127.0.0.1`` to the host's
   outward address for every non-head node (``resolve_ip_for_localhost``), and Ray on
   Spark forces the setting that would stop it, so worker nodes could never reach a head
   on 127.0.0.1. When ``spark.driver.host`` is 127.0.0.1 (a one-machine cluster: the
   executors share the driver's filesystem), the ``ray`` the worker nodes run is a
   launcher written here that keeps 127.0.0.1 as given, then runs Ray's own CLI. Then
   every Ray process binds 127.0.0.1 only. (Another loopback address, e.g. 127.0.0.2,
   needs no launcher, but Ray binds its servers on the head to all interfaces for any
   node address other than exactly 127.0.0.1.)
5. **Slots and raylets, before every barrier stage**: ``spark_ops.available_task_slots``
   asks ``held_slots`` (registered through ``spark_ops.hold_task_slots``) how many slots
   the Ray worker nodes hold, and that call also checks that every executor that can
   run a subtask has a raylet on its host (``executors_without_raylet``): a subtask
   joins Ray through the raylet of its own host (an object store is shared memory).
6. **Stop** (``OnSpark.stop``): the driver's Ray connection, then the cluster if it was
   started here (its head process and the Spark jobs of its worker nodes, which take
   their Ray processes with them), then the environment as it was.

The few calls into Spark's JVM are in functions named ``_jvm_*`` at the end (through
``spark_ops._spark_compat``, which holds every JVM call); the uses of
Ray's internals are ``_refresh_ray_auth`` (Ray's config reread) and, for Ray on Spark's
running cluster (its address, head process, job server), ``_active_cluster_address``,
``_head_process`` and ``_stop_worker_nodes``; and ``_head_start_polled``, which turns
Ray on Spark's fixed 20 s wait for its head into a wait for a new GCS on this machine
(the head is up in about a second; the worker nodes, launched beside it, then set when
the session is ready).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from spark_ops import _spark_compat

from .._cluster.placement import coordinator_resources as coordinator_resources_rule
from .._cluster.ray_join import check_ray_address, join_ray
from .._cluster.ray_util import NAMESPACE, force_loopback, is_loopback_address, live_nodes
from .._errors import SessionError
from .on_spark_plan import (
    WHERE,
    check_spark,
    executors_without_raylet,
    jvm_executors,
    missing_raylet_message,
    plan_slots,
    probe_executors,
    ray_path,
    resolve_host,
    slots_of,
    task_cpus,
    wait_for_executors,
)

__all__ = ["Handover", "OnSpark", "start"]

log = logging.getLogger("hybrid_iter")

_HOOK_ENV = "RAY_ON_SPARK_START_HOOK"
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
#: Ray's resource on each worker node started by Ray on Spark (its node id)
_ROS_NODE_RESOURCE = "NODE_ID_AS_RESOURCE"
_SUPPORTED = "spark://HOST:PORT (standalone), yarn, or local-cluster[N, CORES, MEMORY]"
#: how long ``stop`` waits for the Ray head (on the driver's machine) to exit
STOP_WAIT_SECONDS = 60.0
#: Ray drains a node on SIGTERM for up to this long (for Ray Serve), while the subtasks'
#: idle Python workers keep their Ray connections; a Ray on Spark cluster of a session
#: stops as a whole, so its nodes stop at once unless the environment says otherwise
_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"


# -- 3. what the Ray nodes and the Python workers get ------------------------------------


_LAUNCHER = '''\
"""`ray` for Ray on Spark worker nodes of a cluster on 127.0.0.1 (written by hybrid_iter's
Session.on_spark): Ray's CLI, except that it keeps the head address 127.0.0.1 as given
instead of rewriting it to this host's outward address, which the head does not
listen on."""
import sys

import ray._private.services as services

_resolve = services.resolve_ip_for_localhost


def _keep_loopback(host):
    return host if host == "127.0.0.1" else _resolve(host)


services.resolve_ip_for_localhost = _keep_loopback

from ray.scripts.scripts import main  # noqa: E402

sys.exit(main())
'''


def write_launcher(directory: str) -> str:
    """The loopback launcher as an executable ``ray`` in ``directory``; its directory."""
    path = os.path.join(directory, "ray")
    with open(path, "w") as f:
        f.write(_LAUNCHER)
    os.chmod(path, 0o700)
    return directory


def auth_token(starting: bool) -> str | None:
    """Ray's token for this driver, the Ray nodes and the subtasks; None when token
    authentication is off (``RAY_AUTH_MODE=disabled``, or joining a cluster without a
    token in this process)."""
    mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower()
    if mode == "disabled":
        return None
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return token
    path = os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip()
    if path:
        try:
            with open(os.path.expanduser(path)) as f:
                token = f.read().strip()
        except OSError as ex:
            raise SessionError(
                f"{WHERE}: RAY_AUTH_TOKEN_PATH={path!r} cannot be read ({ex}); point it at "
                f"the cluster's token file, or set RAY_AUTH_TOKEN"
            ) from ex
        if not token:
            raise SessionError(f"{WHERE}: RAY_AUTH_TOKEN_PATH={path!r} is empty")
        return token
    if starting:
        return secrets.token_hex(32)  # this cluster's own, never written to disk
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if mode == "token" and os.path.exists(default):
        with open(default) as f:
            return f.read().strip() or None
    return None


def _refresh_ray_auth() -> None:
    """Make an already imported ``ray`` see this process's new ``RAY_AUTH_*`` (Ray reads
    the mode once, at import; this is what ``ray.init`` itself does when it turns token
    authentication on for a new local cluster)."""
    if "ray" not in sys.modules:
        return
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@dataclass
class Handover:
    """Environment variables handed to this process (``os.environ``), to the Python
    workers of every later Spark task (``SparkContext.environment``) and to the Ray nodes
    (``node_env``, through ``StartHook``); ``restore`` puts everything back."""

    sc: Any
    process_env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    node_env: dict[str, str] = field(default_factory=dict)
    _saved_process: dict[str, str | None] = field(default_factory=dict)
    _saved_workers: dict[str, Any] = field(default_factory=dict)
    _applied: bool = False

    def apply(self) -> None:
        for k, v in self.process_env.items():
            self._saved_process.setdefault(k, os.environ.get(k))
            os.environ[k] = v
        env = self.sc.environment
        for k, v in self.worker_env.items():
            self._saved_workers.setdefault(k, env.get(k, _MISSING))
            env[k] = v
        self._applied = True
        if any(k.startswith("RAY_AUTH") for k in self.process_env):
            _refresh_ray_auth()

    def restore(self) -> None:
        if not self._applied:
            return
        self._applied = False
        for k, old in self._saved_process.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
        env = self.sc.environment
        for k, old in self._saved_workers.items():
            if old is _MISSING:
                env.pop(k, None)
            else:
                env[k] = old
        self._saved_process.clear()
        self._saved_workers.clear()
        if any(k.startswith("RAY_AUTH") for k in self.process_env):
            _refresh_ray_auth()


_MISSING = object()


def _default_hook(is_global: bool) -> Any:
    """The start hook Ray on Spark would have used (the user's, Databricks', or none)."""
    from ray.util.spark.start_hook_base import RayOnSparkStartHook
    from ray.util.spark.utils import is_in_databricks_runtime

    previous = StartHook.previous
    if previous:
        from ray._common.utils import load_class

        return load_class(previous)()
    if is_in_databricks_runtime():
        from ray.util.spark.databricks_hook import DefaultDatabricksRayOnSparkStartHook

        return DefaultDatabricksRayOnSparkStartHook(is_global)
    return RayOnSparkStartHook(is_global)


class StartHook:
    """Ray on Spark's start hook while ``Session.on_spark`` starts a cluster (named in
    ``RAY_ON_SPARK_START_HOOK``): the hook Ray on Spark would have used, plus
    ``node_env`` in every Ray node's environment (after Ray on Spark's own settings, so
    that they win)."""

    node_env: ClassVar[dict[str, str]] = {}
    #: the RAY_ON_SPARK_START_HOOK that was set before ours, if any
    previous: ClassVar[str | None] = None

    def __init__(self, is_global: bool = False) -> None:
        self._inner = _default_hook(is_global)
        self.is_global = is_global

    def get_default_temp_root_dir(self) -> Any:
        return self._inner.get_default_temp_root_dir()

    def on_ray_dashboard_created(self, port: int) -> Any:
        return self._inner.on_ray_dashboard_created(port)

    def on_cluster_created(self, ray_cluster_handler: Any) -> Any:
        return self._inner.on_cluster_created(ray_cluster_handler)

    def on_spark_job_created(self, job_group_id: str) -> Any:
        return self._inner.on_spark_job_created(job_group_id)

    def custom_environment_variables(self) -> dict[str, str]:
        return {**self._inner.custom_environment_variables(), **StartHook.node_env}


# -- the running cluster -----------------------------------------------------------------


@dataclass
class OnSpark:
    """What ``Session.on_spark`` holds: the Ray cluster (started here or joined), how
    many task slots its worker nodes hold, and what to put back at ``stop``."""

    spark: Any
    address: str
    started: bool
    worker_node_slots: int | None  # started here: slots its worker nodes hold
    handover: Handover
    coordinator_resources: dict[str, float]
    launcher_dir: str | None = None
    #: this driver's Ray connection was made here (else it was there before: kept)
    connected_here: bool = True
    #: the slot declaration this one replaced (a joined session's: the outer one's)
    previous_holder: Any = None
    stopped: bool = False

    def held_slots(self) -> int:
        """Task slots the Ray worker nodes hold now; ``SessionError`` when an executor
        that can run a subtask has no raylet on its host. Runs before every barrier stage
        (``spark_ops.available_task_slots``)."""
        nodes = live_nodes()
        executors = jvm_executors(self.spark)
        t = task_cpus(self.spark)
        missing = executors_without_raylet(
            executors, [str(n["NodeManagerAddress"]) for n in nodes], t
        )
        if missing:
            raise SessionError(missing_raylet_message(missing, nodes, self.started))
        if self.worker_node_slots is not None:
            return self.worker_node_slots
        # joined: Ray on Spark's worker nodes (they carry its node-id resource), each a
        # Spark task of this application or of another on the same cluster (counted:
        # better a smaller stage than one that waits for ever)
        return sum(
            math.ceil(float(n["Resources"].get("CPU", t)) / t)
            for n in nodes
            if _ROS_NODE_RESOURCE in n.get("Resources", {})
        )

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        from spark_ops import hold_task_slots

        try:
            hold_task_slots(self.spark, self.previous_holder)
        except Exception as ex:  # pragma: no cover - the SparkContext is gone
            log.debug("releasing the task slots: %s", ex)
        import ray

        if self.started:
            # worker nodes first, while the head still answers: a node's agents report
            # its end to the head and wait up to a minute for an answer
            _stop_worker_nodes(STOP_WAIT_SECONDS)
        if self.connected_here:
            ray.shutdown()
        if self.started:
            head, temp_dir = _head_process()
            try:
                _shutdown_cluster()
            except Exception as ex:
                log.warning("stopping Ray on Spark failed: %s", ex)
            if head is not None:  # the head is here: its ports are free when we return
                try:
                    head.wait(timeout=STOP_WAIT_SECONDS)
                    if temp_dir:  # Ray on Spark's lock beside the cluster's temp dir
                        with contextlib.suppress(OSError):
                            os.remove(f"{temp_dir}.lock")
                except Exception as ex:
                    log.warning("the Ray head (pid %s) is still stopping: %s", head.pid, ex)
        self.handover.restore()
        if self.launcher_dir is not None:
            shutil.rmtree(self.launcher_dir, ignore_errors=True)


def _stop_worker_nodes(seconds: float) -> None:
    """Cancel the Spark jobs of Ray on Spark's worker nodes (its job server's own
    shutdown, which also stops it from starting new ones) and wait, bounded, until the
    head sees none of them alive. Best effort: ``shutdown_ray_cluster`` follows."""
    import ray
    from ray.util.spark import cluster_init

    server = getattr(getattr(cluster_init, "_active_ray_cluster", None), "spark_job_server", None)
    if server is None or not ray.is_initialized():
        return
    try:
        server.shutdown()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            alive = [
                n
                for n in live_nodes()
                if _ROS_NODE_RESOURCE in n.get("Resources", {})
                and n["Resources"][_ROS_NODE_RESOURCE] != 0  # the head has node id 0
            ]
            if not alive:
                return
            time.sleep(0.25)  # polling the nodes' exit, bounded
        log.warning("Ray on Spark worker nodes still alive %.0fs after their stop", seconds)
    except Exception as ex:
        log.warning("stopping Ray on Spark's worker nodes: %s", ex)


def _head_process() -> tuple[Any, str | None]:
    """The running cluster's head process (``subprocess.Popen``) and temp dir."""
    from ray.util.spark import cluster_init

    cluster = getattr(cluster_init, "_active_ray_cluster", None)
    return getattr(cluster, "head_proc", None), getattr(cluster, "temp_dir", None)


def _shutdown_cluster() -> None:
    from ray.util.spark import shutdown_ray_cluster

    shutdown_ray_cluster()


def _active_cluster_address() -> str | None:
    """The address of the Ray on Spark cluster this process started, if one runs."""
    from ray.util.spark import cluster_init

    cluster = getattr(cluster_init, "_active_ray_cluster", None)
    if cluster is None or getattr(cluster, "is_shutdown", False):
        return None
    return str(cluster.address)


def start(
    spark: Any,
    *,
    ray_address: str | None,
    worker_nodes: int | None,
    worker_node_cpus: int | None,
    parallelism: int | None,
    ray_temp_root_dir: str | None,
    setup_options: Mapping[str, Any],
    executor_wait_seconds: float,
    connect_timeout: float,
    coordinator_resources: Mapping[str, float] | None,
) -> OnSpark:
    """Everything ``Session.on_spark`` does before the session exists (see the module
    docstring); returns the running ``OnSpark``."""
    check_spark(spark)
    import ray

    from spark_ops import available_task_slots, hold_task_slots

    t = task_cpus(spark)
    executors = wait_for_executors(spark, executor_wait_seconds)
    if ray_address is None:
        ray_address = _active_cluster_address()
    current = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    starting = ray_address is None
    if starting and current is not None:
        raise SessionError(
            f"{WHERE}: this process is already connected to the Ray cluster at {current}; "
            f"pass ray_address={current!r} to run on it, or call ray.shutdown() first to "
            f"start Ray on Spark"
        )
    if not starting and current is not None and ray_address not in ("auto", current):
        raise SessionError(
            f"{WHERE}(ray_address={ray_address!r}): this process is already connected to "
            f"the Ray cluster at {current}; call ray.shutdown() first, or run in a fresh "
            f"process"
        )
    nodes = len(executors) if worker_nodes is None else worker_nodes
    node_cpus = t if worker_node_cpus is None else worker_node_cpus
    if starting:
        plan_slots(executors, t, nodes, node_cpus, parallelism)

    token = auth_token(starting)
    handover = Handover(spark.sparkContext)
    if token is not None:
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        handover.process_env.update(auth)
        handover.worker_env.update(auth)
        handover.node_env.update(auth)
    launcher_dir: str | None = None
    head_host = resolve_host(str(spark.sparkContext.getConf().get("spark.driver.host", "")))
    if starting:
        handover.node_env[_DRAIN_ENV] = os.environ.get(_DRAIN_ENV, "0")
    try:
        if starting:
            if head_host == "127.0.0.1":
                launcher_dir = write_launcher(tempfile.mkdtemp(prefix="hybrid_iter-ray-"))
            # the one job before Ray starts: what the executors would run `ray` with
            probes = probe_executors(spark, sum(slots_of(e, t) for e in executors))
            path = ray_path(probes, launcher_dir)
            if path is not None:
                handover.node_env["PATH"] = path
        if is_loopback_address(head_host if starting else str(ray_address)):
            force_loopback()  # this driver joins Ray on 127.0.0.1, not the outward address
        handover.apply()
        if starting:
            address = _setup(
                spark,
                handover,
                nodes,
                node_cpus,
                ray_temp_root_dir,
                setup_options,
            )
        else:
            address = _join(str(ray_address), current, connect_timeout)
    except BaseException:
        handover.restore()
        if launcher_dir is not None:
            shutil.rmtree(launcher_dir, ignore_errors=True)
        raise

    handle = OnSpark(
        spark=spark,
        address=address,
        started=starting,
        worker_node_slots=nodes * math.ceil(node_cpus / t) if starting else None,
        handover=handover,
        coordinator_resources={},
        launcher_dir=launcher_dir,
        connected_here=current is None,
    )
    try:
        handle.coordinator_resources = (
            dict(coordinator_resources)
            if coordinator_resources is not None
            else coordinator_resources_rule(driver_node=True)
        )
        handle.held_slots()  # every executor has a raylet beside it, or a SessionError
        handle.previous_holder = hold_task_slots(spark, handle.held_slots)
        if parallelism is not None and not starting:  # (checked before a start)
            free = available_task_slots(spark)
            if parallelism > free:
                raise SessionError(
                    f"{WHERE}(parallelism={parallelism}): the Ray cluster at {address} "
                    f"leaves {free} task slot(s) of this application free for subtasks; "
                    f"lower parallelism or add executors"
                )
    except BaseException:
        handle.stop()
        raise
    return handle


def _setup(
    spark: Any,
    handover: Handover,
    nodes: int,
    node_cpus: int,
    ray_temp_root_dir: str | None,
    setup_options: Mapping[str, Any],
) -> str:
    """Ray on Spark's head here and ``nodes`` worker nodes; then this driver joins it."""
    import ray
    from ray.util.spark import setup_ray_cluster

    options: dict[str, Any] = {
        "num_gpus_worker_node": 0,
        "num_cpus_head_node": 0,  # the coordinator-tier actors take no CPU
        "num_gpus_head_node": 0,
        **dict(setup_options),
    }
    head = dict(options.pop("head_node_options", None) or {})
    head.setdefault("include_dashboard", False)  # its server would bind every interface
    options["head_node_options"] = head
    if ray_temp_root_dir is not None:
        options["ray_temp_root_dir"] = ray_temp_root_dir
    StartHook.node_env = dict(handover.node_env)
    hook = f"{StartHook.__module__}.{StartHook.__qualname__}"
    previous = os.environ.get(_HOOK_ENV)
    StartHook.previous = previous if previous != hook else None
    os.environ[_HOOK_ENV] = hook
    _jvm_make_active(spark)  # Ray on Spark takes the thread's active SparkSession
    try:
        with _head_start_polled():
            address, _ = setup_ray_cluster(
                max_worker_nodes=nodes,
                min_worker_nodes=nodes,
                num_cpus_worker_node=node_cpus,
                **options,
            )
    except Exception as ex:
        raise SessionError(
            f"{WHERE}: Ray on Spark could not start {nodes} Ray worker node(s) of "
            f"{node_cpus} core(s): {type(ex).__name__}: {ex}"
            + (f" ({ex.__cause__})" if ex.__cause__ else "")
        ) from ex
    finally:  # Ray on Spark took the nodes' environment once, at its start
        StartHook.node_env = {}
        if previous is None:
            os.environ.pop(_HOOK_ENV, None)
        else:
            os.environ[_HOOK_ENV] = previous
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    except BaseException:
        _shutdown_cluster()
        raise
    return str(address)


class _HeadStartWait:
    """Stands in for the ``time`` module of Ray on Spark's ``cluster_init`` while
    ``_setup`` calls it. After launching the head, Ray on Spark sleeps a fixed
    ``_RAY_HEAD_STARTUP_TIMEOUT`` (20 s) and then checks once that the head's GCS port
    is in use. That one sleep (that many seconds, on the thread that made this) returns
    as soon as ``head_up()`` says a head has started, within the same 20 s; Ray's own
    check follows, and the driver's ``ray.init`` then waits for the head's raylet itself.
    Every other sleep, and a sleep of another thread, is the real one. Nothing of Ray's
    frames is read: the head is found as Ray finds local clusters (``_new_gcs``)."""

    def __init__(self, module: Any, head_up: Callable[[], bool]) -> None:
        self._module = module
        self._time = module.time
        self._head_up = head_up
        self._thread = threading.get_ident()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._time, name)

    def sleep(self, seconds: float) -> None:
        wait = getattr(self._module, "_RAY_HEAD_STARTUP_TIMEOUT", None)
        if threading.get_ident() != self._thread or seconds != wait:
            self._time.sleep(seconds)  # the caller's own sleep, as it wrote it
            return
        deadline = time.monotonic() + seconds
        while not self._head_up():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.2, left))  # polling the head's start, bounded


def _new_gcs(before: frozenset[str]) -> Callable[[], bool]:
    """Whether a Ray GCS that was not running at the call answers on this machine now
    (``ray._private.services.find_gcs_addresses``, Ray's finder of local clusters, which
    reads the processes' command lines)."""
    from ray._private import services

    finder: Any = services.find_gcs_addresses  # functools.lru_cache'd in Ray 2.60

    def up() -> bool:
        finder.cache_clear()
        for address in set(finder()) - before:
            host, _, port = str(address).rpartition(":")
            with contextlib.suppress(OSError, ValueError):
                with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
                    return True
        return False

    return up


@contextlib.contextmanager
def _head_start_polled() -> Iterator[None]:
    """``_HeadStartWait`` in place of ``cluster_init.time`` for the duration. Read from
    Ray 2.60's ``_setup_ray_cluster`` (``test_on_spark.py`` checks its shape); on a Ray
    whose module is not laid out so, nothing is replaced and Ray's 20 s sleep stays."""
    from ray._private import services
    from ray.util.spark import cluster_init

    real = getattr(cluster_init, "time", None)
    finder: Any = getattr(services, "find_gcs_addresses", None)
    if real is not time or not hasattr(finder, "cache_clear"):
        yield
        return
    finder.cache_clear()
    before = frozenset(finder())
    setattr(  # noqa: B010 (a stand-in)
        cluster_init, "time", _HeadStartWait(cluster_init, _new_gcs(before))
    )
    try:
        yield
    finally:
        cluster_init.time = real


def _join(address: str, current: str | None, connect_timeout: float) -> str:
    import ray

    if current is not None:
        return current
    address = check_ray_address(address, f"{WHERE}(ray_address)")
    join_ray(address, connect_timeout)
    return str(ray.get_runtime_context().gcs_address)


def _jvm_make_active(spark: Any) -> None:
    """Make ``spark`` the SparkSession of this thread (Ray on Spark looks it up so)."""
    _spark_compat.make_active_session(spark)
