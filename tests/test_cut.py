"""The cut and the restore, stepped event by event without Ray (issue 15).

``CutProtocol`` is the pure core; the property test drives the real coordinator class
(``IterationCoordinator``, without Ray: its methods are coroutines) with simulated
subtasks that follow the task-side protocol of ``hybrid_iter._runtime.task`` and crash at random
points: any call, during a checkpoint (some states in, not all), between a publish and
its consumption, during a restore itself. Every crash relaunches the whole stage on a new
coordinator restored from the checkpoint directory, as the driver does. A sync run must
end bit for bit equal to the fault-free run, and every operator's callbacks after its
restore must equal the fault-free ones after the same cut.
"""

from __future__ import annotations

import asyncio
import pickle

import cloudpickle
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import CheckpointSpec, CoordinatorSpec, Emissions, IterationCoordinator
from coordinator._cut import Cut, CutError, CutProtocol, SubtaskCut

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
    """A simulated fault: the stage and its coordinator die here."""


class World:
    """Counts the events of a run; crashes at the chosen ones, yields to vary the order."""

    def __init__(self, faults: set[int], yields: list[int]) -> None:
        self.step, self.faults, self.yields = 0, faults, yields or [0]
        self.logs: list[dict[int, list]] = []  # one dict of per-subtask logs per launch

    async def tick(self) -> None:
        self.step += 1
        for _ in range(self.yields[self.step % len(self.yields)]):
            await asyncio.sleep(0)
        if self.step in self.faults:
            raise Crash(self.step)


class Grad:
    """A partition operator keeping a private copy of the variables (restored through
    snapshot_state) and emitting a record when variables arrive (a record that must not
    be lost at a restore)."""

    def __init__(self, pid: int, log: list) -> None:
        self.pid, self.log, self.w, self.version = pid, log, None, -1

    def process_variables(self, values, version, em: Emissions) -> None:
        self.w, self.version = np.array(values["w"]), version
        self.log.append(("variables", version, self.w.tobytes()))
        em.outputs.append(("seen", (self.pid, version)))

    def watermark(self, epoch: int, em: Emissions) -> None:
        self.log.append(("watermark", epoch, self.w.tobytes()))
        target = np.arange(DIMS, dtype=float) * (self.pid + 1) / 7.0
        em.feedback.append((self.w - target) * (self.pid + 1.5) / 3.0)

    def snapshot(self) -> bytes:
        self.log.append(("snapshot",))
        return cloudpickle.dumps({"w": self.w, "version": self.version})

    def restore(self, blob: bytes) -> None:
        state = cloudpickle.loads(blob)
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


def _spec(directory: str, *, restore: bool, every: int) -> CoordinatorSpec:
    return CoordinatorSpec(
        num_subtasks=N,
        num_streams=1,
        staleness=0,
        max_epochs=EPOCHS,
        has_criteria=False,
        init_variables={"w": np.zeros(DIMS)},
        operators=cloudpickle.dumps((Kickoff(), None, [])),
        checkpoint=CheckpointSpec(directory, every_epochs=every, keep_last=2, restore=restore),
    )


async def _subtask(
    world: World,
    coord: IterationCoordinator,
    pid: int,
    attempt: int,
    log,
    *,
    every: int,
    offers: bool,
):
    """One subtask, following ``hybrid_iter._runtime.task._Subtask``'s protocol;
    ``offers``: it sends its state with a cut's call (else only when asked)."""
    restored = await coord.restored(pid)
    await world.tick()
    payload = await coord.variables(-1)
    op, em = Grad(pid, log), Emissions()
    op.process_variables(payload.inline, payload.version, em)
    em.outputs.append(("loaded", pid))  # a record of loading (applied before any cut)
    k, version, restored_call = 0, payload.version, -1
    if restored is not None:
        call, known_version, state = restored
        em = Emissions()  # records of reloading were applied before the checkpoint
        op.restore(state[1])
        k, version, restored_call = call, known_version, call
    await world.tick()
    while True:
        offered = None
        if offers and 1 <= k < EPOCHS and k % every == 0 and k != restored_call:
            offered = (("state", op.snapshot()),)
            await world.tick()
        reply = await coord.report(pid, k, version, em, [1] if k == 0 else None, attempt, offered)
        while reply.error is None and reply.need_state:
            await world.tick()
            state = ("state", op.snapshot())
            await world.tick()
            reply = await coord.checkpoint_state(pid, k, version, state, attempt)
        assert reply.error is None, reply.error
        await world.tick()
        k += 1
        em = Emissions()
        if reply.variables is not None:
            op.process_variables(reply.variables.inline, reply.variables.version, em)
            version = reply.variables.version
            await world.tick()
        if reply.terminated:
            await coord.finish(pid, em, attempt)
            return
        op.watermark(k - 1, em)
        await world.tick()


async def _run(world: World, directory: str, every: int, offering: frozenset[int] = frozenset()):
    attempt, restore = 0, False
    while True:
        coord = IterationCoordinator(_spec(directory, restore=restore, every=every))
        assert not coord._failures, coord._failures
        coord.begin_attempt(attempt)
        if attempt:  # a call of the dead launch arrives late: fenced off, no effect
            stale = await coord.report(0, 1, -1, Emissions(feedback=[np.ones(DIMS)]), None, 0)
            assert stale.error is not None and stale.error.type_name == "StaleAttempt"
        logs: dict[int, list] = {pid: [] for pid in range(N)}
        world.logs.append(logs)
        tasks = [
            asyncio.ensure_future(
                _subtask(world, coord, pid, attempt, logs[pid], every=every, offers=pid in offering)
            )
            for pid in range(N)
        ]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        crashed = [t for t in done if t.exception() is not None]
        if not crashed:
            return coord.result(), coord.checkpoint_info()
        for t in crashed:
            assert isinstance(t.exception(), Crash), t.exception()
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        attempt, restore = attempt + 1, True


def _after(log: list, marker: str) -> list:
    """The callbacks after the last ``marker`` event of a log (all of it without one)."""
    idx = max((i for i, e in enumerate(log) if e[0] == marker), default=-1)
    return log[idx + 1 :]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    world = World(set(), [0])
    result, info = asyncio.run(_run(world, str(tmp_path_factory.mktemp("clean")), 3))
    assert not info["restored_from"] and len(info["checkpoints"]) == 2
    return result, world.logs[0]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    faults=st.sets(st.integers(min_value=1, max_value=200), max_size=3),
    yields=st.lists(st.integers(min_value=0, max_value=3), max_size=8),
    offering=st.frozensets(st.integers(min_value=0, max_value=N - 1)),
)
def test_a_sync_run_with_faults_anywhere_equals_the_fault_free_run(
    clean, tmp_path_factory, faults, yields, offering
):
    """... whichever subtasks send their state with a cut's call and which wait to be
    asked (the clean run: every subtask is asked)."""
    clean_result, clean_logs = clean
    world = World(faults, yields)
    result, info = asyncio.run(_run(world, str(tmp_path_factory.mktemp("faulty")), 3, offering))
    assert result.variables["w"].tobytes() == clean_result.variables["w"].tobytes()
    assert result.epochs == clean_result.epochs == EPOCHS
    assert [(r.tag, r.epoch, r.source, r.value) for r in result.outputs] == [
        (r.tag, r.epoch, r.source, r.value) for r in clean_result.outputs
    ]
    last = world.logs[-1]

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
