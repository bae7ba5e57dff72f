"""Connecting to Ray on loopback, from the driver and from Spark tasks; the cluster's live
nodes.

On Linux, Ray resolves ``127.0.0.1`` to the host's outward address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` was set before ``ray`` was imported (see
``ray._private.services.get_node_ip_address``); the embedded default must stay on
loopback, so we set it, and flip the already-imported constant when Ray came first.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = ["NAMESPACE", "connect", "force_loopback", "is_loopback_address", "live_nodes"]

NAMESPACE = "hybrid_iter"
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def force_loopback() -> None:
    """Make Ray keep 127.0.0.1 as this node's address (no outward interface)."""
    os.environ[_LOOPBACK_ENV] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    constants: Any = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def is_loopback_address(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def connect(address: str, *, namespace: str = NAMESPACE) -> None:
    """Join the Ray cluster at ``address`` from this process, once (no-op if joined)."""
    loopback = is_loopback_address(address)
    if loopback:
        force_loopback()
    import ray

    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address == address:
            return
        ray.shutdown()
    kwargs: dict[str, Any] = {}
    if loopback:
        kwargs["_node_ip_address"] = "127.0.0.1"
    ray.init(
        address=address,
        namespace=namespace,
        log_to_driver=False,
        logging_level=logging.WARNING,
        **kwargs,
    )


def live_nodes() -> list[dict[str, Any]]:
    """The nodes of the connected Ray cluster that are alive (``ray.nodes()`` lists the
    dead ones too, until the GCS forgets them)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]
