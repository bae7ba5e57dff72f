"""Parameter-server shards as actors: the thin shells around the shard core.

Written as plain classes; ``hybrid_iter.ps`` makes one a Ray actor
(``ray.remote(num_cpus=0)``) where it launches it, one per shard. Spark tasks call the
shards directly (not through the iteration's coordinator, which keeps only the epoch
accounting, the losses, termination and bounded-staleness gating).

Every decision is the core's (``_shard_core.py``: steps, fencing, staleness gates, the
apply, the spare life cycle; its records in ``_shard_protocol.py``): each call here
becomes one event, and the shell carries the instructions out, in order: it answers
the calls (a future of its event loop, or at once), puts a version into the object
store (``Put``), writes a checkpoint record (``WriteCheckpoint``). What stays here is
what needs the process: Ray's ``put`` and whether Ray restarted this actor, the table
part files (``save_table``, ``load_parts``), reading a checkpoint record, the counters'
CPU time and process id.

Two shells differ only in ``pull``/``push``/``lookup_at``:

* ``ParameterShard``: an asyncio actor (its calls may wait): sync mode, where a pull
  waits for its step, and async mode with a step staleness bound, where a reply waits
  at its gate for the slowest worker.
* ``FreeShard``: a plain one-thread actor for async mode, where nothing waits, so every
  call runs straight through without an event loop (less CPU per call); its replies
  leave before it takes the next call, so a version is sent as the live array the first
  time it is pulled (``ShardCore(direct=True)``).

``ServedParameterShard``/``ServedFreeShard`` also serve their own Flight endpoint
(``_ps_endpoint.py``). The protocol, fencing and checkpoints are the core's docstring.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._checkpoint import CheckpointStore, read_record, write_record
from ._errors import CheckpointCorrupt, CheckpointError, CoreError
from ._ps_endpoint import ShardServing
from ._rules import AdagradRule, AdamRule, FTRLRule, SGDRule, make_rule
from ._shard_core import ShardCore
from ._shard_protocol import (
    Configure,
    Event,
    Forget,
    LoadRows,
    Lookup,
    Pull,
    Push,
    Put,
    Refuse,
    Reply,
    Reset,
    Restore,
    Retire,
    Save,
    ShardSpec,
    Values,
    WriteCheckpoint,
)
from ._shell import import_ahead, object_store, was_reconstructed
from ._table_io import read_part, write_part
from ._tables import Table, shard_of

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


class _Slot:
    """Where the answer of a call goes. A call the core answers at once (most) costs no
    future; one that waits gets a future of the running loop (``waiting``), which the
    answer resolves."""

    __slots__ = ("answered", "error", "future", "value")

    def __init__(self) -> None:
        self.answered = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.future: asyncio.Future[None] | None = None

    def done(self) -> bool:
        """Answered, or its caller gave up waiting (its task was cancelled)."""
        return self.answered or (self.future is not None and self.future.done())

    def set_result(self, value: Any) -> None:
        self.value, self.answered = value, True
        if self.future is not None:
            self.future.set_result(None)

    def set_exception(self, error: BaseException) -> None:
        self.error, self.answered = error, True
        if self.future is not None:
            self.future.set_result(None)

    def waiting(self) -> asyncio.Future[None]:
        """The future the caller awaits until the answer (made on first need)."""
        if self.future is None:
            self.future = asyncio.get_running_loop().create_future()
        return self.future

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        if not self.answered:  # the core keeps a call waiting only in a waiting shell
            raise CoreError("a parameter shard call that never waits was left unanswered")
        return self.value


class _ShardShell:
    """What both shells share: the core, the calls of the driver and the coordinator
    (never waiting: no coroutine, since Ray makes a class with any ``async def`` an
    asyncio actor), and carrying out the core's instructions."""

    #: each call runs to its end before the next (a one-thread actor: ``FreeShard``)
    _ONE_THREAD = False

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
        self._put: Callable[[Any], Any] | None = None
        self._ref: Any = None  # the object-store copy of the version the core put last
        if spec is None:
            self.core = ShardCore(None, one_thread=self._ONE_THREAD)
            import_ahead(warm)
            return
        self._put = object_store(put)[0]
        self.core = ShardCore(
            spec,
            one_thread=self._ONE_THREAD,
            can_put=self._put is not None,
            restarted=was_reconstructed(),
        )

    # -- carrying out the core's instructions ---------------------------------------------

    def _run(self, event: Event) -> None:
        """Hand ``event`` to the core and carry out its instructions, in order."""
        for ins in self.core.handle(event):
            if isinstance(ins, Reply):
                slot = ins.slot
                if not slot.done():  # a waiting call its caller gave up is left alone
                    value = ins.value
                    slot.set_result(self._wire(value) if type(value) is Values else value)
            elif isinstance(ins, Refuse):
                if not ins.slot.done():
                    ins.slot.set_exception(ins.error)
            elif isinstance(ins, Put):
                assert self._put is not None  # the core puts only where it can
                self._ref = self._put(ins.value)
            elif isinstance(ins, WriteCheckpoint):
                spec = self.spec
                store = CheckpointStore(ins.uri, keep_last=0, key=spec.key, run_id=spec.run_id)
                write_record(store, ins.name, ins.record)
            # a Wait: a later event's Reply or Refuse answers it

    def _call(self, event: Event) -> Any:
        """Run a call that is answered at once; its reply (or its refusal, raised)."""
        self._run(event)
        return event.slot.result()

    def _wire(self, v: Values) -> Any:
        """A ``Values`` as a worker receives it: ``(version, inline values or None,
        object ref or None)``, then the rows per table when the call asked for rows."""
        dense = (v.version, v.inline, self._ref if v.by_ref else None)
        return dense if v.rows is None else (*dense, v.rows)

    # -- what tests and the driver read -----------------------------------------------------

    @property
    def spec(self) -> ShardSpec:
        return self.core.spec

    @spec.setter
    def spec(self, spec: ShardSpec) -> None:
        self.core.spec = spec

    @property
    def w(self) -> np.ndarray:
        return self.core.w

    @property
    def rule(self) -> Any:
        return self.core.rule

    @property
    def tables(self) -> list[Table]:
        return self.core.tables

    @property
    def stats(self) -> dict[str, Any]:
        return self.core.stats

    @property
    def version(self) -> int:
        return self.core.version

    @property
    def epoch(self) -> int:
        return self.core.epoch

    @property
    def step(self) -> int:
        return self.core.step

    @property
    def token(self) -> str | None:
        return self.core.token

    # -- calls from the driver and the coordinator ----------------------------------------

    def values(self) -> np.ndarray:
        return self.core.w

    def hello(self) -> tuple[str | None, int, int]:
        """``(token, shard id, process id)``: what a worker needs to call this shard, and
        where it runs (to find its process from outside)."""
        return self.token, self.spec.shard_id, os.getpid()

    def configure(self, spec: ShardSpec) -> tuple[str | None, int, int]:
        """Make a spare the shard of ``spec``, exactly as the constructor would have (once
        per run; only for shards Ray never restarts: a restart would run the constructor
        again, as a spare); returns ``hello()``."""
        put = object_store(None)[0]
        self._call(Configure(_Slot(), spec, put is not None, was_reconstructed()))
        self._put, self._ref = put, None
        return self.hello()

    def forget(self) -> bool:
        """After the run it served ended well: drop everything of that run and be a spare
        again (as constructed with no spec), which the next run of this kind configures
        (its process is up: the slow part of a new shard's start is skipped). A late call
        of the ended run is refused, a waiting one released with the refusal. False
        (then it is killed) for a shard that Ray restarted or that serves its own
        endpoint."""
        declined = was_reconstructed() or getattr(self, "_server", None) is not None
        forgot: bool = self._call(Forget(_Slot(), declined))
        if forgot:
            self._put, self._ref = None, None
        return forgot

    def info(self, top: int = 0) -> dict[str, Any]:
        """Counters; ``cpu_seconds`` is this shard process's CPU time so far (every
        thread: Ray's (de)serialisation and object-store puts included). Per table: keys
        held, bytes (a bounded table: rows admitted and removed so far); with ``top``, the most touched keys and their share of all touches."""
        tables = {}
        for tab in self.tables:
            entry: dict[str, Any] = {"keys": len(tab), "bytes": tab.nbytes}
            if tab.bounded:  # rows admitted and removed so far, the sketch's fixed size
                entry["admitted"], entry["expired"] = tab.admitted, tab.expired
                entry["sketch_bytes"] = 0 if tab.sketch is None else tab.sketch.nbytes
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

    def reset(self, token: str) -> None:
        """Back to the initial state (a new launch of the stage), under ``token``."""
        self._call(Reset(_Slot(), token))
        self._ref = None

    def save_checkpoint(self, uri: str, name: str, cut: str) -> dict[str, Any]:
        """Write the whole shard as the sealed record ``name`` in ``uri`` (the checkpoint
        of cut ``cut``); returns what was written."""
        started = time.perf_counter()
        written: dict[str, Any] = self._call(Save(_Slot(), cut, uri, name))
        written["seconds"] = time.perf_counter() - started
        return written

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
        restored: dict[str, Any] = self._call(Restore(_Slot(), snap, cut, token, f"{uri}/{name}"))
        self._ref = None
        return restored

    def save_table(self, uri: str, table: str, save_id: str) -> dict[str, Any]:
        """Write this shard's rows of ``table`` (sorted by key) as its part file of save
        ``save_id``; returns the part's manifest entry (file, rows, size, digest)."""
        tab = self._table(table)
        keys, values = tab.items()
        entry = write_part(uri, table, self.spec.shard_id, keys, values, save_id)
        return {"shard": self.spec.shard_id, **entry}

    def load_rows(self, table: str, keys: np.ndarray, values: np.ndarray) -> int:
        """Add rows (a loaded model): keys that hash here, none held yet."""
        held: int = self._call(LoadRows(_Slot(), table, keys, values))
        return held

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
        return self.core.table(name)

    # -- calls from workers that never wait ---------------------------------------------------

    def lookup(
        self, token: str | None, keys: Any, epoch: int | None = None, step: int = 0
    ) -> tuple[np.ndarray | None, ...]:
        """Values of ``keys`` (per table) without creating rows: an unknown key reads as
        its initializer's value (``epoch``: ``lookup_at`` waits for a step)."""
        rows: tuple[np.ndarray | None, ...] = self._call(Lookup(_Slot(), token, keys))
        return rows

    def retire(self, pid: int) -> None:
        """Worker ``pid`` takes no more steps (it no longer holds back the others)."""
        self._call(Retire(_Slot(), pid))


class ParameterShard(_ShardShell):
    """A shard as an asyncio Ray actor: sync mode, where pulls and fused pushes wait for
    every worker's push of a step (and async mode with a step staleness bound, where a
    reply waits for the slowest worker). All public methods are called through Ray."""

    async def pull(
        self,
        epoch: int,
        step: int,
        token: str | None = None,
        pid: int = -1,
        keys: Any = None,
        counts: Any = None,
    ) -> Any:
        """``(version, inline values or None, object ref or None)``; sync: the parameters
        before step ``(epoch, step)``, async: the newest. With ``keys`` (per table) the
        rows of those keys follow, remembered for ``pid``'s next push; ``counts``: how
        often the step sees each (the tables that admit a key after N sightings)."""
        slot = _Slot()
        self._run(Pull(slot, pid, epoch, step, token, keys, counts))
        if not slot.answered:
            await slot.waiting()
        return slot.result()

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
        counts: Any = None,
    ) -> Any:
        """Worker ``pid``'s gradient of step ``(epoch, step)`` (None: no step; a dense
        array or ``(indices, values)``; ``tables``: per table, gradient rows aligned with
        the rows sent for this step); with ``pull_next`` the reply carries the
        parameters of its next step (and, with ``keys``, the rows of those keys;
        ``counts`` as ``pull``'s)."""
        slot = _Slot()
        self._run(
            Push(
                slot,
                pid,
                epoch,
                step,
                grad,
                rows,
                last,
                pull_next,
                token,
                tables,
                keys,
                span,
                counts,
            )
        )
        if not slot.answered:
            await slot.waiting()
        return slot.result()

    async def push_packed(self, msg: tuple[Any, ...]) -> Any:
        """``push(*msg)``: one Ray argument instead of seven (less per-call overhead)."""
        return await self.push(*msg)

    async def lookup_at(
        self, token: str | None, keys: Any, epoch: int | None = None, step: int = 0
    ) -> Any:
        """``(version, inline, ref, rows per table)``: the dense parameters and the
        ``lookup`` of ``keys`` once step ``(epoch, step)`` is reached (sync: the
        parameters before it; ``epoch`` None: now)."""
        slot = _Slot()
        self._run(Lookup(slot, token, keys, True, None if epoch is None else (epoch, step)))
        if not slot.answered:
            await slot.waiting()
        return slot.result()


class FreeShard(_ShardShell):
    """A shard as a plain (one-thread) Ray actor: async mode, where nothing waits, so
    every call runs straight through without an event loop (less CPU per call than the
    asyncio shell). All public methods are called through Ray."""

    _ONE_THREAD = True

    def pull(
        self,
        epoch: int = 0,
        step: int = 0,
        token: str | None = None,
        pid: int = -1,
        keys: Any = None,
        counts: Any = None,
    ) -> Any:
        """The newest parameters ``(version, inline values or None, object ref or None)``
        (the step is not waited for in async mode: clients call it without arguments),
        with the rows of ``keys`` (per table) when given."""
        return self._call(Pull(_Slot(), pid, epoch, step, token, keys, counts))

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
        counts: Any = None,
    ) -> Any:
        """Apply ``grad`` (None: no step) and the table gradients on arrival; with
        ``pull_next`` reply with the newest parameters (and the rows of ``keys``)."""
        return self._call(
            Push(
                _Slot(),
                pid,
                epoch,
                step,
                grad,
                rows,
                last,
                pull_next,
                token,
                tables,
                keys,
                span,
                counts,
            )
        )

    def push_packed(self, msg: tuple[Any, ...]) -> Any:
        """``push(*msg)``: one Ray argument instead of seven (less per-call overhead)."""
        return self.push(*msg)

    def lookup_at(
        self, token: str | None, keys: Any, epoch: int | None = None, step: int = 0
    ) -> Any:
        """``(version, inline, ref, rows per table)`` now (async: nothing to wait for)."""
        return self._call(Lookup(_Slot(), token, keys, True))


class ServedParameterShard(ShardServing, ParameterShard):
    """``ParameterShard`` that also serves its own endpoint (``serve_endpoint``)."""


class ServedFreeShard(ShardServing, FreeShard):
    """``FreeShard`` that also serves its own endpoint: an asyncio actor (its
    ``serve_endpoint`` is a coroutine), so Ray's calls and the endpoint's all run on its
    one event loop, one at a time, as the plain actor runs them."""


def shard_class(
    sync: bool, staleness_steps: int | None = None, *, served: bool = False
) -> type[_ShardShell]:
    """The actor class of a shard: asyncio where calls wait (sync mode, or async with a
    step staleness bound), plain for async; ``served``: serving its own endpoint."""
    if sync or staleness_steps is not None:
        return ServedParameterShard if served else ParameterShard
    return ServedFreeShard if served else FreeShard
