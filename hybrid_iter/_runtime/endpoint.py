"""The driver's side of the coordinator endpoint (``IterationConfig(transport=...)``).

``EndpointPlan.of`` decides the transport of a run and checks the endpoint's settings
before any job (certificate files read here, on the driver: the coordinator and the
subtasks get their bytes); ``serve`` starts the server in the coordinator actor of each
launch (a coordinator Ray restarted is a new process: it serves again, maybe on another
port) and returns what the subtasks' task plan carries to reach it.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from typing import Any

from coordinator._flight import EndpointAddress, EndpointSpec

from .._config import EndpointConfig, IterationConfig, check_token
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
        raise IterationConfigError(
            f"EndpointConfig.{what} {path!r} cannot be read ({ex.strerror or ex}): give "
            f"the path of a PEM file the driver's user can read"
        ) from ex


def _not_pem(field: str, path: str | None, data: bytes, what: str) -> IterationConfigError:
    """``field`` (file ``path``) does not hold ``what``: say what it seems to hold."""
    text = data.decode("ascii", "replace")
    convert = "openssl pkey" if "key" in what else "openssl x509"
    if not data.strip():
        seems, fix = "empty", "give the path of the PEM file"
    elif "-----BEGIN" not in text and (b"\0" in data or not data.isascii()):
        seems = "binary (DER?)"
        fix = f"convert it to PEM ({convert} -inform DER -in <file> -out <file>.pem)"
    elif "-----BEGIN" not in text:
        seems, fix = "text without a PEM block", "give the path of the PEM file"
    else:
        seems = "PEM of something else (" + ", ".join(sorted(set(_PEM_LABEL.findall(text)))) + ")"
        swapped = field in ("tls_cert", "tls_key") and (
            "PRIVATE KEY" in text or "CERTIFICATE" in text
        )
        fix = "tls_cert and tls_key swapped?" if swapped else "give the file that holds it"
    return IterationConfigError(
        f"EndpointConfig.{field} {path!r} must hold {what}, but it is {seems}: {fix}"
    )


_PEM_LABEL = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----")


def check_tls(
    ec: EndpointConfig, cert: bytes | None, key: bytes | None, roots: bytes | None
) -> None:
    """The TLS files of ``ec`` (``cert``, ``key``, ``roots``: their bytes) as gRPC takes
    them, checked on the driver before any job: a PEM certificate (chain), a PEM private
    key that is not encrypted and belongs to it, PEM root certificates. Each refusal
    names the field, the file and the fix, rather than a server that does not start."""
    import ssl

    if cert is None or key is None:
        return
    labels = set(_PEM_LABEL.findall(cert.decode("ascii", "replace")))
    if "CERTIFICATE" not in labels:
        raise _not_pem("tls_cert", ec.tls_cert, cert, "a PEM certificate (BEGIN CERTIFICATE)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cert.decode("ascii"))
    except (ssl.SSLError, ValueError) as ex:
        raise IterationConfigError(
            f"EndpointConfig.tls_cert {ec.tls_cert!r} holds a PEM block that is not a "
            f"readable certificate ({ex}): give the certificate file as issued"
        ) from ex
    labels = set(_PEM_LABEL.findall(key.decode("ascii", "replace")))
    if "ENCRYPTED PRIVATE KEY" in labels or b"Proc-Type: 4,ENCRYPTED" in key:
        raise IterationConfigError(
            f"EndpointConfig.tls_key {ec.tls_key!r} is an encrypted private key, which the "
            f"endpoint's server cannot use (it has no passphrase to ask for): give it "
            f"decrypted (openssl pkey -in key.pem -out key-plain.pem), readable by the "
            f"driver's user only"
        )
    if not any(label.endswith("PRIVATE KEY") for label in labels):
        raise _not_pem("tls_key", ec.tls_key, key, "a PEM private key (BEGIN PRIVATE KEY)")

    def no_passphrase() -> str:
        raise IterationConfigError(f"EndpointConfig.tls_key {ec.tls_key!r} asks for a passphrase")

    assert ec.tls_cert is not None and ec.tls_key is not None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            ec.tls_cert, ec.tls_key, password=no_passphrase
        )
    except ssl.SSLError as ex:
        mismatch = ex.reason == "KEY_VALUES_MISMATCH"  # OpenSSL's reason code, not its text
        why = (
            "is not the private key of the certificate in"
            if mismatch
            else f"cannot be used with ({ex}) the certificate in"
        )
        raise IterationConfigError(
            f"EndpointConfig.tls_key {ec.tls_key!r} {why} tls_cert {ec.tls_cert!r}: give "
            f"the key the certificate was issued for"
        ) from ex
    if roots is not None and roots is not cert:
        if "CERTIFICATE" not in set(_PEM_LABEL.findall(roots.decode("ascii", "replace"))):
            raise _not_pem(
                "tls_root_certs", ec.tls_root_certs, roots, "PEM certificates (BEGIN CERTIFICATE)"
            )
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
                cadata=roots.decode("ascii")
            )
        except (ssl.SSLError, ValueError) as ex:
            raise IterationConfigError(
                f"EndpointConfig.tls_root_certs {ec.tls_root_certs!r} holds a PEM block "
                f"that is not a readable certificate ({ex})"
            ) from ex


def _env_token() -> str | None:
    """``HYBRID_ITER_ENDPOINT_TOKEN`` of the driver's environment (surrounding
    whitespace stripped), checked as ``EndpointConfig.token`` is; None when unset."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        return None
    check_token(f"the environment variable {TOKEN_ENV}", token)
    return token


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
        token = ec.token or _env_token() or secrets.token_hex(32)
        cert, key = _read(ec.tls_cert, "tls_cert"), _read(ec.tls_key, "tls_key")
        roots = _read(ec.tls_root_certs, "tls_root_certs") or cert
        check_tls(ec, cert, key, roots)
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
            # the server names its own cause (EndpointBindError: the port, the address,
            # the certificate); anything else is reported as it came
            cause = ex.cause if ex.cause is not None else ex
            said = (str(cause).splitlines() or [type(cause).__name__])[0]
            raise SessionError(
                f"the coordinator cannot serve its endpoint on "
                f"{self.spec.bind or '<its node>:0'}: {said}"
            ) from ex
        return EndpointAddress(location, self.spec.token, self.root_certs, self.connect_timeout)
