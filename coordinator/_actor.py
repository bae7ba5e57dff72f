"""The coordinator actor: a thin asyncio shell around ``CoordinatorCore``.

Written as a plain class; ``hybrid_iter`` wraps it with ``ray.remote(num_cpus=0)`` where
it launches it. Each call from a Spark task or the driver becomes an event for the core
(``_core.py``: every decision), whose instructions ``_run`` carries out: answer waiting
calls (their futures), run user callbacks (``_host.py``, in the actor's event loop: user
code never runs concurrently with itself), write checkpoints (``_snapshots.py``). Its only
Ray API is ``ray.put``/``get`` of large variable versions (when Ray runs: tests go without).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ._core import (
    COORDINATOR,
    Aligned,
    Answer,
    BeginAttempt,
    CoordinatorCore,
    Done,
    Emitted,
    Event,
    Fail,
    Failed,
    Finish,
    GroupReport,
    Notify,
    Report,
    Restore,
    StateSent,
    UserCall,
    WriteCheckpoint,
)
from ._endpoint import EndpointServing
from ._errors import RemoteFailure, UserCodeFailed
from ._host import OperatorHost
from ._protocol import Emissions, Progress, Reply, ResultData
from ._shell import (
    LOADING,
    ProgressWaiters,
    import_ahead,
    node_ip,
    object_store,
    startup_failure,
    was_reconstructed,
)
from ._snapshots import CheckpointInfo, Snapshots
from ._spare import SpareLife
from ._spec import CoordinatorSpec
from ._tree import CoordinatorTree, _GroupCall, _Member
from ._variables import VariablesPayload, VariablesStore

__all__ = ["IterationCoordinator"]


class IterationCoordinator(SpareLife, EndpointServing):
    """One iteration's coordinator, called through Ray (or its endpoint, ``_endpoint.py``)."""

    SPARE_OF = "coordinator"
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
        self._spare = True
        import_ahead(warm)

    def configure(self, spec: CoordinatorSpec) -> None:
        """Make a spare the coordinator of ``spec``'s run, as the constructor would have
        (once; a spare runs without checkpoints, so Ray never restarts it; the spare
        protocol is ``_spare.py``'s)."""
        self._take_run(restarted=was_reconstructed())
        self._setup(spec, None)

    def retire(self) -> bool:
        """After a run that ended well (every Spark task of it has ended, so no call of
        it is on the way): forget the run and wait, as a spare, for the next
        ``configure``. False when it must be killed instead: it owns group actors (a
        feedback tree), holds a failure, or was restarted by Ray."""
        if self._spare:
            return True
        if (
            self.core.failures
            or (self._tree is not None and self._tree.groups)
            or was_reconstructed()
        ):
            return False
        self.close_endpoint()
        self._back_to_spare()
        return True

    def _setup(self, spec: CoordinatorSpec, put: Callable[[Any], Any] | None) -> None:
        put, get = object_store(put)
        self.spec = spec
        self._reconstructed = was_reconstructed()
        ck = spec.checkpoint
        self.store = VariablesStore(
            spec.init_variables, put=put, get=get, inline_limit=spec.inline_limit
        )
        self.host = OperatorHost(
            num_subtasks=spec.num_subtasks,
            staleness=spec.staleness,
            has_criteria=spec.has_criteria,
            store=self.store,
            aligned=lambda: self.core.sm.aligned,
            progress_tag=spec.progress_tag,
            hooks=spec.hooks,
        )
        self._progress = ProgressWaiters()
        self._alignment_times: list[float] = []
        self._cut_started = 0.0
        self._stash: dict[int, bytes] = {}
        self._tree: CoordinatorTree | None = None
        self.snapshots: Snapshots | None = None
        failure = None
        try:
            if spec.tree is not None:
                if spec.staleness != 0:
                    raise ValueError("feedback_combine needs a sync iteration (staleness=0)")
                self._tree = CoordinatorTree(
                    spec.tree,
                    spec.num_subtasks,
                    start_groups=put is not None,
                    placement=spec.placement,
                )
                self.host.combiner = self._tree.combiner
            if spec.operators:
                self.host.load(spec.operators, main_per_round=spec.main_per_round)
        except Exception as ex:
            failure = RemoteFailure.capture(ex, source=COORDINATOR, epoch=None, where=LOADING)
        self.core = CoordinatorCore(
            spec.num_subtasks,
            num_streams=spec.num_streams,
            staleness=spec.staleness,
            max_epochs=spec.max_epochs,
            has_criteria=spec.has_criteria,
            checkpoint_every=ck.every_epochs if ck is not None else 0,
            tree=spec.tree is not None,
            tree_groups=self._tree is not None and bool(self._tree.groups),
            attempt=None if self._reconstructed else spec.attempt,
        )
        if failure is not None:
            self._run(Failed(failure))
        try:
            self.snapshots = Snapshots(ck) if ck is not None else None
            if ck is None or not (ck.restore or self._reconstructed) or not self._restore():
                if self.snapshots is not None:
                    self.snapshots.none_found(node_ip)
                self.host.open(checkpointed=ck is not None and ck.every_epochs > 0)
            self._run(Emitted(self.host.emitted(), self.store.version))
        except Exception as ex:  # every call from now on answers with it
            self._run(Failed(startup_failure(ex)))

    def _restore(self) -> bool:
        """Load the newest valid checkpoint; False when there is none."""
        assert self.snapshots is not None
        loaded = self.snapshots.latest(node_ip)
        if loaded is None:
            return False
        self.snapshots.restore_common(loaded, self.host, self.store)
        self.host.emitted()  # what restoring the operators emitted belongs to the past
        self._run(Restore(loaded.data, self.store.version))
        self._alignment_times = list(loaded.data["alignment_times"])
        self.host.outputs = self.snapshots.outputs_until(loaded.epoch)
        return True

    # -- the dispatcher -----------------------------------------------------------------------

    def _run(self, event: Event) -> None:
        """Hand ``event`` to the core and carry out its instructions, in order."""
        events: deque[Event] = deque([event])
        while events:
            for ins in self.core.handle(events.popleft()):
                match ins:
                    case Answer():
                        reply = ins.reply(self.store.payload() if ins.variables else None)
                        for slot in ins.slots:
                            if not slot.done():
                                slot.set_result(reply)
                    case UserCall():  # always last: the core waits for its outcome
                        events.appendleft(self.host.run(ins))
                    case WriteCheckpoint():
                        events.appendleft(self._write_checkpoint(ins))
                    case Aligned():
                        self._aligned(ins, events)
                    case Fail():
                        if self._tree is not None:
                            self._tree.abort(ins.failure)
                        self._notify_progress()
                    case Notify():
                        self._notify_progress()

    def _aligned(self, ins: Aligned, events: deque[Event]) -> None:
        self._alignment_times.append(time.time())
        if self.spec.hooks is not None:
            try:
                self.spec.hooks.at_alignment(
                    ins.epoch, attempt=self.core.cut.attempt, restarted=self._reconstructed
                )
            except Exception as ex:  # a hook that raises is a failure at that point
                failure = RemoteFailure.capture(
                    ex, source=COORDINATOR, epoch=ins.epoch, where="the at_alignment hook"
                )
                events.append(Failed(failure))
        if ins.cut:
            self._cut_started = time.perf_counter()
        self._notify_progress()

    def _write_checkpoint(self, ins: WriteCheckpoint) -> Done:
        assert self.snapshots is not None
        try:
            data = {
                **self.snapshots.common(self.host, self.store),
                **ins.state,
                "alignment_times": list(self._alignment_times),
            }
            self.snapshots.save(ins.epoch, data, self.host.outputs, self._cut_started)
        except UserCodeFailed as ex:
            return Done(ex.failure)
        except Exception as ex:
            epoch, where = self.core.sm.aligned, "writing a checkpoint"
            return Done(RemoteFailure.capture(ex, source=COORDINATOR, epoch=epoch, where=where))
        self._notify_progress()  # the driver learns of it even with progress off
        return Done(None, self.host.emitted(), self.store.version)

    # -- calls from Spark tasks ---------------------------------------------------------------

    async def variables(self, known_version: int = -1) -> VariablesPayload | None:
        """The newest variables if newer than ``known_version``."""
        return self.store.payload() if self.store.version > known_version else None

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
        slot: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._run(Report(pid, epoch, known_version, emissions, rows, attempt, offered, slot))
        return await slot

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
        # one future for the whole group, filled in member by member as they are released
        # (not one asyncio future and one await per member: O(groups) event-loop wakeups)
        call = _GroupCall(len(members), asyncio.get_running_loop().create_future())
        slots = [_Member(call, i) for i in range(len(members))]
        self._run(GroupReport(first_pid, epoch, members, combined, attempt, slots))
        replies = await call.future if members else []
        if self._endpoint is not None:  # the members have no Ray: variables they can read
            replies = self._endpoint.readable(replies)
        return replies

    async def group_of(self, pid: int) -> Any:
        """The feedback group actor subtask ``pid`` reports to (None: to this actor)."""
        return self._tree.group_of(pid) if self._tree is not None else None

    async def checkpoint_state(
        self, pid: int, epoch: int, known_version: int, state: Any, attempt: int = 0
    ) -> Reply:
        """Subtask ``pid``'s state for the pending checkpoint; it waits in call ``epoch``
        having processed variables ``known_version``."""
        slot: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._run(StateSent(pid, epoch, known_version, state, attempt, slot))
        return await slot

    async def finish(
        self,
        pid: int,
        emissions: Emissions,
        attempt: int = 0,
        round_emissions: Emissions | None = None,
    ) -> None:
        """Subtask ``pid`` ran ``on_iteration_terminated``; ``emissions`` are its last.
        ``round_emissions``: what its per-round operators emitted in the terminating round."""
        self._run(Finish(pid, emissions, attempt, round_emissions))

    async def fail(self, failure: RemoteFailure, attempt: int = 0) -> None:
        """A subtask failed: stop everyone waiting, keep the failure for the driver."""
        self._run(Failed(failure, attempt))

    def begin_attempt(self, attempt: int) -> None:
        """Accept calls of launch ``attempt`` only: tasks of an earlier launch that are
        still dying must not disturb a coordinator restored for the next one."""
        self._run(BeginAttempt(attempt))

    async def restored(self, pid: int) -> tuple[int, int, Any] | None:
        """What subtask ``pid`` restores: ``(the call to make again, the variables
        version it had processed, its state)``; None when it starts from scratch."""
        return self.core.restore_instruction(pid)

    async def stash(self, pid: int, state: bytes) -> None:
        """Keep subtask ``pid``'s all-round operator state between two round jobs."""
        self._stash[pid] = state

    async def unstash(self, pid: int) -> bytes | None:
        """The state stashed by the previous round job of subtask ``pid``."""
        return self._stash.pop(pid, None)

    # -- calls from the driver ----------------------------------------------------------------

    async def busy(self) -> tuple[str, int, float] | None:
        """The user call the actor is in, if any: ``(operator.method, epoch, seconds)``.
        The driver calls it in the ``watch`` concurrency group (its own event loop thread),
        so it answers while the main loop is stuck in a coordinator operator."""
        busy = self.host.busy
        return None if busy is None else (busy[0], busy[1], time.monotonic() - busy[2])

    async def wake(self) -> None:
        """Answer the driver's pending progress poll now (its Spark job just ended)."""
        self._progress.notify(lambda *_: True)

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
        poll = (each_alignment, after_aligned, after_checkpoint)
        await self._progress.wait(poll, self._progress_ready, timeout)
        return self.progress()

    def _progress_ready(self, each_alignment: bool, aligned: int, checkpointed: int) -> bool:
        done, newest = self.core.done, self.snapshots.newest if self.snapshots else -1
        return done or newest > checkpointed or (each_alignment and self.core.sm.aligned > aligned)

    def _notify_progress(self) -> None:
        self._progress.notify(self._progress_ready)

    def progress(self) -> Progress:
        t, sm = self._alignment_times, self.core.sm
        return Progress(
            aligned=sm.aligned,
            epochs=sm.epochs_completed,
            last_epoch_seconds=(t[-1] - t[-2]) if len(t) >= 2 else None,
            loss=self.host.last_loss,
            terminated_by=sm.terminated,
            done=self.core.done,
            failed=bool(self.core.failures),
            subtask_epochs=tuple(max(c, 0) for c in sm.last_call),
            rows=sum(self.core.rows),
            checkpointed=self.snapshots.newest if self.snapshots is not None else -1,
            version=self.store.version,
        )

    def checkpoint_info(self) -> CheckpointInfo:
        return Snapshots.info_of(self.snapshots, self._reconstructed)

    def unpicklable_output(self) -> RemoteFailure | None:
        """Why ``result()`` could not reach the driver: the first output record that does
        not pickle, named (None when every one does). Asked only after that failed."""
        return self.host.unpicklable_output()

    def result(self) -> ResultData:
        core = self.core
        return ResultData(
            variables=dict(self.store.values),
            # a failed run's outputs are never delivered, and one that failed because an
            # output cannot be pickled must still deliver the failure
            outputs=[] if core.failures else list(self.host.outputs),
            epochs=core.sm.epochs_completed,
            terminated_by=core.sm.terminated,
            alignment_times=list(self._alignment_times),
            subtask_epochs={p: max(c, 0) for p, c in enumerate(core.sm.last_call)},
            feedback_counts=dict(sorted(core.feedback_counts.items())),
            rows=list(core.rows),
            publishes=self.store.publishes,
            object_store_puts=self.store.puts,
            failures=list(core.failures),
        )
