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
  coordinator's host, of its user, maps the version read-only from the file the server
  wrote it to once in shared memory (``_SharedFiles``/``_map_version``: Ray's
  object-store path, without Ray); any other streams it by ``DoGet`` in chunks of raw
  bytes.
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
import fcntl
import hashlib
import hmac
import itertools
import mmap
import os
import stat
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from ._errors import (
    EndpointAuthError,
    EndpointError,
    EndpointVersionMismatch,
)
from ._link import CoordinatorLink, Pending, _Forwarding, _FuturePending, _Mapped
from ._protocol import Reply
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
    "handshake",
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
#: where the server writes large versions for the subtasks of its host (tmpfs: memory)
SHARED_DIR = "/dev/shm"
_PREFIX = "hi-vars-"
#: a version file: this header (magic, server id, version, size), then each variable's
#: bytes at an offset aligned for any dtype
_MAGIC = b"HIVARS2\0"
_HEADER = 64
_ALIGN = 64
#: version files kept under their version's name: a subtask opens the newest right after
#: its reply; an older version is streamed (the server still holds it) rather than kept
#: in shared memory, so a coordinator killed outright leaves few files behind
_LINKED = 2
#: files of older versions kept to be written again (their memory is allocated already:
#: writing a version into fresh tmpfs pages costs more than Ray's put)
_SPARES = 2
#: a reader maps a version's pages at once (one call) rather than fault by fault
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


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
    #: write large versions to ``SHARED_DIR`` for the subtasks of this host
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
    nbytes)`` per variable, in the order their bytes are streamed; ``shared`` the name
    of its file in ``SHARED_DIR`` on the coordinator's host (None: streamed only)."""

    server: str
    version: int
    layout: tuple[tuple[str, str, tuple[int, ...], int], ...]
    shared: str | None = None


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
        super().__init__(
            f"{scheme}://{host}:{port}",
            tls_certificates=[(spec.tls_cert, spec.tls_key)] if tls else None,
            middleware={"auth": _AuthFactory(spec.token)},
        )
        self.id = uuid.uuid4().hex
        advertise = spec.advertise or f"{host}:{self.port}"
        self.location = f"{scheme}://{advertise}"


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
        shared = _shared_dir() if spec.shared_memory else None
        self._files = None if shared is None else _SharedFiles(shared, spec.token, self.id)
        if shared is not None:
            _sweep(shared)
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
            if name is not None:  # else (a full tmpfs): streamed only
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
        """Remove this server's version files (the run ended, or the process does)."""
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
            raise flight.FlightServerError(str(ex)) from None
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


def _offsets(layout: tuple[tuple[str, str, tuple[int, ...], int], ...]) -> tuple[list[int], int]:
    """Where each variable of ``layout`` starts in a version file, and the file's size."""
    at, out = _HEADER, []
    for _name, _dtype, _shape, nbytes in layout:
        out.append(at)
        at += -(-nbytes // _ALIGN) * _ALIGN
    return out, at


def _file_header(ref: EndpointRef, size: int) -> bytes:
    head = _MAGIC + ref.server.encode()[:32].ljust(32, b"\0")
    head += ref.version.to_bytes(8, "little", signed=True) + size.to_bytes(8, "little")
    return head.ljust(_HEADER, b"\0")


def _views(mapped: mmap.mmap, ref: EndpointRef) -> dict[str, np.ndarray]:
    """The read-only variables of ``ref`` in place in the file ``mapped``."""
    offsets, _size = _offsets(ref.layout)
    out = {}
    for (name, dtype, shape, nbytes), at in zip(ref.layout, offsets, strict=True):
        dt = np.dtype(dtype)
        arr = np.frombuffer(mapped, dt, nbytes // dt.itemsize, at).reshape(shape)
        arr.flags.writeable = False
        out[name] = arr
    return out


class _SharedFiles:
    """The server's version files in ``directory`` (mode 0600, named from the token).

    A reader holds a shared ``flock`` on a file for as long as it maps it; a file is
    written again (for a newer version, under another name) only under an exclusive
    lock taken without waiting, so never while a reader maps it. A version's file is
    written whole under another name and then renamed: a reader finds the whole file
    or none, and checks its header (server, version, size) under its lock, so a file
    opened under an old name and written again since is recognised and not used. The
    server writes through a mapping of each file that it keeps (the pages, allocated
    once with ``posix_fallocate`` so that a full tmpfs is an error, not a SIGBUS, stay
    mapped: writing a version again is one copy)."""

    def __init__(self, directory: str, token: str, server: str) -> None:
        self.directory, self._token, self._server = directory, token.encode(), server
        self._linked: list[_File] = []  # by version, oldest first
        self._spare: list[_File] = []  # to write again
        self._count = itertools.count()

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def write(self, ref: EndpointRef, values: Mapping[str, np.ndarray]) -> str | None:
        """Write version ``ref``; its file's name, None when it cannot be written (the
        caller streams it)."""
        digest = hmac.new(self._token, f"{self._server}:{ref.version}".encode(), hashlib.sha256)
        name = self._path(f"{_PREFIX}{os.getpid()}-{digest.hexdigest()[:40]}")
        offsets, size = _offsets(ref.layout)
        try:
            file = self._free(size)
        except OSError:  # a full tmpfs: no file, the version is streamed
            return None
        file.mapped[:_HEADER] = _file_header(ref, size)
        for (var, _dtype, _shape, nbytes), at in zip(ref.layout, offsets, strict=True):
            raw = np.ascontiguousarray(values[var]).reshape(-1).view(np.uint8)
            np.frombuffer(file.mapped, np.uint8, nbytes, at)[:] = raw
        try:
            fcntl.flock(file.fd, fcntl.LOCK_UN)
            os.rename(file.path, name)
        except OSError:
            file.close()
            return None
        file.path = name
        self._linked.append(file)
        while len(self._linked) > _LINKED:
            old = self._linked.pop(0)
            spare = self._path(f"{_PREFIX}{os.getpid()}-spare-{next(self._count)}")
            try:
                os.rename(old.path, spare)
            except OSError:
                old.close()
                continue
            old.path = spare
            self._spare.append(old)
        while len(self._spare) > _SPARES:
            self._spare.pop(0).close()
        return os.path.basename(name)

    def _free(self, size: int) -> _File:
        """A file of ``size`` bytes no reader maps, locked exclusively: a spare, else a
        new one."""
        for i, file in enumerate(self._spare):
            if len(file.mapped) != size:
                continue
            try:
                fcntl.flock(file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a reader maps it still
            del self._spare[i]
            return file
        path = self._path(f"{_PREFIX}{os.getpid()}-new-{next(self._count)}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.posix_fallocate(fd, 0, size)
            return _File(path, fd, mmap.mmap(fd, size))
        except OSError:
            _unlink(path)
            os.close(fd)
            raise

    def remove_all(self) -> None:
        files, self._linked, self._spare = self._linked + self._spare, [], []
        for file in files:
            file.close()


@dataclass
class _File:
    """One of the server's version files: its current path, descriptor and mapping."""

    path: str
    fd: int
    mapped: mmap.mmap

    def close(self) -> None:
        _unlink(self.path)
        self.mapped.close()
        os.close(self.fd)


def _map_version(directory: str, ref: EndpointRef) -> dict[str, np.ndarray] | None:
    """Version ``ref`` mapped read-only from its file in ``directory``: None when this
    process cannot use it (another host or container, another user, removed or written
    again since), and then the caller streams it. The file is used only when it is a
    regular file of this process's user that no one else may write or read, of the size
    and header the layout says, locked (shared) for as long as the mapping lives."""
    name = ref.shared
    if name is None or os.path.basename(name) != name or not name.startswith(_PREFIX):
        return None
    _at, size = _offsets(ref.layout)
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # the shared lock first: while held, the server does not write the file again
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_mode & 0o077
            or st.st_size != size
        ):
            raise ValueError("not the version's file")
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ)
    except (OSError, ValueError):
        os.close(fd)
        return None
    if mapped[:_HEADER] != _file_header(ref, size):
        mapped.close()
        os.close(fd)
        return None
    weakref.finalize(mapped, os.close, fd)  # the lock lasts as long as the mapping
    return _views(mapped, ref)


def _shared_dir() -> str | None:
    d = SHARED_DIR
    return d if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK) else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _sweep(directory: str) -> None:
    """Remove the version files of servers whose process is gone (killed outright)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    me = os.geteuid()
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == me:
                os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's
    return True


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
                got = _map_version(SHARED_DIR, ref)
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
    except flight.FlightUnauthenticatedError:
        raise EndpointAuthError(
            f"{what} at {where} refused this subtask's token: the "
            f"task plan's token is not the one the coordinator serves with. Use the "
            f"same EndpointConfig(token=...) (or HYBRID_ITER_ENDPOINT_TOKEN) for the "
            f"driver and the coordinator; without one, each run makes its own"
        ) from None
    except flight.FlightServerError as ex:
        if "protocol version mismatch" in str(ex):
            raise EndpointVersionMismatch(
                f"{what} at {where} refused this subtask's protocol "
                f"version ({str(ex).splitlines()[0]}): install the same hybrid_iter on "
                f"the executors as on the driver and the Ray cluster"
            ) from None
        raise EndpointError(f"{what} at {where} failed: {ex}") from None
    except (flight.FlightUnavailableError, flight.FlightTimedOutError) as ex:
        raise EndpointError(
            f"{what} at {where} cannot be reached within "
            f"{timeout:g} s ({type(ex).__name__}: {str(ex).splitlines()[0]}): check "
            f"that the executors can reach that host and port (EndpointConfig(bind=..., "
            f"advertise=...), a firewall or NetworkPolicy, TLS on both sides or "
            f"neither), and that {running} is running"
        ) from None
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
            ) from None
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
            ) from None
        try:
            return assemble(ref, pieces)
        except ValueError as ex:
            raise EndpointError(
                f"the coordinator endpoint at {self.address.address} streamed variables "
                f"version {ref.version} wrong: {ex}"
            ) from None

    def group_of(self, pid: int) -> Pending[CoordinatorLink | None]:
        def link(location: str | None) -> CoordinatorLink | None:
            if location is None:
                return None
            from ._tree_endpoint import group_link

            return group_link(self.address, location)

        return _Mapped(self._call("group_of", pid), link)
