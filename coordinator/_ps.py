"""Parameter-server shards: one key range of a flat parameter vector and its update rule.

Written as a plain class; ``hybrid_iter.ps`` makes it an async Ray actor
(``ray.remote(num_cpus=0)``) where it launches it, one per shard. Spark tasks call the
shards directly (not through the iteration's coordinator, which keeps only the epoch
accounting, the losses, termination and bounded-staleness gating).

Protocol of a worker (one subtask) in epoch ``e``, steps ``s = 0 .. S_p - 1``:
``pull(e, 0)``, then per step ``push(pid, e, s, grad, rows, last=(s == S_p - 1),
pull_next=not last)``, whose reply is the parameters for step ``s + 1``. A worker with no
step in an epoch (no rows) sends ``push(pid, e, 0, None, 0, last=True)``.

* **sync**: step ``(e, s)`` is applied once every worker that takes part in it has
  pushed (a worker whose epoch has fewer steps is done once it pushed ``last``), with the
  workers' mean gradients weighted by their rows and summed in worker order, so results
  are deterministic; ``pull(e, s)`` waits for exactly the parameters before step
  ``(e, s)``. Epoch ``e`` ends when every worker's last step is applied.
* **async**: every push is applied on arrival (the worker's own mean gradient); a pull
  returns the newest parameters.

Sync mode materialises each version at most once for the workers: inline in the reply
when small, else put once into the object store (``put``) and read zero-copy by every
task on the node. Async mode (``FreeShard``) sends a large version's first pull as the
array itself (most versions are pulled once there) and puts a version pulled again. Gradients arrive dense (an array of the shard's length) or sparse
(``(indices, values)`` with sorted, unique indices local to the shard).

**Tables** (``ShardSpec.tables``): besides its dense key range a shard holds the rows of
every sparse table whose keys hash to it (``coordinator._tables.shard_of``). A pull or
push may carry, per table, the keys of the worker's next step: the shard finds (on first
touch: creates) their rows, remembers them for that worker, and the reply carries their
values; the worker's next push carries the gradient rows in the same order (no keys
again). So each step is one call per shard that moves only the batch's rows.

**Fencing**: every call of a worker carries the shards' ``token``; a reset or restore
(``reset``, ``restore_checkpoint``: the run's coordinator after a failure) sets a new
token, so a task of a failed launch still running cannot change the restored state
(``StaleShardCall``). A shard that Ray restarted after its process died accepts no
worker call until it is restored or reset.

**Checkpoints**: ``save_checkpoint`` writes the whole shard (dense range, every table's
rows and optimizer state, the step bookkeeping) as one sealed record (the authenticated
container of ``coordinator._checkpoint``); ``restore_checkpoint`` reads it back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._checkpoint import CheckpointStore, read_record, write_record
from ._errors import (
    CheckpointCorrupt,
    CheckpointError,
    IterationConfigError,
    NonFiniteGradient,
    StaleShardCall,
    UsageError,
)
from ._finite import first_nonfinite
from ._ps_endpoint import ShardServing
from ._rules import AdagradRule, AdamRule, FTRLRule, SGDRule, _Scratch, make_rule
from ._shell import import_ahead, was_reconstructed
from ._table_io import read_part, write_part
from ._tables import Table, TableSpec, shard_of
from ._variables import INLINE_LIMIT, OncePerVersion

__all__ = [
    "AdagradRule",
    "AdamRule",
    "FTRLRule",
    "FreeShard",
    "ParameterShard",
    "SGDRule",
    "ShardSpec",
    "make_rule",
    "shard_class",
]


@dataclass(frozen=True)
class ShardSpec:
    """What one shard needs: its key range, initial values, update rule, worker count;
    with tables, their specs and the shard count (the hash routing), the fencing token
    of the first launch, the step staleness bound (async), the checkpoint key and the
    run it belongs to."""

    shard_id: int
    lo: int
    hi: int
    init: np.ndarray
    rule: str
    rule_params: Mapping[str, float]
    num_workers: int
    sync: bool
    inline_limit: int = INLINE_LIMIT
    extra: Mapping[str, Any] = field(default_factory=dict)
    tables: tuple[TableSpec, ...] = ()
    num_shards: int = 1
    token: str | None = None
    staleness_steps: int | None = None
    run_id: str = ""
    key: bytes = field(default=b"", repr=False)


#: a step's table part as the shard keeps it: per table, (rows, gradient rows) or None
_TableParts = list[tuple[np.ndarray, np.ndarray] | None]


class _ShardCore:
    """One shard's state and update logic, without waiting (no coroutine: Ray makes a
    class with any ``async def`` an asyncio actor, so the two shells below differ only
    in ``pull``/``push``)."""

    spec: ShardSpec
    #: an idle process no run has configured (started ahead, or ``forget`` after a run)
    _spare = False

    def __init__(
        self,
        spec: ShardSpec | None,
        put: Callable[[Any], Any] | None = None,
        *,
        warm: Sequence[str] = (),
    ) -> None:
        """``spec`` None: a spare, an idle process started ahead of need (its start is
        the slow part of a launch) with the modules ``warm`` imported; ``configure``
        makes it a run's shard."""
        if spec is not None:
            self._setup(spec, put)
            return
        self._spare = True
        import_ahead(warm)

    def configure(self, spec: ShardSpec) -> tuple[str | None, int, int]:
        """Make a spare the shard of ``spec``, exactly as the constructor would have (once
        per run; only for shards Ray never restarts: a restart would run the constructor
        again, as a spare); returns ``hello()``."""
        if not self._spare:
            raise UsageError("this parameter shard is configured already")
        if was_reconstructed():
            raise UsageError("a restarted spare parameter shard cannot take a run")
        self._setup(spec, None)
        return self.hello()

    def _setup(self, spec: ShardSpec, put: Callable[[Any], Any] | None) -> None:
        if put is None:
            try:
                import ray

                put = ray.put if ray.is_initialized() else None
            except ImportError:  # pragma: no cover - ray is a dependency
                put = None
        self._spare = False
        self.spec = spec
        self._put = put
        self.stats = {
            "pushes": 0,
            "updates": 0,
            "pulls": 0,
            "puts": 0,
            "apply_seconds": 0.0,
            "calls": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "lookups": 0,
            "restores": 0,
            "gate_waits": 0,
            "max_lead": 0,
            "endpoint_calls": 0,
        }
        self._fresh()
        # a shard Ray restarted after its process died holds nothing of the run: no
        # worker call is taken until the run's coordinator restores or resets it
        self.restarted = was_reconstructed()
        self.token = None if self.restarted else spec.token
        # what the last reset replaced: a restore right after it reports that
        self._replaced: tuple[bool, int, dict[int, tuple[int, int]]] | None = None

    def _fresh(self) -> None:
        """The state of a new shard: initial dense values, empty tables, step 0."""
        spec = self.spec
        self._refs = OncePerVersion(self._put, spec.inline_limit)
        self.w = np.array(spec.init, copy=True)
        if self.w.shape != (spec.hi - spec.lo,):
            raise IterationConfigError(
                f"shard {spec.shard_id}: {self.w.shape} initial values for keys "
                f"[{spec.lo}, {spec.hi})"
            )
        self.rule = make_rule(spec.rule, spec.rule_params, len(self.w), self.w.dtype)
        self.tables = [
            Table(t, make_rule(t.rule, t.rule_params, 0, np.dtype(np.float64))) for t in spec.tables
        ]
        # sync steps with several pushes sum them here (reused: no fresh array per step)
        self._acc = _Scratch(len(self.w), self.w.dtype)
        self._part = _Scratch(len(self.w), self.w.dtype)
        self.version = 0
        # sync bookkeeping: the next step to apply, pushes per step, last steps per epoch
        self.epoch = 0
        self.step = 0
        self._pushes: dict[tuple[int, int], dict[int, tuple[Any, float, _TableParts | None]]] = {}
        self._steps: dict[int, dict[int, int]] = {}
        self._waiters: list[tuple[tuple[int, int], asyncio.Future[None]]] = []
        # tables: the rows last sent to each worker, per table (its next push's rows)
        self._sent: dict[int, list[np.ndarray | None]] = {}
        # each worker's (epoch, step) after its last push, and its steps per epoch
        self.positions: dict[int, tuple[int, int]] = {}
        self._spans: dict[int, int] = {}
        self._retired: set[int] = set()
        self._gates: list[tuple[int, asyncio.Future[None]]] = []

    # -- calls from the driver and the coordinator ----------------------------------------

    def values(self) -> np.ndarray:
        return self.w

    def hello(self) -> tuple[str | None, int, int]:
        """``(token, shard id, process id)``: what a worker needs to call this shard, and
        where it runs (to find its process from outside)."""
        import os

        return self.token, self.spec.shard_id, os.getpid()

    def info(self, top: int = 0) -> dict[str, Any]:
        """Counters; ``cpu_seconds`` is this shard process's CPU time so far (every
        thread: Ray's (de)serialisation and object-store puts included). Per table: keys
        held, bytes; with ``top``, the most touched keys and their share of all touches."""
        import os

        tables = {}
        for tab in self.tables:
            entry: dict[str, Any] = {"keys": len(tab), "bytes": tab.nbytes}
            if top:
                keys, touches, total = tab.hottest(top)
                entry["touches"] = total
                entry["hottest"] = [(int(k), int(t)) for k, t in zip(keys, touches)]
                entry["hottest_share"] = float(touches.sum() / total) if total else 0.0
            tables[tab.spec.name] = entry
        return {
            "shard": self.spec.shard_id,
            "keys": [self.spec.lo, self.spec.hi],
            "version": self.version,
            "cpu_seconds": time.process_time(),
            "pid": os.getpid(),
            "tables": tables,
            **self.stats,
        }

    def forget(self) -> bool:
        """After the run it served ended well: drop everything of that run and be a spare
        again (as constructed with no spec), which the next run of this kind configures
        (its process is up: the slow part of a new shard's start is skipped). A late call
        of the ended run is refused. False (then it is killed) for a shard that Ray
        restarted or that serves its own endpoint."""
        if self._spare:
            return True
        if was_reconstructed() or getattr(self, "_server", None) is not None:
            return False
        self._cancel_waiters("the run ended")
        vars(self).clear()  # the run's values, tables, references and counters
        self._spare = True
        return True

    def reset(self, token: str) -> None:
        """Back to the initial state (a new launch of the stage), under ``token``."""
        self._cancel_waiters("the shards were reset for a relaunch")
        self._replaced = (self.restarted, int(self.stats["updates"]), dict(self.positions))
        self._fresh()
        self.token = token
        self.restarted = False

    def save_checkpoint(self, uri: str, name: str, cut: str) -> dict[str, Any]:
        """Write the whole shard as the sealed record ``name`` in ``uri`` (the checkpoint
        of cut ``cut``); returns what was written."""
        started = time.perf_counter()
        store = CheckpointStore(uri, keep_last=0, key=self.spec.key, run_id=self.spec.run_id)
        snap = self._snapshot()
        snap["cut"] = cut
        write_record(store, name, snap)
        return {
            "shard": self.spec.shard_id,
            "name": name,
            "updates": self.stats["updates"],
            "rows": sum(len(t) for t in self.tables),
            "seconds": time.perf_counter() - started,
        }

    def restore_checkpoint(self, uri: str, name: str, cut: str, token: str) -> dict[str, Any]:
        """Replace the whole state by record ``name`` of cut ``cut``, under ``token``.
        Returns what the state it replaced had that the record does not (updates and
        each worker's steps after the cut; None for a restarted shard, whose state was
        lost with its process)."""
        store = CheckpointStore(uri, keep_last=0, key=self.spec.key, run_id=self.spec.run_id)
        try:
            snap = read_record(store, name)
        except (CheckpointCorrupt, OSError) as ex:
            raise CheckpointError(
                f"parameter shard {self.spec.shard_id} cannot restore its part {name!r} of "
                f"the checkpoint in {uri!r}: {ex}"
            ) from ex
        if snap.get("cut") != cut:
            raise CheckpointError(
                f"parameter shard {self.spec.shard_id}: {uri}/{name} belongs to another "
                f"checkpoint (cut {snap.get('cut')!r}, expected {cut!r}); not restored"
            )
        lost, updates, positions = (
            self._replaced
            if self._replaced is not None
            else (self.restarted, self.stats["updates"], dict(self.positions))
        )
        self._replaced = None
        self._cancel_waiters("the shards were restored from a checkpoint")
        self._fresh()
        self._restore(snap)
        self.token = token
        self.restarted = False
        self.stats["restores"] += 1
        return {
            "shard": self.spec.shard_id,
            "discarded_updates": None if lost else updates - self.stats["updates"],
            "positions_before": None if lost else positions,
            "positions_cut": dict(self.positions),
        }

    def _snapshot(self) -> dict[str, Any]:
        return {
            "w": self.w.copy(),
            "rule": self.rule.state(),
            "version": self.version,
            "epoch": self.epoch,
            "step": self.step,
            "positions": dict(self.positions),
            "spans": dict(self._spans),
            "stats": dict(self.stats),
            "tables": [t.snapshot() for t in self.tables],
        }

    def _restore(self, snap: Mapping[str, Any]) -> None:
        self.w[...] = snap["w"]
        self.rule.set_state(snap["rule"])
        self.version = int(snap["version"])
        self.epoch, self.step = int(snap["epoch"]), int(snap["step"])
        self.positions = dict(snap["positions"])
        self._spans = dict(snap["spans"])
        for k in ("pushes", "updates", "pulls"):
            self.stats[k] = snap["stats"][k]
        for tab, part in zip(self.tables, snap["tables"]):
            tab.restore(part)

    def save_table(self, uri: str, table: str, save_id: str) -> dict[str, Any]:
        """Write this shard's rows of ``table`` (sorted by key) as its part file of save
        ``save_id``; returns the part's manifest entry (file, rows, size, digest)."""
        tab = self._table(table)
        keys, values = tab.items()
        entry = write_part(uri, table, self.spec.shard_id, keys, values, save_id)
        return {"shard": self.spec.shard_id, **entry}

    def load_rows(self, table: str, keys: np.ndarray, values: np.ndarray) -> int:
        """Add rows (a loaded model): keys that hash here, not held yet."""
        tab = self._table(table)
        keys = np.asarray(keys, dtype=np.int64)
        rows, new = tab.index.find_or_insert(keys)
        if len(new) != len(keys):
            raise UsageError(f"table {table!r}: a loaded key is held already (a duplicate key)")
        tab._make_room(tab.index.n)
        tab.values[rows] = values
        for name, start in tab.rule.row_state().items():
            tab.state[name][rows] = start
        tab.touches[rows] = 0
        return len(tab)

    def load_parts(
        self, uri: str, table: str, parts: list[dict[str, Any]], dim: int, save_id: str | None
    ) -> int:
        """Load the rows of saved part files (their manifest entries) that hash to this
        shard, each checked first against save ``save_id`` (None: not verified; see
        ``read_part``); returns the rows held."""
        tab = self._table(table)
        for part in parts:
            keys, values = read_part(uri, part, dim, save_id)
            mine = shard_of(keys, self.spec.num_shards) == self.spec.shard_id
            if mine.any():
                self.load_rows(table, keys[mine], values[mine])
        return len(tab)

    def export(self, table: str, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``[start, start + count)`` (in row order) of ``table``: keys, values."""
        tab = self._table(table)
        end = min(len(tab), start + count)
        return tab.index.keys()[start:end].copy(), tab.values[start:end].copy()

    def _table(self, name: str) -> Table:
        for tab in self.tables:
            if tab.spec.name == name:
                return tab
        raise UsageError(f"parameter shard {self.spec.shard_id} holds no table {name!r}")

    # -- internals ------------------------------------------------------------------------

    def _check_token(self, token: str | None) -> None:
        if self._spare:
            raise StaleShardCall(
                "a spare parameter shard refused a call: it serves no run (the run that "
                "called has ended, or has not configured it yet); nothing was applied"
            )
        if token != self.token:
            why = (
                "it was restarted after its process died and is not restored yet"
                if self.token is None
                else "the shards were reset or restored since (a relaunch)"
            )
            raise StaleShardCall(
                f"parameter shard {self.spec.shard_id} refused a call of an earlier launch of "
                f"the training: {why}; nothing of it was applied"
            )

    def _cancel_waiters(self, why: str) -> None:
        for _, fut in [*self._waiters, *self._gates]:
            if not fut.done():
                fut.set_exception(StaleShardCall(f"parameter shard {self.spec.shard_id}: {why}"))
        self._waiters, self._gates = [], []

    def _refuse_nonfinite(self, pid: int, epoch: int, step: int, grad: Any) -> None:
        """Refuse a sparse push holding NaN/inf whole, before any of it is stored or
        applied. The worker checked every gradient before sending any slice (so no shard
        applies part of a bad step); this is defence in depth for producers other than
        it, and cheap for sparse pushes (a pass over the entries pushed, next to their
        fancy-indexed update). Dense pushes are not checked again here: that would be a
        second full pass per push in the one process that applies every worker's update
        (the bottleneck in async mode), for values the worker has just checked."""
        if not isinstance(grad, tuple):
            return
        keys, vals = grad
        i = first_nonfinite(vals)
        if i is not None:
            spec = self.spec
            raise NonFiniteGradient(
                f"parameter shard {spec.shard_id} (keys [{spec.lo}, {spec.hi})) refused the "
                f"sparse push of partition {pid} at epoch {epoch}, step {step}: the value for "
                f"key {spec.lo + int(keys[i])} is {vals[i]}; nothing of the push was applied"
            )

    def _take_tables(self, pid: int, epoch: int, step: int, tables: Any) -> _TableParts | None:
        """The table gradients of a push matched with the rows sent to ``pid`` for this
        step (checked finite, whole, before anything is applied)."""
        if tables is None:
            return None
        sent = self._sent.get(pid)
        out: _TableParts = []
        for t, (tab, g) in enumerate(zip(self.tables, tables)):
            if g is None:
                out.append(None)
                continue
            rows = sent[t] if sent is not None else None
            g = np.asarray(g, dtype=np.float64)
            if rows is None or g.shape != (len(rows), tab.spec.dim):
                raise UsageError(
                    f"parameter shard {self.spec.shard_id}: partition {pid} pushed gradient "
                    f"rows of shape {g.shape} for table {tab.spec.name!r}, but {0 if rows is None else len(rows)} "
                    f"rows of dim {tab.spec.dim} were sent to it for this step"
                )
            i = first_nonfinite(g)
            if i is not None:
                key = int(tab.index.keys_by_row[rows[i // tab.spec.dim]])
                raise NonFiniteGradient(
                    f"parameter shard {self.spec.shard_id} refused the push of partition {pid} "
                    f"at epoch {epoch}, step {step}: the gradient of table {tab.spec.name!r} "
                    f"for key {key} is {g.reshape(-1)[i]}; nothing of the push was applied"
                )
            out.append((rows, g))
        return out

    def _prepare(self, pid: int, keys: Any) -> None:
        """Find (create) the rows of ``keys`` (per table) and remember them for ``pid``."""
        if keys is None:
            return
        sent: list[np.ndarray | None] = []
        for tab, k in zip(self.tables, keys):
            sent.append(None if k is None else tab.rows_for(np.asarray(k, np.int64), create=True))
        self._sent[pid] = sent

    def _rows_reply(self, pid: int) -> tuple[np.ndarray | None, ...]:
        sent = self._sent.get(pid, [])
        out = tuple(None if r is None else t.read(r) for t, r in zip(self.tables, sent))
        self.stats["bytes_out"] += sum(v.nbytes for v in out if v is not None)
        return out

    def _count_in(self, grad: Any, tables: Any, keys: Any) -> None:
        n = 0
        if isinstance(grad, np.ndarray):
            n += grad.nbytes
        elif isinstance(grad, tuple):
            n += sum(np.asarray(x).nbytes for x in grad)
        seen: set[int] = set()
        for part in (tables or ()), (keys or ()):
            for x in part:
                if isinstance(x, np.ndarray) and id(x) not in seen:
                    seen.add(id(x))
                    n += x.nbytes
        self.stats["bytes_in"] += n
        self.stats["calls"] += 1

    def lookup(
        self, token: str | None, keys: Any, epoch: int | None = None, step: int = 0
    ) -> tuple[np.ndarray | None, ...]:
        """Values of ``keys`` (per table) without creating rows: an unknown key reads as
        its initializer's value. (``epoch``: sync shells wait for that step first.)"""
        self._check_token(token)
        self.stats["lookups"] += 1
        self._count_in(None, None, keys)
        out = tuple(
            None if k is None else t.lookup(np.asarray(k, np.int64))
            for t, k in zip(self.tables, keys)
        )
        self.stats["bytes_out"] += sum(v.nbytes for v in out if v is not None)
        return out

    def retire(self, pid: int) -> None:
        """Worker ``pid`` takes no more steps (it no longer holds back the others)."""
        self._retired.add(pid)
        self._open_gates()

    def _moved(self, pid: int, epoch: int, step: int, span: int | None) -> None:
        self.positions[pid] = (epoch, step)
        if span is not None:
            self._spans[pid] = span
        if self._gates:
            self._open_gates()

    def _done_steps(self, pid: int, width: int) -> int:
        pos = self.positions.get(pid)
        return 0 if pos is None else pos[0] * width + pos[1] + 1

    def _lead(self, pid: int) -> int:
        """How many steps ``pid`` has done more than the slowest other worker (steps
        counted over epochs of the longest worker's length; retired workers do not
        count)."""
        width = max(self._spans.values(), default=1)
        others = [
            self._done_steps(q, width)
            for q in range(self.spec.num_workers)
            if q != pid and q not in self._retired
        ]
        return self._done_steps(pid, width) - min(others) if others else 0

    def _may_go(self, pid: int) -> bool:
        """Async with ``staleness_steps=k``: ``pid`` may take its next step when it has
        done at most ``k`` steps more than the slowest worker."""
        k = self.spec.staleness_steps
        return k is None or self._lead(pid) <= k

    def _open_gates(self) -> None:
        keep = []
        for pid, fut in self._gates:
            if fut.done():
                continue
            if self._may_go(pid):
                fut.set_result(None)
            else:
                keep.append((pid, fut))
        self._gates = keep

    def _current(self) -> tuple[int, np.ndarray | None, Any]:
        ref = self._refs.ref(self.version, self.w, self.w.nbytes)  # one copy per version
        self.stats["puts"] = self._refs.puts
        return (self.version, None, ref) if ref is not None else (self.version, self.w.copy(), None)

    def _reply(self, pid: int, dense: tuple[int, np.ndarray | None, Any], keys: Any) -> Any:
        self._count_dense_out(dense)
        if keys is None:
            return dense
        return (*dense, self._rows_reply(pid))

    def _count_dense_out(self, dense: tuple[int, np.ndarray | None, Any]) -> None:
        """The dense values a reply hands out, inline or as an object-store reference
        (the caller reads the whole range from the store: counted for each reply)."""
        _, inline, ref = dense
        if inline is not None:
            self.stats["bytes_out"] += inline.nbytes
        elif ref is not None:
            self.stats["bytes_out"] += self.w.nbytes

    def _advance(self) -> None:
        """Apply every sync step whose pushes are all in; end epochs; wake pullers."""
        n = self.spec.num_workers
        while True:
            key = (self.epoch, self.step)
            got = self._pushes.get(key, {})
            lasts = self._steps.get(self.epoch, {})
            if any(p not in got and lasts.get(p, self.step + 1) > self.step for p in range(n)):
                break  # a worker still owes this step
            if got:
                parts = [got[p] for p in sorted(got)]
                self._apply(parts, sum(r for _, r, _ in parts))
                del self._pushes[key]
                self.step += 1
            else:  # nobody takes part in this step: the epoch is over
                self._steps.pop(self.epoch, None)
                self.epoch += 1
                self.step = 0
        if self._waiters:
            now = (self.epoch, self.step)
            keep = []
            for key, fut in self._waiters:
                if key <= now:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((key, fut))
            self._waiters = keep

    def _apply(self, parts: list[tuple[Any, float, _TableParts | None]], total: float) -> None:
        """One update from ``parts`` (gradient, weight, table parts): ``sum(weight * g) /
        total``, the sum in the order of ``parts`` (worker order)."""
        started = time.perf_counter()
        if total <= 0:
            return
        dense = [(g, r) for g, r, _ in parts if g is not None]
        if dense and len(self.w):
            self._apply_dense(dense, total)
        for t, tab in enumerate(self.tables):
            got = []
            for _, r, tp in parts:
                part = tp[t] if tp is not None else None
                if part is not None:
                    got.append((part, r))
            if got:
                tab.apply(*_weighted_rows(got, total, tab.spec.dim))
        self.version += 1
        self.stats["updates"] += 1
        self.stats["apply_seconds"] += time.perf_counter() - started

    def _apply_dense(self, parts: list[tuple[Any, float]], total: float) -> None:
        sparse = [p for p in parts if isinstance(p[0], tuple)]
        if len(sparse) == len(parts):
            if len(parts) == 1:
                (idx, vals), weight = parts[0]
                vals = vals * (weight / total) if weight != total else vals
            else:
                idx = np.concatenate([g[0] for g, _ in parts])
                vals = np.concatenate([g[1] * (r / total) for g, r in parts])
                idx, inverse = np.unique(idx, return_inverse=True)
                vals = np.bincount(inverse, weights=vals, minlength=len(idx))
            if len(idx):
                self.rule.sparse(self.w, idx, vals.astype(self.w.dtype, copy=False))
        else:
            if len(parts) == 1 and parts[0][1] == total:
                g = np.asarray(parts[0][0], dtype=self.w.dtype)
            else:
                g, part = self._acc.get(), self._part.get()
                g.fill(0)
                for grad, r in parts:
                    if isinstance(grad, tuple):
                        np.add.at(g, grad[0], grad[1] * (r / total))
                    else:
                        np.multiply(grad, r / total, out=part)
                        g += part
            self.rule.dense(self.w, g)


def _weighted_rows(
    got: list[tuple[tuple[np.ndarray, np.ndarray], float]], total: float, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Unique rows and ``sum(weight * g) / total`` over the workers' gradient rows, each
    row's sum taken in worker order (``np.add.at`` adds in the order given)."""
    if len(got) == 1:
        (rows, g), weight = got[0]
        return rows, (g * (weight / total) if weight != total else g)
    rows = np.concatenate([rg[0] for rg, _ in got])
    vals = np.concatenate([rg[1] * (r / total) for rg, r in got])
    uniq, inverse = np.unique(rows, return_inverse=True)
    acc = np.zeros((len(uniq), dim))
    np.add.at(acc, inverse, vals)
    return uniq, acc


class ParameterShard(_ShardCore):
    """A shard as an asyncio Ray actor: sync mode, where pulls and fused pushes wait for
    every worker's push of a step (and async mode with a step staleness bound, where a
    reply waits for the slowest worker). All public methods are called through Ray."""

    # -- calls from workers ---------------------------------------------------------------

    async def pull(
        self,
        epoch: int,
        step: int,
        token: str | None = None,
        pid: int = -1,
        keys: Any = None,
    ) -> Any:
        """``(version, inline values or None, object ref or None)``; sync: the parameters
        before step ``(epoch, step)``, async: the newest. With ``keys`` (per table) the
        rows of those keys follow, remembered for ``pid``'s next push."""
        self._check_token(token)
        self._count_in(None, None, keys)
        self._prepare(pid, keys)
        if self.spec.sync:
            await self._ready(epoch, step)
        self.stats["pulls"] += 1
        return self._reply(pid, self._current(), keys)

    async def push(
        self,
        pid: int,
        epoch: int,
        step: int,
        grad: Any,
        rows: float,
        last: bool,
        pull_next: bool,
        token: str | None = None,
        tables: Any = None,
        keys: Any = None,
        span: int | None = None,
    ) -> Any:
        """Worker ``pid``'s gradient of step ``(epoch, step)`` (None: no step; a dense
        array or ``(indices, values)``; ``tables``: per table, gradient rows aligned with
        the rows sent for this step); with ``pull_next`` the reply carries the
        parameters of its next step (and, with ``keys``, the rows of those keys)."""
        self._check_token(token)
        self.stats["pushes"] += 1
        self._count_in(grad, tables, keys)
        self._refuse_nonfinite(pid, epoch, step, grad)
        parts = self._take_tables(pid, epoch, step, tables)
        is_step = grad is not None or parts is not None
        if not self.spec.sync:
            if is_step:
                self._apply([(grad, 1.0, parts)], 1.0)
            self._moved(pid, epoch, step, span)
            if not pull_next:
                return None
            self._prepare(pid, keys)
            if not self._may_go(pid):
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._gates.append((pid, fut))
                self.stats["gate_waits"] += 1
                await fut
            # the lead a released worker starts its next step with (at most the bound)
            self.stats["max_lead"] = max(self.stats["max_lead"], self._lead(pid))
            self.stats["pulls"] += 1
            return self._reply(pid, self._current(), keys)
        if is_step:
            self._pushes.setdefault((epoch, step), {})[pid] = (grad, float(rows), parts)
        if last:
            self._steps.setdefault(epoch, {})[pid] = step + 1 if is_step else step
        self.positions[pid] = (epoch, step)
        self._advance()
        if not pull_next:
            return None
        self._prepare(pid, keys)
        await self._ready(epoch, step + 1)
        self.stats["pulls"] += 1
        return self._reply(pid, self._current(), keys)

    async def push_packed(self, msg: tuple[Any, ...]) -> Any:
        """``push(*msg)``: one Ray argument instead of seven (less per-call overhead)."""
        return await self.push(*msg)

    async def lookup_at(
        self, token: str | None, keys: Any, epoch: int | None = None, step: int = 0
    ) -> Any:
        """``(version, inline, ref, rows per table)``: the dense parameters and the
        ``lookup`` of ``keys`` once step ``(epoch, step)`` is reached (sync: the
        parameters before it; ``epoch`` None: now)."""
        if epoch is not None and self.spec.sync:
            await self._ready(epoch, step)
        dense = self._current()
        self._count_dense_out(dense)
        return (*dense, self.lookup(token, keys))

    async def _ready(self, epoch: int, step: int) -> None:
        if (self.epoch, self.step) >= (epoch, step):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(((epoch, step), fut))
        await fut


class FreeShard(_ShardCore):
    """A shard as a plain (one-thread) Ray actor: async mode, where nothing waits, so
    every call runs straight through without an event loop (less CPU per call than the
    asyncio shell). All public methods are called through Ray."""

    _direct = -1  # the version last sent as an array (not a reference); ``_fresh`` resets it

    def _fresh(self) -> None:
        super()._fresh()
        self._direct = -1

    def pull(
        self,
        epoch: int = 0,
        step: int = 0,
        token: str | None = None,
        pid: int = -1,
        keys: Any = None,
    ) -> Any:
        """The newest parameters ``(version, inline values or None, object ref or None)``
        (the step is not waited for in async mode: clients call it without arguments),
        with the rows of ``keys`` (per table) when given."""
        self._check_token(token)
        self._count_in(None, None, keys)
        self._prepare(pid, keys)
        self.stats["pulls"] += 1
        return self._reply(pid, self._newest(), keys)

    def push(
        self,
        pid: int,
        epoch: int,
        step: int,
        grad: Any,
        rows: float,
        last: bool,
        pull_next: bool,
        token: str | None = None,
        tables: Any = None,
        keys: Any = None,
        span: int | None = None,
    ) -> Any:
        """Apply ``grad`` (None: no step) and the table gradients on arrival; with
        ``pull_next`` reply with the newest parameters (and the rows of ``keys``)."""
        self._check_token(token)
        self.stats["pushes"] += 1
        self._count_in(grad, tables, keys)
        self._refuse_nonfinite(pid, epoch, step, grad)
        parts = self._take_tables(pid, epoch, step, tables)
        if grad is not None or parts is not None:
            self._apply([(grad, 1.0, parts)], 1.0)
        self._moved(pid, epoch, step, span)
        if not pull_next:
            return None
        self._prepare(pid, keys)
        self.stats["pulls"] += 1
        return self._reply(pid, self._newest(), keys)

    def push_packed(self, msg: tuple[Any, ...]) -> Any:
        """``push(*msg)``: one Ray argument instead of seven (less per-call overhead)."""
        return self.push(*msg)

    def lookup_at(
        self, token: str | None, keys: Any, epoch: int | None = None, step: int = 0
    ) -> Any:
        """``(version, inline, ref, rows per table)`` now (async: nothing to wait for)."""
        dense = self._current()
        self._count_dense_out(dense)
        return (*dense, self.lookup(token, keys))

    def _newest(self) -> tuple[int, np.ndarray | None, Any]:
        # In async mode versions change with every push, so most are pulled once: the
        # first pull of a version gets the array itself (Ray copies it into the reply, as
        # a hand-rolled actor would; safe without a copy here, since this one-thread actor
        # serialises its reply before it runs the next call); a version pulled again is
        # put into the object store once and shared by reference.
        if not self._refs.would_put(self.w.nbytes):
            return self._current()
        if self._direct != self.version:
            self._direct = self.version
            return (self.version, self.w, None)
        return self._current()


class ServedParameterShard(ShardServing, ParameterShard):
    """``ParameterShard`` that also serves its own endpoint (``serve_endpoint``)."""


class ServedFreeShard(ShardServing, FreeShard):
    """``FreeShard`` that also serves its own endpoint: an asyncio actor (its
    ``serve_endpoint`` is a coroutine), so Ray's calls and the endpoint's all run on its
    one event loop, one at a time, as the plain actor runs them."""


def shard_class(
    sync: bool, staleness_steps: int | None = None, *, served: bool = False
) -> type[_ShardCore]:
    """The actor class of a shard: asyncio where calls wait (sync mode, or async with a
    step staleness bound), plain for async; ``served``: serving its own endpoint."""
    if sync or staleness_steps is not None:
        return ServedParameterShard if served else ParameterShard
    return ServedFreeShard if served else FreeShard
