"""The long-lived actors (the coordinator, the online coordinator, PS shards): where they
go, and the one way they are launched and killed (``actor_class``, ``launch``, ``kill``).

Runs on the driver, when an actor is launched. Those actors hold the run's state (the
variables, the epoch, the parameter shards); a Spark executor lost with its node is
replaced and its task retried, but losing the node that hosts the coordinator loses the
run (or, with checkpoints, costs a restore). So they go to the Ray *head* node, which a
cluster cannot lose without losing everything anyway, unless told otherwise:

1. ``coordinator_resources`` of the current cluster context (``Session.raydp(...,
   coordinator_resources={...})`` / ``Session.attach``), else the environment variable
   ``HYBRID_ITER_COORDINATOR_RESOURCES`` (a JSON object; ``{}`` means anywhere): Ray
   custom resources the actors ask for, a small fraction each;
2. else, when a live node advertises the custom resource ``hybrid_iter_head`` (the
   manifests in ``k8s/`` set it on the head: ``rayStartParams.resources``), that one;
3. else, asked for the driver's node (``Session.on_spark``: Ray on Spark starts its head
   beside the driver, and a joined cluster is reached through the driver's node), that
   node: Ray's head resource when it is the head, else its ``node:<ip>`` resource;
4. else Ray's own ``node:__internal_head__`` resource, which only the head node has;
5. on a single-node Ray (``Session.local``) nothing is asked: there is nowhere else.

This rule is written here only; the tree's aggregators go where the coordinator went
(``CoordinatorSpec.placement``).

The actors take ``num_cpus=0``, so a fraction of a resource is all they hold, and the
head may advertise ``num-cpus: 0`` (keeping Spark executors, which need CPUs, on the
workers). A requested resource that no live node offers is a ``SessionError`` here, not
an actor pending forever.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from .._errors import SessionError
from .ray_util import live_nodes

log = logging.getLogger(__name__)

__all__ = [
    "COORDINATOR_RESOURCES_ENV",
    "HEAD_RESOURCE",
    "RAY_HEAD_RESOURCE",
    "SHARE",
    "ActorKind",
    "Launched",
    "actor_class",
    "check_resources",
    "coordinator_actor_options",
    "coordinator_resources",
    "head_node",
    "kill",
    "launch",
    "launch_held",
]

#: The custom resource the k8s manifests put on the head node (also RayDP's app master's).
HEAD_RESOURCE = "hybrid_iter_head"
#: Ray's built-in resource of the head node (Ray >= 2.9).
RAY_HEAD_RESOURCE = "node:__internal_head__"
COORDINATOR_RESOURCES_ENV = "HYBRID_ITER_COORDINATOR_RESOURCES"
#: How much of the resource each actor holds: many actors fit one unit.
SHARE = 0.001


def check_resources(value: Any, where: str) -> dict[str, float]:
    """``{name: amount > 0}`` or ``SessionError`` naming ``where``."""
    if not isinstance(value, Mapping):
        raise SessionError(
            f"{where} must be a mapping of Ray resource names to amounts, e.g. "
            f'{{"{HEAD_RESOURCE}": 0.001}}, got {type(value).__name__}'
        )
    out: dict[str, float] = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise SessionError(f"{where}: resource names are non-empty strings, got {name!r}")
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise SessionError(
                f"{where}: {name!r} is not a placement resource (the actors use num_cpus=0); "
                f"name a custom resource a node advertises, e.g. {HEAD_RESOURCE!r}"
            )
        if (
            isinstance(amount, bool)
            or not isinstance(amount, (int, float))
            or not 0 < amount < math.inf
        ):
            raise SessionError(f"{where}[{name!r}] must be a number > 0, got {amount!r}")
        out[name] = float(amount)
    return out


def _configured() -> dict[str, float] | None:
    from .context import current

    ctx = current()
    if ctx is not None and ctx.coordinator_resources is not None:
        return dict(ctx.coordinator_resources)
    text = os.environ.get(COORDINATOR_RESOURCES_ENV, "").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as ex:
        raise SessionError(
            f"{COORDINATOR_RESOURCES_ENV} must be a JSON object such as "
            f'{{"{HEAD_RESOURCE}": 0.001}} ({{}} = any node), got {text!r}: {ex}'
        ) from ex
    return check_resources(value, COORDINATOR_RESOURCES_ENV)


def coordinator_resources(*, driver_node: bool = False) -> dict[str, float]:
    """The Ray resources the coordinator-tier actors ask for (driver; Ray connected).
    ``driver_node``: rule 3 of the module docstring (the driver's node) applies."""
    import ray

    nodes = live_nodes()
    offered: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.get("Resources", {}).items():
            offered[name] = max(offered.get(name, 0.0), amount)
    wanted = _configured()
    if wanted is not None:
        missing = {k: v for k, v in wanted.items() if offered.get(k, 0.0) < v}
        if missing:
            raise SessionError(
                f"coordinator_resources {missing} (Session or {COORDINATOR_RESOURCES_ENV}): no "
                f"live node of the Ray cluster offers that much, so the coordinator would "
                f"wait forever; give a node the resource (`ray start --resources`, KubeRay "
                f"rayStartParams.resources) or change the setting"
            )
        return wanted
    if HEAD_RESOURCE in offered:
        return {HEAD_RESOURCE: SHARE}
    if driver_node:
        mine = ray.get_runtime_context().get_node_id()
        for n in nodes:
            if n["NodeID"] == mine:
                if RAY_HEAD_RESOURCE in n.get("Resources", {}):
                    return {RAY_HEAD_RESOURCE: SHARE}
                return {f"node:{n['NodeManagerAddress']}": SHARE}
    if len(nodes) <= 1:
        return {}  # one node: nowhere else to go
    if RAY_HEAD_RESOURCE in offered:
        return {RAY_HEAD_RESOURCE: SHARE}
    return {}  # pragma: no cover - every Ray >= 2.9 head has it


def head_node(nodes: list[dict[str, Any]]) -> str | None:
    """The address of the head among ``ray.nodes()``' live ``nodes`` (None: none)."""
    for n in nodes:
        if n.get("Alive") and RAY_HEAD_RESOURCE in n.get("Resources", {}):
            return str(n["NodeManagerAddress"])
    return None


def coordinator_actor_options() -> dict[str, Any]:
    """Keyword arguments for ``ray.remote(...)`` of a coordinator-tier actor."""
    resources = coordinator_resources()
    return {"resources": resources} if resources else {}


#: ``ray.remote(cls, ...)`` per class and creation-only options: Ray exports an actor
#: class (pickles it and disassembles its code for a collision check, ~0.1 s) each time
#: a *new* ``ray.remote`` class is first launched, so it is made once per process and
#: the per-run options go through ``.options`` (Ray re-exports it by itself to a new
#: Ray session)
_REMOTE_CLASSES: dict[tuple[type, tuple[tuple[str, Any], ...]], Any] = {}


class ActorKind:
    """A coordinator-tier actor class with its options: ``.options(name=..., ...)``
    gives what ``.remote(*args)`` starts (``launch``)."""

    def __init__(self, remote_cls: Any, options: Mapping[str, Any]) -> None:
        self._remote_cls, self._options = remote_cls, dict(options)

    def options(self, **more: Any) -> Any:
        return self._remote_cls.options(**self._options, **more)


def actor_class(
    cls: type,
    *,
    max_restarts: int = 0,
    concurrency_groups: Mapping[str, int] | None = None,
    **options: Any,
) -> ActorKind:
    """``cls`` as a Ray actor class of the coordinator tier: no CPU of its own, placed by
    ``coordinator_actor_options``, no task retries (a retried call could apply an update
    twice), restarted ``max_restarts`` times after its process died (only runs with
    checkpoints restart: a restarted actor reloads the newest one)."""
    import ray

    fixed = tuple(sorted((concurrency_groups or {}).items()))
    key = (cls, fixed)
    remote_cls = _REMOTE_CLASSES.get(key)
    if remote_cls is None:
        # ray's remote(**options) overload lists task options only, not concurrency_groups
        remote_cls = _REMOTE_CLASSES[key] = ray.remote(  # type: ignore[call-overload]
            num_cpus=0, max_task_retries=0, concurrency_groups=dict(fixed) or None
        )(cls)
    return ActorKind(
        remote_cls,
        {"max_restarts": max_restarts, **options, **coordinator_actor_options()},
    )


class Launched:
    """A started actor and what it was created from: ``handle``, and ``args``, the
    object-store references of its creation arguments, held by the driver for as long
    as the actor may be restarted. Ray restarts a dead actor by running its creation
    task again, which reads those arguments again; an argument larger than Ray's inline
    limit (100 KiB) that nobody holds is gone by then, and the restart fails with
    ``ReferenceCountingAssertionError``."""

    def __init__(self, handle: Any, args: tuple[Any, ...]) -> None:
        self.handle, self.args = handle, args


def launch(actor_cls: Any, name: str, *args: Any) -> Any:
    """Start one named actor of ``actor_class`` in hybrid_iter's namespace (tasks find it
    by name); returns its handle. For an actor Ray may restart use ``launch_held``."""
    from .ray_util import NAMESPACE

    return actor_cls.options(name=name, namespace=NAMESPACE).remote(*args)


def launch_held(actor_cls: Any, name: str, *args: Any) -> Launched:
    """``launch``, with every creation argument put into the object store first and the
    references kept in the returned ``Launched``: keep it while the actor may restart."""
    import ray

    refs = tuple(ray.put(a) for a in args)
    return Launched(launch(actor_cls, name, *refs), refs)


def kill(handle: Any, what: str) -> None:
    """Kill an actor for good (no restart); never raises, so the error being raised or
    the result being returned is never hidden by a failed kill."""
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception as ex:
        log.warning("could not kill %s: %s", what, ex)
