"""Spare actors: the pool of idle coordinator-tier actors a run takes instead of starting
one, and the registry of what the session's warm-up starts ahead.

Runs on the driver. An actor kind's owner (the iteration's coordinator in
``_runtime/iterate.py``, the array store, the parameter shards in ``ps``) registers a
``Warmer`` here: the one function that builds its kind and starts its spares, which its
own runs use too, so that the warm-up starts exactly what runs take (nothing predicts
another module's pool key). The pool is keyed by the actor class, its options and the
Ray job; a spare is taken ``configure``d for a run and given back emptied after a run
that ended well (``retire_as_spare``: the spare protocol of ``coordinator._spare``).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .context import ClusterContext
from .placement import ActorKind, kill

log = logging.getLogger("hybrid_iter")

__all__ = [
    "SPARE_POOL",
    "Warmer",
    "drop_spares",
    "keep_spare",
    "register_warmer",
    "retire_as_spare",
    "spares",
    "take_spare",
    "take_spares",
    "warmers",
]


@dataclass(frozen=True)
class Warmer:
    """What the warm-up starts for one actor kind, registered by the kind's owner.

    ``name``: its key in the warm-up's report; ``order``: its place among the warm-up's
    steps (lower first); ``start(ctx)``: start the spares of the kind for cluster
    ``ctx`` (no waiting), returning (what to report: names, or a name, or None; the
    object references that are ready once they are up); ``forget``: drop the handles
    its owner keeps outside the pool when the cluster's Ray ends (``drop_spares``)."""

    name: str
    order: int
    start: Callable[[ClusterContext], tuple[Any, list[Any]]]
    forget: Callable[[], None] | None = None


_WARMERS: dict[str, Warmer] = {}


def register_warmer(
    name: str,
    order: int,
    start: Callable[[ClusterContext], tuple[Any, list[Any]]],
    forget: Callable[[], None] | None = None,
) -> None:
    """Register (or replace) the warmer ``name``; its owner calls this once, on import."""
    _WARMERS[name] = Warmer(name, order, start, forget)


def warmers() -> list[Warmer]:
    """The registered warmers, in their order."""
    return sorted(_WARMERS.values(), key=lambda w: w.order)


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
    """Kill every spare actor this driver keeps, and have every warmer forget what it
    keeps outside the pool (a session's Ray ends: nothing of it outlives the session);
    never raises."""
    with _SPARES_LOCK:
        doomed = [got for pool in _SPARES.values() for got in pool]
        _SPARES.clear()
    for handle, name in doomed:
        kill(handle, f"the spare {name}")
    for warmer in warmers():
        if warmer.forget is not None:
            try:
                warmer.forget()
            except Exception as ex:  # the session's stop goes on
                log.warning("forgetting the %s failed: %s", warmer.name, ex)
