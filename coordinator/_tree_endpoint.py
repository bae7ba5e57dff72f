"""``feedback_combine``'s group aggregators over Arrow Flight: members' calls without Ray.

Over the coordinator endpoint (``IterationConfig(transport="endpoint")``) each
``GroupAggregator`` actor serves its own Flight endpoint in its own process
(``serve_group``, the same ``FlightServing`` as the coordinator's: the run's token, its
TLS certificate, the protocol version handshake), bound on its node's address. The
coordinator starts them when it starts serving its own endpoint and answers a subtask's
``group_of`` with its group's location; the subtask then makes its ``report`` calls to
that location (``GroupLink``), exactly the calls it makes to a group actor through Ray.
Everything upstream of the groups (the root aggregator, the coordinator's
``report_group``) is unchanged and goes through Ray, inside the coordinator tier: the
merge order, hence the bits of a sync run, are those of the Ray path.

What travels is what travels to the coordinator's endpoint: the call's arguments and its
reply, cloudpickled; a reply's variables were made readable without Ray by the
coordinator (inline, or an ``EndpointRef`` the subtask streams from the coordinator's
endpoint), so the group forwards them untouched.

The client side (``GroupLink``) lives beside the coordinator's client in ``_endpoint``,
whose ``FlightLink.group_of`` makes it: pyarrow and cloudpickle only, nothing of Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pyarrow.flight as flight

from ._flight import PROTOCOL_VERSION, WILDCARDS, EndpointSpec, FlightServing, start_server

__all__ = ["GroupServer", "close_server", "group_spec", "serve_group"]

#: the one call a member makes to its group (``hello`` is the handshake)
_GROUP_CALLS = frozenset({"report"})


def group_spec(spec: EndpointSpec) -> EndpointSpec:
    """What a group serves on, from the coordinator's ``spec``: the same token and TLS,
    any free port (never the coordinator's fixed port, nor its ``advertise``, which names
    that port); every interface when the coordinator binds every interface, else its own
    node's address (a group may run on another node than the coordinator when the
    coordinator tier holds no custom resource)."""
    host = spec.bind.rpartition(":")[0].strip("[]") if spec.bind else ""
    bind = f"{host}:0" if host in WILDCARDS and host else ""
    if host == "::":
        bind = "[::]:0"
    return dataclasses.replace(spec, bind=bind, advertise=None)


class GroupServer(FlightServing):
    """Serves ``group`` (a ``GroupAggregator`` whose coroutines run on ``loop``, the
    actor's event loop) to its members."""

    def __init__(self, group: Any, loop: asyncio.AbstractEventLoop, spec: EndpointSpec) -> None:
        super().__init__(spec)
        self.group, self.loop = group, loop

    def do_action(self, context: Any, action: Any) -> Iterator[bytes]:
        kind = action.type
        if kind == "hello":
            return iter([cloudpickle.dumps((PROTOCOL_VERSION, self.id))])
        if kind not in _GROUP_CALLS:
            raise flight.FlightServerError(f"unknown call {kind!r}")
        args = cloudpickle.loads(action.body.to_pybytes())
        future = asyncio.run_coroutine_threadsafe(getattr(self.group, kind)(*args), self.loop)
        try:
            result = future.result()
        except Exception as ex:  # upstream died: the member fails with the cause
            raise flight.FlightServerError(f"{type(ex).__name__}: {ex}") from ex
        return iter([cloudpickle.dumps(result, protocol=5)])


async def serve_group(group: Any, spec: EndpointSpec) -> GroupServer:
    """Start ``group``'s server in this process, on the running loop (the actor's).
    ``spec.bind`` empty: this node's address, any free port; a wildcard host: every
    interface, advertised as this node's address."""
    server: GroupServer = await start_server(
        GroupServer, group, spec, "a feedback group's bind address"
    )
    return server


def close_server(server: Any) -> None:
    if server is not None:
        threading.Thread(target=server.shutdown, daemon=True).start()
