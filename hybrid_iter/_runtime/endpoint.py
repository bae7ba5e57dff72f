"""The driver's side of the coordinator endpoint (``IterationConfig(transport=...)``).

``EndpointPlan.of`` decides the transport of a run and checks the endpoint's settings
before any job (certificate files read here, on the driver: the coordinator and the
subtasks get their bytes); ``serve`` starts the server in the coordinator actor of each
launch (a coordinator Ray restarted is a new process: it serves again, maybe on another
port) and returns what the subtasks' task plan carries to reach it.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

from coordinator._endpoint import EndpointAddress, EndpointSpec

from .._config import EndpointConfig, IterationConfig
from .._errors import IterationConfigError, SessionError

__all__ = ["NOT_ON_CONNECT", "TOKEN_ENV", "EndpointPlan", "refuse_on_connect"]

#: the driver's environment variable holding the endpoint token (a Kubernetes Secret's)
TOKEN_ENV = "HYBRID_ITER_ENDPOINT_TOKEN"
#: seconds the coordinator may take to start serving
SERVE_TIMEOUT = 120.0


#: what cannot run for a Spark Connect client yet, and why (the tasks of a Connect
#: server reach the coordinator by its endpoint only, never through Ray)
NOT_ON_CONNECT = {
    "Model.transform": (
        "a model with tables scores in Spark tasks that look rows up in its shards through "
        "Ray, which a Spark Connect server's tasks do not have (training reaches the shards "
        "by their endpoints; scoring does not yet)"
    ),
    "Model.to_dataframe": (
        "its Spark tasks read each shard's rows through Ray, which a Spark Connect "
        "server's tasks do not have; Model.save(uri) and Model.lookup(...) run on the driver"
    ),
    "iterate_unbounded_streams": (
        "its micro-batches run in foreachBatch, a Python process of the Spark Connect "
        "server, which the driver's closures, its Ray connection and its coordinator "
        "handle do not reach"
    ),
}


def refuse_on_connect(what: str, spark: Any) -> None:
    """``SessionError`` before any job when ``what`` (a key of ``NOT_ON_CONNECT``) is
    asked of a Spark Connect session."""
    from spark_ops._spark_compat import connect_endpoint, is_connect

    why = NOT_ON_CONNECT.get(what)
    if why is None or not is_connect(spark):
        return
    raise SessionError(
        f"{what} cannot run on the Spark Connect session of {connect_endpoint(spark)}: "
        f"{why}. Run it with a classic SparkSession on the cluster's driver "
        f"(Session.on_spark(spark), or Session.attach(spark, ray_address=...) with Ray "
        f"beside the executors); bounded iterations, the hybrid_iter.ml estimators and "
        f"ps.train do run on Spark Connect"
    )


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as ex:
        raise IterationConfigError(f"EndpointConfig.{what} {path!r} cannot be read: {ex}") from None


@dataclass(frozen=True)
class EndpointPlan:
    """A run's endpoint: what the coordinator serves with and what subtasks dial with."""

    spec: EndpointSpec
    root_certs: bytes | None
    connect_timeout: float

    @classmethod
    def of(cls, config: IterationConfig, spark: Any) -> EndpointPlan | None:
        """The run's endpoint, None when its subtasks use Ray (``transport``)."""
        transport = config.transport
        if transport == "auto":
            from spark_ops._spark_compat import is_connect

            transport = "endpoint" if is_connect(spark) else "ray"
        if transport != "endpoint":
            return None
        ec = config.endpoint or EndpointConfig()
        token = ec.token or os.environ.get(TOKEN_ENV, "").strip() or secrets.token_hex(32)
        cert, key = _read(ec.tls_cert, "tls_cert"), _read(ec.tls_key, "tls_key")
        roots = _read(ec.tls_root_certs, "tls_root_certs") or cert
        spec = EndpointSpec(
            bind=ec.bind or "",
            token=token,
            advertise=ec.advertise,
            tls_cert=cert,
            tls_key=key,
            shared_memory=ec.shared_memory,
        )
        return cls(spec, roots, float(ec.connect_timeout))

    def serve(self, actor: Any) -> EndpointAddress:
        """Start (or find) the endpoint of coordinator ``actor``; the subtasks' address."""
        import ray

        try:
            location = ray.get(actor.serve_endpoint.remote(self.spec), timeout=SERVE_TIMEOUT)
        except ray.exceptions.RayTaskError as ex:
            raise SessionError(
                f"the coordinator cannot serve its endpoint on "
                f"{self.spec.bind or '<its node>:0'}: {str(ex.cause or ex).splitlines()[0]}; "
                f"give EndpointConfig(bind='host:port') an address of the coordinator's "
                f"node with a free port"
            ) from None
        return EndpointAddress(location, self.spec.token, self.root_certs, self.connect_timeout)
