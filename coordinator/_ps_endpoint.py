"""Parameter-server shards over Arrow Flight: a worker's pulls and pushes without Ray.

Over the coordinator endpoint (``IterationConfig(transport="endpoint")``) each shard
actor serves its own Flight endpoint in its own process (``ShardServing``, the same
``FlightServing`` as the coordinator's: bound where it is told, the run's token, TLS,
the protocol version handshake). A worker's step is then one ``DoAction`` per shard, the
fused push of step ``s`` and pull of the keys of step ``s + 1``, straight to the shard:
no hop through the coordinator, whose endpoint would add one round trip and carry every
shard's bytes through one process.

What travels (``pack``/``unpack``): the call's arguments and its reply as a pickle
(protocol 5) whose numpy arrays travel out of band, as raw bytes appended to the message
(64-byte aligned): one copy into the message on the sender, read in place from the
received buffer on the receiver (read-only arrays), never element by element. The shard
runs the call on its actor's event loop (where Ray's calls run too: the coordinator's
resets, checkpoints and restores never interleave with a step), and packs the reply
there, before it runs anything else. A refusal of the shard (a ``HybridIterError``:
a stale token, a non-finite gradient) travels back as itself.

The client side (``ShardClient``) needs pyarrow and cloudpickle only: nothing of Ray.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import struct
import threading
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pyarrow as pa
import pyarrow.flight as flight

from ._errors import EndpointError, HybridIterError
from ._flight import (
    PROTOCOL_VERSION,
    EndpointAddress,
    EndpointSpec,
    FlightServing,
    handshake,
    open_client,
    start_server,
)

__all__ = ["SHARD_CALLS", "ShardClient", "ShardServer", "ShardServing", "pack", "unpack"]

#: the Flight action of each shard method a worker calls (``hello`` is the handshake)
SHARD_CALLS = {
    "pull": "pull",
    "push_packed": "push_packed",
    "lookup_at": "lookup_at",
    "retire": "retire",
    "shard_hello": "hello",
}
_ALIGN = 64
_HEAD = struct.Struct("<QQ")


def pack(obj: Any) -> bytes:
    """``obj`` as one message: ``(buffers, pickle bytes)``, each buffer's size, the
    pickle (protocol 5), then each out-of-band buffer (numpy arrays' bytes) at a
    64-byte aligned offset."""
    raws: list[memoryview] = []

    def keep(buf: pickle.PickleBuffer) -> None:
        raws.append(buf.raw())

    head = pickle.dumps(obj, protocol=5, buffer_callback=keep)
    sizes = [r.nbytes for r in raws]
    parts: list[Any] = [
        _HEAD.pack(len(raws), len(head)),
        struct.pack(f"<{len(sizes)}Q", *sizes),
        head,
    ]
    at = _HEAD.size + 8 * len(sizes) + len(head)
    for raw in raws:
        pad = -at % _ALIGN
        parts.append(b"\0" * pad)
        parts.append(raw)
        at += pad + raw.nbytes
    return b"".join(parts)


def unpack(message: Any) -> Any:
    """The object ``pack`` made of ``message`` (bytes or a ``pyarrow.Buffer``); its
    arrays are read in place (read-only where the message is). ``ValueError`` when the
    message is not one ``pack`` made."""
    view = memoryview(message).cast("B")
    try:
        n, head_len = _HEAD.unpack_from(view, 0)
        at = _HEAD.size + 8 * n
        if at + head_len > len(view):
            raise ValueError("shorter than its header says")
        sizes = struct.unpack_from(f"<{n}Q", view, _HEAD.size)
        head = view[at : at + head_len]
        at += head_len
        buffers = []
        for size in sizes:
            at += -at % _ALIGN
            if at + size > len(view):
                raise ValueError("shorter than its buffers")
            buffers.append(view[at : at + size])
            at += size
    except struct.error as ex:
        raise ValueError(f"a truncated message ({ex})") from ex
    if at != len(view):
        raise ValueError(f"{len(view) - at} bytes after the last buffer")
    return pickle.loads(head, buffers=buffers)


# -- the server (in the shard actor's process) ---------------------------------------------


class ShardServer(FlightServing):
    """Serves ``shard`` (whose methods run on ``loop``, the actor's event loop) to
    workers."""

    def __init__(self, shard: Any, loop: asyncio.AbstractEventLoop, spec: EndpointSpec) -> None:
        super().__init__(spec)
        self.shard, self.loop = shard, loop

    async def _answer(self, method: str, args: tuple[Any, ...]) -> bytes:
        try:
            got = getattr(self.shard, method)(*args)
            if inspect.isawaitable(got):
                got = await got
            reply: tuple[bool, Any] = (True, got)
        except HybridIterError as ex:  # the shard refused the call: the worker says why
            reply = (False, ex)
        stats = getattr(self.shard, "stats", None)
        if stats is not None:
            stats["endpoint_calls"] = stats.get("endpoint_calls", 0) + 1
        # packed here, on the loop: no later call changes what the reply holds
        return pack(reply)

    def do_action(self, context: Any, action: Any) -> Iterator[Any]:
        kind = action.type
        if kind == "hello":
            return iter([cloudpickle.dumps((PROTOCOL_VERSION, self.id))])
        method = SHARD_CALLS.get(kind)
        if method is None:
            raise flight.FlightServerError(f"unknown call {kind!r}")
        try:
            args = unpack(action.body)
        except ValueError as ex:
            raise flight.FlightServerError(f"a malformed call {kind!r}: {ex}") from ex
        future = asyncio.run_coroutine_threadsafe(self._answer(method, tuple(args)), self.loop)
        try:
            body = future.result()
        except Exception as ex:
            raise flight.FlightServerError(f"{type(ex).__name__}: {ex}") from ex
        return iter([flight.Result(pa.py_buffer(body))])


class ShardServing:
    """Mixed into the shard actors of a run over the endpoint: ``serve_endpoint`` starts
    the shard's server in its process, on the actor's event loop (``async``: Ray makes
    the actor an asyncio one, so every call, Ray's and the endpoint's, runs on that
    loop)."""

    _server: ShardServer | None = None

    async def serve_endpoint(self, spec: EndpointSpec) -> str:
        """Serve this shard on ``spec`` (once: a second call answers the same); returns
        the location workers dial. ``spec.bind`` empty: this node's address, any free
        port; a wildcard host: every interface, advertised as this node's address."""
        if self._server is None:
            server = await start_server(ShardServer, self, spec, "a parameter shard's bind address")
            self._server = server
        return self._server.location

    def close_endpoint(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            threading.Thread(target=server.shutdown, daemon=True).start()


# -- the client (in a Spark task, without Ray) ---------------------------------------------


class ShardClient:
    """One shard reached through its endpoint: ``call`` is one ``DoAction`` whose answer
    is the shard method's reply (a refusal is raised as the shard raised it; a call that
    fails on the way, the shard's process ended or unreachable, is an ``EndpointError``
    naming its address)."""

    def __init__(self, address: EndpointAddress) -> None:
        self.address = address
        self._client, self._options = open_client(address)
        self.server_id = handshake(
            self._client,
            address,
            self._options.headers,
            what="the parameter shard endpoint",
            running="the run's parameter shard",
        )

    def call(self, method: str, *args: Any) -> Any:
        action = flight.Action(method, pack(args))
        try:
            (result,) = list(self._client.do_action(action, self._options))
        except flight.FlightError as ex:
            text = str(ex).splitlines()[0] if str(ex) else type(ex).__name__
            raise EndpointError(
                f"the parameter shard endpoint at {self.address.address} failed in {method}: {text}"
            ) from ex
        ok, value = unpack(result.body)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._client.close()
