"""A parameter shard's decisions in one pure object: events in, instructions out.

``ShardCore.handle(event) -> list[instruction]`` is the only entry that changes a shard.
It holds one key range of a flat parameter vector, the rows of the sparse tables whose
keys hash to it, their update rules (``_rules.py``, ``_tables.py``), and decides
everything the shard actor (``_ps.py``) does: which call is refused, when a sync step is
applied and with what, which waiting call is released and with which values, when a
version is put into the object store, what a checkpoint holds. No asyncio, no Ray, no
I/O: the shell turns each Ray or Flight call into an event and carries the instructions
out, in order (resolving its futures, ``ray.put``, writing checkpoint files).

Protocol of a worker (one subtask) in epoch ``e``, steps ``s = 0 .. S_p - 1``:
``Pull(e, 0)``, then per step ``Push(pid, e, s, grad, rows, last=(s == S_p - 1),
pull_next=not last)``, whose reply is the parameters for step ``s + 1``. A worker with no
step in an epoch (no rows) pushes ``(pid, e, 0, None, 0, last=True)``.

* **sync**: step ``(e, s)`` is applied once every worker that takes part in it has
  pushed (a worker whose epoch has fewer steps is done once it pushed ``last``), with the
  workers' mean gradients weighted by their rows and summed in worker order, so results
  are deterministic; a pull of ``(e, s)`` waits for exactly the parameters before step
  ``(e, s)``. Epoch ``e`` ends when every worker's last step is applied.
* **async**: every push is applied on arrival (the worker's own mean gradient); a pull
  gets the newest parameters. With ``staleness_steps=k`` (SSP) a push's reply waits
  until its worker has done at most ``k`` steps more than the slowest other worker (a
  retired worker no longer counts).

Gradients arrive dense (an array of the shard's length) or sparse (``(indices, values)``
with sorted, unique indices local to the shard). A pull or push may carry, per table,
the keys of the worker's next step: the core finds (on first touch: creates) their rows,
remembers them for that worker, and the reply carries their values; the worker's next
push carries the gradient rows in the same order. A table with bounds (``_bounds.py``)
creates no row on a pull: the call also carries how often each key is seen in the step
(``counts``), a key without a row reads as its initial value, and the step's apply
admits keys (their gradient is applied to their new row; a key not admitted yet has
its gradient dropped), then removes the rows expiry and the cap name. Remembered rows
are looked up again where they are -1 and renumbered when rows go, so a reply always
reads the rows as the last applied step left them.

**Fencing**: every worker call carries the shards' ``token``; ``Reset`` and ``Restore``
(the run's coordinator, after a failure) set a new one, so a task of a failed launch
still running cannot change the restored state (``StaleShardCall``, nothing applied). A
shard that Ray restarted accepts no worker call until it is restored or reset. A spare
(``_spare.py``: constructed with no spec, or given back by ``Forget``) refuses every
call of a run.

**Answers**: each event carries the shell's ``slot`` (its future, or any handle) and
gets exactly one ``Reply`` or ``Refuse`` for it, at once or, after a ``Wait``, from a
later event (a waiting call is answered with the values at the moment it is released).
``Values.by_ref``: the reply is the object-store copy of its version, made by the ``Put``
of that version before it. A refusal is decided before anything of the call changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._combine import apply_dense, weighted_rows
from ._errors import (
    CheckpointError,
    CoreError,
    HybridIterError,
    IterationConfigError,
    NonFiniteGradient,
    StaleShardCall,
    UsageError,
)
from ._finite import first_nonfinite
from ._rules import _Scratch, make_rule
from ._shard_protocol import (
    Configure,
    Event,
    Forget,
    Instruction,
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
    Wait,
    WriteCheckpoint,
)
from ._shard_tables import Part, Sent, admitted, check_counts, renumber, resolved
from ._spare import SpareLife
from ._tables import Table

__all__ = ["ShardCore"]


#: a step's table parts as the shard keeps them: per table, a part or None
_TableParts = list[Part | None]


@dataclass(slots=True)
class _Waiting:
    """A call that waits: for step ``until`` (sync) or for its gate (async ``until``
    None); answered with the dense values and ``pid``'s rows (``rows``), or, for a
    ``Lookup`` (``is_lookup``), the dense values and the lookup of ``keys``."""

    slot: Any
    pid: int
    rows: bool
    until: tuple[int, int] | None = None
    is_lookup: bool = False
    keys: Any = None


class ShardCore(SpareLife):
    """One shard's state and decisions (see the module docstring).

    ``one_thread``: the shell runs each call to its end before it takes the next (a
    one-thread actor): no call can wait there (only async shards without a staleness
    bound), and a reply leaves before the next event, so it may hand out the live array
    of a version the first time it is pulled (most async versions are pulled once; the
    object store only from a version's second pull on)."""

    SPARE_OF = "parameter shard"
    spec: ShardSpec

    def __init__(
        self,
        spec: ShardSpec | None,
        *,
        one_thread: bool = False,
        can_put: bool = False,
        restarted: bool = False,
    ) -> None:
        self.one_thread = one_thread
        #: calls taken and calls answered (``validate``: the difference is what waits)
        self.asked = self.answered = 0
        if spec is None:
            self._spare = True
            return
        self._setup(spec, can_put, restarted)

    def _setup(self, spec: ShardSpec, can_put: bool, restarted: bool) -> None:
        if self.one_thread and (spec.sync or spec.staleness_steps is not None):
            raise UsageError(
                f"parameter shard {spec.shard_id}: a sync or staleness-bounded shard makes "
                f"calls wait, which a one-thread shard (FreeShard) cannot; make it a "
                f"ParameterShard (coordinator._ps.shard_class picks the class)"
            )
        self.spec = spec
        self.can_put = can_put
        self.stats: dict[str, Any] = {
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
        self.restarted = restarted
        self.token = None if restarted else spec.token
        # what the last reset replaced: a restore right after it reports that
        self._replaced: tuple[bool, int, dict[int, tuple[int, int]]] | None = None

    def _fresh(self) -> None:
        """The state of a new shard: initial dense values, empty tables, step 0."""
        spec = self.spec
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
        self._base_version, self._applied = 0, 0  # validate: version = base + applied
        # sync bookkeeping: the next step to apply, pushes per step, last steps per epoch
        self.epoch = 0
        self.step = 0
        self._pushes: dict[tuple[int, int], dict[int, tuple[Any, float, _TableParts | None]]] = {}
        self._steps: dict[int, dict[int, int]] = {}
        self._waiters: list[_Waiting] = []
        # tables: the rows last sent to each worker, per table (its next push's rows)
        self._sent: dict[int, list[Sent | None]] = {}
        # each worker's (epoch, step) after its last push, and its steps per epoch
        self.positions: dict[int, tuple[int, int]] = {}
        self._spans: dict[int, int] = {}
        self._retired: set[int] = set()
        self._gates: list[_Waiting] = []
        # the version put into the object store (one put per version), the puts, and
        # the version last handed out as the live array (``one_thread``)
        self._put_version, self._puts, self._sent_live = -1, 0, -1

    # -- the entry --------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        """Take ``event``; the instructions to carry out, in order."""
        on = _HANDLERS.get(type(event))
        if on is None:
            raise CoreError(f"not a parameter shard event: {event!r}")
        out: list[Instruction] = []
        self.asked += 1
        try:
            on(self, event, out)
        except HybridIterError as ex:  # a refusal: decided before anything changed
            self.answered += 1
            out.append(Refuse(event.slot, ex))
        except Exception:  # a bug or a malformed call: the shell raises it to the caller
            self.answered += 1
            raise
        return out

    # -- queries ----------------------------------------------------------------------------

    @property
    def spare(self) -> bool:
        return self._spare

    def validate(self) -> None:
        """Invariants that hold between events (every core test checks them at its end)."""
        waiting = [] if self._spare else [*self._waiters, *self._gates]
        assert self.asked - self.answered == len(waiting), "a call answered twice or never"
        assert len({id(w.slot) for w in waiting}) == len(waiting), "a call waits twice"
        if self._spare:
            assert not hasattr(self, "spec"), "a spare holds a run"
            return
        assert self.version == self._base_version + self._applied >= 0, "versions skipped"
        assert not self.restarted or self.token is None, "a restarted shard took a token"
        now = (self.epoch, self.step)
        if self.spec.sync:
            assert not self._gates
            assert all(w.until is not None and w.until > now for w in self._waiters), (
                "a sync call waits for a step already reached"
            )
            assert all(key >= now for key in self._pushes), "a push of a step already applied"
            assert all(e >= self.epoch for e in self._steps)
        else:
            assert not self._waiters and not self._pushes
            assert not any(self._may_go(g.pid) for g in self._gates), "a gate left shut"
        k = self.spec.staleness_steps
        assert k is None or self.spec.sync or self.stats["max_lead"] <= k, "staleness exceeded"
        for tab in self.tables:
            cap = tab.spec.bounds.max_rows
            assert cap is None or len(tab) <= cap, f"table {tab.spec.name!r} over its cap"
            assert tab.bounded or tab.admitted == tab.expired == 0

    # -- event handlers ---------------------------------------------------------------------

    def _on_pull(self, ev: Pull, out: list[Instruction]) -> None:
        self._check_token(ev.token)
        check_counts(self.spec.shard_id, self.tables, ev.pid, ev.keys, ev.counts)
        self._count_in(None, None, ev.keys)
        self._prepare(ev.pid, ev.keys, ev.counts)
        rows = ev.keys is not None
        if self.spec.sync:
            if (self.epoch, self.step) >= (ev.epoch, ev.step):
                self._give(out, ev.slot, ev.pid, rows, newest=False)
            else:
                self._wait(out, _Waiting(ev.slot, ev.pid, rows, (ev.epoch, ev.step)))
        else:
            self._give(out, ev.slot, ev.pid, rows, newest=True)

    def _on_push(self, ev: Push, out: list[Instruction]) -> None:
        self._check_token(ev.token)
        pid, epoch, step, grad = ev.pid, ev.epoch, ev.step, ev.grad
        check_counts(self.spec.shard_id, self.tables, pid, ev.keys, ev.counts)
        self.stats["pushes"] += 1
        self._count_in(grad, ev.tables, ev.keys)
        self._refuse_bad_gradient(pid, epoch, step, grad)
        parts = self._take_tables(pid, epoch, step, ev.tables)
        is_step = grad is not None or parts is not None
        rows = ev.keys is not None
        if not self.spec.sync:
            if is_step:
                self._apply([(grad, 1.0, parts)], 1.0)
            self._moved(out, pid, epoch, step, ev.span)
            if not ev.pull_next:
                self._answer(out, ev.slot, None)
                return
            self._prepare(pid, ev.keys, ev.counts)
            if self.spec.staleness_steps is None:
                self._give(out, ev.slot, pid, rows, newest=True)
            elif self._may_go(pid):
                self._through_gate(out, ev.slot, pid, rows)
            else:
                self._gates.append(_Waiting(ev.slot, pid, rows))
                self.stats["gate_waits"] += 1
                out.append(Wait(ev.slot, None))
            return
        if is_step:
            self._pushes.setdefault((epoch, step), {})[pid] = (grad, float(ev.rows), parts)
        if ev.last:
            self._steps.setdefault(epoch, {})[pid] = step + 1 if is_step else step
        self.positions[pid] = (epoch, step)
        self._advance(out)
        if not ev.pull_next:
            self._answer(out, ev.slot, None)
            return
        self._prepare(pid, ev.keys, ev.counts)
        if (self.epoch, self.step) >= (epoch, step + 1):
            self._give(out, ev.slot, pid, rows, newest=False)
        else:
            self._wait(out, _Waiting(ev.slot, pid, rows, (epoch, step + 1)))

    def _on_lookup(self, ev: Lookup, out: list[Instruction]) -> None:
        self._check_token(ev.token)
        waiting = _Waiting(ev.slot, -1, False, ev.at, True, ev.keys)
        if ev.dense and ev.at is not None and self.spec.sync and (self.epoch, self.step) < ev.at:
            self._wait(out, waiting)
        elif ev.dense:
            self._give_lookup(out, waiting)
        else:
            self._answer(out, ev.slot, self._lookup(ev.keys))

    def _on_retire(self, ev: Retire, out: list[Instruction]) -> None:
        self._check_spare()
        self._retired.add(ev.pid)
        self._open_gates(out)
        self._answer(out, ev.slot, None)

    def _on_reset(self, ev: Reset, out: list[Instruction]) -> None:
        self._check_spare()
        self._refuse_waiting(out, "the shards were reset for a relaunch")
        self._replaced = (self.restarted, int(self.stats["updates"]), dict(self.positions))
        self._fresh()
        self.token = ev.token
        self.restarted = False
        self._answer(out, ev.slot, None)

    def _on_save(self, ev: Save, out: list[Instruction]) -> None:
        self._check_spare()
        out.append(WriteCheckpoint(ev.uri, ev.name, {**self._snapshot(), "cut": ev.cut}))
        summary = {
            "shard": self.spec.shard_id,
            "name": ev.name,
            "updates": self.stats["updates"],
            "rows": sum(len(t) for t in self.tables),
        }
        self._answer(out, ev.slot, summary)

    def _on_restore(self, ev: Restore, out: list[Instruction]) -> None:
        self._check_spare()
        record = ev.record
        if record.get("cut") != ev.cut:
            raise CheckpointError(
                f"parameter shard {self.spec.shard_id}: {ev.where} belongs to another "
                f"checkpoint (cut {record.get('cut')!r}, expected {ev.cut!r}); not restored"
            )
        lost, updates, positions = (
            self._replaced
            if self._replaced is not None
            else (self.restarted, self.stats["updates"], dict(self.positions))
        )
        self._replaced = None
        self._refuse_waiting(out, "the shards were restored from a checkpoint")
        self._fresh()
        self._restore(record)
        self.token = ev.token
        self.restarted = False
        self.stats["restores"] += 1
        summary = {
            "shard": self.spec.shard_id,
            "discarded_updates": None if lost else updates - self.stats["updates"],
            "positions_before": None if lost else positions,
            "positions_cut": dict(self.positions),
        }
        self._answer(out, ev.slot, summary)

    def _on_load_rows(self, ev: LoadRows, out: list[Instruction]) -> None:
        self._check_spare()
        tab = self.table(ev.table)
        keys = np.asarray(ev.keys, dtype=np.int64)
        if (tab.index.find(keys) >= 0).any() or len(np.unique(keys)) != len(keys):
            raise UsageError(f"table {ev.table!r}: a loaded key is held already (a duplicate key)")
        rows, _ = tab.index.find_or_insert(keys)
        tab._make_room(tab.index.n)
        tab.values[rows] = ev.values
        for name, start in tab.rule.row_state().items():
            tab.state[name][rows] = start
        tab.touches[rows] = 0
        tab.last_step[rows] = self.version
        self._answer(out, ev.slot, len(tab))

    def _on_configure(self, ev: Configure, out: list[Instruction]) -> None:
        self._take_run(restarted=ev.restarted)
        try:
            self._setup(ev.spec, ev.can_put, restarted=False)
        except BaseException:
            self._back_to_spare(keep=("one_thread", "asked", "answered"))
            raise
        self._answer(out, ev.slot, None)

    def _on_forget(self, ev: Forget, out: list[Instruction]) -> None:
        if self._spare or ev.declined:
            self._answer(out, ev.slot, self._spare)
            return
        self._refuse_waiting(out, "the run ended")
        self._back_to_spare(keep=("one_thread", "asked", "answered"))
        self._answer(out, ev.slot, True)

    # -- answers ----------------------------------------------------------------------------

    def _answer(self, out: list[Instruction], slot: Any, value: Any) -> None:
        self.answered += 1
        out.append(Reply(slot, value))

    def _wait(self, out: list[Instruction], waiting: _Waiting) -> None:
        """Sync: ``waiting`` waits for its step (``_advance`` answers it)."""
        self._waiters.append(waiting)
        out.append(Wait(waiting.slot, waiting.until))

    def _release(self, out: list[Instruction], waiting: _Waiting) -> None:
        if waiting.is_lookup:
            self._give_lookup(out, waiting)
        else:
            self._give(out, waiting.slot, waiting.pid, waiting.rows, newest=False)

    def _give(
        self, out: list[Instruction], slot: Any, pid: int, rows: bool, *, newest: bool
    ) -> None:
        """Reply with the current parameters (and ``pid``'s rows)."""
        self.stats["pulls"] += 1
        version, inline, by_ref = self._dense(out, newest)
        self._answer(out, slot, Values(version, inline, by_ref, self._rows(pid) if rows else None))

    def _give_lookup(self, out: list[Instruction], waiting: _Waiting) -> None:
        version, inline, by_ref = self._dense(out, False)
        self._answer(out, waiting.slot, Values(version, inline, by_ref, self._lookup(waiting.keys)))

    def _dense(self, out: list[Instruction], newest: bool) -> tuple[int, np.ndarray | None, bool]:
        """The current dense values as a reply carries them: inline (a copy) when small or
        without an object store; else by reference, put once per version (``newest``
        and ``one_thread``: the live array the first time a version is handed out)."""
        w, version = self.w, self.version
        if self.can_put and w.nbytes > self.spec.inline_limit:
            self.stats["bytes_out"] += w.nbytes
            if newest and self.one_thread and self._sent_live != version:
                self._sent_live = version
                return version, w, False
            if self._put_version != version:
                out.append(Put(version, w))
                self._put_version = version
                self._puts += 1
            self.stats["puts"] = self._puts
            return version, None, True
        self.stats["puts"] = self._puts
        inline = w.copy()
        self.stats["bytes_out"] += inline.nbytes
        return version, inline, False

    def _rows(self, pid: int) -> tuple[np.ndarray | None, ...]:
        sent = self._sent.get(pid, [])
        out = tuple(
            None if s is None else t.read_or_init(resolved(t, s), s.keys)
            for t, s in zip(self.tables, sent)
        )
        self.stats["bytes_out"] += sum(v.nbytes for v in out if v is not None)
        return out

    def _lookup(self, keys: Any) -> tuple[np.ndarray | None, ...]:
        """Values of ``keys`` (per table) without creating rows: an unknown key reads as
        its initializer's value."""
        self.stats["lookups"] += 1
        self._count_in(None, None, keys)
        out = tuple(
            None if k is None else t.lookup(np.asarray(k, np.int64))
            for t, k in zip(self.tables, keys)
        )
        self.stats["bytes_out"] += sum(v.nbytes for v in out if v is not None)
        return out

    def _refuse_waiting(self, out: list[Instruction], why: str) -> None:
        for waiting in (*self._waiters, *self._gates):
            self.answered += 1
            out.append(
                Refuse(waiting.slot, StaleShardCall(f"parameter shard {self.spec.shard_id}: {why}"))
            )
        self._waiters, self._gates = [], []

    # -- refusals ---------------------------------------------------------------------------

    def _check_spare(self) -> None:
        if self._spare:
            raise StaleShardCall(
                "a spare parameter shard refused a call: it serves no run (the run that "
                "called has ended, or has not configured it yet); nothing was applied"
            )

    def _check_token(self, token: str | None) -> None:
        self._check_spare()
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

    def _refuse_bad_gradient(self, pid: int, epoch: int, step: int, grad: Any) -> None:
        """Refuse, whole and before any of it is stored or applied, a dense gradient that
        is not of the shard's length (numpy would broadcast it over every key: a silent
        wrong answer) and a sparse one holding NaN/inf. The worker checked every gradient
        before sending any slice (so no shard applies part of a bad step); the sparse
        check is defence in depth for producers other than it, and cheap (a pass over
        the entries pushed, next to their fancy-indexed update). Dense values are not
        scanned again here: that would be a second full pass per push in the one process
        that applies every worker's update (the bottleneck in async mode), for values
        the worker has just checked."""
        spec = self.spec
        if isinstance(grad, np.ndarray):
            if grad.shape != self.w.shape:
                raise UsageError(
                    f"parameter shard {spec.shard_id} (keys [{spec.lo}, {spec.hi})) refused "
                    f"the push of partition {pid} at epoch {epoch}, step {step}: a dense "
                    f"gradient of shape {grad.shape} for {self.w.shape[0]} keys; push the "
                    f"shard's slice of the flat gradient; nothing of the push was applied"
                )
            return
        if not isinstance(grad, tuple):
            return
        keys, vals = grad
        i = first_nonfinite(vals)
        if i is not None:
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
        checked: list[tuple[Sent, np.ndarray] | None] = []
        for t, (tab, g) in enumerate(zip(self.tables, tables)):
            if g is None:
                checked.append(None)
                continue
            got = sent[t] if sent is not None else None
            g = np.asarray(g, dtype=np.float64)
            if got is None or g.shape != (len(got.keys), tab.spec.dim):
                raise UsageError(
                    f"parameter shard {self.spec.shard_id}: partition {pid} pushed gradient "
                    f"rows of shape {g.shape} for table {tab.spec.name!r}, but "
                    f"{0 if got is None else len(got.keys)} rows of dim {tab.spec.dim} were "
                    f"sent to it for this step"
                )
            i = first_nonfinite(g)
            if i is not None:
                key = int(got.keys[i // tab.spec.dim])
                raise NonFiniteGradient(
                    f"parameter shard {self.spec.shard_id} refused the push of partition {pid} "
                    f"at epoch {epoch}, step {step}: the gradient of table {tab.spec.name!r} "
                    f"for key {key} is {g.reshape(-1)[i]}; nothing of the push was applied"
                )
            checked.append((got, g))
        out: _TableParts = []
        for tab, c in zip(self.tables, checked):
            if c is None:
                out.append(None)
                continue
            mine, g = c
            rows = resolved(tab, mine).copy()  # the part's own: _sent changes on
            out.append(Part(mine.keys, rows, mine.counts, g))
        return out

    # -- bookkeeping --------------------------------------------------------------------------

    def table(self, name: str) -> Table:
        for tab in self.tables:
            if tab.spec.name == name:
                return tab
        raise UsageError(f"parameter shard {self.spec.shard_id} holds no table {name!r}")

    def _prepare(self, pid: int, keys: Any, counts: Any = None) -> None:
        """Find the rows of ``keys`` (per table; a table without bounds creates the
        absent ones) and remember them for ``pid``."""
        if keys is None:
            return
        sent: list[Sent | None] = []
        for t, (tab, k) in enumerate(zip(self.tables, keys)):
            if k is None:
                sent.append(None)
                continue
            k = np.asarray(k, np.int64)
            rows = tab.rows_for(k, create=not tab.bounded, step=self.version)
            c = None if counts is None or counts[t] is None else np.asarray(counts[t], np.int64)
            sent.append(Sent(k, rows, c))
        self._sent[pid] = sent

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
        self.version = self._base_version = int(snap["version"])
        self.epoch, self.step = int(snap["epoch"]), int(snap["step"])
        self.positions = dict(snap["positions"])
        self._spans = dict(snap["spans"])
        for k in ("pushes", "updates", "pulls"):
            self.stats[k] = snap["stats"][k]
        for tab, part in zip(self.tables, snap["tables"]):
            tab.restore(part)

    # -- staleness gates (async) ------------------------------------------------------------

    def _moved(
        self, out: list[Instruction], pid: int, epoch: int, step: int, span: int | None
    ) -> None:
        self.positions[pid] = (epoch, step)
        if span is not None:
            self._spans[pid] = span
        if self._gates:
            self._open_gates(out)

    def _done_steps(self, pid: int, width: int) -> int:
        pos = self.positions.get(pid)
        return 0 if pos is None else pos[0] * width + pos[1] + 1

    def lead(self, pid: int) -> int:
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
        return k is None or self.lead(pid) <= k

    def _open_gates(self, out: list[Instruction]) -> None:
        keep = []
        for waiting in self._gates:
            if self._may_go(waiting.pid):
                self._through_gate(out, waiting.slot, waiting.pid, waiting.rows)
            else:
                keep.append(waiting)
        self._gates = keep

    def _through_gate(self, out: list[Instruction], slot: Any, pid: int, rows: bool) -> None:
        # the lead a released worker starts its next step with (at most the bound)
        self.stats["max_lead"] = max(self.stats["max_lead"], self.lead(pid))
        self._give(out, slot, pid, rows, newest=True)

    # -- sync steps and the apply -------------------------------------------------------------

    def _advance(self, out: list[Instruction]) -> None:
        """Apply every sync step whose pushes are all in; end epochs; answer the calls
        waiting for a step now reached (in the order they came)."""
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
            for waiting in self._waiters:
                if waiting.until is not None and waiting.until <= now:
                    self._release(out, waiting)
                else:
                    keep.append(waiting)
            self._waiters = keep

    def _apply(self, parts: list[tuple[Any, float, _TableParts | None]], total: float) -> None:
        """One update from ``parts`` (gradient, weight, table parts): ``sum(weight * g) /
        total``, the sum in the order of ``parts`` (worker order)."""
        started = time.perf_counter()  # a counter only: nothing is decided by the clock
        if total <= 0:
            return
        dense = [(g, r) for g, r, _ in parts if g is not None]
        if dense and len(self.w):
            apply_dense(self.rule, self.w, dense, total, self._acc, self._part)
        now = self.version
        for t, tab in enumerate(self.tables):
            got: list[tuple[Part, float]] = []
            for _, r, tp in parts:
                part = tp[t] if tp is not None else None
                if part is not None:
                    got.append((part, r))
            if tab.bounded and got:
                got = admitted(tab, got, now)
            if got:
                rg = [((p.rows, p.g), r) for p, r in got]
                tab.apply(*weighted_rows(rg, total, tab.spec.dim), step=now)
            if tab.bounded:
                remap = tab.expire(now)
                if remap is not None:
                    renumber(self._sent.values(), t, remap)
        self.version += 1
        self._applied += 1
        self.stats["updates"] += 1
        self.stats["apply_seconds"] += time.perf_counter() - started


_HANDLERS: dict[type, Callable[[ShardCore, Any, list[Instruction]], None]] = {
    Pull: ShardCore._on_pull,
    Push: ShardCore._on_push,
    Lookup: ShardCore._on_lookup,
    Retire: ShardCore._on_retire,
    Reset: ShardCore._on_reset,
    Save: ShardCore._on_save,
    Restore: ShardCore._on_restore,
    LoadRows: ShardCore._on_load_rows,
    Configure: ShardCore._on_configure,
    Forget: ShardCore._on_forget,
}
