"""The cut and the restore, stepped event by event without Ray.

``CutProtocol`` is the pure piece of the core; the property test runs the real subtask
runtime (``hybrid_iter._runtime.task.run_subtask``, one thread per subtask) against the
real coordinator (``IterationCoordinator``, without Ray, on an asyncio loop of this
process) through the in-process ``CoordinatorLink``, and crashes a subtask at random
points: before or after any coordinator call, so during a checkpoint (some states in,
not all), between a publish and its consumption, during a restore itself. Every crash
relaunches the whole stage on a new coordinator restored from the checkpoint directory,
as the driver does. A sync run must end bit for bit equal to the fault-free run, and
every operator's callbacks after its restore must equal the fault-free ones after the
same cut.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybrid_iter as hi
from coordinator import (
    CheckpointSpec,
    CoordinatorSpec,
    Emissions,
    InProcessLink,
    IterationCoordinator,
)
from coordinator._cut import Cut, CutProtocol, SubtaskCut
from coordinator._errors import CutError
from hybrid_iter._runtime.task import TaskPlan, run_subtask

pytestmark = pytest.mark.usefixtures("validate_cores")

N, EPOCHS, DIMS = 3, 9, 4


# -- the pure core ------------------------------------------------------------------------


def test_sync_emissions_wait_for_their_alignment_in_partition_order():
    cut = CutProtocol(3, sync=True, every_epochs=2)
    for pid in (2, 0, 1):
        assert cut.on_report(pid, 1, f"em{pid}") is False
    assert cut.on_report(0, 2, "early") is False
    assert cut.aligned(1) == [(0, "em0"), (1, "em1"), (2, "em2")]
    assert cut.aligned(1) == []
    with pytest.raises(CutError, match="twice"):
        cut.on_report(0, 2, "again")
    assert CutProtocol(2, sync=False).on_report(0, 1, "x") is True


def test_a_cut_holds_every_subtask_and_records_what_each_had_seen():
    cut = CutProtocol(2, sync=True, every_epochs=2)
    assert cut.after_alignment(1, terminated=False) is False
    assert cut.after_alignment(2, terminated=False) is True
    cut.on_report(1, 3, "beyond the cut")
    assert cut.ask_state([0, 1]) == [0, 1]
    assert cut.on_state(0, 2, 5, ("state", b"s0")) is False
    assert cut.ask_state([1]) == [1]
    with pytest.raises(CutError, match="is not complete"):
        cut.take()
    assert cut.on_state(1, 2, 5, None) is True
    taken = cut.take()
    assert taken.epoch == 2 and cut.cutting is None
    assert taken.subtasks[0] == SubtaskCut(2, 5, ("state", b"s0"))
    assert taken.unapplied == {3: {1: "beyond the cut"}}
    plain = pickle.loads(pickle.dumps(taken.to_plain()))
    again = CutProtocol(2, sync=True, every_epochs=2)
    again.restore(Cut.from_plain(plain))
    assert again.instruction(1) == SubtaskCut(2, 5, None)
    assert again.aligned(3) == [(1, "beyond the cut")]  # held again, applied once
    with pytest.raises(CutError, match="cannot restore 3"):
        CutProtocol(3, sync=True).restore(taken)


def test_a_terminated_iteration_abandons_its_cut_and_old_launches_are_fenced():
    cut = CutProtocol(1, sync=True, every_epochs=1)
    assert cut.after_alignment(3, terminated=False)
    assert cut.after_alignment(3, terminated=True) is False
    assert cut.on_state(0, 3, 1, None) is False and cut.cutting is None
    cut.begin_attempt(2)
    assert cut.accepts(2) and not cut.accepts(1)


def test_states_sent_with_a_cuts_call_complete_the_cut_without_asking():
    cut = CutProtocol(3, sync=True, every_epochs=2)
    cut.offer_state(0, 2, 4, ("state", b"s0"), aligned=1)
    cut.offer_state(1, 2, 4, None, aligned=1)
    cut.offer_state(2, 3, 4, "not a cut's call", aligned=1)  # dropped
    cut.offer_state(2, 2, 4, "already aligned", aligned=2)  # a restored held call: dropped
    assert cut.after_alignment(2, terminated=False) is True
    assert cut.ask_state([0, 1, 2]) == [2]  # only the subtask that did not send it
    assert cut.on_state(2, 2, 4, ("state", b"s2")) is True
    taken = cut.take()
    assert taken.subtasks[0] == SubtaskCut(2, 4, ("state", b"s0"))
    assert taken.subtasks[1] == SubtaskCut(2, 4, None)
    every = CutProtocol(2, sync=True, every_epochs=1)
    every.offer_state(0, 1, 0, "a", aligned=0)
    every.offer_state(1, 1, 0, "b", aligned=0)
    assert every.after_alignment(1, terminated=False) and every.complete  # no round trip
    # a terminating alignment drops what was sent for it; async mode never takes offers
    ended = CutProtocol(1, sync=True, every_epochs=1)
    ended.offer_state(0, 1, 0, "x", aligned=0)
    assert ended.after_alignment(1, terminated=True) is False
    assert ended.after_alignment(2, terminated=False) and not ended.complete
    lazy = CutProtocol(1, sync=False, every_epochs=1)
    lazy.offer_state(0, 1, 0, "x", aligned=0)
    assert lazy.after_alignment(1, terminated=False) and not lazy.complete
    with pytest.raises(CutError, match="out of range"):
        CutProtocol(2, sync=True, every_epochs=1).offer_state(5, 1, 0, None, aligned=0)


# -- the property: faults anywhere, sync result bit for bit -------------------------------


class Crash(Exception):
    """A simulated fault: a subtask dies here, and the stage with it."""


#: the callbacks of each launch's partition operators: LAUNCHES[-1][pid] is the newest
LAUNCHES: list[dict[int, list]] = []


class Grad(hi.PartitionOperator):
    """A partition operator keeping a private copy of the variables (restored through
    snapshot_state) and emitting a record when variables arrive (a record that must not
    be lost at a restore). Logs its callbacks in its launch's log."""

    def open(self, ctx):
        self.pid, self.w, self.version = ctx.partition_id, None, -1
        self.log = LAUNCHES[-1][ctx.partition_id]

    def process_variables(self, variables, ctx, out):
        self.w, self.version = np.array(variables["w"]), ctx.variables_version
        self.log.append(("variables", self.version, self.w.tobytes()))
        out.output("seen", (self.pid, self.version))

    def process_data(self, stream, batch, ctx, out):
        out.output("loaded", self.pid)  # a record of loading (applied before any cut)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.log.append(("watermark", epoch, self.w.tobytes()))
        target = np.arange(DIMS, dtype=float) * (self.pid + 1) / 7.0
        out.feedback((self.w - target) * (self.pid + 1.5) / 3.0)

    def snapshot_state(self):
        self.log.append(("snapshot",))
        return {"w": self.w, "version": self.version}

    def restore_state(self, state):
        self.w, self.version = state["w"], state["version"]
        self.log.append(("restored",))


class Momentum:
    """A coordinator operator with state and no snapshot_state (pickled whole)."""

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])
        self.m = np.zeros_like(self.w)
        self.g = np.zeros_like(self.w)

    def process_feedback(self, value, ctx, out):
        self.g = self.g + value
        out.output("feedback", (ctx.epoch, ctx.source_partition, float(value.sum())))

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if epoch == 0:
            return  # epoch 0 carries no feedback (the records of loading)
        self.m = 0.7 * self.m + self.g
        self.w = self.w - 0.05 * self.m
        self.g = np.zeros_like(self.w)
        out.output("w", self.w.tobytes())
        out.publish_variables(w=self.w)


class Kickoff(Momentum):
    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if epoch == 0:
            out.publish_variables(w=self.w + 1.0)  # epoch 0 publishes: the loop starts
            return
        super().on_epoch_watermark_incremented(epoch, ctx, out)


def _spec(directory: str, *, restore: bool, every: int, attempt: int) -> CoordinatorSpec:
    return CoordinatorSpec(
        num_subtasks=N,
        num_streams=1,
        staleness=0,
        max_epochs=EPOCHS,
        has_criteria=False,
        init_variables={"w": np.zeros(DIMS)},
        operators=cloudpickle.dumps((Kickoff(), None, [])),
        checkpoint=CheckpointSpec(directory, every_epochs=every, keep_last=2, restore=restore),
        attempt=attempt,
    )


def _plan(every: int, attempt: int, restore: bool) -> TaskPlan:
    return TaskPlan(
        ray_address="",
        namespace="",
        actor_name="in-process",
        operator=cloudpickle.dumps(Grad()),
        num_subtasks=N,
        numeric_columns=(None,),
        staleness=0,
        has_criteria=False,
        attempt=attempt,
        restore=restore,
        checkpoint_every=every,
        max_epochs=EPOCHS,
    )


class FaultyLink:
    """The in-process link, counting every coordinator call of the run (a step before
    it is sent, one after its answer arrives) and crashing at the chosen steps."""

    def __init__(self, link: InProcessLink, faults: set[int], counter: list[int]) -> None:
        self._link, self._faults, self._counter = link, faults, counter
        self._lock = threading.Lock()

    def _tick(self) -> None:
        with self._lock:
            self._counter[0] += 1
            step = self._counter[0]
        if step in self._faults:
            raise Crash(step)

    def resolve(self, payload):
        return self._link.resolve(payload)

    def fail(self, failure, attempt):
        return self._link.fail(failure, attempt)  # reporting a crash never crashes

    def __getattr__(self, method):
        call = getattr(self._link, method)

        def crashing(*args):
            self._tick()
            answer = call(*args)
            link = self

            class Answer:
                def ready(self):
                    return answer.ready()

                def result(self, timeout=None):
                    got = answer.result(timeout)
                    link._tick()
                    return got

            return Answer()

        return crashing


@contextmanager
def _loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An asyncio loop run by a thread of its own: where the coordinator lives."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _launch(
    plan: TaskPlan, link: FaultyLink, offering: frozenset[int]
) -> dict[int, Exception | None]:
    """Run the stage: every subtask in a thread of its own; how each ended."""
    batch = pa.record_batch({"x": pa.array([1.0])})
    outcome: dict[int, Exception | None] = {}

    def subtask(pid: int) -> None:
        # a subtask that does not offer its state with a cut's call is asked for it
        own = plan if pid in offering else dataclasses.replace(plan, checkpoint_every=0)
        try:
            run_subtask(own, pid, iter([(0, batch)]), link)
            outcome[pid] = None
        except Exception as ex:
            outcome[pid] = ex

    threads = [threading.Thread(target=subtask, args=(p,)) for p in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a subtask hangs"
    return outcome


def _run(faults: set[int], directory: str, every: int, offering: frozenset[int] = frozenset()):
    """Launch the stage until it ends without a crash, as the driver does; returns the
    result, the checkpoint info and the launches' operator logs."""
    LAUNCHES.clear()
    counter = [0]
    attempt, restore = 0, False
    with _loop() as loop:
        while True:
            coord = IterationCoordinator(
                _spec(directory, restore=restore, every=every, attempt=attempt)
            )
            assert not coord.core.failures, coord.core.failures
            link = InProcessLink(coord, loop)
            if attempt:  # a call of the dead launch arrives late: fenced off, no effect
                late = Emissions(feedback=[np.ones(DIMS)])
                stale = link.report(0, 1, -1, late, None, attempt - 1, None).result(30)
                assert stale.error is not None and stale.error.type_name == "StaleAttempt"
            LAUNCHES.append({pid: [] for pid in range(N)})
            outcome = _launch(
                _plan(every, attempt, restore), FaultyLink(link, faults, counter), offering
            )
            crashed = [ex for ex in outcome.values() if ex is not None]
            if not crashed:
                return coord.result(), coord.checkpoint_info(), list(LAUNCHES)
            for ex in crashed:
                assert isinstance(ex, Crash), ex
            attempt, restore = attempt + 1, True


def _after(log: list, marker: str) -> list:
    """The callbacks after the last ``marker`` event of a log (all of it without one)."""
    idx = max((i for i, e in enumerate(log) if e[0] == marker), default=-1)
    return log[idx + 1 :]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    result, info, launches = _run(set(), str(tmp_path_factory.mktemp("clean")), 3)
    assert not info["restored_from"] and len(info["checkpoints"]) == 2
    return result, launches[0]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    faults=st.sets(st.integers(min_value=1, max_value=200), max_size=3),
    offering=st.frozensets(st.integers(min_value=0, max_value=N - 1)),
)
def test_a_sync_run_with_faults_anywhere_equals_the_fault_free_run(
    clean, tmp_path_factory, faults, offering
):
    """... whichever subtasks send their state with a cut's call and which wait to be
    asked (the clean run: every subtask is asked)."""
    clean_result, clean_logs = clean
    result, info, launches = _run(faults, str(tmp_path_factory.mktemp("faulty")), 3, offering)
    assert result.variables["w"].tobytes() == clean_result.variables["w"].tobytes()
    assert result.epochs == clean_result.epochs == EPOCHS
    assert [(r.tag, r.epoch, r.source, r.value) for r in result.outputs] == [
        (r.tag, r.epoch, r.source, r.value) for r in clean_result.outputs
    ]
    last = launches[-1]
    for pid in range(N):
        if info["restored_from"]:
            # after restore_state: exactly the fault-free callbacks after the same cut
            restored_life = _after(last[pid], "restored")
            epoch = info["restored_epoch"]
            snaps = [i for i, e in enumerate(clean_logs[pid]) if e[0] == "snapshot"]
            cut_index = snaps[epoch // 3 - 1]
            assert restored_life == clean_logs[pid][cut_index + 1 :]
        else:
            assert last[pid] == clean_logs[pid]
