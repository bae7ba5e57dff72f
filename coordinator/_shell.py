"""What both coordinator actors (bounded ``_actor.py``, online ``_online.py``) need of
Ray and asyncio: the driver's progress polls, the object store of large variable
versions, and what Ray says about this actor. Runs in the Ray coordinator actor; without
Ray every helper answers as if there were none."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from ._core import COORDINATOR
from ._errors import (
    ForeignCheckpoint,
    MissingCheckpoint,
    RemoteFailure,
    UnpicklableOperator,
    UserCodeFailed,
)

__all__ = [
    "LOADING",
    "ProgressWaiters",
    "node_ip",
    "object_store",
    "quiet_get",
    "startup_failure",
    "was_reconstructed",
]

#: where a coordinator that cannot load its operators failed
LOADING = (
    "loading the coordinator operator or feedback combiner in the Ray actor (is its module "
    "importable there? see hybrid_iter docs on shipping code)"
)


def startup_failure(ex: Exception) -> RemoteFailure:
    """The failure of a coordinator that cannot start: user code that raised (opening or
    restoring an operator); a checkpoint of another run, one missing, or an operator a
    checkpoint cannot hold (final: a relaunch meets them again); a checkpoint that
    cannot be read."""
    if isinstance(ex, UserCodeFailed):
        return ex.failure
    if isinstance(ex, ForeignCheckpoint | MissingCheckpoint | UnpicklableOperator):
        where = (
            "checking that the coordinator operator can be checkpointed"
            if isinstance(ex, UnpicklableOperator)
            else "restoring a checkpoint"
        )
        return RemoteFailure(COORDINATOR, None, where, type(ex).__name__, str(ex), "", ex)
    return RemoteFailure.capture(ex, source=COORDINATOR, epoch=None, where="restoring a checkpoint")


class ProgressWaiters:
    """The driver's pending progress polls: each waits until ``ready(*poll)`` or its
    timeout. Shared by the bounded and the online coordinator."""

    def __init__(self) -> None:
        self._waiting: list[tuple[tuple[Any, ...], asyncio.Future[None]]] = []

    async def wait(self, poll: tuple[Any, ...], ready: Callable[..., bool], timeout: float) -> None:
        if ready(*poll):
            return
        entry = (poll, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(entry[1], timeout)
        except asyncio.TimeoutError:
            if entry in self._waiting:
                self._waiting.remove(entry)

    def notify(self, ready: Callable[..., bool]) -> None:
        keep = []
        for poll, fut in self._waiting:
            if fut.done():
                continue
            if ready(*poll):
                fut.set_result(None)
            else:
                keep.append((poll, fut))
        self._waiting = keep


def object_store(
    put: Callable[[Any], Any] | None,
) -> tuple[Callable[[Any], Any] | None, Callable[[Any], Any] | None]:
    """``(put, get)`` of large variable versions: Ray's when it runs here (None: inline)."""
    if put is not None:
        return put, None
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return None, None
    return (ray.put, quiet_get) if ray.is_initialized() else (None, None)


def quiet_get(ref: Any) -> Any:
    """``ray.get`` inside an async actor without Ray's once-per-process warning about
    blocking gets: for a read that does not block the event loop (an object this actor
    has just put, a published version), so the warning stays for the user's code."""
    import ray

    try:
        from ray._private import worker as ray_worker
    except ImportError:  # pragma: no cover - a Ray without that module: plain get
        return ray.get(ref)
    warned = getattr(ray_worker, "blocking_get_inside_async_warned", True)
    ray_worker.blocking_get_inside_async_warned = True
    try:
        return ray.get(ref)
    finally:
        ray_worker.blocking_get_inside_async_warned = warned


def import_ahead(modules: Sequence[str]) -> None:
    """A spare actor's imports of what it will likely need: each one that fails is left
    for the real use to report."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # pragma: no cover - configure reports a real failure
            pass


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "local"
    except Exception:
        return "unknown"


def was_reconstructed() -> bool:
    """True in an actor that Ray restarted after its process died."""
    try:
        import warnings

        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a Ray instance
            return False
        with warnings.catch_warnings():  # Ray flags the property deprecated, with no successor
            warnings.simplefilter("ignore")
            ctx = ray.get_runtime_context()
            return bool(ctx.get_actor_id() and ctx.was_current_actor_reconstructed)
    except Exception:
        return False
