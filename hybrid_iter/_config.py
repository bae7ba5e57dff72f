"""Iteration configuration: a frozen, keyword-only dataclass validated on creation."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, fields
from typing import Any

import storage_uri
from coordinator import RuntimeHooks
from coordinator._flight import token_problem

from ._errors import IterationConfigError

__all__ = [
    "CheckpointConfig",
    "EndpointConfig",
    "IterationConfig",
    "OperatorLifecycle",
    "check_token",
]

#: how subtasks reach their coordinator (``IterationConfig.transport``)
TRANSPORTS = ("auto", "ray", "endpoint")


class OperatorLifecycle(str, enum.Enum):
    """How long an operator instance lives (FLIP-176)."""

    #: One instance per subtask for the whole iteration (the default).
    ALL_ROUND = "all_round"
    #: A fresh instance per epoch; needs every stream it reads to be replayed.
    PER_ROUND = "per_round"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_call_timeout(field: str, value: object) -> None:
    """``call_timeout`` (of ``IterationConfig`` and ``OnlineConfig``): finite seconds > 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise IterationConfigError(
            f"{field} must be a finite number of seconds > 0, got {value!r}; raise it for "
            f"callbacks that legitimately take long"
        )


def _check_uri(field: str, uri: object, *, spark_reads: bool = False) -> str:
    """A location's syntax (and pyarrow's reading of its options), without network;
    the value to keep: a URI as given (Spark's spelling), a plain path made absolute
    here, on the driver (``~`` expanded; the coordinator actor and Spark's tasks run in
    other directories). ``spark_reads``: Spark reads or writes there too."""
    loc = storage_uri.check(uri, what=field, error=IterationConfigError, spark_reads=spark_reads)
    assert isinstance(uri, str)
    return uri if not loc.is_local or uri[:5].lower() == "file:" else loc.path


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of a bounded iteration (docs/fault_tolerance.md).

    Every ``every_epochs`` global alignments the coordinator writes a consistent cut
    (variables, epoch, its state machine, the coordinator operator, every partition
    operator's ``snapshot_state()``) to ``path`` (a local path, made absolute here, or a
    storage URI in Spark's spellings: ``s3a://``, ``gs://``, ``abfss://``, ``hdfs://``,
    ``file:``), atomically and authenticated (docs/fault_tolerance.md), keeping the newest
    ``keep_last``. On a multi-node Ray cluster a local path or ``file:`` URI is refused
    (it would be a different disk on every node) unless ``shared_filesystem=True``
    declares a mount every node sees at the same path.
    """

    path: str
    every_epochs: int = 1
    keep_last: int = 2
    shared_filesystem: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _check_uri("CheckpointConfig.path", self.path))
        if not _is_int(self.every_epochs) or self.every_epochs < 1:
            raise IterationConfigError(
                f"CheckpointConfig.every_epochs must be an int >= 1, got {self.every_epochs!r}"
            )
        if not _is_int(self.keep_last) or self.keep_last < 1:
            raise IterationConfigError(
                f"CheckpointConfig.keep_last must be an int >= 1, got {self.keep_last!r}"
            )
        if not isinstance(self.shared_filesystem, bool):
            raise IterationConfigError(
                f"CheckpointConfig.shared_filesystem must be True or False, got "
                f"{self.shared_filesystem!r}"
            )


#: a host of ``host:port``: a name, an IPv4 address or a bracketed IPv6 one (a zone too)
_HOST = re.compile(
    r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?\]|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*"
)


def _check_hostport(field: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise IterationConfigError(
            f"{field} must be 'host:port' (port 0: any free port), got {value!r}"
        )
    if not _HOST.fullmatch(host):
        raise IterationConfigError(
            f"{field}: {host!r} is not a host name or an IP address (letters, digits, "
            f"'.', '-', '_'; an IPv6 address in brackets: '[::1]:8815'), in {value!r}"
        )


def check_token(field: str, token: str) -> None:
    """A token every endpoint call can carry; the message never shows the token."""
    problem = token_problem(token)
    if problem is not None:
        newline = "U+000A" in problem or "U+000D" in problem
        raise IterationConfigError(
            f"{field} cannot be used: {problem}. Every call to the endpoint carries the "
            f"token in its 'authorization' header; use printable ASCII, e.g. "
            f"secrets.token_hex(32)"
            + (" (a token read from a file: strip its newline)" if newline else "")
        )


def _check_file(field: str, value: object) -> None:
    import os

    if value is None:
        return
    if not isinstance(value, str) or not os.path.isfile(value):
        raise IterationConfigError(f"{field} must be the path of a PEM file, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """The coordinator endpoint (``IterationConfig(transport="endpoint")``): a server in
    the coordinator actor's process that subtasks reach without Ray (docs/design.md, "the seam").

    * ``bind``: ``host:port`` the server listens on, on the coordinator's node (None: that
      node's address, any free port). ``"0.0.0.0:8815"`` listens everywhere.
    * ``advertise``: ``host:port`` the executors dial (a Kubernetes Service, a load
      balancer); None: the bound host and port.
    * ``token``: the shared secret every call carries (in gRPC metadata: printable
      ASCII only); None: ``HYBRID_ITER_ENDPOINT_TOKEN`` of the driver's environment
      (checked alike), else a random one made for each run. It travels to the
      coordinator over Ray and to the subtasks in their task plan.
    * ``tls_cert``, ``tls_key``: PEM files of the server's certificate and key (both or
      neither: TLS on; the key not encrypted); ``tls_root_certs``: what the subtasks
      verify the server's certificate against (default: ``tls_cert``, a self-signed
      certificate). Their contents are checked on the driver when a run plans its
      endpoint, before any job.
    * ``connect_timeout``: seconds a subtask's first call may take before the endpoint
      counts as unreachable.
    * ``shared_memory``: the coordinator also writes each large variables version once
      to a sealed memory file of its process (mode 0600, its size fixed for good), which
      the subtasks on its host, of its user, map read-only instead of streaming it (as
      Ray's object store does); False: every subtask process streams it.
    """

    bind: str | None = None
    advertise: str | None = None
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_root_certs: str | None = None
    connect_timeout: float = 30.0
    shared_memory: bool = True

    def __post_init__(self) -> None:
        _check_hostport("EndpointConfig.bind", self.bind, optional=True)
        if not isinstance(self.shared_memory, bool):
            raise IterationConfigError(
                f"EndpointConfig.shared_memory must be True or False, got {self.shared_memory!r}"
            )
        _check_hostport("EndpointConfig.advertise", self.advertise, optional=True)
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise IterationConfigError("EndpointConfig.token must be a non-empty string or None")
        if self.token is not None:
            check_token("EndpointConfig.token", self.token)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise IterationConfigError(
                "EndpointConfig.tls_cert and tls_key go together: give both (TLS) or neither"
            )
        for name in ("tls_cert", "tls_key", "tls_root_certs"):
            _check_file(f"EndpointConfig.{name}", getattr(self, name))
        if self.tls_root_certs is not None and self.tls_cert is None:
            raise IterationConfigError("EndpointConfig.tls_root_certs needs tls_cert and tls_key")
        _check_call_timeout("EndpointConfig.connect_timeout", self.connect_timeout)


@dataclass(frozen=True, kw_only=True)
class _RunConfig:
    """The fields ``IterationConfig`` and ``OnlineConfig`` share, checked here once for
    both (the messages name the class the user wrote): ``staleness``, ``parallelism``,
    ``progress``, ``progress_tag``, ``inline_variables_bytes``, ``name``, ``hooks``,
    ``call_timeout``. Each class documents what they mean for it."""

    staleness: int | None = 0
    parallelism: int | None = None
    progress: bool | None = None
    progress_tag: str = "loss"
    inline_variables_bytes: int = 64 * 1024
    name: str | None = None
    hooks: RuntimeHooks | None = None
    call_timeout: float = 600.0

    def __post_init__(self) -> None:
        cls = type(self).__name__
        self._check_staleness()
        if self.parallelism is not None and (not _is_int(self.parallelism) or self.parallelism < 1):
            raise IterationConfigError(
                f"{cls}.parallelism must be None (as many tasks as Spark gives) or an "
                f"int >= 1, got {self.parallelism!r}"
            )
        if self.progress is not None and not isinstance(self.progress, bool):
            raise IterationConfigError(
                f"{cls}.progress must be True, False or None, got {self.progress!r}"
            )
        if not isinstance(self.progress_tag, str) or not self.progress_tag:
            raise IterationConfigError(f"{cls}.progress_tag must be a non-empty string")
        if not _is_int(self.inline_variables_bytes) or self.inline_variables_bytes < 0:
            raise IterationConfigError(f"{cls}.inline_variables_bytes must be an int >= 0")
        if self.name is not None and not isinstance(self.name, str):
            raise IterationConfigError(
                f"{cls}.name must be None or a string, got {type(self.name).__name__}"
            )
        if self.hooks is not None and not isinstance(self.hooks, RuntimeHooks):
            raise IterationConfigError(
                f"{cls}.hooks must be None or a RuntimeHooks (e.g. "
                f"hybrid_iter.testing.FaultInjection), got {type(self.hooks).__name__}"
            )
        _check_call_timeout(f"{cls}.call_timeout", self.call_timeout)

    def _check_staleness(self) -> None:
        if self.staleness is not None and (not _is_int(self.staleness) or self.staleness < 0):
            raise IterationConfigError(
                f"{type(self).__name__}.staleness must be 0 (sync), None (async) or a "
                f"positive int (bounded staleness), got {self.staleness!r}"
            )

    def shared_fields(self) -> dict[str, Any]:
        """The values of the shared fields (what an ``OnlineConfig`` takes over from an
        ``IterationConfig``)."""
        return {f.name: getattr(self, f.name) for f in fields(_RunConfig)}


@dataclass(frozen=True, kw_only=True)
class IterationConfig(_RunConfig):
    """How an iteration runs.

    * ``staleness``: ``0`` is sync (global lock step), ``None`` is async (no subtask ever
      waits for another), ``k > 0`` is stale-synchronous (no subtask more than ``k``
      epochs ahead of the slowest).
    * ``max_epochs``: no subtask runs epoch ``max_epochs`` or later; the iteration ends
      at the global alignment of that epoch (``terminated_by == "max_epochs"``).
    * ``parallelism``: the number of subtasks (Spark tasks of the barrier stage);
      ``None`` takes every task slot Spark has.
    * ``operator_lifecycle``: ``ALL_ROUND`` or ``PER_ROUND``.
    * ``progress``: print a live line per epoch (epoch, loss, seconds/epoch); ``None``
      prints only when standard error is a terminal.
    * ``progress_tag``: the output tag whose newest value the progress line shows.
    * ``inline_variables_bytes``: variable versions up to this size travel inside the
      reply to each subtask; larger ones go through the Ray object store once per
      version and are read zero-copy.
    * ``checkpoint``: a ``CheckpointConfig`` (None: no checkpoints).
    * ``resume_from``: a checkpoint directory to continue from (after a driver died).
    * ``max_restarts``: relaunches after a failure (a Spark task, the coordinator); each
      restores the newest checkpoint (or starts over without one). ``None``: 3 with
      checkpoints, 0 without.
    * ``hooks``: a ``RuntimeHooks`` the runtime calls at named points (a coordinator
      alignment, a subtask's watermark); tests pass the fault injections of
      ``hybrid_iter.testing`` here. None (the default): no hooks.
    * ``call_timeout``: seconds a partition operator, a coordinator operator or a
      subtask step may make no progress before the run fails with
      ``IterationFailedError`` naming the partition or operator, the method and the
      epoch (default 600; raise it for callbacks that legitimately take longer). An
      online iteration takes it over (``OnlineConfig.call_timeout``).
    * ``transport``: how subtasks reach the coordinator. ``"ray"``: Ray actor calls and
      the object store (a raylet on every executor's host: ``Session.local``,
      ``on_spark``, ``raydp``); ``"endpoint"``: the coordinator endpoint
      (``endpoint``), nothing of Ray on the executors; ``"auto"`` (default): the
      endpoint for a Spark Connect session, Ray otherwise.
    * ``endpoint``: the ``EndpointConfig`` of ``transport="endpoint"`` (None: defaults).
    """

    max_epochs: int | None = None
    operator_lifecycle: OperatorLifecycle = OperatorLifecycle.ALL_ROUND
    checkpoint: CheckpointConfig | None = None
    resume_from: str | None = None
    max_restarts: int | None = None
    transport: str = "auto"
    endpoint: EndpointConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_epochs is not None and (not _is_int(self.max_epochs) or self.max_epochs < 1):
            raise IterationConfigError(
                f"IterationConfig.max_epochs must be None or an int >= 1, got {self.max_epochs!r}"
            )
        try:
            lifecycle = OperatorLifecycle(self.operator_lifecycle)
        except ValueError as ex:
            raise IterationConfigError(
                f"IterationConfig.operator_lifecycle must be OperatorLifecycle.ALL_ROUND or "
                f"PER_ROUND, got {self.operator_lifecycle!r}"
            ) from ex
        object.__setattr__(self, "operator_lifecycle", lifecycle)
        if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointConfig):
            raise IterationConfigError(
                f"IterationConfig.checkpoint must be a CheckpointConfig(path, ...), got "
                f"{type(self.checkpoint).__name__}"
            )
        if self.resume_from is not None:
            resume = _check_uri("IterationConfig.resume_from", self.resume_from)
            object.__setattr__(self, "resume_from", resume)
        if self.max_restarts is not None and (
            not _is_int(self.max_restarts) or self.max_restarts < 0
        ):
            raise IterationConfigError(
                f"IterationConfig.max_restarts must be None or an int >= 0, got {self.max_restarts!r}"
            )
        if self.transport not in TRANSPORTS:
            raise IterationConfigError(
                f"IterationConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}"
            )
        if self.endpoint is not None and not isinstance(self.endpoint, EndpointConfig):
            raise IterationConfigError(
                f"IterationConfig.endpoint must be an EndpointConfig(...), got "
                f"{type(self.endpoint).__name__}"
            )

    @property
    def restarts(self) -> int:
        """Relaunches allowed after failures."""
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.checkpoint is not None or self.resume_from is not None else 0

    @property
    def mode(self) -> str:
        """``"sync"``, ``"async"`` or ``"ssp"``."""
        if self.staleness == 0:
            return "sync"
        return "async" if self.staleness is None else "ssp"
