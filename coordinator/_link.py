"""The seam between a subtask and its coordinator: the calls a Spark task makes.

A subtask (``hybrid_iter._runtime.task``) talks to its coordinator only through a
``CoordinatorLink``: each call returns a ``Pending`` answer the task waits on (or polls,
to read data while the answer is on the way). Three implement it:

* ``RayLink``: Ray actor calls to the coordinator actor (and its feedback group actors),
  variables read zero-copy from the object store. Where a raylet runs beside the
  executors (``Session.local``, ``on_spark``, ``raydp``).
* ``InProcessLink``: the coordinator as a plain object on an asyncio loop of this process
  (no Ray): the subtask runtime is tested against the real coordinator with it.
* ``FlightLink`` (``_endpoint.py``): the coordinator endpoint, an Arrow Flight server in
  the coordinator actor's process, for subtasks without a raylet on their host (Spark
  Connect, Spark on Kubernetes beside KubeRay): nothing of Ray in the subtask.

The subtask's runtime picks the link from its task plan (``IterationConfig.transport``);
the protocol, its determinism and its recovery are the same over every link.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, Protocol, TypeVar

from ._errors import RemoteFailure
from ._protocol import Emissions, Reply
from ._variables import VariablesPayload, fetch_all

__all__ = ["CoordinatorLink", "InProcessLink", "Pending", "RayLink"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """An answer on its way."""

    def ready(self) -> bool:
        """True once the answer has arrived (``result`` would not wait)."""
        ...

    def result(self, timeout: float | None = None) -> T_co:
        """The answer, waiting for it (at most ``timeout`` seconds when given)."""
        ...


class CoordinatorLink(Protocol):
    """What a subtask asks of its coordinator (``IterationCoordinator``'s methods of the
    same names say what each does)."""

    def variables(self, known_version: int) -> Pending[VariablesPayload | None]: ...

    def resolve(self, payload: VariablesPayload) -> dict[str, Any]:
        """The values a payload carries (inline, or read from where the transport put
        them); numpy arrays are read-only."""
        ...

    def report(
        self,
        pid: int,
        call: int,
        known_version: int,
        emissions: Emissions,
        rows: Sequence[int] | None,
        attempt: int,
        offered: tuple[Any] | None,
    ) -> Pending[Reply]: ...

    def checkpoint_state(
        self, pid: int, call: int, known_version: int, state: Any, attempt: int
    ) -> Pending[Reply]: ...

    def finish(
        self, pid: int, emissions: Emissions, attempt: int, round_emissions: Emissions | None
    ) -> Pending[None]: ...

    def fail(self, failure: RemoteFailure, attempt: int) -> Pending[None]: ...

    def restored(self, pid: int) -> Pending[tuple[int, int, Any] | None]: ...

    def group_of(self, pid: int) -> Pending[CoordinatorLink | None]:
        """feedback_combine: the link to the group subtask ``pid`` reports through (its
        ``report`` only); None: straight to the coordinator."""
        ...

    def stash(self, pid: int, state: bytes) -> Pending[None]: ...

    def unstash(self, pid: int) -> Pending[bytes | None]: ...

    def online_report(self, batch_id: int, partition: int, emissions: Emissions) -> Pending[bool]:
        """An online micro-batch partition's emissions (``OnlineCoordinator``)."""
        ...


class _Mapped(Generic[T]):
    """``inner``'s answer passed through ``fn``."""

    def __init__(self, inner: Pending[Any], fn: Callable[[Any], T]) -> None:
        self._inner, self._fn = inner, fn

    def ready(self) -> bool:
        return self._inner.ready()

    def result(self, timeout: float | None = None) -> T:
        return self._fn(self._inner.result(timeout))


class _Forwarding:
    """The calls every link passes on unchanged to the coordinator's method of the same
    name: a link only says how a call travels (``_call``), how variables are read
    (``resolve``) and what a feedback group is on its side (``group_of``)."""

    def _call(self, method: str, *args: Any) -> Pending[Any]:
        raise NotImplementedError

    def variables(self, known_version: int) -> Pending[VariablesPayload | None]:
        return self._call("variables", known_version)

    def report(self, *args: Any) -> Pending[Reply]:
        return self._call("report", *args)

    def checkpoint_state(self, *args: Any) -> Pending[Reply]:
        return self._call("checkpoint_state", *args)

    def finish(self, *args: Any) -> Pending[None]:
        return self._call("finish", *args)

    def fail(self, failure: RemoteFailure, attempt: int) -> Pending[None]:
        return self._call("fail", failure, attempt)

    def restored(self, pid: int) -> Pending[tuple[int, int, Any] | None]:
        return self._call("restored", pid)

    def stash(self, pid: int, state: bytes) -> Pending[None]:
        return self._call("stash", pid, state)

    def unstash(self, pid: int) -> Pending[bytes | None]:
        return self._call("unstash", pid)

    def online_report(self, batch_id: int, partition: int, emissions: Emissions) -> Pending[bool]:
        return self._call("online_report", batch_id, partition, emissions)


# -- Ray ------------------------------------------------------------------------------------


class _RayPending(Generic[T]):
    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def ready(self) -> bool:
        import ray

        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self, timeout: float | None = None) -> T:
        import ray

        return ray.get(self.ref, timeout=timeout)  # type: ignore[no-any-return]


class RayLink(_Forwarding):
    """A coordinator (or feedback group) actor reached through Ray. Runs in a Spark task."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def _call(self, method: str, *args: Any) -> _RayPending[Any]:
        return _RayPending(getattr(self.handle, method).remote(*args))

    def resolve(self, payload: VariablesPayload) -> dict[str, Any]:
        def get(refs: list[Any]) -> list[Any]:
            import ray

            return ray.get(refs)  # zero-copy, read-only views of the object store

        (values,) = fetch_all([(payload.inline or {}, payload.ref)], get)
        return dict(values)

    def group_of(self, pid: int) -> Pending[CoordinatorLink | None]:
        return _Mapped(self._call("group_of", pid), lambda g: None if g is None else RayLink(g))


# -- in process -----------------------------------------------------------------------------


class _FuturePending(Generic[T]):
    __slots__ = ("future",)

    def __init__(self, future: concurrent.futures.Future[T]) -> None:
        self.future = future

    def ready(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> T:
        return self.future.result(timeout)


class InProcessLink(_Forwarding):
    """A coordinator object (``IterationCoordinator`` or ``OnlineCoordinator``, made
    without Ray) whose coroutines run on ``loop``, an asyncio loop another thread of
    this process runs; subtasks call it from their own threads, as Spark tasks call the
    actor. Variables always travel inline (no object store)."""

    def __init__(self, coordinator: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.coordinator, self.loop = coordinator, loop

    def _call(self, method: str, *args: Any) -> _FuturePending[Any]:
        coro: Coroutine[Any, Any, Any] = getattr(self.coordinator, method)(*args)
        return _FuturePending(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def resolve(self, payload: VariablesPayload) -> dict[str, Any]:
        if payload.ref is not None:
            raise ValueError("an in-process coordinator hands out inline variables only")
        (values,) = fetch_all([(payload.inline or {}, None)], lambda refs: [])
        return dict(values)

    def group_of(self, pid: int) -> Pending[CoordinatorLink | None]:
        def local(group: Any) -> CoordinatorLink | None:
            if group is not None:
                raise ValueError("an in-process coordinator has no feedback group actors")
            return None

        return _Mapped(self._call("group_of", pid), local)
