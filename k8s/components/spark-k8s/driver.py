"""The Spark driver of the Spark-on-Kubernetes Job (k8s/components/spark-k8s): the example
linear regression, its subtasks reaching the coordinator over the coordinator endpoint.

In the pod, ``spark-submit --master k8s://... --deploy-mode client`` runs this file: the
SparkSession it gets has executor pods, which have no Ray. The pod's sidecar ``ray-node``
has joined the KubeRay cluster, so this process is a Ray driver on a node of its own
(``Session.attach``); the coordinator is placed on the Ray head (its ``hybrid_iter_head``
resource) and serves the endpoint there, which the executors dial through the Service
``hybrid-iter-endpoint``.

Settings, from the environment (the Job's container sets them; k8s/README.md):

* ``HYBRID_ITER_RAY_ADDRESS``: the KubeRay cluster's GCS, ``host:port``. Unset or
  ``local``: the embedded default, ``Session.local`` (what the tests run).
* ``HYBRID_ITER_ENDPOINT_BIND``, ``HYBRID_ITER_ENDPOINT_ADVERTISE``: ``EndpointConfig``'s
  ``bind`` and ``advertise``; ``HYBRID_ITER_ENDPOINT_TLS_CERT``, ``..._TLS_KEY``: the
  server's certificate and key (TLS on). The token: ``HYBRID_ITER_ENDPOINT_TOKEN``, which
  hybrid_iter reads itself (from a Secret in the pod).

Prints one line ``hybrid-iter result: {json}`` and exits 0, or fails with the error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import hybrid_iter as hi
from hybrid_iter.cli import RESULT_PREFIX
from hybrid_iter.example import linear_regression

RAY_ADDRESS = "HYBRID_ITER_RAY_ADDRESS"
BIND = "HYBRID_ITER_ENDPOINT_BIND"
ADVERTISE = "HYBRID_ITER_ENDPOINT_ADVERTISE"
TLS_CERT = "HYBRID_ITER_ENDPOINT_TLS_CERT"
TLS_KEY = "HYBRID_ITER_ENDPOINT_TLS_KEY"


def endpoint_config(environ: Mapping[str, str]) -> hi.EndpointConfig:
    """The run's ``EndpointConfig`` from the container's environment (unset: None)."""

    def get(name: str) -> str | None:
        return environ.get(name) or None

    return hi.EndpointConfig(
        bind=get(BIND), advertise=get(ADVERTISE), tls_cert=get(TLS_CERT), tls_key=get(TLS_KEY)
    )


def open_session(environ: Mapping[str, str]) -> hi.Session:
    """The KubeRay cluster beside the SparkSession spark-submit made, or the embedded
    default."""
    address = environ.get(RAY_ADDRESS) or "local"
    if address == "local":
        return hi.Session.local(warm_up=False)
    from pyspark.sql import SparkSession

    return hi.Session.attach(SparkSession.builder.getOrCreate(), address)


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument(
        "--partitions", type=int, default=None, help="subtasks (default: every task slot)"
    )
    args = parser.parse_args(argv)
    endpoint = endpoint_config(environ)  # bad settings fail here, before Spark or Ray start
    with open_session(environ) as session:
        result: dict[str, Any] = linear_regression(
            session,
            rows=args.rows,
            features=args.features,
            partitions=args.partitions,
            endpoint=endpoint,
        )
        report = {
            "session": session.kind,
            "spark_master": session.spark.sparkContext.master,
            "endpoint": {"bind": endpoint.bind, "advertise": endpoint.advertise},
            "tls": endpoint.tls_cert is not None,
            "result": result,
        }
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
