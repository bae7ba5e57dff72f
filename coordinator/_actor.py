"""The coordinator actor: a thin asyncio shell around ``EpochStateMachine``.

Written as a plain class; ``hybrid_iter`` wraps it with ``ray.remote(num_cpus=0)`` where
it launches it. It runs the user's ``CoordinatorOperator`` (and the body's coordinator-
tier listeners such as termination criteria) in the actor's event loop, so user code is
never run concurrently with itself. The only Ray API it touches is ``ray.put`` for large
variable versions, passed in as a function so the class works without Ray in tests.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, cast

import numpy as np

from ._checkpoint import (
    CheckpointStore,
    ForeignCheckpoint,
    LoadedCheckpoint,
    checkpoint_key,
    damaged_since,
    dumps_state,
    fingerprint_mismatch,
    first_unpicklable,
    previous_checkpoint_key,
)
from ._cut import Cut, CutProtocol
from ._errors import (
    CheckpointEncodeError,
    CheckpointError,
    FeedbackShapeMismatch,
    RemoteFailure,
    ValueEncodeError,
    VariablesMismatchError,
)
from ._hooks import RuntimeHooks
from ._protocol import Emissions, OutputRecord, Progress, Reply, ResultData
from ._state import EpochStateMachine, StateMachineError
from ._tree import CoordinatorTree, TreeSpec
from ._variables import INLINE_LIMIT, VariablesPayload, VariablesStore

__all__ = [
    "CheckpointInfo",
    "CheckpointSpec",
    "CoordinatorCollector",
    "CoordinatorContext",
    "CoordinatorSpec",
    "FeedbackShapeMismatch",
    "IterationCoordinator",
    "MissingCheckpoint",
    "NonFiniteVariables",
    "UnpicklableOperator",
]

COORDINATOR = "coordinator"


@dataclass(frozen=True)
class CoordinatorSpec:
    """Everything the actor needs; plain, picklable data plus the user's operators."""

    num_subtasks: int
    num_streams: int
    staleness: int | None
    max_epochs: int | None
    has_criteria: bool
    init_variables: Mapping[str, Any]
    #: cloudpickle of ``(main_operator_or_None, per_round_operator_or_None, [listeners])``,
    #: loaded in the actor
    operators: bytes = b""
    #: the main coordinator operator is created afresh every round (PER_ROUND lifecycle)
    main_per_round: bool = False
    checkpoint: CheckpointSpec | None = None
    #: called at named points (tests: ``hybrid_iter.testing``); None: no hooks
    hooks: RuntimeHooks | None = None
    inline_limit: int = INLINE_LIMIT
    progress_tag: str = "loss"
    #: feedback_combine: merge feedback in a tree (sync only; ``coordinator._tree``)
    tree: TreeSpec | None = None
    #: the launch whose calls a newly created actor accepts from the start, so the driver
    #: need not wait for the actor's process before the Spark stage (None: none until
    #: ``begin_attempt``); a restarted actor ignores it (the driver opens the next one)
    attempt: int | None = None


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often the coordinator checkpoints, and whether it restores."""

    uri: str
    #: checkpoint at every alignment that is a multiple of this (0: never, only restore)
    every_epochs: int = 1
    keep_last: int = 2
    #: what identifies the iteration; a checkpoint with another fingerprint is refused
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    #: start from the newest valid checkpoint (a retry, or resume_from)
    restore: bool = False
    #: the run this iteration is; a checkpoint of another run is refused
    run_id: str = ""
    #: the HMAC key authenticating the files (resolved on the driver: ``checkpoint_key``)
    key: bytes = field(default_factory=checkpoint_key, repr=False)
    #: a key still accepted for reading during a key rotation (``previous_checkpoint_key``)
    previous_key: bytes | None = field(default_factory=previous_checkpoint_key, repr=False)
    #: a restore must find a checkpoint of at least this epoch (the driver saw it
    #: written, or resumes from it); finding less is an error, never a silent restart
    expect_epoch: int | None = None


class CoordinatorContext:
    """What coordinator-tier code can see. Runs in the Ray coordinator actor.

    ``epoch`` is the epoch of the record or watermark being handled; ``source_partition``
    is the sending partition inside ``process_feedback`` (``None`` elsewhere);
    ``variables`` is the newest published version.
    """

    def __init__(self, coordinator: IterationCoordinator) -> None:
        self._c = coordinator
        self.epoch = 0
        self.source_partition: int | None = None
        #: True while the terminating round's per-round operators run; their
        #: publish_variables are dropped (nothing is fed back after termination)
        self.terminating = False

    @property
    def num_partitions(self) -> int:
        return self._c.spec.num_subtasks

    @property
    def staleness(self) -> int | None:
        return self._c.spec.staleness

    @property
    def is_sync(self) -> bool:
        return self._c.spec.staleness == 0

    @property
    def variables(self) -> Mapping[str, Any]:
        return self._c.store.values

    @property
    def variables_version(self) -> int:
        return self._c.store.version

    @property
    def global_epoch_watermark(self) -> int:
        """The coordinator tier's epoch watermark (-1 before epoch 0 completes)."""
        return self._c.sm.aligned - 1


class CoordinatorCollector:
    """``out`` of coordinator-tier callbacks. Runs in the Ray coordinator actor."""

    def __init__(self, coordinator: IterationCoordinator, *, from_listener: bool = False) -> None:
        self._c = coordinator
        self._from_listener = from_listener

    def publish_variables(self, **variables: Any) -> None:
        """Publish new values of some variables: the next epoch's broadcast to partitions."""
        if self._c.ctx.terminating:
            return  # the terminating round's publishes are fed back nowhere (loop closed)
        for name, value in variables.items():
            arr = np.asarray(value)
            if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
                bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
                raise NonFiniteVariables(
                    f"publish_variables({name}=...) at epoch {self._c.ctx.epoch} has {bad} "
                    f"NaN/inf value(s) of {arr.size}; the update diverged (lower the learning "
                    f"rate, scale the features) or its input had NaN"
                )
        self._c.store.publish(variables)
        self._c.sm.record_coordinator(self._c.ctx.epoch, published=1)

    def output(self, tag: str, value: Any) -> None:
        """Emit a record to the iteration's outputs under ``tag``."""
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"output tag must be a non-empty string, got {tag!r}")
        self._c.route_output(tag, self._c.ctx.epoch, COORDINATOR, value, self._from_listener)

    def criteria(self, value: Any = 1) -> None:
        """Emit a termination-criteria record: the iteration continues this epoch."""
        if not self._c.spec.has_criteria:
            raise RuntimeError(
                "out.criteria() was called but the IterationBody has no criteria stream; "
                "pass IterationBody(..., criteria=True) or a criteria helper such as "
                "TerminateOnMaxIter(n)"
            )
        self._c.sm.record_coordinator(self._c.ctx.epoch, criteria=1)


class IterationCoordinator:
    """One iteration's coordinator. All public methods are called through Ray."""

    spec: CoordinatorSpec

    def __init__(
        self,
        spec: CoordinatorSpec | None,
        put: Callable[[Any], Any] | None = None,
        *,
        warm: Sequence[str] = (),
    ) -> None:
        """``spec`` None: a spare, started ahead of need (its process and imports are the
        slow part of a launch), with the modules ``warm`` (those of the operators it is
        likely to load) imported; ``configure`` makes it a run's coordinator."""

        if spec is not None:
            self._setup(spec, put)
            return
        import importlib

        for module in warm:
            try:
                importlib.import_module(module)
            except Exception:  # pragma: no cover - configure reports a real failure
                pass

    def configure(self, spec: CoordinatorSpec) -> None:
        """Make a spare the coordinator of ``spec``'s run, as the constructor would have
        (once; a spare runs without checkpoints, so Ray never restarts it)."""
        if hasattr(self, "spec"):
            raise RuntimeError("this coordinator is configured already")
        self._setup(spec, None)

    def retire(self) -> bool:
        """After a run that ended well (every Spark task of it has ended, so no call of
        it is on the way): forget the run (variables, operators, outputs) and wait, as
        a spare, for the next ``configure``. False when it must be killed instead: it
        owns group actors (a feedback tree) or holds a failure."""
        if self._failures or (self._tree is not None and self._tree.groups):
            return False
        self.__dict__.clear()
        return True

    def _setup(self, spec: CoordinatorSpec, put: Callable[[Any], Any] | None) -> None:
        get: Callable[[Any], Any] | None = None
        if put is None:
            try:
                import ray

                put, get = (ray.put, _get_own) if ray.is_initialized() else (None, None)
            except ImportError:  # pragma: no cover - ray is a dependency
                put = None
        self.spec = spec
        self.sm = EpochStateMachine(
            spec.num_subtasks,
            staleness=spec.staleness,
            max_epochs=spec.max_epochs,
            has_criteria=spec.has_criteria,
        )
        self.store = VariablesStore(
            spec.init_variables, put=put, get=get, inline_limit=spec.inline_limit
        )
        self.ctx = CoordinatorContext(self)
        self._out = CoordinatorCollector(self)
        self._listener_out = CoordinatorCollector(self, from_listener=True)
        self._waiters: dict[int, tuple[int, int, _Waiter]] = {}
        self._busy: tuple[str, int, float] | None = None
        self._feedback_shapes: dict[int, tuple[int, tuple[int, ...]]] = {}
        # fencing, sync buffering, the cut and the restore: pure logic (``_cut.py``)
        self.cut = CutProtocol(
            spec.num_subtasks,
            sync=spec.staleness == 0,
            every_epochs=spec.checkpoint.every_epochs if spec.checkpoint is not None else 0,
        )
        self._final: dict[int, Emissions] = {}
        self._final_round: dict[int, Emissions] = {}
        self._outputs: list[OutputRecord] = []
        self._alignment_times: list[float] = []
        self._feedback_counts = self._new_feedback_counts()
        self._rows = [0] * spec.num_streams
        self._failures: list[RemoteFailure] = []
        # the driver's progress polls: (answer at each alignment?, aligned, checkpointed)
        # seen by the poll, and its future
        self._progress_waiters: list[tuple[bool, int, int, asyncio.Future[None]]] = []
        self._last_loss: Any = None
        self._closed = False
        self._stash: dict[int, bytes] = {}
        self._main = _Slot(self, None, per_round=spec.main_per_round)
        self._round = _Slot(self, None, per_round=True)
        self._listeners: Sequence[Any] = ()
        self._tree: CoordinatorTree | None = None
        try:
            if spec.tree is not None:
                if spec.staleness != 0:
                    raise ValueError("feedback_combine needs a sync iteration (staleness=0)")
                self._tree = CoordinatorTree(
                    spec.tree, spec.num_subtasks, start_groups=put is not None
                )
            if spec.operators:
                import cloudpickle

                main, per_round, self._listeners = cloudpickle.loads(spec.operators)
                self._main = _Slot(self, main, per_round=spec.main_per_round)
                self._round = _Slot(self, per_round, per_round=True)
        except Exception as ex:
            self._record_failure(
                RemoteFailure.capture(
                    ex,
                    source=COORDINATOR,
                    epoch=None,
                    where="loading the coordinator operator or feedback combiner in the Ray actor "
                    "(is its module importable there? see hybrid_iter docs on shipping code)",
                )
            )
        self._ckpt_store: CheckpointStore | None = None
        self._cut_started = 0.0
        self._checkpointed = -1  # the newest checkpoint written or restored
        self._saved_outputs = 0
        self.checkpoints: list[tuple[int, str, float]] = []  # (epoch, path, seconds)
        self.restored_from: str | None = None
        self.restored_epoch: int | None = None
        self.skipped_checkpoints: list[tuple[str, str]] = []
        self._reconstructed = _was_reconstructed()
        if spec.attempt is not None and not self._reconstructed:
            self.cut.begin_attempt(spec.attempt)
        try:
            ck = spec.checkpoint
            if ck is not None:
                self._ckpt_store = CheckpointStore(
                    ck.uri,
                    keep_last=ck.keep_last,
                    key=ck.key,
                    previous_key=ck.previous_key,
                    run_id=ck.run_id,
                )
            if ck is not None and (ck.restore or self._reconstructed) and self._restore():
                pass  # state, operators and listeners come from the checkpoint
            else:
                if ck is not None and ck.expect_epoch is not None:
                    raise MissingCheckpoint(
                        f"the coordinator (on node {_node_ip()}) found no checkpoint in "
                        f"{ck.uri!r}, but checkpoint {ck.expect_epoch} was written: the "
                        f"path is not shared by every node (a node-local file:// path on a "
                        f"multi-node cluster?); use shared storage (s3://, gs://, hdfs://, "
                        f"or a mount every node sees)"
                    )
                self._main.open_all_round()
                main = self._main.alive()
                if (
                    ck is not None
                    and ck.every_epochs
                    and main is not None
                    and not _overrides(main, "snapshot_state")
                ):
                    # refuse before any job an operator a checkpoint could not hold
                    self._dump_operator(main)
        except _UserCodeFailed:
            pass  # recorded: every call from now on answers with the failure
        except (ForeignCheckpoint, MissingCheckpoint, UnpicklableOperator) as ex:  # final
            where = (
                "checking that the coordinator operator can be checkpointed"
                if isinstance(ex, UnpicklableOperator)
                else "restoring a checkpoint"
            )
            self._record_failure(
                RemoteFailure(COORDINATOR, None, where, type(ex).__name__, str(ex), "", ex)
            )
        except Exception as ex:  # a checkpoint that cannot be used
            self._record_failure(
                RemoteFailure.capture(
                    ex, source=COORDINATOR, epoch=None, where="restoring a checkpoint"
                )
            )

    # -- calls from Spark tasks ---------------------------------------------------------

    async def variables(self, known_version: int = -1) -> VariablesPayload | None:
        """The newest variables if newer than ``known_version``."""
        return self._payload_for(known_version)

    async def report(
        self,
        pid: int,
        epoch: int,
        known_version: int,
        emissions: Emissions,
        rows: Sequence[int] | None = None,
        attempt: int = 0,
        offered: tuple[Any] | None = None,
    ) -> Reply:
        """Subtask ``pid``'s call ``epoch``; returns when it may run that epoch (or stop).
        ``offered``: ``(its checkpoint state,)`` sent with a call that a cut will hold
        (sync mode), so the cut need not ask for it in a second round trip."""
        if self._tree is not None:
            self._tree.calls += 1
            if self._tree.groups and self.cut.accepts(attempt) and not self._failures:
                # with group actors every subtask reports to its group: a direct call
                # would leave its group waiting for it forever
                self._record_failure(
                    RemoteFailure(
                        pid,
                        epoch,
                        "reporting its call",
                        "ProtocolError",
                        f"subtask {pid} reported to the coordinator directly, but the "
                        f"feedback tree has group actors and it belongs to one",
                        "",
                    )
                )
        got = self._accept(pid, epoch, known_version, emissions, rows, attempt)
        if isinstance(got, Reply):
            return got
        if offered is not None:
            self.cut.offer_state(pid, epoch, known_version, offered[0], self.sm.aligned)
        self._after_calls()
        return await cast("asyncio.Future[Reply]", got)  # no slot given: a future

    async def report_group(
        self,
        first_pid: int,
        epoch: int,
        members: Sequence[tuple[int, int, Emissions, Sequence[int] | None]],
        combined: Emissions,
        attempt: int = 0,
    ) -> list[Reply]:
        """A feedback group's call ``epoch`` for its members ``(pid, known_version,
        emissions without feedback, rows)``, with their feedback merged (``combined``);
        one alignment step for all of them (tree aggregation, ``coordinator._tree``)."""
        assert self._tree is not None, "report_group without feedback_combine"
        self._tree.calls += 1
        if self.cut.accepts(attempt) and not self._failures and self.sm.terminated is None:
            self._tree.take(first_pid, epoch, combined)
        aligned = self.sm.aligned
        # one future for the whole group, filled in member by member as they are released
        # (not one asyncio future and one await per member: O(groups) event-loop wakeups)
        call = _GroupCall(len(members), asyncio.get_running_loop().create_future())
        for i, (p, kv, em, rows) in enumerate(members):
            slot = _Member(call, i)
            got = self._accept(p, epoch, kv, em, rows, attempt, slot)
            if isinstance(got, Reply):
                slot.set_result(got)
        # Sync only: a call is released by an alignment, termination or a checkpoint, or at
        # once when its epoch is already aligned (after a restore); else skip the O(N)
        # release scan, which would run once per group call for nothing.
        try:
            self._advance()
        except _UserCodeFailed:
            pass
        if (
            self.sm.aligned != aligned
            or epoch <= self.sm.aligned
            or self.sm.terminated is not None
            or self.cut.cutting is not None
        ):
            self._release()
        return await call.future if members else []

    async def group_of(self, pid: int) -> Any:
        """The feedback group actor subtask ``pid`` reports to (None: to this actor)."""
        return self._tree.group_of(pid) if self._tree is not None else None

    def _accept(
        self,
        pid: int,
        epoch: int,
        known_version: int,
        emissions: Emissions,
        rows: Sequence[int] | None,
        attempt: int,
        slot: _Member | None = None,
    ) -> Reply | _Waiter:
        """Validate and take call ``epoch`` of ``pid``: a reply now, or what will get it
        (a new future, or ``slot``: the member's place in its group's call)."""
        if not self.cut.accepts(attempt):
            return self._stale_reply(epoch, attempt)
        if self._failures:
            return self._error_reply(epoch)
        try:  # validate the call before anything waits on it
            self.sm.report(
                pid, epoch, feedback=emissions.feedback_count, criteria=emissions.criteria
            )
        except StateMachineError as ex:  # a protocol bug: fail loudly, never hang
            self._record_failure(
                RemoteFailure.capture(ex, source=COORDINATOR, epoch=epoch, where="protocol")
            )
            return self._error_reply(epoch)
        future: _Waiter = slot if slot is not None else asyncio.get_running_loop().create_future()
        self._waiters[pid] = (epoch, known_version, future)
        try:
            if rows is not None:
                for i, n in enumerate(rows):
                    self._rows[i] += n
            if self.sm.terminated is not None:
                # The loop is closed: feedback is no longer applied; outputs are kept.
                for tag, value in emissions.outputs:
                    self.route_output(tag, max(epoch - 1, 0), pid, value, False)
            else:
                if self._tree is not None and self.cut.sync:
                    # feedback_combine: the feedback goes to the tree's per-epoch partials
                    self._tree.take(pid, epoch, emissions)
                if not self.cut.on_report(pid, epoch, emissions):
                    return future  # sync: held for the alignment, in partition order
                self._apply_partition_emissions(pid, max(epoch - 1, 0), emissions)
        except _UserCodeFailed:
            pass
        return future

    def _after_calls(self) -> None:
        try:
            self._advance()
        except _UserCodeFailed:
            pass
        self._release()

    async def finish(
        self,
        pid: int,
        emissions: Emissions,
        attempt: int = 0,
        round_emissions: Emissions | None = None,
    ) -> None:
        """Subtask ``pid`` ran ``on_iteration_terminated``; ``emissions`` are its last.
        ``round_emissions``: what its per-round operators emitted in the terminating round."""
        if self._failures or not self.cut.accepts(attempt):
            return
        try:
            self._final[pid] = emissions
            if round_emissions is not None:
                self._final_round[pid] = round_emissions
            if self.sm.finish(pid):
                self._terminating_round()
                # the partitions' last outputs, in partition order (deterministic)
                last = max(self.sm.epochs_completed - 1, 0)
                for p in sorted(self._final):
                    for tag, value in self._final[p].outputs:
                        self.route_output(tag, last, p, value, False)
                self._final.clear()
                self._terminate_coordinator_tier()
        except _UserCodeFailed:
            pass
        except StateMachineError as ex:
            self._record_failure(
                RemoteFailure.capture(ex, source=COORDINATOR, epoch=None, where="protocol")
            )
        self._notify_progress()

    async def fail(self, failure: RemoteFailure, attempt: int = 0) -> None:
        """A subtask failed: stop everyone waiting, keep the failure for the driver."""
        if self.cut.accepts(attempt):  # a task of an earlier attempt dying is old news
            self._record_failure(failure)

    def begin_attempt(self, attempt: int) -> None:
        """Accept calls of launch ``attempt`` only: tasks of an earlier launch that are
        still dying must not disturb a coordinator restored for the next one."""
        self.cut.begin_attempt(attempt)

    @property
    def _attempt(self) -> int | None:
        """The launch whose calls are accepted (None until the driver opens one)."""
        return self.cut.attempt

    @_attempt.setter
    def _attempt(self, attempt: int) -> None:
        self.cut.begin_attempt(attempt)

    def _stale_reply(self, epoch: int, attempt: int) -> Reply:
        stale = RemoteFailure(
            COORDINATOR,
            epoch,
            "fencing",
            "StaleAttempt",
            f"a call of launch {attempt} reached the coordinator of launch {self.cut.attempt}",
            "",
        )
        return Reply(epoch, True, self.sm.aligned, None, stale)

    async def checkpoint_state(
        self, pid: int, epoch: int, known_version: int, state: Any, attempt: int = 0
    ) -> Reply:
        """Subtask ``pid``'s state for the pending checkpoint; it waits in call ``epoch``
        having processed variables ``known_version``."""
        if not self.cut.accepts(attempt):
            return self._stale_reply(epoch, attempt)
        if self._failures:
            return self._error_reply(epoch)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiters[pid] = (epoch, known_version, future)
        self.cut.on_state(pid, epoch, known_version, state)
        self._release()
        return await future

    async def restored(self, pid: int) -> tuple[int, int, Any] | None:
        """What subtask ``pid`` restores: ``(the call to make again, the variables
        version it had processed, its state)``; None when it starts from scratch."""
        got = self.cut.instruction(pid)
        return None if got is None else (got.call, got.known_version, got.state)

    async def busy(self) -> tuple[str, int, float] | None:
        """The user call the actor is in, if any: ``(operator.method, epoch, seconds)``.

        The driver calls it in the ``watch`` concurrency group (its own event loop
        thread), so it answers while the main loop is stuck in a coordinator operator."""
        busy = self._busy
        return None if busy is None else (busy[0], busy[1], time.monotonic() - busy[2])

    async def wake(self) -> None:
        """Answer the driver's pending progress poll now (its Spark job just ended)."""
        self._notify_progress(force=True)

    async def stash(self, pid: int, state: bytes) -> None:
        """Keep subtask ``pid``'s all-round operator state between two round jobs."""
        self._stash[pid] = state

    async def unstash(self, pid: int) -> bytes | None:
        """The state stashed by the previous round job of subtask ``pid``."""
        return self._stash.pop(pid, None)

    # -- calls from the driver ----------------------------------------------------------

    async def wait_progress(
        self,
        after_aligned: int,
        timeout: float,
        each_alignment: bool = True,
        after_checkpoint: int = -1,
    ) -> Progress:
        """Return at the end, after a failure, once a checkpoint newer than
        ``after_checkpoint`` is written, once alignment passes ``after_aligned`` (with
        ``each_alignment``: a progress line to draw), at ``wake()``, or at ``timeout``.
        Without ``each_alignment`` the driver's poll costs no call per epoch."""
        waiter = (each_alignment, after_aligned, after_checkpoint)
        if not self._progress_ready(*waiter):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (*waiter, fut)
            self._progress_waiters.append(entry)
            try:
                await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                if entry in self._progress_waiters:
                    self._progress_waiters.remove(entry)
        return self.progress()

    def _progress_ready(self, each_alignment: bool, aligned: int, checkpointed: int) -> bool:
        return (
            self._is_done()
            or self._checkpointed > checkpointed
            or (each_alignment and self.sm.aligned > aligned)
        )

    def progress(self) -> Progress:
        t = self._alignment_times
        return Progress(
            aligned=self.sm.aligned,
            epochs=self.sm.epochs_completed,
            last_epoch_seconds=(t[-1] - t[-2]) if len(t) >= 2 else None,
            loss=self._last_loss,
            terminated_by=self.sm.terminated,
            done=self._is_done(),
            failed=bool(self._failures),
            subtask_epochs=tuple(max(c, 0) for c in self.sm.last_call),
            rows=sum(self._rows),
            checkpointed=self._checkpointed,
            version=self.store.version,
        )

    def unpicklable_output(self) -> RemoteFailure | None:
        """Why ``result()`` could not reach the driver: the first output record that does
        not pickle, named (None when every one does). Asked only after that failed."""
        found = first_unpicklable(self._outputs, "the output records")
        if found is None:
            return None
        record, what = found
        error = ValueEncodeError(
            f"{what}; the result cannot be sent to the driver. Emit with out.output only "
            f"what pickles: numbers, strings, numpy arrays, and containers and objects of "
            f"them (drop or convert the part named, e.g. a lock, an open file, a client)"
        )
        return RemoteFailure(
            record.source,
            record.epoch,
            "sending the result to the driver",
            type(error).__name__,
            str(error),
            "",
            error,
        )

    def result(self) -> ResultData:
        return ResultData(
            variables=dict(self.store.values),
            # a failed run's outputs are never delivered, and one that failed because an
            # output cannot be pickled must still deliver the failure
            outputs=[] if self._failures else list(self._outputs),
            epochs=self.sm.epochs_completed,
            terminated_by=self.sm.terminated,
            alignment_times=list(self._alignment_times),
            subtask_epochs={p: max(c, 0) for p, c in enumerate(self.sm.last_call)},
            feedback_counts=dict(sorted(self._feedback_counts.items())),
            rows=list(self._rows),
            publishes=self.store.publishes,
            object_store_puts=self.store.puts,
            failures=list(self._failures),
        )

    # -- internals ----------------------------------------------------------------------

    def _new_feedback_counts(self) -> Counter[int]:
        """Feedback records applied per subtask, each counted from 0 (a mapping: the
        online coordinator's partitions vary between micro-batches)."""
        return Counter(dict.fromkeys(range(self.spec.num_subtasks), 0))

    def _is_done(self) -> bool:
        return self._closed or bool(self._failures)

    def _advance(self) -> None:
        while (k := self.sm.next_alignment()) is not None:
            if self._tree is not None:
                self._apply_combined(max(k - 1, 0), *self._tree.totals(k))
            for pid, em in self.cut.aligned(k):
                self._apply_partition_emissions(pid, max(k - 1, 0), em)
            if k >= 1:
                self._coordinator_watermark(k - 1)
            if k == 0:
                empty = [i for i, n in enumerate(self._rows) if n == 0]
                if empty:
                    self._record_failure(
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
            self._alignment_times.append(time.time())
            reason = self.sm.complete_alignment(k)
            if self.spec.hooks is not None:
                self.spec.hooks.at_alignment(
                    k, attempt=self._attempt, restarted=self._reconstructed
                )
            if self.cut.after_alignment(k, terminated=reason is not None):
                self._cut_started = time.perf_counter()
            self._notify_progress()

    def _check_feedback_shapes(self, pid: int, epoch: int, values: Sequence[Any]) -> None:
        """The i-th array a partition feeds back must have the shape of the first
        partition's i-th: summing (3,) and (1, 3) broadcasts to a silent wrong answer."""
        for i, value in enumerate(values):
            if not isinstance(value, np.ndarray):
                continue
            first = self._feedback_shapes.setdefault(i, (pid, value.shape))
            if first[1] != value.shape:
                self._record_failure(
                    RemoteFailure.capture(
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
                )
                raise _UserCodeFailed

    def _apply_partition_emissions(self, pid: int, epoch: int, em: Emissions) -> None:
        self._check_feedback_shapes(pid, epoch, em.feedback)
        self._feedback_counts[pid] += em.feedback_count
        self.ctx.epoch = epoch
        self.ctx.source_partition = pid
        try:
            # the per-round sub-body's feedback goes to its own coordinator when it has one
            round_slot = self._round if self._round.template is not None else self._main
            for slot, values in ((self._main, em.feedback), (round_slot, em.round_feedback)):
                if values and slot.template is not None:
                    op = slot.get(epoch)
                    for value in values:
                        self._user_call(op, "process_feedback", value, self.ctx, self._out)
        finally:
            self.ctx.source_partition = None
        for tag, value in em.outputs:
            self.route_output(tag, epoch, pid, value, False)

    def _apply_combined(self, epoch: int, main: Any, round_: Any) -> None:
        """feedback_combine: one ``process_feedback`` per epoch with the merged total
        (``ctx.source_partition`` is None: the value comes from every partition)."""
        self.ctx.epoch = epoch
        round_slot = self._round if self._round.template is not None else self._main
        for slot, value in ((self._main, main), (round_slot, round_)):
            if value is not None and slot.template is not None:
                self._user_call(slot.get(epoch), "process_feedback", value, self.ctx, self._out)

    def _coordinator_watermark(self, epoch: int) -> None:
        self.ctx.epoch = epoch
        for slot in (self._main, self._round):
            if slot.template is not None:
                op = slot.get(epoch)
                self._user_call(op, "on_epoch_watermark_incremented", epoch, self.ctx, self._out)
                slot.end_round()
        for listener in self._listeners:
            self._user_call(
                listener, "on_epoch_watermark_incremented", epoch, self.ctx, self._listener_out
            )

    def _terminating_round(self) -> None:
        """Round k, into which the last variables were fed back, runs like every other
        round before termination (as in Flink ML): the partitions' per-round operators
        already ran it; here their feedback is applied and the coordinator tier's
        per-round operators of round k are created, get their end-of-round watermark
        callback and are closed."""
        k = self.sm.terminating_round
        emitted, self._final_round = self._final_round, {}
        if k is None:
            return
        self.ctx.terminating = True
        try:
            for pid, em in sorted(emitted.items()):
                self._apply_partition_emissions(pid, k, em)
            self.ctx.epoch = k
            for slot in (self._main, self._round):
                if slot.per_round and slot.template is not None:
                    op = slot.get(k)
                    self._user_call(op, "on_epoch_watermark_incremented", k, self.ctx, self._out)
                    slot.end_round()
        finally:
            self.ctx.terminating = False

    def _terminate_coordinator_tier(self) -> None:
        self.ctx.epoch = max(self.sm.epochs_completed - 1, 0)
        # only operators still alive hear of it: per-round ones closed with their round
        op = self._main.alive()
        if op is not None:
            self._user_call(op, "on_iteration_terminated", self.ctx, self._out)
            self._user_call(op, "close")
        for listener in self._listeners:
            self._user_call(listener, "on_iteration_terminated", self.ctx, self._listener_out)
        self._closed = True

    def route_output(
        self, tag: str, epoch: int, source: int | str, value: Any, from_listener: bool
    ) -> None:
        if not from_listener:
            prev = self.ctx.epoch
            self.ctx.epoch = epoch
            try:
                for listener in self._listeners:
                    if self._user_call(
                        listener, "process_output", tag, value, self.ctx, self._listener_out
                    ):
                        return
            finally:
                self.ctx.epoch = prev
        if tag == self.spec.progress_tag:
            self._last_loss = value
        self._outputs.append(OutputRecord(tag, epoch, source, value))

    def _user_call(self, obj: Any, method: str, *args: Any) -> Any:
        """Call user code ``obj.method(*args)`` (a missing hook is a no-op)."""
        fn = getattr(obj, method, None)
        if fn is None:
            return None
        label = f"{type(obj).__name__}.{method}"
        # read by ``busy()`` from another thread while this one may be stuck in user code
        self._busy = (label, self.ctx.epoch, time.monotonic())
        try:
            return fn(*args)
        except Exception as ex:
            self._record_failure(
                RemoteFailure.capture(ex, source=COORDINATOR, epoch=self.ctx.epoch, where=label)
            )
            raise _UserCodeFailed from ex
        finally:
            self._busy = None

    def _record_failure(self, failure: RemoteFailure) -> None:
        self._failures.append(failure)
        self.sm.fail()
        if self._tree is not None:
            self._tree.abort(self._failures[0])
        replies: dict[int, Reply] = {}  # one object per epoch: a group's replies pickle once
        for epoch, _, future in self._waiters.values():
            if not future.done():
                reply = replies.get(epoch) or replies.setdefault(epoch, self._error_reply(epoch))
                future.set_result(reply)
        self._waiters.clear()
        self._notify_progress()

    def _error_reply(self, epoch: int) -> Reply:
        return Reply(epoch, True, self.sm.aligned, None, self._failures[0])

    def _payload_for(self, known_version: int) -> VariablesPayload | None:
        return self.store.payload() if self.store.version > known_version else None

    # -- checkpoints ------------------------------------------------------------------------

    def _dump_operator(self, op: Any) -> tuple[str, bytes]:
        import cloudpickle

        if hasattr(op, "snapshot_state") and _overrides(op, "snapshot_state"):
            state = self._user_call(op, "snapshot_state")
            return "state", dumps_state(
                state,
                f"the state snapshot_state() of the coordinator operator {type(op).__name__} "
                f"returned",
            )
        try:
            return "object", cloudpickle.dumps(op)
        except Exception as ex:
            raise UnpicklableOperator(
                f"the coordinator operator {type(op).__name__} cannot be pickled for a "
                f"checkpoint ({type(ex).__name__}: {ex}); define snapshot_state() and "
                f"restore_state() on it, or drop what cannot be pickled"
            ) from ex

    def _write_checkpoint(self) -> None:
        assert self._ckpt_store is not None and self.spec.checkpoint is not None
        cut = self.cut.take()
        epoch = cut.epoch
        calls = {pid: s.call for pid, s in cut.subtasks.items()}
        data = {
            **self._checkpoint_common(),
            "epoch": epoch,
            "sm": self.sm.snapshot(calls),
            "cut": cut.to_plain(),
            "feedback_counts": [self._feedback_counts[p] for p in range(self.spec.num_subtasks)],
            "rows": list(self._rows),
            "alignment_times": list(self._alignment_times),
        }
        self._save_checkpoint(epoch, data, self._cut_started)

    def _checkpoint_common(self) -> dict[str, Any]:
        """What every checkpoint of a coordinator holds (bounded and online): the
        fingerprint, the variables and their version, the coordinator operator's state,
        the listeners, the last loss. ``_restore_common`` reads it back."""
        assert self.spec.checkpoint is not None
        main = self._main.alive()
        return {
            "fingerprint": dict(self.spec.checkpoint.fingerprint),
            "variables": self.store.values,
            "version": self.store.version,
            "publishes": self.store.publishes,
            "main": self._dump_operator(main) if main is not None else None,
            "listeners": dumps_state(list(self._listeners), "the coordinator listeners"),
            "last_loss": self._last_loss,
        }

    def _check_fingerprint(self, data: Mapping[str, Any], what: str) -> None:
        """Refuse a checkpoint file of another iteration (``ForeignCheckpoint``)."""
        assert self._ckpt_store is not None and self.spec.checkpoint is not None
        mismatch = fingerprint_mismatch(
            data.get("fingerprint", {}), self.spec.checkpoint.fingerprint
        )
        if mismatch:
            raise ForeignCheckpoint(f"{what} is of another iteration: {mismatch}")

    def _restore_common(self, loaded: LoadedCheckpoint) -> None:
        """Take back what ``_checkpoint_common`` wrote (the fingerprint is checked)."""
        import cloudpickle

        data = loaded.data
        self._check_fingerprint(data, f"checkpoint {loaded.path}")
        self.store.restore(data["variables"], data["version"], data["publishes"])
        if data["main"] is not None and self._main.template is not None:
            kind, blob = data["main"]
            if kind == "state":
                self._main.open_all_round()
                self._user_call(self._main.alive(), "restore_state", cloudpickle.loads(blob))
            else:
                self._main.adopt(cloudpickle.loads(blob))
        elif self._main.alive() is None:
            self._main.open_all_round()
        self._listeners = cloudpickle.loads(data["listeners"])
        self._last_loss = data["last_loss"]
        self.restored_from = loaded.path
        self.restored_epoch = loaded.epoch

    def _save_checkpoint(self, epoch: int, data: dict[str, Any], started: float) -> None:
        """Write ``data`` with the outputs not yet saved; record the path and seconds."""
        assert self._ckpt_store is not None
        path = self._ckpt_store.save(epoch, data, self._outputs[self._saved_outputs :])
        self._saved_outputs = len(self._outputs)
        self.checkpoints.append((epoch, path, time.perf_counter() - started))
        self._checkpointed = epoch
        self._notify_progress()  # the driver learns of it even with progress off

    def _restore(self) -> bool:
        """Load the newest valid checkpoint; False when there is none."""
        assert self._ckpt_store is not None and self.spec.checkpoint is not None
        loaded = self._ckpt_store.load_latest()
        if loaded is None:
            return False
        self.skipped_checkpoints = list(loaded.skipped)
        if loaded.epoch < 0:
            raise ValueError(
                "no valid checkpoint in "
                + self._ckpt_store.uri
                + ": "
                + "; ".join(f"{p}: {why}" for p, why in loaded.skipped)
            )
        expect = self.spec.checkpoint.expect_epoch
        if (
            expect is not None
            and loaded.epoch < expect
            and not damaged_since(loaded.skipped, expect)
        ):
            raise MissingCheckpoint(
                f"the coordinator (on node {_node_ip()}) found checkpoint {loaded.epoch} in "
                f"{self._ckpt_store.uri!r} as the newest valid one, but checkpoint {expect} "
                f"was written: the path is not shared by every node, or newer files were "
                f"lost ({'; '.join(f'{p}: {w}' for p, w in loaded.skipped) or 'none skipped'})"
            )
        data = loaded.data
        self._restore_common(loaded)
        self.sm = EpochStateMachine.restore(
            data["sm"],
            staleness=self.spec.staleness,
            max_epochs=self.spec.max_epochs,
            has_criteria=self.spec.has_criteria,
        )
        self.cut.restore(Cut.from_plain(data["cut"]))
        self._feedback_counts = Counter(dict(enumerate(data["feedback_counts"])))
        self._rows = list(data["rows"])
        self._alignment_times = list(data["alignment_times"])
        self._outputs = list(self._ckpt_store.outputs_until(loaded.epoch))
        self.skipped_checkpoints += self._ckpt_store.skipped_outputs
        self._saved_outputs = len(self._outputs)
        self._checkpointed = loaded.epoch
        return True

    def checkpoint_info(self) -> CheckpointInfo:
        return CheckpointInfo(
            checkpoints=list(self.checkpoints),
            restored_from=self.restored_from,
            restored_epoch=self.restored_epoch,
            skipped=list(self.skipped_checkpoints),
            reconstructed=self._reconstructed,
        )

    def _release(self) -> None:
        if self._failures:
            return
        if self.cut.cutting is not None:
            if self.sm.terminated is not None:
                self.cut.abandon()  # nothing to resume any more
            else:
                asks: dict[int, Reply] = {}
                for pid in self.cut.ask_state(list(self._waiters)):
                    epoch, _, future = self._waiters.pop(pid)
                    if not future.done():  # it answers with its state and waits there
                        ask = asks.get(epoch) or asks.setdefault(
                            epoch, Reply(epoch, False, self.sm.aligned, need_state=True)
                        )
                        future.set_result(ask)
                if not self.cut.complete:
                    return  # hold everyone until every subtask's state is in
                try:
                    self._write_checkpoint()
                except _UserCodeFailed:
                    return
                except Exception as ex:
                    self._record_failure(
                        RemoteFailure.capture(
                            ex,
                            source=COORDINATOR,
                            epoch=self.sm.aligned,
                            where="writing a checkpoint",
                        )
                    )
                    return
        last_round = self.sm.terminating_round
        # equal replies are one object: a group's list of replies pickles each once
        made: dict[tuple[int, bool, int], Reply] = {}
        for r in self.sm.releasable():
            _, known_version, future = self._waiters.pop(r.pid)
            if not future.done():
                payload = self._payload_for(known_version)
                key = (r.epoch, r.terminated, id(payload))
                reply = made.get(key)
                if reply is None:
                    reply = made[key] = Reply(
                        r.epoch,
                        r.terminated,
                        self.sm.aligned,
                        payload,
                        terminating_round=r.epoch if last_round is not None else None,
                    )
                future.set_result(reply)

    def _notify_progress(self, *, force: bool = False) -> None:
        if not self._progress_waiters:
            return
        keep = []
        for each, aligned, checkpointed, fut in self._progress_waiters:
            if fut.done():
                continue
            if force or self._progress_ready(each, aligned, checkpointed):
                fut.set_result(None)
            else:
                keep.append((each, aligned, checkpointed, fut))
        self._progress_waiters = keep


def _get_own(ref: Any) -> Any:
    """``ray.get`` of an object this actor has just put (a published version): a local
    read that does not block the event loop, so Ray's once-per-process warning about
    blocking gets inside async actors stays for the user's code."""
    import ray

    try:
        from ray._private import worker as ray_worker
    except ImportError:  # pragma: no cover - a Ray without that module: plain get
        return ray.get(ref)
    warned = getattr(ray_worker, "blocking_get_inside_async_warned", True)
    ray_worker.blocking_get_inside_async_warned = True
    try:
        return ray.get(ref)
    finally:
        ray_worker.blocking_get_inside_async_warned = warned


class _UserCodeFailed(Exception):
    """Internal: user code raised; the failure is already recorded."""


class NonFiniteVariables(VariablesMismatchError):
    """``publish_variables`` with NaN or infinite values."""


class UnpicklableOperator(CheckpointEncodeError):
    """An operator without snapshot_state() that cannot be pickled into a checkpoint."""


class CheckpointInfo(TypedDict):
    """What ``checkpoint_info()`` answers (it also lands in ``result.extra["checkpoint"]``)."""

    #: (epoch, path, seconds) of each checkpoint this coordinator wrote
    checkpoints: list[tuple[int, str, float]]
    #: the file it restored, and that checkpoint's epoch (None: it restored none)
    restored_from: str | None
    restored_epoch: int | None
    #: (path, why) of the files it skipped as damaged
    skipped: list[tuple[str, str]]
    #: Ray restarted this actor after its process died
    reconstructed: bool


class MissingCheckpoint(CheckpointError, RuntimeError):
    """A restore did not find the checkpoint it must find (a node-local path?)."""


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "local"
    except Exception:
        return "unknown"


def _was_reconstructed() -> bool:
    """True in an actor that Ray restarted after its process died."""
    try:
        import warnings

        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a Ray instance
            return False
        with warnings.catch_warnings():  # Ray flags the property deprecated, with no successor
            warnings.simplefilter("ignore")
            ctx = ray.get_runtime_context()
            return bool(ctx.get_actor_id() and ctx.was_current_actor_reconstructed)
    except Exception:
        return False


class _Slot:
    """One coordinator-tier operator: one instance for the whole iteration (all-round), or
    a fresh copy of the template every round (per-round: opened with the variables of
    its round when first needed, closed after its round's watermark)."""

    def __init__(self, coordinator: IterationCoordinator, template: Any, *, per_round: bool):
        self._c = coordinator
        self.template = template
        self.per_round = per_round
        self._instance: Any = None
        self._epoch: int | None = None
        self._blob: bytes | None = None

    def open_all_round(self) -> None:
        if self.template is not None and not self.per_round:
            self._instance = self.template
            self._c._user_call(self._instance, "open", self._c.store.values, self._c.ctx)

    def get(self, epoch: int) -> Any:
        if not self.per_round:
            return self._instance
        if self._instance is None or self._epoch != epoch:
            self.end_round()
            import cloudpickle

            if self._blob is None:
                self._blob = cloudpickle.dumps(self.template)
            self._instance, self._epoch = cloudpickle.loads(self._blob), epoch
            self._c._user_call(self._instance, "open", self._c.store.values, self._c.ctx)
        return self._instance

    def end_round(self) -> None:
        if self.per_round and self._instance is not None:
            op, self._instance, self._epoch = self._instance, None, None
            self._c._user_call(op, "close")

    def alive(self) -> Any:
        return None if self.per_round else self._instance

    def adopt(self, instance: Any) -> None:
        """Use a restored all-round instance (already opened in its first life)."""
        self._instance = instance


class _Waiter(Protocol):
    """What a held call waits on: its own future, or its place in a group's call."""

    def done(self) -> bool: ...

    def set_result(self, result: Reply, /) -> None: ...


class _GroupCall:
    """The members' replies of one ``report_group`` call; its ``future`` resolves with
    them, in member order, when the last one is set."""

    __slots__ = ("future", "missing", "replies")

    def __init__(self, size: int, future: asyncio.Future[list[Reply]]) -> None:
        self.replies: list[Reply | None] = [None] * size
        self.missing = size
        self.future = future


class _Member:
    """One member's place in a ``_GroupCall``: set like a future, at most once."""

    __slots__ = ("call", "index")

    def __init__(self, call: _GroupCall, index: int) -> None:
        self.call, self.index = call, index

    def done(self) -> bool:
        return self.call.replies[self.index] is not None

    def set_result(self, result: Reply, /) -> None:
        call = self.call
        if call.replies[self.index] is not None:
            raise asyncio.InvalidStateError(f"member #{self.index} already has its reply")
        call.replies[self.index] = result
        call.missing -= 1
        if call.missing == 0 and not call.future.done():
            call.future.set_result(call.replies)  # type: ignore[arg-type]  # all set now


def _overrides(obj: Any, method: str) -> bool:
    """True when ``obj``'s class defines ``method`` itself, not the no-op hook of the base
    classes in ``hybrid_iter._operators`` (operators of hybrid_iter's own packages, such
    as ``hybrid_iter.ps``'s, override hooks like any user's)."""
    for klass in type(obj).__mro__:
        if method in vars(klass):
            return bool(klass.__module__ != "hybrid_iter._operators")
    return False
