"""The parameter shards of ``ps.train`` and ``ps.load`` from the driver: how many, their
key ranges, their actor kind (the spare pool's key), starting them (or taking spares),
serving them over the endpoint, and retiring or stopping them. Driver only; the shard
itself is ``coordinator._ps`` (its pure core ``coordinator._shard_core``)."""

from __future__ import annotations

import dataclasses
import math
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from coordinator._flight import EndpointAddress
from coordinator._ps import ShardSpec, shard_class
from coordinator._tables import TableSpec
from coordinator._variables import INLINE_LIMIT

from .._cluster import context as cluster
from .._cluster.placement import ActorKind, actor_class, kill, launch, launch_held
from .._cluster.ray_util import NAMESPACE
from .._cluster.spares import keep_spare, register_warmer, retire_as_spare, spares, take_spares
from .._errors import IterationConfigError
from .._runtime.endpoint import SERVE_TIMEOUT, EndpointPlan
from ._epochs import ShardServingPlan
from ._optim import SGD, Optimizer

__all__ = [
    "PARAMS_PER_SHARD",
    "SPARE_PREFIX",
    "TABLE_SHARDS",
    "keep_shard_spares",
    "launch_shards",
    "launch_table_shards",
    "retire_shards",
    "serve_shards",
    "shard_bounds",
    "shard_kind",
    "start_shards",
    "stop_shards",
    "table_shards",
]


#: ``num_shards=None`` gives each shard about this many parameters (at most ``_MAX_AUTO``).
PARAMS_PER_SHARD = 2_500_000
_MAX_AUTO_SHARDS = 4
#: ``num_shards=None`` with tables: at most this many shards (each its own process) ...
TABLE_SHARDS = 2
#: ... and more than one only when the Ray cluster has CPUs for every task of the run
#: plus this many (the coordinator, the driver, a second shard): else the extra shard
#: only adds a round trip per worker step and a process that competes for the same cores
_SPARE_CPUS_FOR_SHARDS = 4


def table_shards(parallelism: int, cluster_cpus: float) -> int:
    """The shard count of a model with tables under ``num_shards=None`` (before the dense
    part's own rule, ``_shard_bounds``): ``TABLE_SHARDS`` when the cluster's CPUs cover
    the run's ``parallelism`` plus ``_SPARE_CPUS_FOR_SHARDS``, else 1."""
    return TABLE_SHARDS if cluster_cpus >= parallelism + _SPARE_CPUS_FOR_SHARDS else 1


def shard_bounds(size: int, num_shards: int | None) -> list[int]:
    if num_shards is None:
        num_shards = min(_MAX_AUTO_SHARDS, max(1, math.ceil(size / PARAMS_PER_SHARD)))
    cuts = np.linspace(0, size, num_shards + 1).round().astype(int)
    return [int(c) for c in cuts]


def get(calls: list[Any], timeout: float | None = None) -> list[Any]:
    import ray

    return list(ray.get(calls, timeout=timeout))


def launch_shards(
    flat: np.ndarray,
    bounds: Sequence[int],
    optimizer: Optimizer,
    *,
    num_workers: int,
    sync: bool,
) -> tuple[list[str], list[Any]]:
    """Start one shard actor per key range ``[bounds[i], bounds[i + 1])`` of a dense
    model (driver; Ray must be connected); returns their names and handles once every
    one is up."""
    names, handles, _ = _launch(flat, bounds, optimizer, num_workers=num_workers, sync=sync)
    return names, handles


def _launch(
    flat: np.ndarray,
    bounds: Sequence[int],
    optimizer: Optimizer,
    *,
    num_workers: int,
    sync: bool,
    tables: Sequence[TableSpec] = (),
    staleness_steps: int | None = None,
    max_restarts: int = 0,
    key: bytes = b"",
    label: str = "train",
) -> tuple[list[str], list[Any], list[Any]]:
    """``launch_shards`` with tables, a step staleness bound, restarts (then the third
    item holds the creation arguments, to keep while Ray may restart a shard) and the
    checkpoint key."""
    import ray

    names, handles, held, started = start_shards(
        flat,
        bounds,
        optimizer,
        num_workers=num_workers,
        sync=sync,
        tables=tables,
        staleness_steps=staleness_steps,
        max_restarts=max_restarts,
        key=key,
        label=label,
    )
    try:
        ray.get(started)  # started (a bad spec fails here)
    except BaseException:
        stop_shards(handles)
        raise
    return names, handles, held


def start_shards(
    flat: np.ndarray,
    bounds: Sequence[int],
    optimizer: Optimizer,
    *,
    num_workers: int,
    sync: bool,
    tables: Sequence[TableSpec] = (),
    staleness_steps: int | None = None,
    max_restarts: int = 0,
    key: bytes = b"",
    label: str = "train",
    served: bool = False,
) -> tuple[list[str], list[Any], list[Any], list[Any]]:
    """``_launch`` without waiting: the shards are created (named: tasks find them at
    once) and their processes start in the background; the fourth item holds one
    reference per shard that resolves once it is up (or raises why it could not).
    ``served``: shards that can serve their own endpoint (``serve_shards``), whose
    replies always carry the values (no object-store reference: no Ray on the caller)."""
    run_id = uuid.uuid4().hex[:12]
    kind = shard_kind(sync, staleness_steps, served, num_workers, max_restarts)
    # the run's name in the actors' names: findable by it (dashboard, state API)
    tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)[:40] or "train"
    count = len(bounds) - 1
    specs = [
        ShardSpec(
            shard_id=i,
            lo=bounds[i],
            hi=bounds[i + 1],
            init=flat[bounds[i] : bounds[i + 1]],
            rule=optimizer.rule,
            rule_params=optimizer.rule_params(),
            num_workers=num_workers,
            sync=sync,
            tables=tuple(tables),
            num_shards=count,
            token=run_id,
            staleness_steps=staleness_steps,
            run_id=run_id,
            key=key,
            inline_limit=sys.maxsize if served else INLINE_LIMIT,
        )
        for i in range(count)
    ]
    # a shard Ray never restarts may be a spare of its kind (started ahead: the session's
    # warm-up, or the previous run's refill), configured with this run's spec as its
    # constructor would have been; a restart would run the constructor again, with no
    # spec, so shards that may restart are always started here
    pooled: list[Any] = [None] * count
    if not max_restarts:
        pooled = take_spares(kind, "configure", [(spec,) for spec in specs])
    names: list[str] = []
    handles: list[Any] = []
    held: list[Any] = []
    try:
        for i, spec in enumerate(specs):
            if pooled[i] is not None:
                handle, name, _ = pooled[i]
            else:
                name = f"hybrid_iter.ps.{tag}.{run_id}.shard{i}"
                if max_restarts:
                    launched = launch_held(kind, name, spec)
                    handle = launched.handle
                    held.append(launched)
                else:
                    handle = launch(kind, name, spec)
            names.append(name)
            handles.append(handle)
        started = [h.hello.remote() for h in handles]
    except BaseException:
        stop_shards(handles)
        stop_shards([p[0] for p in pooled if p is not None and p[0] not in handles])
        raise
    return names, handles, held, started


#: the name prefix of spare shards (``keep_shard_spares``)
SPARE_PREFIX = "hybrid_iter.ps.spare"


def shard_kind(
    sync: bool,
    staleness_steps: int | None,
    served: bool,
    num_workers: int,
    max_restarts: int = 0,
) -> ActorKind:
    """The actor class and options of a run's shards (the spare pool's key)."""
    # sync mode: an asyncio actor whose pulls wait for a step; async mode: a plain actor,
    # one call at a time with no event loop in between (nothing ever waits there)
    waits = sync or staleness_steps is not None
    concurrency = max(1000, 4 * num_workers + 16) if waits else 1
    return actor_class(
        shard_class(sync, staleness_steps, served=served),
        max_concurrency=concurrency,
        max_restarts=max_restarts,
    )


def keep_shard_spares(kind: ActorKind, count: int) -> list[Any]:
    """Start spare shards of ``kind`` until its pool holds ``count`` (at most
    ``SPARE_POOL``): idle processes the next run of that kind configures (driver; never
    raises, never waits)."""
    return keep_spare(kind, count=count, prefix=SPARE_PREFIX)


def _warm_shards(ctx: cluster.ClusterContext) -> tuple[list[str], list[Any]]:
    """The warm-up's spare shards: of the kind of ``ps.train``'s defaults (sync, through
    Ray, never restarted, every task slot a subtask), as many as a model with tables
    takes by default."""
    import ray

    from spark_ops import available_task_slots

    slots = max(1, available_task_slots(ctx.spark))
    count = table_shards(slots, float(ray.cluster_resources().get("CPU", 0.0)))
    kind = shard_kind(True, None, False, slots)
    started = keep_shard_spares(kind, count)
    return spares(kind), [h.__ray_ready__.remote() for h in started]


register_warmer("shard_spares", 30, _warm_shards)


def serve_shards(
    handles: Sequence[Any], started: Sequence[Any], plan: EndpointPlan
) -> tuple[tuple[EndpointAddress, ...], ShardServingPlan]:
    """Every shard serving its own endpoint (once each is up): the addresses the tasks
    dial, and what the run's coordinator re-serves a restarted shard with (the same
    address: the tasks' plans name it)."""
    import ray

    from .._errors import SessionError

    raise_if_not_started(started)
    spec = plan.spec
    host = spec.bind.rpartition(":")[0] if spec.bind else ""
    first = dataclasses.replace(spec, bind=f"{host}:0" if host else "", advertise=None)
    try:
        locations = ray.get(
            [h.serve_endpoint.remote(first) for h in handles], timeout=SERVE_TIMEOUT
        )
    except ray.exceptions.GetTimeoutError as ex:
        raise SessionError(
            f"the parameter shards did not start serving their endpoints within "
            f"{SERVE_TIMEOUT:g} s: look for the shard actors' errors in Ray's logs"
        ) from ex
    except ray.exceptions.RayTaskError as ex:
        # the server names its own cause (EndpointBindError: the address, the certificate)
        cause = ex.cause if ex.cause is not None else ex
        raise SessionError(
            f"the parameter shards cannot serve their endpoints on "
            f"{first.bind or '<their node>:0'}: "
            f"{(str(cause).splitlines() or [type(cause).__name__])[0]}"
        ) from ex
    specs = []
    for loc in locations:
        hostport = loc.split("://", 1)[-1]
        port = hostport.rpartition(":")[2]
        specs.append(
            dataclasses.replace(
                spec, bind=f"{host or hostport.rpartition(':')[0]}:{port}", advertise=hostport
            )
        )
    addresses = tuple(
        EndpointAddress(loc, spec.token, plan.root_certs, plan.connect_timeout) for loc in locations
    )
    return addresses, ShardServingPlan(tuple(specs), tuple(locations))


#: seconds a failed run waits for its shards' start to learn whether one failed to start
_START_CHECK_TIMEOUT = 60.0


def raise_if_not_started(started: Sequence[Any]) -> None:
    """Raise the error of a shard that could not start (its constructor's), which is the
    cause of a run that failed with it: the tasks only saw the shard gone. Returns when
    every shard started, or when they cannot be asked."""
    import ray

    try:
        ray.get(list(started), timeout=_START_CHECK_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        return
    except ray.exceptions.RayActorError as ex:
        # its message ends with the creation task's exception (the traceback before it)
        lines = [ln.strip() for ln in str(ex).splitlines() if ln.strip()]
        raise IterationConfigError(
            f"a parameter shard could not start: {lines[-1] if lines else type(ex).__name__}"
        ) from ex


def launch_table_shards(
    tables: Sequence[TableSpec], num_shards: int
) -> tuple[str, list[str], list[Any], str]:
    """Shards holding only ``tables`` (a loaded model; driver, in a Session): the Ray
    address, their names, handles and fencing token."""
    from .._cluster.ray_util import connect

    address = cluster.ray_address(what="ps.load")
    connect(address, namespace=NAMESPACE)
    names, handles, _ = _launch(
        np.zeros(0), [0] * (num_shards + 1), SGD(1.0), num_workers=1, sync=False, tables=tables
    )
    token = get([handles[0].hello.remote()])[0][0]
    return address, names, handles, token


def retire_shards(kind: ActorKind, handles: Sequence[Any], names: Sequence[str]) -> None:
    """The shards of a run that ended well, emptied (``forget``) into the spare pool of
    ``kind``; one that declines or cannot be reached is killed (driver; never raises)."""
    for i, (handle, name) in enumerate(zip(handles, names, strict=True)):
        if not retire_as_spare(kind, handle, name, method="forget"):
            kill(handle, f"parameter shard {i}")


def stop_shards(handles: Sequence[Any]) -> None:
    for i, h in enumerate(handles):
        kill(h, f"parameter shard {i}")  # never hides the training's own outcome
