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
* **Authentication**: every call carries ``authorization: Bearer <token>``; the server's
  middleware refuses a missing or wrong token before any byte of the body is unpickled
  (the body is pickled Python: the token is what stands between the network and the
  coordinator's process, as Ray's token stands in front of Ray's).
* **Version handshake**: every call carries the client's ``PROTOCOL_VERSION``; the
  middleware refuses another one, and the client's first call (``hello``) turns that
  refusal into ``EndpointVersionMismatch`` naming both versions and the address.
* **TLS**: a certificate and key make the server ``grpc+tls``; the client verifies it
  against the root certificates it is given.

The client side (``FlightLink``, ``EndpointAddress``) needs pyarrow and cloudpickle only:
nothing of Ray, nor of py4j.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import errno
import hmac
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ._errors import (
    EndpointAuthError,
    EndpointBindError,
    EndpointError,
    EndpointVersionMismatch,
)
from ._link import CoordinatorLink, Pending, _Forwarding, _FuturePending, _Mapped
from ._protocol import Reply
from ._shared_versions import SharedFiles, map_version, shared_memory_available
from ._variables import INLINE_LIMIT, VariablesPayload

__all__ = [
    "PROTOCOL_VERSION",
    "EndpointAddress",
    "EndpointRef",
    "EndpointServer",
    "EndpointServing",
    "EndpointSpec",
    "FlightLink",
    "FlightServing",
    "bind_problem",
    "handshake",
    "token_problem",
]

#: the version of what travels over the endpoint; a client and a coordinator of
#: different versions refuse each other (``EndpointVersionMismatch``)
PROTOCOL_VERSION = 2
_AUTH = "authorization"
_PROTOCOL = "x-hybrid-iter-protocol"
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
class EndpointSpec:
    """What the coordinator serves on: from the driver, over Ray's authenticated channel.

    ``bind`` is ``host:port`` (port 0: any free one); ``advertise`` the ``host:port``
    subtasks dial (a Service name, a load balancer; None: the bound host and port);
    ``tls_cert``/``tls_key`` PEM bytes (None: plain TCP)."""

    bind: str
    token: str
    advertise: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    #: write large versions to sealed shared memory for the subtasks of this host
    shared_memory: bool = True


@dataclass(frozen=True)
class EndpointAddress:
    """What a subtask needs to reach the endpoint (plain data in its task plan).

    ``root_certs``: the PEM certificates the server's is verified against (with TLS);
    ``connect_timeout``: seconds the first call may take before the address is declared
    unreachable."""

    location: str
    token: str
    root_certs: bytes | None = None
    connect_timeout: float = 30.0

    @property
    def address(self) -> str:
        return self.location.split("://", 1)[-1]


@dataclass(frozen=True)
class EndpointRef:
    """A large variables version to read: ``layout`` is ``(name, dtype, shape,
    nbytes)`` per variable, in the order their bytes are streamed; ``shared`` where its
    file is on the coordinator's host, ``<pid>/<fd>`` (None: streamed only)."""

    server: str
    version: int
    layout: tuple[tuple[str, str, tuple[int, ...], int], ...]
    shared: str | None = None


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot travel in the ``authorization`` header every call carries
    (gRPC metadata takes printable ASCII only: space to ``~``), naming the first
    character that cannot by its position and code point, never the token itself; None
    when it can."""
    for i, ch in enumerate(token):
        if not " " <= ch <= "~":
            kind = "not ASCII" if ord(ch) > 127 else "a control character"
            return (
                f"its character {i + 1} of {len(token)} is U+{ord(ch):04X} ({kind}), which "
                f"gRPC metadata cannot carry (printable ASCII only, space to '~')"
            )
    return None


def _split(hostport: str, what: str) -> tuple[str, int]:
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{what} must be 'host:port', got {hostport!r}")
    return host.strip("[]"), int(port)


# -- the server -----------------------------------------------------------------------------


class _AuthMiddleware(flight.ServerMiddleware):  # type: ignore[misc]
    pass


class _AuthFactory(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Refuses a call without the token or of another protocol version, before its
    handler (and any unpickling) runs."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self._token = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: Mapping[str, list[Any]]) -> _AuthMiddleware:
        given = _header(headers, _AUTH)
        if given is None or not hmac.compare_digest(given.encode(), self._token):
            raise flight.FlightUnauthenticatedError("wrong or missing token")
        version = _header(headers, _PROTOCOL)
        if version != str(PROTOCOL_VERSION):
            # its words are the wire contract: clients of every release match them
            raise flight.FlightServerError(
                f"protocol version mismatch: client {version}, coordinator {PROTOCOL_VERSION}"
            )
        return _AuthMiddleware()


def _header(headers: Mapping[str, list[Any]], name: str) -> str | None:
    values = headers.get(name) or []
    if not values:
        return None
    v = values[0]
    return v.decode() if isinstance(v, bytes) else str(v)


class FlightServing(flight.FlightServerBase):  # type: ignore[misc]
    """A Flight server on ``spec``: bound where it is told, TLS when given a certificate,
    every call refused without the token or of another protocol version (``_AuthFactory``);
    ``location`` is what clients dial, ``id`` names this server's life. The coordinator's
    endpoint and the parameter shards' (``coordinator._ps_endpoint``) are both one."""

    def __init__(self, spec: EndpointSpec) -> None:
        host, port = _split(spec.bind, "the endpoint's bind address")
        tls = spec.tls_cert is not None
        scheme = "grpc+tls" if tls else "grpc+tcp"
        try:
            super().__init__(
                f"{scheme}://{host}:{port}",
                tls_certificates=[(spec.tls_cert, spec.tls_key)] if tls else None,
                middleware={"auth": _AuthFactory(spec.token)},
            )
        except Exception as ex:  # gRPC says only "Server did not start properly"
            raise EndpointBindError(
                f"the endpoint's server cannot listen on {host}:{port}: "
                f"{bind_problem(host, port, tls, ex)}"
            ) from ex
        self.id = uuid.uuid4().hex
        advertise = spec.advertise or f"{host}:{self.port}"
        self.location = f"{scheme}://{advertise}"


def bind_problem(host: str, port: int, tls: bool, failure: BaseException) -> str:
    """Why a server did not start on ``host:port`` (gRPC's ``failure`` does not say), found
    by binding a plain socket there: the cause and its fix, never a guess."""
    said = (str(failure).splitlines() or [type(failure).__name__])[0]
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as ex:
        return (
            f"the host {host!r} does not resolve here ({ex.strerror}): give "
            f"EndpointConfig(bind='host:port') a name or address of the coordinator's node"
        )
    for family, kind, proto, _name, where in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as ex:
                if ex.errno == errno.EADDRINUSE:
                    return (
                        f"port {port} is in use there: give EndpointConfig(bind='host:port') "
                        f"a free port (port 0: any free one)"
                    )
                if ex.errno == errno.EADDRNOTAVAIL:
                    return (
                        f"{host} is not an address of the node the server runs on: give "
                        f"EndpointConfig(bind=...) an address of the coordinator's node, or "
                        f"'0.0.0.0:<port>' for every interface"
                    )
                if ex.errno == errno.EACCES:
                    return (
                        f"port {port} needs privileges this process does not have: use a "
                        f"port above 1023"
                    )
                return f"binding a socket there fails too ({ex.strerror}); gRPC said {said!r}"
    cause = "its TLS certificate or key, " if tls else ""
    return (
        f"gRPC did not start the server ({said!r}), though the address takes a socket: the "
        f"cause is not the port ({cause}see the coordinator's log for gRPC's own words)"
    )


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


#: bind hosts that mean every interface: a server bound so is advertised by its node's address
WILDCARDS = ("0.0.0.0", "::", "")


async def start_server(server_cls: Any, owner: Any, spec: EndpointSpec, what: str) -> Any:
    """``server_cls(owner, loop, spec)`` started in this actor's process, on its running
    loop. ``spec.bind`` empty: this node's address, any free port; a wildcard host: every
    interface, advertised as this node's address. ``what`` names the bind address in
    errors."""
    from ._shell import node_ip

    ip = node_ip()
    here = ip if ip not in ("local", "unknown") else "127.0.0.1"
    if not spec.bind:
        spec = dataclasses.replace(spec, bind=f"{here}:0")
    host, _ = _split(spec.bind, what)
    loop = asyncio.get_running_loop()
    server = await loop.run_in_executor(None, server_cls, owner, loop, spec)
    if spec.advertise is None and host in WILDCARDS:
        server.location = f"{server.location.split('://')[0]}://{here}:{server.port}"
    return server


def open_client(address: EndpointAddress, protocol: int = PROTOCOL_VERSION) -> tuple[Any, Any]:
    """A Flight client of ``address`` (TLS when its location says so) and the call options
    every call carries: the run's token and this side's protocol version."""
    kwargs: dict[str, Any] = {}
    if address.location.startswith("grpc+tls"):
        kwargs["tls_root_certs"] = address.root_certs
    client = flight.FlightClient(address.location, **kwargs)
    headers = [
        (_AUTH.encode(), f"Bearer {address.token}".encode()),
        (_PROTOCOL.encode(), str(protocol).encode()),
    ]
    return client, flight.FlightCallOptions(headers=headers)


def handshake(
    client: Any,
    address: EndpointAddress,
    headers: list[tuple[bytes, bytes]],
    protocol: int = PROTOCOL_VERSION,
    what: str = "the coordinator endpoint",
    running: str = "the coordinator",
) -> str:
    """The first call of a client of ``what`` at ``address``, bounded by its
    ``connect_timeout``: the address, the token and the protocol version are checked
    here, each failure named with the fix; returns the server's id."""
    where = address.address
    timeout = address.connect_timeout
    options = flight.FlightCallOptions(timeout=timeout, headers=headers)
    try:
        (result,) = list(client.do_action(flight.Action("hello", b""), options))
    except flight.FlightUnauthenticatedError as ex:
        raise EndpointAuthError(
            f"{what} at {where} refused this subtask's token: the "
            f"task plan's token is not the one the coordinator serves with. Use the "
            f"same EndpointConfig(token=...) (or HYBRID_ITER_ENDPOINT_TOKEN) for the "
            f"driver and the coordinator; without one, each run makes its own"
        ) from ex
    except flight.FlightServerError as ex:
        # Flight carries a status and a text, no type of ours: the text is what every
        # release's server (_AuthFactory) sends, a server of another release included
        if "protocol version mismatch" in str(ex):
            raise EndpointVersionMismatch(
                f"{what} at {where} refused this subtask's protocol "
                f"version ({str(ex).splitlines()[0]}): install the same hybrid_iter on "
                f"the executors as on the driver and the Ray cluster"
            ) from ex
        raise EndpointError(f"{what} at {where} failed: {ex}") from ex
    except (flight.FlightUnavailableError, flight.FlightTimedOutError) as ex:
        raise EndpointError(
            f"{what} at {where} cannot be reached within "
            f"{timeout:g} s ({type(ex).__name__}: {str(ex).splitlines()[0]}): check "
            f"that the executors can reach that host and port (EndpointConfig(bind=..., "
            f"advertise=...), a firewall or NetworkPolicy, TLS on both sides or "
            f"neither), and that {running} is running"
        ) from ex
    except flight.FlightError as ex:
        bad = token_problem(address.token)
        said = (str(ex).splitlines() or [""])[0]
        why = f"the token cannot be sent: {bad}" if bad is not None else said
        raise EndpointError(
            f"{what} at {where} failed this subtask's first call ({type(ex).__name__}): {why}"
        ) from ex
    version, server_id = cloudpickle.loads(result.body.to_pybytes())
    if version != protocol:  # pragma: no cover - the middleware refuses first
        raise EndpointVersionMismatch(
            f"{what} at {where} speaks protocol version {version}, this subtask version {protocol}"
        )
    return str(server_id)


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
            if location is None:
                return None
            from ._tree_endpoint import group_link

            return group_link(self.address, location)

        return _Mapped(self._call("group_of", pid), link)
