"""The long-lived actors (the coordinator, the online coordinator, PS shards): where they
go, and the one way they are launched and killed (``actor_class``, ``launch``, ``kill``).

Runs on the driver, when an actor is launched. Those actors hold the run's state (the
variables, the epoch, the parameter shards); a Spark executor lost with its node is
replaced and its task retried, but losing the node that hosts the coordinator loses the
run (or, with checkpoints, costs a restore). So they go to the Ray *head* node, which a
cluster cannot lose without losing everything anyway, unless told otherwise:

1. ``coordinator_resources`` of the current ``Session`` (``Session.raydp(...,
   coordinator_resources={...})`` / ``Session.attach``), else the environment variable
   ``HYBRID_ITER_COORDINATOR_RESOURCES`` (a JSON object; ``{}`` means anywhere): Ray
   custom resources the actors ask for, a small fraction each;
2. else, when a live node advertises the custom resource ``hybrid_iter_head`` (the
   manifests in ``k8s/`` set it on the head: ``rayStartParams.resources``), that one;
3. else Ray's own ``node:__internal_head__`` resource, which only the head node has;
4. on a single-node Ray (``Session.local``) nothing is asked: there is nowhere else.

The actors take ``num_cpus=0``, so a fraction of a resource is all they hold, and the
head may advertise ``num-cpus: 0`` (keeping Spark executors, which need CPUs, on the
workers). A requested resource that no live node offers is a ``SessionError`` here, not
an actor pending forever.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import SessionError

log = logging.getLogger(__name__)

__all__ = [
    "COORDINATOR_RESOURCES_ENV",
    "HEAD_RESOURCE",
    "RAY_HEAD_RESOURCE",
    "ActorKind",
    "Launched",
    "actor_class",
    "check_resources",
    "coordinator_actor_options",
    "coordinator_resources",
    "drop_spares",
    "keep_spare",
    "kill",
    "launch",
    "launch_held",
    "retire_as_spare",
    "spares",
    "take_spare",
    "take_spares",
]

#: The custom resource the k8s manifests put on the head node (also RayDP's app master's).
HEAD_RESOURCE = "hybrid_iter_head"
#: Ray's built-in resource of the head node (Ray >= 2.9).
RAY_HEAD_RESOURCE = "node:__internal_head__"
COORDINATOR_RESOURCES_ENV = "HYBRID_ITER_COORDINATOR_RESOURCES"
#: How much of the resource each actor holds: many actors fit one unit.
_SHARE = 0.001


def check_resources(value: Any, where: str) -> dict[str, float]:
    """``{name: amount > 0}`` or ``SessionError`` naming ``where``."""
    if not isinstance(value, Mapping):
        raise SessionError(
            f"{where} must be a mapping of Ray resource names to amounts, e.g. "
            f'{{"{HEAD_RESOURCE}": 0.001}}, got {type(value).__name__}'
        )
    out: dict[str, float] = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise SessionError(f"{where}: resource names are non-empty strings, got {name!r}")
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise SessionError(
                f"{where}: {name!r} is not a placement resource (the actors use num_cpus=0); "
                f"name a custom resource a node advertises, e.g. {HEAD_RESOURCE!r}"
            )
        if (
            isinstance(amount, bool)
            or not isinstance(amount, (int, float))
            or not 0 < amount < math.inf
        ):
            raise SessionError(f"{where}[{name!r}] must be a number > 0, got {amount!r}")
        out[name] = float(amount)
    return out


def _configured() -> dict[str, float] | None:
    from .._session import Session

    session = Session.current()
    if session is not None and session.coordinator_resources is not None:
        return dict(session.coordinator_resources)
    text = os.environ.get(COORDINATOR_RESOURCES_ENV, "").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as ex:
        raise SessionError(
            f"{COORDINATOR_RESOURCES_ENV} must be a JSON object such as "
            f'{{"{HEAD_RESOURCE}": 0.001}} ({{}} = any node), got {text!r}: {ex}'
        ) from None
    return check_resources(value, COORDINATOR_RESOURCES_ENV)


def coordinator_resources() -> dict[str, float]:
    """The Ray resources the coordinator-tier actors ask for (driver; Ray connected)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    offered: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.get("Resources", {}).items():
            offered[name] = max(offered.get(name, 0.0), amount)
    wanted = _configured()
    if wanted is not None:
        missing = {k: v for k, v in wanted.items() if offered.get(k, 0.0) < v}
        if missing:
            raise SessionError(
                f"coordinator_resources {missing} (Session or {COORDINATOR_RESOURCES_ENV}): no "
                f"live node of the Ray cluster offers that much, so the coordinator would "
                f"wait forever; give a node the resource (`ray start --resources`, KubeRay "
                f"rayStartParams.resources) or change the setting"
            )
        return wanted
    if len(nodes) <= 1:
        return {}  # one node: nowhere else to go
    if HEAD_RESOURCE in offered:
        return {HEAD_RESOURCE: _SHARE}
    if RAY_HEAD_RESOURCE in offered:
        return {RAY_HEAD_RESOURCE: _SHARE}
    return {}  # pragma: no cover - every Ray >= 2.9 head has it


def coordinator_actor_options() -> dict[str, Any]:
    """Keyword arguments for ``ray.remote(...)`` of a coordinator-tier actor."""
    resources = coordinator_resources()
    return {"resources": resources} if resources else {}


#: ``ray.remote(cls, ...)`` per class and creation-only options: Ray exports an actor
#: class (pickles it and disassembles its code for a collision check, ~0.1 s) each time
#: a *new* ``ray.remote`` class is first launched, so it is made once per process and
#: the per-run options go through ``.options`` (Ray re-exports it by itself to a new
#: Ray session)
_REMOTE_CLASSES: dict[tuple[type, tuple[tuple[str, Any], ...]], Any] = {}


class ActorKind:
    """A coordinator-tier actor class with its options: ``.options(name=..., ...)``
    gives what ``.remote(*args)`` starts (``launch``)."""

    def __init__(self, remote_cls: Any, options: Mapping[str, Any]) -> None:
        self._remote_cls, self._options = remote_cls, dict(options)

    def options(self, **more: Any) -> Any:
        return self._remote_cls.options(**self._options, **more)


def actor_class(
    cls: type,
    *,
    max_restarts: int = 0,
    concurrency_groups: Mapping[str, int] | None = None,
    **options: Any,
) -> ActorKind:
    """``cls`` as a Ray actor class of the coordinator tier: no CPU of its own, placed by
    ``coordinator_actor_options``, no task retries (a retried call could apply an update
    twice), restarted ``max_restarts`` times after its process died (only runs with
    checkpoints restart: a restarted actor reloads the newest one)."""
    import ray

    fixed = tuple(sorted((concurrency_groups or {}).items()))
    key = (cls, fixed)
    remote_cls = _REMOTE_CLASSES.get(key)
    if remote_cls is None:
        # ray's remote(**options) overload lists task options only, not concurrency_groups
        remote_cls = _REMOTE_CLASSES[key] = ray.remote(  # type: ignore[call-overload]
            num_cpus=0, max_task_retries=0, concurrency_groups=dict(fixed) or None
        )(cls)
    return ActorKind(
        remote_cls,
        {"max_restarts": max_restarts, **options, **coordinator_actor_options()},
    )


#: spare actors per (class, options, Ray job), oldest first: started ahead of the runs
#: that take them (by the session's warm-up, or a run's coordinator kept after it ended)
_SPARES: dict[tuple[Any, ...], list[tuple[Any, str]]] = {}
#: the session's warm-up thread fills the pool while runs take from it
_SPARES_LOCK = threading.Lock()
#: at most this many spares of one kind: one for the next run, one more for a run that
#: starts while another holds the first (each is an idle Ray worker process)
SPARE_POOL = 2


def _spare_key(kind: ActorKind) -> tuple[Any, ...]:
    import ray

    job = ray.get_runtime_context().get_job_id()
    return (kind._remote_cls, job, repr(sorted(kind._options.items())))


def _pool(key: tuple[Any, ...]) -> list[tuple[Any, str]]:
    """The pool of ``key`` (lock held); an earlier Ray job's pools of its class are
    dropped (their actors ended with that job)."""
    for other in [k for k in _SPARES if k[0] is key[0] and k[1] != key[1]]:
        del _SPARES[other]
    return _SPARES.setdefault(key, [])


def keep_spare(
    kind: ActorKind, warm: Sequence[str] = (), count: int = 1, prefix: str = "hybrid_iter.spare"
) -> list[Any]:
    """Start spare actors of ``kind`` (its class with ``(None, warm=warm)``: idle, with
    the modules ``warm`` imported) until its pool holds ``count`` (at most
    ``SPARE_POOL``), named ``<prefix>.<random>``: the next ``take_spare`` finds a process
    started and its modules imported. Returns the handles started here (``.remote()``
    only: nothing waits for them). They belong to this driver and end with it; never
    raises."""
    from .ray_util import NAMESPACE

    started: list[Any] = []
    try:
        key = _spare_key(kind)
        import uuid

        with _SPARES_LOCK:
            pool = _pool(key)
            while len(pool) < min(count, SPARE_POOL):
                name = f"{prefix}.{uuid.uuid4().hex[:12]}"
                handle = kind.options(name=name, namespace=NAMESPACE).remote(None, warm=tuple(warm))
                pool.append((handle, name))
                started.append(handle)
    except Exception as ex:  # an optimisation only
        log.debug("no spare actor: %s", ex)
    return started


def spares(kind: ActorKind) -> list[str]:
    """The names of the spare actors of ``kind`` waiting in the pool (driver)."""
    try:
        key = _spare_key(kind)
    except Exception:
        return []
    with _SPARES_LOCK:
        return [name for _, name in _SPARES.get(key, [])]


def take_spare(kind: ActorKind, configure: str, *args: Any) -> tuple[Any, str] | None:
    """A spare actor of ``kind`` (the oldest: the likeliest to be up) with
    ``configure(*args)`` done on it, and its name; None when there is none or it cannot
    take the run (then launch one). Never waits for a spare to be started: one still
    starting is taken as it is (a new actor would start no sooner)."""
    import ray

    try:
        key = _spare_key(kind)
        with _SPARES_LOCK:
            pool = _pool(key)
            got = pool.pop(0) if pool else None
    except Exception:
        return None
    if got is None:
        return None
    handle, name = got
    try:
        ray.get(getattr(handle, configure).remote(*args), timeout=120)
    except Exception as ex:  # it died, or Ray is gone: start one the usual way
        log.debug("spare %s unusable: %s", name, ex)
        kill(handle, f"the spare {name}")
        return None
    return handle, name


#: seconds ``take_spares`` waits to learn which spares are up (a round trip to each)
_READY_CHECK = 0.2


def take_spares(kind: ActorKind, configure: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``take_spare`` for several actors, for callers that would otherwise start actors
    without waiting for them: per item of ``args``, a spare of ``kind`` that is up (its
    process started) with ``configure(*item)`` done on it (all side by side), as
    ``(handle, name, reply)``; None where there is none up, or it could not take the run
    (then launch one: it starts while the caller goes on, where waiting for a spare
    still starting would hold the caller up). A spare still starting stays in the pool
    for a later run; one that failed is killed."""
    import ray

    popped: list[tuple[Any, str]] = []
    try:
        key = _spare_key(kind)
        with _SPARES_LOCK:
            pool = _pool(key)
            while pool and len(popped) < len(args):
                popped.append(pool.pop(0))
    except Exception:
        return [None] * len(args)
    up: list[tuple[Any, str]] = []
    if popped:
        probes = {h.__ray_ready__.remote(): (h, n) for h, n in popped}
        try:
            done, _ = ray.wait(list(probes), num_returns=len(probes), timeout=_READY_CHECK)
        except Exception:
            done = []
        up = [probes[r] for r in probes if r in done]
        with _SPARES_LOCK:
            pool = _SPARES.setdefault(key, [])
            pool[:0] = [got for got in popped if got not in up]  # still starting: kept
    calls = [getattr(h, configure).remote(*a) for (h, _), a in zip(up, args, strict=False)]
    out: list[Any] = []
    for (handle, name), call in zip(up, calls, strict=True):
        try:
            out.append((handle, name, ray.get(call, timeout=120)))
        except Exception as ex:  # it died, or Ray is gone: start one the usual way
            log.debug("spare %s unusable: %s", name, ex)
            kill(handle, f"the spare {name}")
            out.append(None)
    return out + [None] * (len(args) - len(out))


def retire_as_spare(kind: ActorKind, handle: Any, name: str, method: str = "retire") -> bool:
    """After a run that ended well: ``handle.retire()`` (it forgets the run) and keep it
    in the spare pool of ``kind`` (the oldest spare is killed when the pool is full).
    False when it declines (it owns other actors, or failed) or cannot be reached: then
    kill it."""
    import ray

    try:
        if not ray.get(getattr(handle, method).remote(), timeout=30):
            return False
        key = _spare_key(kind)
    except Exception as ex:
        log.debug("%s not kept as a spare: %s", name, ex)
        return False
    with _SPARES_LOCK:
        pool = _pool(key)
        pool.append((handle, name))
        extra = pool[: max(0, len(pool) - SPARE_POOL)]
        del pool[: len(extra)]
    for old, old_name in extra:
        kill(old, f"the spare {old_name}")
    return True


def drop_spares() -> None:
    """Kill every spare actor this driver keeps (``Session.stop``: nothing of the
    session outlives it); never raises."""
    with _SPARES_LOCK:
        doomed = [got for pool in _SPARES.values() for got in pool]
        _SPARES.clear()
    for handle, name in doomed:
        kill(handle, f"the spare {name}")


class Launched:
    """A started actor and what it was created from: ``handle``, and ``args``, the
    object-store references of its creation arguments, held by the driver for as long
    as the actor may be restarted. Ray restarts a dead actor by running its creation
    task again, which reads those arguments again; an argument larger than Ray's inline
    limit (100 KiB) that nobody holds is gone by then, and the restart fails with
    ``ReferenceCountingAssertionError``."""

    def __init__(self, handle: Any, args: tuple[Any, ...]) -> None:
        self.handle, self.args = handle, args


def launch(actor_cls: Any, name: str, *args: Any) -> Any:
    """Start one named actor of ``actor_class`` in hybrid_iter's namespace (tasks find it
    by name); returns its handle. For an actor Ray may restart use ``launch_held``."""
    from .ray_util import NAMESPACE

    return actor_cls.options(name=name, namespace=NAMESPACE).remote(*args)


def launch_held(actor_cls: Any, name: str, *args: Any) -> Launched:
    """``launch``, with every creation argument put into the object store first and the
    references kept in the returned ``Launched``: keep it while the actor may restart."""
    import ray

    refs = tuple(ray.put(a) for a in args)
    return Launched(launch(actor_cls, name, *refs), refs)


def kill(handle: Any, what: str) -> None:
    """Kill an actor for good (no restart); never raises, so the error being raised or
    the result being returned is never hidden by a failed kill."""
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception as ex:
        log.warning("could not kill %s: %s", what, ex)
