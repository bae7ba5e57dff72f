"""Ray addresses, and joining a running Ray cluster from this driver: the checks an
address gets before anything starts, a probe that answers within a bound (``ray.init``
itself retries an unreachable GCS for minutes), and ``join_ray``. Runs on the driver.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping

from .._errors import SessionError
from .ray_util import NAMESPACE, force_loopback, is_loopback_address, live_nodes

__all__ = [
    "ADDRESS_ENV_VARS",
    "AUTH_HINT",
    "DEFAULT_CONNECT_TIMEOUT",
    "check_offered",
    "check_ray_address",
    "join_ray",
    "probe_ray_cluster",
    "ray_address_from_env",
]

#: Where ``Session.raydp(address=None)`` and ``hybrid-iter run --session raydp`` look for
#: the Ray cluster, in order: ours, then Ray's own (``ray job submit`` sets it for the
#: entrypoint to the cluster's GCS address).
ADDRESS_ENV_VARS = ("HYBRID_ITER_RAY_ADDRESS", "RAY_ADDRESS")
#: Seconds to reach a Ray cluster's GCS before giving up with a SessionError.
DEFAULT_CONNECT_TIMEOUT = 30.0
SUBMIT_HINT = (
    "run the driver on the cluster instead: `ray job submit --address http://<head>:8265 "
    "-- hybrid-iter run MODULE:FUNCTION --session raydp` (Ray Jobs set RAY_ADDRESS for it), "
    "or a KubeRay RayJob"
)
AUTH_HINT = (
    "the cluster requires Ray token authentication: set RAY_AUTH_MODE=token and the "
    "cluster's token in RAY_AUTH_TOKEN (or a file named by RAY_AUTH_TOKEN_PATH, default "
    "~/.ray/auth_token) in this process's environment; on KubeRay the token is key "
    "auth_token of the Secret named after the RayCluster, and jobs submitted with `ray job "
    "submit` or a RayJob get it from the head"
)


def _auth_refused(ex: BaseException) -> bool:
    """A Ray cluster refused this process' token (``ray.exceptions.AuthenticationError``,
    Ray >= 2.52; older Rays have no token authentication)."""
    import ray.exceptions

    refused = getattr(ray.exceptions, "AuthenticationError", None)
    return refused is not None and isinstance(ex, refused)


def check_ray_address(address: str, where: str = "address") -> str:
    """The address as given, or ``SessionError`` when it cannot work (driver).

    Spark's driver and executors join the cluster's GCS directly: Ray Client addresses
    (``ray://``) and dashboard URLs (``http://``, what ``ray job submit`` takes) cannot.
    """
    text = address.strip()
    if not text:
        raise SessionError(f"{where} must not be empty: give host:port of the GCS, auto or local")
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme == "ray":
        raise SessionError(
            f"{where}={text!r} is a Ray Client address; Spark on Ray needs the driver on a "
            f"node of the cluster, joining its GCS (host:6379) directly: {SUBMIT_HINT}"
        )
    if scheme in ("http", "https"):
        raise SessionError(
            f"{where}={text!r} is a Ray dashboard / job-submission URL, not a GCS address; "
            f"{SUBMIT_HINT}"
        )
    if scheme:
        raise SessionError(
            f"{where}={text!r}: unknown scheme {scheme!r}; give host:port of the GCS, auto or local"
        )
    if text not in ("auto", "local"):
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SessionError(
                f"{where}={text!r} is not host:port of a Ray GCS (e.g. 10.0.0.5:6379), auto "
                f"(the cluster of this node) or local (an embedded Ray)"
            )
    return text


def ray_address_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``(address, variable)`` from ``HYBRID_ITER_RAY_ADDRESS`` then ``RAY_ADDRESS``."""
    environ = os.environ if environ is None else environ
    for name in ADDRESS_ENV_VARS:
        value = environ.get(name, "").strip()
        if value:
            return check_ray_address(value, name), name
    return None


def probe_ray_cluster(address: str, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> str:
    """Check that a Ray GCS answers at ``address`` and lets this process in (driver).

    Returns the GCS ``host:port`` (``auto`` resolved). Raises ``SessionError`` naming
    the address and what to check, within about ``timeout`` seconds: ``ray.init`` itself
    retries an unreachable GCS for minutes and reports a token-protected cluster as a
    bare ``ConnectionError`` after ~20 s.
    """
    deadline = time.monotonic() + timeout
    from ray._private import services

    if address == "auto":
        try:
            gcs = services.canonicalize_bootstrap_address_or_die("auto")
        except (ConnectionError, ValueError) as ex:
            raise SessionError(
                f"Ray address 'auto': no Ray cluster found on this node ({ex}); run on a "
                f"node of the cluster (where `ray start` ran), or give host:port of its GCS"
            ) from ex
    else:
        gcs = address
    host, _, port = gcs.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=min(10.0, timeout)):
            pass
    except OSError as ex:
        raise SessionError(
            f"no Ray cluster reachable at {gcs} ({type(ex).__name__}: {ex}); check the "
            f"address (host:port of the head's GCS, port 6379 by default; `ray status "
            f"--address {gcs}` on a cluster node), that the cluster is up, and that no "
            f"firewall or NetworkPolicy blocks this host"
        ) from ex

    # The GCS client retries in C++ for up to a minute; ask from a thread and stop waiting
    # at the deadline (the thread ends on its own; it holds nothing of ours).
    outcome: dict[str, BaseException | None] = {}

    def ask() -> None:
        try:
            # a Cython class that ray's _raylet.pyi does not declare
            from ray._raylet import GcsClient  # type: ignore[attr-defined]

            GcsClient(address=gcs).internal_kv_get(b"hybrid_iter_probe", None, timeout=5)
            outcome["error"] = None
        except BaseException as ex:  # reported to the caller below
            outcome["error"] = ex

    thread = threading.Thread(target=ask, name="hybrid_iter-ray-probe", daemon=True)
    thread.start()
    thread.join(max(0.1, deadline - time.monotonic()))
    if "error" not in outcome:
        raise SessionError(
            f"something accepts connections at {gcs} but no Ray GCS answered within "
            f"{timeout:.0f}s; check that the address is the head's GCS port (6379 by "
            f"default), not the dashboard (8265) or client (10001) port"
        )
    error = outcome["error"]
    if error is not None:
        if _auth_refused(error):
            raise SessionError(
                f"the Ray cluster at {gcs} refused this driver: {AUTH_HINT}"
            ) from error
        raise SessionError(
            f"the Ray GCS at {gcs} did not answer: {type(error).__name__}: {error}; check "
            f"that the cluster is healthy (`ray status --address {gcs}`)"
        ) from error
    return gcs


def check_offered(resources: Mapping[str, float], owns_ray: bool) -> None:
    """Fail at session start, not at the first iteration, on a resource nobody offers."""
    import ray

    offered: dict[str, float] = {}
    for node in live_nodes():
        for name, amount in node.get("Resources", {}).items():
            offered[name] = max(offered.get(name, 0.0), amount)
    missing = {k: v for k, v in resources.items() if offered.get(k, 0.0) < v}
    if missing:
        if owns_ray:
            ray.shutdown()
        raise SessionError(
            f"coordinator_resources {missing}: no live node of the Ray cluster offers that "
            f"much (nodes offer {sorted(k for k in offered if not k.startswith('node:'))}); "
            f"give a node the resource (`ray start --resources`, KubeRay "
            f"rayStartParams.resources) or change coordinator_resources"
        )


def join_ray(address: str, connect_timeout: float) -> None:
    """``ray.init`` to an existing cluster, after the probe; Ray's errors as SessionError."""
    import ray

    gcs = probe_ray_cluster(address, connect_timeout)
    if is_loopback_address(gcs):
        force_loopback()
    try:
        ray.init(address=gcs, namespace=NAMESPACE, logging_level=logging.WARNING)
    except Exception as ex:
        hint = (
            AUTH_HINT
            if _auth_refused(ex)
            else ("a driver must run on a node of the cluster; " + SUBMIT_HINT)
        )
        raise SessionError(
            f"could not join the Ray cluster at {gcs}: {type(ex).__name__}: {ex}; {hint}"
        ) from ex
