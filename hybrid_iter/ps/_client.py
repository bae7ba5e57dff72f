"""The shards as a worker sees them: one client per Spark task (or per ``transform``
task), and the per-step key plan of the tables.

Runs in Spark tasks. ``StepKeys`` is what a batch references: per key group (the tables
keyed by the same columns share one), the batch's unique ids, each entry's position among
them, and the ids routed to their shards (``coordinator._tables.shard_of``). ``Shards``
moves one step: a pull or fused push per shard carrying the dense slice, the gradient
rows of this step and the ids of the next (whose rows the reply brings).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from coordinator._tables import shard_of
from coordinator._variables import fetch_all

from .._errors import EndpointError, HybridIterError, ShardLost, ShardsUnavailable

__all__ = [
    "FlightShards",
    "RayShards",
    "ShardLinks",
    "Shards",
    "StepKeys",
    "TablePlan",
    "step_keys",
]


@dataclass(frozen=True)
class TablePlan:
    """Tables as the tasks need them: names, dims, key columns, and key groups (tables
    keyed by the same columns: one id set per step). Plain data."""

    names: tuple[str, ...]
    dims: tuple[int, ...]
    columns: tuple[tuple[str, ...], ...]
    group_of: tuple[int, ...]
    groups: tuple[tuple[str, ...], ...]
    #: per table, whether its shards count each id's sightings (admission after N)
    counted: tuple[bool, ...] = ()

    @classmethod
    def of(
        cls,
        tables: Sequence[tuple[str, int, tuple[str, ...]]],
        counted: Sequence[bool] | None = None,
    ) -> TablePlan:
        groups: list[tuple[str, ...]] = []
        group_of = []
        for _, _, cols in tables:
            if cols not in groups:
                groups.append(cols)
            group_of.append(groups.index(cols))
        return cls(
            tuple(t[0] for t in tables),
            tuple(t[1] for t in tables),
            tuple(t[2] for t in tables),
            tuple(group_of),
            tuple(groups),
            tuple(bool(c) for c in counted) if counted is not None else (False,) * len(tables),
        )

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c for g in self.groups for c in g))


@dataclass
class StepKeys:
    """The ids one batch references, per key group: ``uniq[g]`` (unique, in order of
    first appearance), ``positions[g][c]`` (each entry of column ``c`` in ``uniq[g]``),
    and the routing: ``order[g][cuts[g][j]:cuts[g][j + 1]]`` are the positions in
    ``uniq[g]`` of the ids shard ``j`` owns. ``counts[g]``: how many entries hold each
    id (for the tables whose shards count sightings; None where no table of the group
    does)."""

    uniq: list[np.ndarray]
    positions: list[dict[str, np.ndarray]]
    order: list[np.ndarray]
    cuts: list[np.ndarray]
    counts: list[np.ndarray | None] | None = None

    def for_shard(self, plan: TablePlan, j: int) -> tuple[np.ndarray, ...]:
        """Per table, the ids of shard ``j`` (tables of one group share one array)."""
        per_group = [u[o[c[j] : c[j + 1]]] for u, o, c in zip(self.uniq, self.order, self.cuts)]
        return tuple(per_group[g] for g in plan.group_of)

    def counts_for_shard(self, plan: TablePlan, j: int) -> tuple[np.ndarray | None, ...] | None:
        """Per table, the sightings of shard ``j``'s ids (None: a table that does not
        count them); None when no table does."""
        if self.counts is None:
            return None
        per_group = [
            None if n is None else n[o[c[j] : c[j + 1]]]
            for n, o, c in zip(self.counts, self.order, self.cuts)
        ]
        return tuple(
            per_group[g] if counted else None for g, counted in zip(plan.group_of, plan.counted)
        )

    def split(self, plan: TablePlan, t: int, g: np.ndarray, j: int) -> np.ndarray:
        """Table ``t``'s rows ``g`` (aligned with its ids) that shard ``j`` owns."""
        k = plan.group_of[t]
        o, c = self.order[k], self.cuts[k]
        return g[o[c[j] : c[j + 1]]]

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.uniq)


def _factorize(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, uniques)``: uniques in order of first appearance (a hash pass, not a
    sort: ~3x faster than ``np.unique`` on a batch's ids)."""
    import pandas as pd

    codes, uniq = pd.factorize(ids, sort=False)
    return codes.astype(np.int64, copy=False), np.asarray(uniq, dtype=np.int64)


def step_keys(plan: TablePlan, ids: Mapping[str, np.ndarray], num_shards: int) -> StepKeys:
    """The key plan of one batch whose columns hold ``ids`` (by column name)."""
    uniq, positions, order, cuts = [], [], [], []
    counts: list[np.ndarray | None] = []
    counted = {g for g, c in zip(plan.group_of, plan.counted) if c}
    wanted = np.arange(num_shards + 1)
    for g, cols in enumerate(plan.groups):
        parts = [ids[c] for c in cols]
        allids = parts[0] if len(parts) == 1 else np.concatenate(parts)
        codes, u = _factorize(allids)
        bounds = np.cumsum([0] + [len(p) for p in parts])
        positions.append({c: codes[bounds[i] : bounds[i + 1]] for i, c in enumerate(cols)})
        sh = shard_of(u, num_shards)
        o = np.argsort(sh, kind="stable")
        uniq.append(u)
        order.append(o)
        cuts.append(np.searchsorted(sh[o], wanted))
        counts.append(np.bincount(codes, minlength=len(u)) if g in counted else None)
    return StepKeys(uniq, positions, order, cuts, counts if counted else None)


class ShardLinks(Protocol):
    """How a task reaches every shard of a run: one call per shard, all at once."""

    def call(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``method(*args[i])`` on shard ``i`` for every shard, concurrently; their
        replies in shard order. A shard's refusal is raised as itself; a shard whose
        process ended raises ``ShardLost``."""
        ...

    def dense(self, parts: Sequence[tuple[Any, Any]]) -> list[np.ndarray]:
        """The dense values of replies' ``(inline, reference)`` pairs (read-only)."""
        ...


class RayShards:
    """The shard actors reached through Ray (a raylet on this task's host)."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    def call(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        return self.get([getattr(h, method).remote(*a) for h, a in zip(self.handles, args)])

    @staticmethod
    def get(calls: list[Any]) -> list[Any]:
        """The replies of shard calls made through Ray, errors as ``call`` raises them."""
        import ray

        try:
            return list(ray.get(calls))
        except ray.exceptions.RayTaskError as ex:
            if isinstance(ex.cause, HybridIterError):
                # a shard refused the call: its own error (the message says why) is raised
                # as itself; Ray's wrapper adds only the shard's traceback of a refusal
                raise ex.cause from None
            raise
        except ray.exceptions.RayActorError as ex:
            raise ShardLost(
                f"a parameter shard died (its process ended) while this task called it: "
                f"{str(ex).splitlines()[0]}"
            ) from ex

    def dense(self, parts: Sequence[tuple[Any, Any]]) -> list[np.ndarray]:
        import ray

        # one round trip for every shard's object-store reference
        return fetch_all(list(parts), ray.get)


#: this process's clients of shard endpoints, by (location, token): the tasks a Spark
#: Python worker runs one after the other reuse the connections of their run
_CLIENTS: dict[tuple[str, str], Any] = {}
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_LOCK = threading.Lock()


class FlightShards:
    """The shards reached through their own endpoints (``coordinator._ps_endpoint``):
    nothing of Ray in this task. A call to several shards runs on a small thread pool,
    one thread per shard, so a step costs one round trip however many shards."""

    def __init__(self, addresses: Sequence[Any]) -> None:
        from coordinator._ps_endpoint import ShardClient

        self.addresses = list(addresses)
        self.clients = []
        for a in self.addresses:
            key = (a.location, a.token)
            with _LOCK:
                client = _CLIENTS.get(key)
            if client is None:
                client = ShardClient(a)  # checks the address, the token, the version
                with _LOCK:
                    # a Python worker runs one task at a time: another run's clients
                    # (another token) are closed rather than kept for good
                    for old in [k for k in _CLIENTS if k[1] != a.token]:
                        _CLIENTS.pop(old).close()
                    _CLIENTS[key] = client
            self.clients.append(client)

    def _one(self, j: int, method: str, args: tuple[Any, ...]) -> Any:
        try:
            return self.clients[j].call(method, *args)
        except EndpointError as ex:  # on the way: not a refusal of the shard
            raise ShardLost(
                f"parameter shard {j} cannot be called any more (its process ended, or it "
                f"is no longer reachable): {ex}"
            ) from ex

    def call(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        global _POOL

        if len(self.clients) == 1:
            return [self._one(0, method, args[0])]
        with _LOCK:
            if _POOL is None:
                _POOL = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="hi-shards")
            pool = _POOL
        futures = [pool.submit(self._one, j, method, a) for j, a in enumerate(args)]
        return [f.result() for f in futures]

    def dense(self, parts: Sequence[tuple[Any, Any]]) -> list[np.ndarray]:
        out = []
        for inline, ref in parts:
            if ref is not None or inline is None:
                raise ShardsUnavailable(
                    "a parameter shard answered with an object-store reference over the "
                    "endpoint (it was not started to serve one)"
                )
            out.append(inline)
        return out


class Shards:
    """A task's links to every shard, and the calls of a step.

    Dense parameters are key ranges ``bounds`` of one flat vector; tables (``plan``) are
    hash-partitioned. ``token`` fences calls (``coordinator._ps``); it is read from the
    shards when the client is made, after the run's coordinator set it. The shards are
    reached through their endpoints when ``endpoints`` (one ``EndpointAddress`` per
    shard) is given, else through Ray (``handles``, or found by ``names``)."""

    def __init__(
        self,
        names: Sequence[str],
        bounds: Sequence[int],
        dtype: str,
        *,
        sync: bool = True,
        plan: TablePlan | None = None,
        handles: Sequence[Any] | None = None,
        token: str | None = None,
        endpoints: Sequence[Any] | None = None,
    ) -> None:
        self.names = list(names)
        self.link: ShardLinks
        if endpoints is not None:
            self.link = FlightShards(endpoints)
            self.handles: list[Any] = []
        else:
            if handles is None:
                import ray

                from .._cluster.ray_util import NAMESPACE

                handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
            # Any, like start_shards' handles: ray types get_actor's handle as of no class
            self.handles = list(handles)
            self.link = RayShards(self.handles)
        self.bounds = list(bounds)
        self.dtype = np.dtype(dtype)
        self.buffer: np.ndarray | None = None
        self.sync = sync
        self.plan = plan
        if token is None:
            hello = "shard_hello" if endpoints is not None else "hello"
            replies = self.link.call(hello, [()] * len(self.names))
            tokens = {t for t, _, _ in replies}
            if len(tokens) != 1 or None in tokens:
                raise ShardsUnavailable(
                    "the parameter shards are not ready for this task (a shard was "
                    "restarted and not restored yet, or they disagree on the launch): "
                    f"tokens {sorted(map(str, tokens))}"
                )
            token = tokens.pop()
        self.token = token

    def _get(self, calls: list[Any]) -> list[Any]:
        """The replies of calls made through Ray on ``handles`` (the driver's model)."""
        return RayShards.get(calls)

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def dense_size(self) -> int:
        return self.bounds[-1]

    def _assemble(self, replies: list[Any]) -> np.ndarray:
        if self.dense_size == 0:
            return np.zeros(0, dtype=self.dtype)
        parts = self.link.dense([(r[1], r[2]) for r in replies])
        if len(parts) == 1:
            flat = parts[0]
        else:
            if self.buffer is None:
                self.buffer = np.empty(self.bounds[-1], dtype=self.dtype)
            np.concatenate(parts, out=self.buffer)
            flat = self.buffer.view()
        flat.flags.writeable = False
        return flat

    def _tables(self, replies: list[Any], keys: StepKeys) -> list[np.ndarray]:
        """Per table, the values of its rows in the order of its ids."""
        assert self.plan is not None
        out = []
        for t, dim in enumerate(self.plan.dims):
            k = self.plan.group_of[t]
            vals = np.empty((len(keys.uniq[k]), dim))
            o, c = keys.order[k], keys.cuts[k]
            for j, r in enumerate(replies):
                vals[o[c[j] : c[j + 1]]] = r[3][t]
            out.append(vals)
        return out

    def pull(self, epoch: int, step: int, keys: StepKeys | None = None, pid: int = -1) -> Any:
        """The dense parameters before step ``(epoch, step)`` (sync; async: the newest);
        with ``keys``, ``(dense, table values)``, the rows remembered for ``pid``."""
        if keys is None:
            at = (epoch, step) if self.sync else (0, 0)
            return self._assemble(self.link.call("pull", [(*at, self.token)] * self.n))
        plan = self.plan
        assert plan is not None
        calls = [
            (epoch, step, self.token, pid, keys.for_shard(plan, j))
            + ((keys.counts_for_shard(plan, j),) if keys.counts is not None else ())
            for j in range(self.n)
        ]
        replies = self.link.call("pull", calls)
        return self._assemble(replies), self._tables(replies, keys)

    def push(
        self,
        pid: int,
        epoch: int,
        step: int,
        grad: Any,
        rows: float,
        last: bool,
        *,
        keys: StepKeys | None = None,
        table_grads: Sequence[np.ndarray | None] | None = None,
        next_keys: StepKeys | None = None,
        span: int | None = None,
    ) -> Any:
        """Send ``grad`` (flat dense, ``(indices, values)``, or None) and the gradient
        rows of the tables (aligned with ``keys``) to the shards; unless this was the
        epoch's ``last`` step, the parameters of the next step (with ``next_keys``:
        ``(dense, table values)``)."""
        calls = []
        lo_hi = list(zip(self.bounds[:-1], self.bounds[1:]))
        if isinstance(grad, tuple):
            idx, vals = grad
            cuts = np.searchsorted(idx, self.bounds)
        tables = self.plan is not None and (table_grads is not None or next_keys is not None)
        for j, (lo, hi) in enumerate(lo_hi):
            if grad is None or (hi == lo and not isinstance(grad, tuple)):
                part: Any = None
            elif isinstance(grad, tuple):
                a, b = cuts[j], cuts[j + 1]
                part = (idx[a:b] - lo, vals[a:b]) if b > a or hi > lo else None
            else:
                part = grad[lo:hi]
            if not tables:
                msg: tuple[Any, ...] = (pid, epoch, step, part, rows, last, not last, self.token)
            else:
                assert self.plan is not None
                tparts = None
                if table_grads is not None and keys is not None:
                    tparts = tuple(
                        None if g is None else keys.split(self.plan, t, g, j)
                        for t, g in enumerate(table_grads)
                    )
                nk = next_keys.for_shard(self.plan, j) if next_keys is not None else None
                msg = (pid, epoch, step, part, rows, last, not last, self.token, tparts, nk, span)
                if next_keys is not None and next_keys.counts is not None:
                    msg = (*msg, next_keys.counts_for_shard(self.plan, j))
            calls.append((msg,))
        replies = self.link.call("push_packed", calls)
        if last:
            return None
        if tables and next_keys is not None:
            return self._assemble(replies), self._tables(replies, next_keys)
        return self._assemble(replies)

    def lookup(
        self, keys: StepKeys, epoch: int | None = None, step: int = 0
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """The dense parameters and the rows of ``keys`` without creating any (an unknown
        key reads as its initializer's value); sync: once step ``(epoch, step)`` is
        reached."""
        assert self.plan is not None
        calls = [(self.token, keys.for_shard(self.plan, j), epoch, step) for j in range(self.n)]
        replies = self.link.call("lookup_at", calls)
        return self._assemble(replies), self._tables(replies, keys)

    def retire(self, pid: int) -> None:
        self.link.call("retire", [(pid,)] * self.n)
