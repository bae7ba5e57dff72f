"""Which cluster a run is on: a frozen description of it, published by the session that
started (or attached to) it, read by the runtime, ``ml`` and ``ps``.

Runs on the driver. A ``Session`` publishes its ``ClusterContext`` when it is made and
withdraws it when it stops; below the session, nothing reads the ``Session`` itself.
``of(spark)`` is what a run asks: the context published for that SparkSession, else, when
this driver is connected to a Ray instance of its own making (``ray.init()`` before
plain ``pyspark``), an ambient context around that Ray, else a ``SessionError`` naming
what to start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import SessionError

__all__ = [
    "ClusterContext",
    "announce_run",
    "current",
    "of",
    "publish",
    "ray_address",
    "withdraw",
]

#: the kinds of cluster a context describes (the session's start mode, or ``ambient``: a
#: Ray this driver joined without a session)
KINDS = ("local", "raydp", "attach", "on_spark", "ambient")


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class ClusterContext:
    """A running cluster as a run sees it (driver).

    ``spark``: the classic SparkSession or Spark Connect client the data lives in;
    ``ray_address``: the GCS ``host:port`` that Spark's tasks (and this driver) reach;
    ``kind``: how it started (``KINDS``); ``coordinator_resources``: the Ray resources the
    coordinator-tier actors ask for (None: the placement rule decides, see
    ``placement.coordinator_resources``); ``connect``: ``spark`` is a Spark Connect
    client (no JVM in this process); ``run_coming``: what a run calls once its arguments
    are checked, before it starts actors (the session's warm-up then waits for it).
    """

    spark: Any
    ray_address: str
    kind: str
    coordinator_resources: Mapping[str, float] | None = None
    connect: bool = False
    run_coming: Callable[[], None] = field(default=_nothing, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ClusterContext(kind) must be one of {KINDS}, got {self.kind!r}")
        if not self.ray_address:
            raise ValueError("ClusterContext(ray_address) must not be empty")
        if self.coordinator_resources is not None:
            object.__setattr__(self, "coordinator_resources", dict(self.coordinator_resources))


_lock = threading.Lock()
#: published contexts, oldest first (sessions nest: the innermost is the current one)
_published: list[ClusterContext] = []


def publish(ctx: ClusterContext) -> None:
    """Make ``ctx`` the current context (a session that started)."""
    with _lock:
        _published.append(ctx)


def withdraw(ctx: ClusterContext) -> None:
    """``ctx`` is no more (its session stopped); idempotent. By identity: a nested
    session over the same Spark and Ray has an equal context, and withdrawing that one
    must leave the outer session's published."""
    with _lock:
        _published[:] = [c for c in _published if c is not ctx]


def current() -> ClusterContext | None:
    """The innermost published context, if any."""
    with _lock:
        return _published[-1] if _published else None


def _published_for(spark: Any) -> ClusterContext | None:
    with _lock:
        for ctx in reversed(_published):
            if ctx.spark is spark:
                return ctx
    return None


def of(spark: Any) -> ClusterContext:
    """The context a run over ``spark``'s data runs in: the one published for that
    session, else the Ray this driver is connected to (an ``ambient`` context), else a
    ``SessionError`` naming what to start."""
    found = _published_for(spark)
    if found is not None:
        return found
    import ray

    if ray.is_initialized():
        from spark_ops._spark_compat import is_connect

        outer = current()
        return ClusterContext(
            spark=spark,
            ray_address=str(ray.get_runtime_context().gcs_address),
            kind="ambient",
            coordinator_resources=None if outer is None else outer.coordinator_resources,
            connect=is_connect(spark),
        )
    raise SessionError(
        "no Ray instance: run inside `with hybrid_iter.Session.local():` (or Session.raydp / "
        "Session.on_spark / Session.attach), or call ray.init() before iterating"
    )


def ray_address(spark: Any | None = None, *, what: str = "this run") -> str:
    """The Ray address of ``spark``'s context (``of``); with no ``spark``, of the current
    context or the Ray this driver is connected to, else a ``SessionError`` naming
    ``what`` needs Ray."""
    if spark is not None:
        return of(spark).ray_address
    ctx = current()
    if ctx is not None:
        return ctx.ray_address
    import ray

    if ray.is_initialized():
        return str(ray.get_runtime_context().gcs_address)
    raise SessionError(
        f"{what} needs Ray: run it inside `with hybrid_iter.Session.local():` (or another "
        f"Session), or call ray.init() first"
    )


def announce_run(spark: Any | None = None) -> None:
    """A run is about to start on ``spark``'s cluster (the current one without
    ``spark``): its context's ``run_coming`` is called."""
    ctx = _published_for(spark) if spark is not None else current()
    if ctx is not None:
        ctx.run_coming()
