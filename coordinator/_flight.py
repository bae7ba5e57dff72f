"""The Arrow Flight transport every endpoint of ours shares: the coordinator's
(``_endpoint``), its feedback groups' (``_tree_endpoint``) and the parameter shards'
(``_ps_endpoint``). Each serves its own calls; what they have in common is here, once.

* **Authentication**: every call carries ``authorization: Bearer <token>``; the server's
  middleware refuses a missing or wrong token before any byte of the body is unpickled
  (the body is pickled Python: the token is what stands between the network and the
  server's process, as Ray's token stands in front of Ray's).
* **Version handshake**: every call carries the client's ``PROTOCOL_VERSION``; the
  middleware refuses another one, and the client's first call (``hello``) turns that
  refusal into ``EndpointVersionMismatch`` naming both versions and the address.
* **TLS**: a certificate and key make the server ``grpc+tls``; the client verifies it
  against the root certificates it is given.
* **Binding**: ``start_server`` binds where it is told (this node's address when not
  told), advertises a wildcard bind by the node's address, and a server that cannot
  listen says why (``bind_problem``).

The client side (``open_client``, ``handshake``, ``EndpointAddress``) needs pyarrow and
cloudpickle only: nothing of Ray, nor of py4j.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hmac
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import pyarrow.flight as flight

from ._errors import (
    EndpointAuthError,
    EndpointBindError,
    EndpointError,
    EndpointVersionMismatch,
)

__all__ = [
    "PROTOCOL_VERSION",
    "WILDCARDS",
    "EndpointAddress",
    "EndpointSpec",
    "FlightServing",
    "bind_problem",
    "handshake",
    "open_client",
    "start_server",
    "token_problem",
]

#: the version of what travels over the endpoint; a client and a coordinator of
#: different versions refuse each other (``EndpointVersionMismatch``)
PROTOCOL_VERSION = 2
_AUTH = "authorization"
_PROTOCOL = "x-hybrid-iter-protocol"


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
        # release's server sends, a server of another release included
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
