"""The coordinator endpoint: the subtask <-> coordinator protocol over Arrow Flight.

A subtask that has no raylet on its host (a Spark Connect server's executors, Spark on
Kubernetes beside a KubeRay cluster) reaches its coordinator through a network endpoint
served in the coordinator actor's process (docs/design.md, "the seam"). It carries
the calls of ``CoordinatorLink`` unchanged: each call is a Flight ``DoAction`` whose body
is the call's arguments (cloudpickle) and whose one result is the coroutine's answer, run
on the actor's own event loop, so the coordinator cannot tell the transports apart and
the protocol, its determinism and its recovery are those of the Ray path.

* **Variables**: a version at most ``inline_limit`` bytes travels inside the reply, as
  through Ray; a larger one is named in the reply (``EndpointRef``: version and layout)
  and read once per version per Python process (``_VersionCache``): every later subtask
  call of that process reads the cached, read-only arrays. A process on the
  coordinator's host, of its user, maps the version read-only from the sealed memory
  file the server wrote it to once (``coordinator._shared_versions``: Ray's
  object-store path, without Ray, and no mapping that a truncation could fault); any
  other streams it by ``DoGet`` in chunks of raw bytes.
* **Authentication, the version handshake, TLS, binding**: those of every endpoint of
  ours (``coordinator._flight``).
* **Feedback groups** (``feedback_combine``): ``group_of`` answers a group's location,
  and the subtask makes its ``report`` calls there (``GroupLink``, served by
  ``coordinator._tree_endpoint``).

The client side (``FlightLink``, ``GroupLink``) needs pyarrow and cloudpickle only:
nothing of Ray, nor of py4j.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ._errors import EndpointError
from ._flight import (
    PROTOCOL_VERSION,
    EndpointAddress,
    EndpointSpec,
    FlightServing,
    handshake,
    open_client,
)
from ._link import CoordinatorLink, Pending, _Forwarding, _FuturePending, _Mapped
from ._protocol import Reply
from ._shared_versions import SharedFiles, map_version, shared_memory_available
from ._variables import INLINE_LIMIT, VariablesPayload

__all__ = [
    "VERSIONS",
    "EndpointRef",
    "EndpointServer",
    "EndpointServing",
    "FlightLink",
    "GroupLink",
    "assemble",
    "group_link",
]

#: the calls a subtask makes (``CoordinatorLink``); nothing else is served
_CALLS = frozenset(
    {
        "variables",
        "report",
        "checkpoint_state",
        "finish",
        "fail",
        "restored",
        "group_of",
        "stash",
        "unstash",
        "online_report",
    }
)
#: bytes of one streamed chunk of a large variables version: a variable of at most this
#: size is read in place where it arrived; larger ones are joined (one copy), which costs
#: less than the pipelining of smaller chunks saves (8 MB: 6 ms in 2 MiB chunks, 7.5 ms
#: in one, on the shared 2-core machine)
_CHUNK = 2 << 20
_BYTES = pa.schema([("bytes", pa.uint8())])
_EMPTY = np.empty(0, np.uint8)


@dataclass(frozen=True)
class EndpointRef:
    """A large variables version to read: ``layout`` is ``(name, dtype, shape,
    nbytes)`` per variable, in the order their bytes are streamed; ``shared`` where its
    file is on the coordinator's host, ``<pid>/<fd>`` (None: streamed only)."""

    server: str
    version: int
    layout: tuple[tuple[str, str, tuple[int, ...], int], ...]
    shared: str | None = None


# -- the server -----------------------------------------------------------------------------


class EndpointServer(FlightServing):
    """Serves ``coordinator`` (whose coroutines run on ``loop``) to subtasks."""

    def __init__(
        self, coordinator: Any, loop: asyncio.AbstractEventLoop, spec: EndpointSpec
    ) -> None:
        super().__init__(spec)
        self.coordinator, self.loop = coordinator, loop
        self._versions: dict[int, tuple[EndpointRef, dict[str, np.ndarray]]] = {}
        self._lock = threading.Lock()
        self._token = spec.token.encode()
        shared = spec.shared_memory and shared_memory_available()
        self._files = SharedFiles(self.id) if shared else None
        if shared:
            atexit.register(self.forget_versions)

    # runs on the coordinator's loop: the store is read where it is written
    async def _answer(self, method: str, args: tuple[Any, ...]) -> Any:
        result = await getattr(self.coordinator, method)(*args)
        if method == "group_of" and result is not None:  # its group's endpoint location
            return self.coordinator._tree.location_of(*args)
        if isinstance(result, VariablesPayload):
            return self._external(result)
        if isinstance(result, Reply) and result.variables is not None:
            return _replace_variables(result, self._external(result.variables))
        return result

    def readable(self, replies: list[Reply]) -> list[Reply]:
        """A feedback group's replies (``report_group``) as its members, without Ray,
        read them: their variables inline or streamed from this endpoint (each distinct
        reply converted once; the members mostly share one)."""
        done: dict[int, Reply] = {}
        out = []
        for r in replies:
            got = done.get(id(r))
            if got is None:
                got = r
                if r.variables is not None:
                    got = _replace_variables(r, self._external(r.variables))
                done[id(r)] = got
            out.append(got)
        return out

    def _external(self, payload: VariablesPayload) -> VariablesPayload:
        """``payload`` as a subtask without Ray can read it: inline, or an
        ``EndpointRef`` to stream."""
        with self._lock:
            held = self._versions.get(payload.version)
        if held is not None:
            return VariablesPayload(payload.version, None, held[0])
        if payload.ref is None and payload.inline is not None:
            values = dict(payload.inline)
        else:
            values = _get_own(payload.ref)
        size = sum(a.nbytes for a in values.values())
        limit = getattr(getattr(self.coordinator, "spec", None), "inline_limit", INLINE_LIMIT)
        if size <= limit:
            return VariablesPayload(payload.version, values, None)
        with self._lock:
            held = self._versions.get(payload.version)
            if held is None:
                held = self._hold(payload.version, values)
        return VariablesPayload(payload.version, None, held[0])

    def _hold(
        self, version: int, values: dict[str, np.ndarray]
    ) -> tuple[EndpointRef, dict[str, np.ndarray]]:
        """Make ``version`` readable (under the lock): held here to be streamed, written
        to a shared-memory file for this host's subtasks when it has one, and named in
        an ``EndpointRef``."""
        layout = tuple((name, a.dtype.str, tuple(a.shape), a.nbytes) for name, a in values.items())
        ref = EndpointRef(self.id, version, layout)
        if self._files is not None:
            name = self._files.write(ref, values)
            if name is not None:  # else (no memory for it): streamed only
                ref = dataclasses.replace(ref, shared=name)
        held = (ref, values)
        self._versions[version] = held
        # a reply's version is read right after it arrives; async runs may publish a few
        # more meanwhile (one reply per subtask at most)
        keep = max(8, 2 * getattr(self.coordinator.spec, "num_subtasks", 1))
        for old in sorted(self._versions)[:-keep]:
            del self._versions[old]
        return held

    def forget_versions(self) -> None:
        """Close this server's version files (the run ended, or the process does); their
        memory goes once no reader maps them."""
        if self._files is not None:
            with self._lock:
                self._files.remove_all()

    def do_action(self, context: Any, action: Any) -> Iterator[bytes]:
        kind = action.type
        if kind == "hello":
            return iter([cloudpickle.dumps((PROTOCOL_VERSION, self.id))])
        if kind not in _CALLS:
            raise flight.FlightServerError(f"unknown call {kind!r}")
        args = cloudpickle.loads(action.body.to_pybytes())
        future = asyncio.run_coroutine_threadsafe(self._answer(kind, args), self.loop)
        try:
            result = future.result()
        except EndpointError as ex:
            raise flight.FlightServerError(str(ex)) from ex
        return iter([cloudpickle.dumps(result, protocol=5)])

    def do_get(self, context: Any, ticket: Any) -> Any:
        version = int(ticket.ticket.decode())
        with self._lock:
            held = self._versions.get(version)
        if held is None:
            raise flight.FlightServerError(
                f"variables version {version} is no longer held (newer ones were published "
                f"before this subtask streamed it)"
            )
        ref, values = held
        return flight.GeneratorStream(_BYTES, _chunks(ref, values))


def _chunks(ref: EndpointRef, values: Mapping[str, np.ndarray]) -> Iterator[pa.RecordBatch]:
    """The streamed bytes of ``ref``: each variable's, in chunks of at most ``_CHUNK``
    (a chunk never spans two variables)."""
    for name, _dtype, _shape, nbytes in ref.layout:
        raw = np.ascontiguousarray(values[name]).reshape(-1).view(np.uint8)
        for start in range(0, nbytes, _CHUNK):
            yield _batch(raw[start : start + _CHUNK])


def _piece(batch: pa.RecordBatch) -> np.ndarray:
    """The bytes of one streamed chunk, in place."""
    col = batch.column(0)
    return np.frombuffer(col.buffers()[1], np.uint8, len(col), col.offset)


def assemble(ref: EndpointRef, pieces: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The variables of ``ref`` from its streamed chunks (``_chunks``' order), as
    read-only arrays: in place for a variable that came in one chunk, joined (one copy)
    otherwise. ``ValueError`` when the chunks do not add up to the layout."""
    out, got = {}, iter(pieces)
    for name, dtype, shape, nbytes in ref.layout:
        parts, have = [], 0
        while have < nbytes:
            part = next(got, None)
            if part is None:
                raise ValueError(f"short in {name!r}: {have} of {nbytes} bytes")
            parts.append(part)
            have += len(part)
        if have != nbytes:
            raise ValueError(f"{name!r}: {have} bytes for {nbytes}")
        raw = parts[0] if len(parts) == 1 else np.concatenate(parts or [_EMPTY])
        dt = np.dtype(dtype)
        if raw.ctypes.data % dt.alignment:
            raw = raw.copy()  # numpy reads unaligned data slowly
        arr = raw.view(dt).reshape(shape)
        arr.flags.writeable = False
        out[name] = arr
    if next(got, None) is not None:
        raise ValueError("more chunks than the layout holds")
    return out


def _batch(raw: np.ndarray) -> pa.RecordBatch:
    arr = pa.Array.from_buffers(pa.uint8(), len(raw), [None, pa.py_buffer(raw)])
    return pa.RecordBatch.from_arrays([arr], schema=_BYTES)


def _replace_variables(reply: Reply, payload: VariablesPayload) -> Reply:
    return dataclasses.replace(reply, variables=payload)


def _get_own(ref: Any) -> dict[str, np.ndarray]:
    from ._shell import quiet_get as get

    return dict(get(ref))


class EndpointServing:
    """Mixed into the coordinator actors: ``serve_endpoint`` starts the server in the
    actor's process, on its event loop; ``close_endpoint`` stops it."""

    _endpoint: EndpointServer | None = None

    async def serve_endpoint(self, spec: EndpointSpec) -> str:
        """Serve this coordinator on ``spec`` (once: a second call answers the same);
        returns the location subtasks dial."""
        given = spec
        if self._endpoint is None:
            if not spec.bind:  # this node's address, any free port
                from ._shell import node_ip

                ip = node_ip()
                host = ip if ip not in ("local", "unknown") else "127.0.0.1"
                spec = dataclasses.replace(spec, bind=f"{host}:0")
            loop = asyncio.get_running_loop()
            server = await loop.run_in_executor(None, EndpointServer, self, loop, spec)
            self._endpoint = server
            store = getattr(self, "store", None)
            if store is not None:  # the subtasks read versions from the server only
                store.without_object_store()
        tree = getattr(self, "_tree", None)
        if tree is not None:  # feedback_combine: its groups serve their members too
            await tree.serve(given)
        return self._endpoint.location

    def close_endpoint(self) -> None:
        server, self._endpoint = self._endpoint, None
        if server is not None:
            server.forget_versions()
            atexit.unregister(server.forget_versions)
            threading.Thread(target=server.shutdown, daemon=True).start()


# -- the client -----------------------------------------------------------------------------


class _VersionCache:
    """Large variables versions read in this process, by (server, version): each is
    read once (mapped or streamed), whatever the number of subtasks of this process that
    read it. ``fetched`` counts the versions read, ``mapped`` those of them mapped from
    the server's shared-memory file rather than streamed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], dict[str, np.ndarray]] = {}
        self._loading: dict[tuple[str, int], threading.Lock] = {}
        self.fetched = 0
        self.mapped = 0

    def get(
        self, ref: EndpointRef, fetch: Callable[[EndpointRef], dict[str, np.ndarray]]
    ) -> dict[str, np.ndarray]:
        key = (ref.server, ref.version)
        with self._lock:
            got = self._held.get(key)
            if got is not None:
                return got
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:
                got = self._held.get(key)
            if got is None:
                got = map_version(ref)
                mapped = got is not None
                if got is None:
                    got = fetch(ref)
                with self._lock:
                    self.fetched += 1
                    self.mapped += mapped
                    # keep the newest two versions of each server (one may still be read),
                    # and of servers of runs past only as many as two runs at once need
                    for old in [k for k in self._held if k[0] == ref.server]:
                        if old[1] < ref.version - 1:
                            del self._held[old]
                    self._held[key] = got
                    while len(self._held) > _CACHED:
                        del self._held[next(iter(self._held))]
                    self._loading.pop(key, None)
        return got


#: versions a process keeps at most (a mapped one holds its file's memory)
_CACHED = 4
#: this process's large variables versions (a Spark Python worker's, for its subtasks)
VERSIONS = _VersionCache()


class FlightLink(_Forwarding):
    """The coordinator reached through its endpoint. Runs in a Spark task, without Ray.

    Calls run on a small thread pool so that each returns a ``Pending`` at once, as a
    Ray call does (a subtask reads its data while its first answer is on the way)."""

    def __init__(self, address: EndpointAddress, *, _protocol: int = PROTOCOL_VERSION) -> None:
        self.address = address
        self._client, self._options = open_client(address, _protocol)
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="hi-endpoint")
        self.server_id, self._protocol = "", _protocol
        self._hello()

    #: what this link reaches, as its errors name it; what serves there; what a failed
    #: call adds to say where to look
    _what = "the coordinator endpoint"
    _running = "the coordinator"
    _lost = ""

    def _hello(self) -> None:
        """The first call, bounded by ``connect_timeout``: the address, the token and the
        protocol version are checked here, each failure named."""
        self.server_id = handshake(
            self._client,
            self.address,
            self._options.headers,
            self._protocol,
            what=self._what,
            running=self._running,
        )

    def _do(self, method: str, args: tuple[Any, ...]) -> Any:
        body = cloudpickle.dumps(args, protocol=5)
        try:
            results = list(self._client.do_action(flight.Action(method, body), self._options))
        except flight.FlightError as ex:
            raise EndpointError(
                f"{self._what} at {self.address.address} failed in {method}: "
                f"{str(ex).splitlines()[0] if str(ex) else type(ex).__name__}{self._lost}"
            ) from ex
        return cloudpickle.loads(results[0].body.to_pybytes())

    def _call(self, method: str, *args: Any) -> _FuturePending[Any]:
        return _FuturePending(self._pool.submit(self._do, method, args))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()

    # -- CoordinatorLink ----------------------------------------------------------------

    def resolve(self, payload: VariablesPayload) -> dict[str, Any]:
        if isinstance(payload.ref, EndpointRef):
            return dict(VERSIONS.get(payload.ref, self._stream))
        if payload.ref is not None:
            raise EndpointError("a Ray object reference reached a subtask through the endpoint")
        values = dict(payload.inline or {})
        for arr in values.values():
            if isinstance(arr, np.ndarray) and arr.flags.writeable:
                arr.flags.writeable = False
        return values

    def _stream(self, ref: EndpointRef) -> dict[str, np.ndarray]:
        """One ``DoGet`` of version ``ref``: its variables, read-only."""
        try:
            reader = self._client.do_get(flight.Ticket(str(ref.version).encode()), self._options)
            pieces = [_piece(chunk.data) for chunk in reader]
        except flight.FlightError as ex:
            raise EndpointError(
                f"the coordinator endpoint at {self.address.address} failed streaming "
                f"variables version {ref.version}: {str(ex).splitlines()[0]}"
            ) from ex
        try:
            return assemble(ref, pieces)
        except ValueError as ex:
            raise EndpointError(
                f"the coordinator endpoint at {self.address.address} streamed variables "
                f"version {ref.version} wrong: {ex}"
            ) from ex

    def group_of(self, pid: int) -> Pending[CoordinatorLink | None]:
        def link(location: str | None) -> CoordinatorLink | None:
            return None if location is None else group_link(self.address, location)

        return _Mapped(self._call("group_of", pid), link)


class GroupLink(FlightLink):
    """A feedback group reached through its endpoint (``coordinator._tree_endpoint``): a
    member's ``report`` calls (the variables of a reply are read through the
    coordinator's link, which the task keeps)."""

    _what = "the feedback group endpoint"
    _running = "the run's coordinator (it starts its feedback groups)"
    _lost = " (its group aggregator actor, in the coordinator tier, ended or is unreachable)"


#: this process's group links, by (location, token): one client per group, whatever the
#: number of this process's subtasks that report to it
_LINKS: dict[tuple[str, str], GroupLink] = {}
_LOCK = threading.Lock()


def group_link(coordinator: EndpointAddress, location: str) -> GroupLink:
    """The link to the group at ``location``, dialled with the coordinator's token, TLS
    roots and connect timeout."""
    key = (location, coordinator.token)
    with _LOCK:
        link = _LINKS.get(key)
    if link is None:
        link = GroupLink(dataclasses.replace(coordinator, location=location))
        with _LOCK:
            if len(_LINKS) >= 256:  # groups of earlier runs
                _LINKS.clear()
            link = _LINKS.setdefault(key, link)
    return link
