"""The coordinator's decisions in one pure object: events in, instructions out.

``CoordinatorCore.handle(event) -> list[instruction]`` is the only entry. It wraps the
epoch state machine (``_state.py``: calls, alignments, termination, releases) and the cut
protocol (``_cut.py``: fencing, sync buffering, the checkpoint cut, the restore) and
decides, in the order docs/semantics.md and docs/fault_tolerance.md give, everything the coordinator actor
does: which call is accepted, when an alignment completes, which user callback runs
next, who is released and with which answer, when subtasks are asked for their state,
when a checkpoint is written, how the iteration terminates (the terminating round, then
``on_iteration_terminated``), and which failure ends it. No Ray, no asyncio, no I/O and
no user code run here: the actor (``_actor.py``) carries the instructions out.

Instructions come in order; the shell carries them out in that order. Two kinds need an
outcome before the core can go on: a user callback (``UserCall``: its failure, and the
variables it published, decide what follows) and ``WriteCheckpoint``. They always end
the list; the shell answers with ``Done`` (the next ``handle``), and no other event is
taken meanwhile. Internally each event is a generator that yields instructions, so the
decision logic reads top to bottom.

``Answer.slots`` are the shell's opaque handles of waiting calls (its futures): the core
only stores and returns them. One ``Answer`` per distinct reply: equal replies are one
object, so a group of many subtasks pickles each once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._cut import Cut, CutProtocol
from ._errors import (
    CoreError,
    FeedbackShapeMismatch,
    RemoteFailure,
    StateMachineError,
    _FailureRecorded,
)
from ._protocol import Emissions, Reply
from ._state import EpochStateMachine
from ._variables import VariablesPayload

__all__ = [
    "COORDINATOR",
    "Aligned",
    "Answer",
    "Apply",
    "ApplyCombined",
    "BeginAttempt",
    "CoordinatorCore",
    "Done",
    "Emitted",
    "Fail",
    "Failed",
    "FeedbackShapes",
    "Finish",
    "GroupReport",
    "Notify",
    "Report",
    "Restore",
    "StateSent",
    "Terminate",
    "TerminatingRound",
    "UserCall",
    "Watermark",
    "WriteCheckpoint",
]

#: the ``source`` of failures and outputs of the coordinator tier
COORDINATOR = "coordinator"


# -- events ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Report:
    """Subtask ``pid``'s call ``call``; ``offered``: ``(its checkpoint state,)`` sent with
    a call a cut will hold (sync); ``slot``: where its answer goes."""

    pid: int
    call: int
    known_version: int
    emissions: Emissions
    rows: Sequence[int] | None = None
    attempt: int = 0
    offered: tuple[Any] | None = None
    slot: Any = None


@dataclass(frozen=True, slots=True)
class GroupReport:
    """A feedback group's call ``call`` for its ``members`` ``(pid, known_version,
    emissions without feedback, rows)``, their feedback merged into ``combined``; each
    member's answer goes to its ``slots`` entry."""

    first_pid: int
    call: int
    members: Sequence[tuple[int, int, Emissions, Sequence[int] | None]]
    combined: Emissions
    attempt: int
    slots: Sequence[Any]


@dataclass(frozen=True, slots=True)
class StateSent:
    """Subtask ``pid``, held in ``call`` with variables ``known_version``, sent its
    operator state for the cut; it waits at ``slot`` to be released."""

    pid: int
    call: int
    known_version: int
    state: Any
    attempt: int
    slot: Any = None


@dataclass(frozen=True, slots=True)
class Finish:
    """Subtask ``pid`` ran ``on_iteration_terminated``; ``emissions`` are its last,
    ``round_emissions`` its per-round operators' of the terminating round."""

    pid: int
    emissions: Emissions
    attempt: int = 0
    round_emissions: Emissions | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """A failure reported from outside (a subtask, a group, the shell); ``attempt``
    None: the shell's own, always taken."""

    failure: RemoteFailure
    attempt: int | None = None


@dataclass(frozen=True, slots=True)
class BeginAttempt:
    """From now on only calls of launch ``attempt`` are served."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Restore:
    """A checkpoint's core part (``WriteCheckpoint.state``) and its variables version."""

    state: Mapping[str, Any]
    version: int


@dataclass(frozen=True, slots=True)
class Emitted:
    """Coordinator-tier records emitted outside a ``UserCall`` (an operator opened or
    restored while the actor starts): ``(epoch, published, criteria)``, and the
    variables version after them."""

    counts: tuple[tuple[int, int, int], ...]
    version: int


@dataclass(frozen=True, slots=True)
class Done:
    """The outcome of the last ``UserCall`` or ``WriteCheckpoint``: its failure (None: it
    succeeded), the coordinator-tier records it emitted ``(epoch, published, criteria)``
    and the variables version after it."""

    failure: RemoteFailure | None = None
    counts: tuple[tuple[int, int, int], ...] = ()
    version: int | None = None


# -- instructions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the calls waiting at ``slots``: they may run epoch ``epoch`` (or stop, with
    ``terminated``); ``variables``: with the current version's payload; ``need_state``:
    send your operator state and wait; ``error``: the run failed."""

    slots: tuple[Any, ...]
    epoch: int
    terminated: bool
    aligned: int
    variables: bool = False
    error: RemoteFailure | None = None
    need_state: bool = False
    terminating_round: int | None = None

    def reply(self, payload: VariablesPayload | None) -> Reply:
        """The protocol record a waiting call receives (``payload``: the variables)."""
        return Reply(
            self.epoch,
            self.terminated,
            self.aligned,
            payload,
            self.error,
            self.need_state,
            self.terminating_round,
        )


class UserCall:
    """Run coordinator-tier user code; the shell answers with ``Done``."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Apply(UserCall):
    """``process_feedback`` for each feedback value of ``pid`` (``ctx.source_partition``),
    then its outputs through the listeners; all at ``epoch``. ``terminating``: inside the
    terminating round (its publishes are dropped)."""

    epoch: int
    pid: int
    emissions: Emissions
    terminating: bool = False


@dataclass(frozen=True, slots=True)
class ApplyCombined(UserCall):
    """feedback_combine: fold ``main`` (and ``round``) left to right, in partition order,
    and call ``process_feedback`` once with each total."""

    epoch: int
    main: Sequence[Any]
    round: Sequence[Any]


@dataclass(frozen=True, slots=True)
class Watermark(UserCall):
    """The coordinator tier's ``on_epoch_watermark_incremented(epoch)``: every operator,
    per-round ones closed after it, then the listeners."""

    epoch: int


@dataclass(frozen=True, slots=True)
class TerminatingRound(UserCall):
    """The per-round operators of the terminating round ``epoch``: their end-of-round
    watermark callback, then close (publishes dropped)."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Terminate(UserCall):
    """The partitions' last ``outputs`` (partition order) at ``epoch``, then
    ``on_iteration_terminated`` of every operator still alive and the listeners."""

    epoch: int
    outputs: Sequence[tuple[int, Sequence[tuple[str, Any]]]]


@dataclass(frozen=True, slots=True)
class WriteCheckpoint:
    """Write checkpoint ``epoch`` with this core part (``Restore`` takes it back) and the
    shell's own (variables, operator states, outputs); answer with ``Done``."""

    epoch: int
    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Aligned:
    """Global alignment ``epoch`` completed; ``cut``: a checkpoint's cut starts here."""

    epoch: int
    cut: bool


@dataclass(frozen=True, slots=True)
class Fail:
    """The run failed with ``failure`` (the waiting calls are answered by ``Answer``s)."""

    failure: RemoteFailure


@dataclass(frozen=True, slots=True)
class Notify:
    """Progress changed (the driver's progress poll may want to know)."""


Event = Report | GroupReport | StateSent | Finish | Failed | BeginAttempt | Restore | Emitted | Done
Instruction = Answer | UserCall | WriteCheckpoint | Aligned | Fail | Notify
_Flow = Generator[Instruction, Done | None, Any]


class FeedbackShapes:
    """The i-th array a partition feeds back must have the shape of the first
    partition's i-th: summing (3,) and (1, 3) broadcasts to a silent wrong answer."""

    def __init__(self) -> None:
        self._first: dict[int, tuple[int, tuple[int, ...]]] = {}

    def check(self, pid: int, epoch: int, values: Sequence[Any]) -> RemoteFailure | None:
        for i, value in enumerate(values):
            if not isinstance(value, np.ndarray):
                continue
            first = self._first.setdefault(i, (pid, value.shape))
            if first[1] != value.shape:
                return RemoteFailure.capture(
                    FeedbackShapeMismatch(
                        f"partition {pid} fed back an array of shape {value.shape} as its "
                        f"feedback record #{i} at epoch {epoch}, but partition {first[0]} "
                        f"fed back shape {first[1]}: every partition must feed back "
                        f"arrays of the same shape (a sum would broadcast them)"
                    ),
                    source=pid,
                    epoch=epoch,
                    where="feedback",
                )
        return None


@dataclass
class _Partials:
    """feedback_combine: the feedback values of one call by first partition (a group's
    merged value, or a lone subtask's values), merged in that order at the alignment."""

    main: dict[int, list[Any]] = field(default_factory=dict)
    round: dict[int, list[Any]] = field(default_factory=dict)


class CoordinatorCore:
    """One bounded iteration's coordinator logic (see the module docstring)."""

    def __init__(
        self,
        num_subtasks: int,
        *,
        num_streams: int,
        staleness: int | None,
        max_epochs: int | None,
        has_criteria: bool,
        checkpoint_every: int = 0,
        tree: bool = False,
        tree_groups: bool = False,
        attempt: int | None = None,
    ) -> None:
        config = {"staleness": staleness, "max_epochs": max_epochs, "has_criteria": has_criteria}
        self._config: dict[str, Any] = config  # a restore builds its state machine alike
        self.sm = EpochStateMachine(
            num_subtasks, staleness=staleness, max_epochs=max_epochs, has_criteria=has_criteria
        )
        self.cut = CutProtocol(num_subtasks, sync=staleness == 0, every_epochs=checkpoint_every)
        if attempt is not None:
            self.cut.begin_attempt(attempt)
        #: feedback_combine: feedback goes to per-call partials; ``tree_groups``: every
        #: subtask reports through a group actor (a direct call is a protocol error)
        self.tree, self.tree_groups = tree, tree_groups
        self.version = 0  # the newest variables version (the shell's store has it too)
        #: the calls held: pid -> (call, variables version it had processed, slot)
        self.waiters: dict[int, tuple[int, int, Any]] = {}
        self.rows = [0] * num_streams
        self.feedback_counts: Counter[int] = Counter(dict.fromkeys(range(num_subtasks), 0))
        self.failures: list[RemoteFailure] = []
        self.closed = False  # every operator has heard on_iteration_terminated
        self._shapes = FeedbackShapes()
        self._partials: dict[int, _Partials] = {}
        self._final: dict[int, Emissions] = {}
        self._final_round: dict[int, Emissions] = {}
        self._flow: _Flow | None = None
        self._handlers: dict[type, Callable[[Any], _Flow]] = {
            Report: self._on_report,
            GroupReport: self._on_group_report,
            StateSent: self._on_state,
            Finish: self._on_finish,
            Failed: self._on_failed,
            BeginAttempt: self._on_begin_attempt,
            Restore: self._on_restore,
            Emitted: self._on_emitted,
        }

    # -- the entry --------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        """Take ``event``; the instructions to carry out, in order."""
        out: list[Instruction] = []
        if isinstance(event, Done):
            flow, self._flow = self._flow, None
            if flow is None:
                raise CoreError("Done without a user call or checkpoint write pending")
            if event.version is not None:
                self.version = event.version
            for epoch, published, criteria in event.counts:
                self.sm.record_coordinator(epoch, published=published, criteria=criteria)
            if event.failure is None:
                return self._drive(flow, out, None)
            out += self._fail(event.failure)
            return self._drive(flow, out, _FailureRecorded())
        if self._flow is not None:
            raise CoreError(f"{type(event).__name__} while a user call's outcome is awaited")
        handler = self._handlers.get(type(event))
        if handler is None:
            raise CoreError(f"not an event: {event!r}")
        return self._drive(handler(event), out, None)

    def _drive(
        self, flow: _Flow, out: list[Instruction], throw: Exception | None
    ) -> list[Instruction]:
        while True:
            try:
                ins = flow.throw(throw) if throw is not None else flow.send(None)
            except StopIteration:
                return out
            throw = None
            out.append(ins)
            if isinstance(ins, UserCall | WriteCheckpoint):
                self._flow = flow  # resumed by the Done that answers it
                return out

    # -- queries ----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.closed or bool(self.failures)

    def restore_instruction(self, pid: int) -> tuple[int, int, Any] | None:
        """What relaunched subtask ``pid`` restores: ``(the call to make again, the
        variables version it had processed, its state)``; None: it starts from scratch."""
        got = self.cut.instruction(pid)
        return None if got is None else (got.call, got.known_version, got.state)

    def validate(self) -> None:
        """Invariants that hold between events (every core test checks them at its end)."""
        assert self._flow is None, "an instruction's outcome is still awaited"
        self.sm.validate(holding=self.cut.cutting is not None)
        assert self.version >= 0
        assert not self.cut.complete or self.failures, "a complete cut was left unwritten"
        if self.failures:
            assert self.sm.failed and not self.waiters, "a failed run left calls waiting"
            return
        for pid, (call, _, _) in self.waiters.items():
            assert self.sm.pending.get(pid) == call, (pid, call, self.sm.pending)
        if self.closed:
            assert self.sm.terminated is not None and self.sm.all_finished
        assert sum(self.feedback_counts.values()) >= 0

    # -- event handlers ---------------------------------------------------------------------

    def _on_report(self, ev: Report) -> _Flow:
        if self.tree_groups and self.cut.accepts(ev.attempt) and not self.failures:
            # with group actors every subtask reports to its group: a direct call would
            # leave its group waiting for it forever
            yield from self._fail(
                RemoteFailure(
                    ev.pid,
                    ev.call,
                    "reporting its call",
                    "ProtocolError",
                    f"subtask {ev.pid} reported to the coordinator directly, but the "
                    f"feedback tree has group actors and it belongs to one",
                    "",
                )
            )
        accepted = yield from self._accept(
            ev.pid, ev.call, ev.known_version, ev.emissions, ev.rows, ev.attempt, ev.slot
        )
        if not accepted:
            return
        if ev.offered is not None:
            self.cut.offer_state(ev.pid, ev.call, ev.known_version, ev.offered[0], self.sm.aligned)
        try:
            yield from self._advance()
        except _FailureRecorded:
            pass
        yield from self._release()

    def _on_group_report(self, ev: GroupReport) -> _Flow:
        if self.cut.accepts(ev.attempt) and not self.failures and self.sm.terminated is None:
            self._take_partial(ev.first_pid, ev.call, ev.combined)
        aligned = self.sm.aligned
        for (pid, known_version, em, rows), slot in zip(ev.members, ev.slots):
            yield from self._accept(pid, ev.call, known_version, em, rows, ev.attempt, slot)
        try:
            yield from self._advance()
        except _FailureRecorded:
            pass
        # sync only: a call is released by an alignment, termination or a checkpoint, or
        # at once when its epoch is already aligned (after a restore); else the O(N)
        # release scan would run once per group call for nothing
        if (
            self.sm.aligned != aligned
            or ev.call <= self.sm.aligned
            or self.sm.terminated is not None
            or self.cut.cutting is not None
        ):
            yield from self._release()

    def _on_state(self, ev: StateSent) -> _Flow:
        if not self.cut.accepts(ev.attempt):
            yield self._stale(ev.slot, ev.call, ev.attempt)
            return
        if self.failures:
            yield self._error((ev.slot,), ev.call)
            return
        self.waiters[ev.pid] = (ev.call, ev.known_version, ev.slot)
        self.cut.on_state(ev.pid, ev.call, ev.known_version, ev.state)
        yield from self._release()

    def _on_finish(self, ev: Finish) -> _Flow:
        if self.failures or not self.cut.accepts(ev.attempt):
            return
        try:
            self._final[ev.pid] = ev.emissions
            if ev.round_emissions is not None:
                self._final_round[ev.pid] = ev.round_emissions
            if self.sm.finish(ev.pid):
                yield from self._terminating_round()
                # the partitions' last outputs, in partition order (deterministic)
                last = max(self.sm.epochs_completed - 1, 0)
                outputs = [(p, self._final[p].outputs) for p in sorted(self._final)]
                self._final.clear()
                yield Terminate(last, outputs)
                self.closed = True
        except _FailureRecorded:
            pass
        except StateMachineError as ex:
            yield from self._fail(
                RemoteFailure.capture(ex, source=COORDINATOR, epoch=None, where="protocol")
            )
        yield Notify()

    def _on_failed(self, ev: Failed) -> _Flow:
        if ev.attempt is None or self.cut.accepts(ev.attempt):  # old launches: old news
            yield from self._fail(ev.failure)

    def _on_begin_attempt(self, ev: BeginAttempt) -> _Flow:
        self.cut.begin_attempt(ev.attempt)
        yield from ()

    def _on_restore(self, ev: Restore) -> _Flow:
        state = ev.state
        self.sm = EpochStateMachine.restore(state["sm"], **self._config)
        self.cut.restore(Cut.from_plain(state["cut"]))
        self.feedback_counts = Counter(dict(enumerate(state["feedback_counts"])))
        self.rows = list(state["rows"])
        self.version = ev.version
        yield from ()

    def _on_emitted(self, ev: Emitted) -> _Flow:
        for epoch, published, criteria in ev.counts:
            self.sm.record_coordinator(epoch, published=published, criteria=criteria)
        self.version = ev.version
        yield from ()

    # -- steps ------------------------------------------------------------------------------

    def _accept(
        self,
        pid: int,
        call: int,
        known_version: int,
        em: Emissions,
        rows: Sequence[int] | None,
        attempt: int,
        slot: Any,
    ) -> Generator[Instruction, Done | None, bool]:
        """Validate and take call ``call`` of ``pid``: True when it now waits (its
        answer comes later), False when it was answered at once."""
        if not self.cut.accepts(attempt):
            yield self._stale(slot, call, attempt)
            return False
        if self.failures:
            yield self._error((slot,), call)
            return False
        try:  # validate the call before anything waits on it
            self.sm.report(pid, call, feedback=em.feedback_count, criteria=em.criteria)
        except StateMachineError as ex:  # a protocol bug: fail loudly, never hang
            yield from self._fail(
                RemoteFailure.capture(ex, source=COORDINATOR, epoch=call, where="protocol")
            )
            yield self._error((slot,), call)
            return False
        self.waiters[pid] = (call, known_version, slot)
        try:
            if rows is not None:
                for i, n in enumerate(rows):
                    self.rows[i] += n
            if self.sm.terminated is not None:
                # the loop is closed: feedback is no longer applied; outputs are kept
                if em.outputs:
                    yield Apply(max(call - 1, 0), pid, Emissions(outputs=em.outputs))
            else:
                if self.tree and self.cut.sync:
                    self._take_partial(pid, call, em)
                if self.cut.on_report(pid, call, em):  # else: held for the alignment
                    yield from self._apply(pid, max(call - 1, 0), em)
        except _FailureRecorded:
            pass
        return True

    def _take_partial(self, first_pid: int, call: int, em: Emissions) -> None:
        """feedback_combine: take ``em``'s feedback out of it into the partials of
        ``call`` (keeping its record count)."""
        if not (em.feedback or em.round_feedback):
            return  # a group's member (its feedback came merged) or nothing fed back
        part = self._partials.get(call)
        if part is None:
            part = self._partials[call] = _Partials()
        em.combined_count = em.feedback_count
        if em.feedback:
            part.main[first_pid], em.feedback = em.feedback, []
        if em.round_feedback:
            part.round[first_pid], em.round_feedback = em.round_feedback, []

    def _apply(
        self, pid: int, epoch: int, em: Emissions, *, terminating: bool = False
    ) -> Generator[Instruction, Done | None, None]:
        failure = self._shapes.check(pid, epoch, em.feedback)
        if failure is not None:
            yield from self._fail(failure)
            raise _FailureRecorded
        self.feedback_counts[pid] += em.feedback_count
        if em.feedback or em.round_feedback or em.outputs:
            yield Apply(epoch, pid, em, terminating)

    def _advance(self) -> Generator[Instruction, Done | None, None]:
        while (k := self.sm.next_alignment()) is not None:
            epoch = max(k - 1, 0)
            part = self._partials.pop(k, None)
            if part is not None:
                main = [v for p in sorted(part.main) for v in part.main[p]]
                round_ = [v for p in sorted(part.round) for v in part.round[p]]
                yield ApplyCombined(epoch, main, round_)
            for pid, em in self.cut.aligned(k):
                yield from self._apply(pid, epoch, em)
            if k >= 1:
                yield Watermark(k - 1)
            if k == 0:
                empty = [i for i, n in enumerate(self.rows) if n == 0]
                if empty:
                    yield from self._fail(
                        RemoteFailure(
                            "data",
                            0,
                            "initial input",
                            "EmptyDataError",
                            f"data stream(s) {empty} had no rows in any partition; an "
                            f"iteration needs data: check the DataFrame's filters or source",
                            "",
                        )
                    )
                    return
            reason = self.sm.complete_alignment(k)
            yield Aligned(k, self.cut.after_alignment(k, terminated=reason is not None))

    def _release(self) -> Generator[Instruction, Done | None, None]:
        if self.failures:
            return
        if self.cut.cutting is not None:
            if self.sm.terminated is not None:
                self.cut.abandon()  # nothing to resume any more
            else:
                asks: dict[int, list[Any]] = {}
                for pid in self.cut.ask_state(list(self.waiters)):
                    call, _, slot = self.waiters.pop(pid)
                    asks.setdefault(call, []).append(slot)
                for call, slots in asks.items():  # it answers with its state and waits
                    yield Answer(tuple(slots), call, False, self.sm.aligned, need_state=True)
                if not self.cut.complete:
                    return  # hold everyone until every subtask's state is in
                cut = self.cut.take()
                try:
                    yield WriteCheckpoint(cut.epoch, self._checkpoint_state(cut))
                except _FailureRecorded:
                    return
        last_round = self.sm.terminating_round
        answers: dict[tuple[int, bool, bool], list[Any]] = {}
        for r in self.sm.releasable():
            _, known_version, slot = self.waiters.pop(r.pid)
            key = (r.epoch, r.terminated, self.version > known_version)
            answers.setdefault(key, []).append(slot)
        for (epoch, terminated, fresh), slots in answers.items():
            yield Answer(
                tuple(slots),
                epoch,
                terminated,
                self.sm.aligned,
                variables=fresh,
                terminating_round=epoch if last_round is not None else None,
            )

    def _terminating_round(self) -> Generator[Instruction, Done | None, None]:
        """Round k, into which the last variables were fed back, runs like every other
        round before termination (as in Flink ML): the partitions' per-round operators
        already ran it; here their feedback is applied and the coordinator tier's
        per-round operators of round k get their end-of-round callback."""
        k = self.sm.terminating_round
        emitted, self._final_round = self._final_round, {}
        if k is None:
            return
        for pid, em in sorted(emitted.items()):
            yield from self._apply(pid, k, em, terminating=True)
        yield TerminatingRound(k)

    def _checkpoint_state(self, cut: Cut) -> dict[str, Any]:
        calls = {pid: s.call for pid, s in cut.subtasks.items()}
        return {
            "epoch": cut.epoch,
            "sm": self.sm.snapshot(calls),
            "cut": cut.to_plain(),
            "feedback_counts": [self.feedback_counts[p] for p in range(self.sm.num_subtasks)],
            "rows": list(self.rows),
        }

    def _fail(self, failure: RemoteFailure) -> list[Instruction]:
        """Record ``failure``: every waiting call is answered with the first failure."""
        self.failures.append(failure)
        self.sm.fail()
        out: list[Instruction] = [Fail(failure)]
        by_epoch: dict[int, list[Any]] = {}
        for call, _, slot in self.waiters.values():
            by_epoch.setdefault(call, []).append(slot)
        self.waiters.clear()
        out += [self._error(tuple(slots), call) for call, slots in by_epoch.items()]
        return out

    def _error(self, slots: tuple[Any, ...], call: int) -> Answer:
        return Answer(slots, call, True, self.sm.aligned, error=self.failures[0])

    def _stale(self, slot: Any, call: int, attempt: int) -> Answer:
        stale = RemoteFailure(
            COORDINATOR,
            call,
            "fencing",
            "StaleAttempt",
            f"a call of launch {attempt} reached the coordinator of launch {self.cut.attempt}",
            "",
        )
        return Answer((slot,), call, True, self.sm.aligned, error=stale)
