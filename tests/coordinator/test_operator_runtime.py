"""One operator runtime for both tiers: the same ``ctx``/``out`` checks and exceptions,
one operator-state form (checkpoints and the round stash), one "does the user override
this hook", and the subtask runtime run against the in-process coordinator (no Ray)."""

from __future__ import annotations

import asyncio
import threading

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest

import hybrid_iter as hi
from coordinator import (
    CoordinatorSpec,
    Emissions,
    InProcessLink,
    IterationCoordinator,
    RuntimeHooks,
    UnpicklableOperator,
)
from coordinator._operator_api import overrides
from coordinator._tree import TreeSpec
from hybrid_iter._runtime.task import TaskPlan, _Subtask, run_round, run_subtask

pytestmark = pytest.mark.usefixtures("validate_cores")


class _Sink:
    def publish(self, variables):
        pass

    def output(self, tag, value, *, from_listener):
        pass

    def criteria(self):
        pass


@pytest.mark.parametrize(
    "out",
    [hi.PartitionCollector(False), hi.CoordinatorCollector(_Sink(), False)],
    ids=["partition tier", "coordinator tier"],
)
def test_both_tiers_refuse_the_same_misuse_with_the_same_exception(out):
    with pytest.raises(hi.ConfigTypeError, match="output tag must be a non-empty string"):
        out.output(3, "x")
    with pytest.raises(hi.UsageError, match="no criteria stream"):
        out.criteria()


class Duck:
    """An operator that does not subclass the base classes, without snapshot_state."""

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        pass


class Own(hi.PartitionOperator):
    def snapshot_state(self):
        return 1


class Inherited(Own):
    pass


class Reset(Own):
    snapshot_state = hi.PartitionOperator.snapshot_state  # back to the no-op hook


@pytest.mark.parametrize(
    "op, expected",
    [
        (Duck(), False),
        (hi.PartitionOperator(), False),
        (hi.CoordinatorOperator(), False),
        (Own(), True),
        (Inherited(), True),
        (Reset(), False),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, bool) else str(v),
)
def test_overrides_tells_a_users_hook_from_the_no_op_one_on_both_tiers(op, expected):
    assert overrides(op, "snapshot_state") is expected


def _plan(n=2, **kw):
    defaults = dict(
        ray_address="",
        namespace="",
        actor_name="in-process",
        operator=cloudpickle.dumps(Grad()),
        num_subtasks=n,
        numeric_columns=(None,),
        staleness=0,
        has_criteria=False,
    )
    return TaskPlan(**{**defaults, **kw})


class Locked(hi.PartitionOperator):
    def open(self, ctx):
        self.lock = threading.Lock()  # cannot be pickled


def test_an_unpicklable_partition_operator_is_the_same_error_as_on_the_coordinator_tier():
    sub = _Subtask(_plan(), 0, None)
    sub.all_round = Locked()
    sub.all_round.open(sub.ctx)
    with pytest.raises(
        UnpicklableOperator, match=r"partition operator Locked \(partition 0\) cannot be pickled"
    ):
        sub.checkpoint_state()
    sub.last = type("Reply", (), {"aligned": 0})()
    with pytest.raises(UnpicklableOperator, match="define snapshot_state"):
        sub.snapshot()  # the round stash: the same form, the same error


# -- the subtask runtime against the in-process coordinator --------------------------------


class Grad(hi.PartitionOperator):
    """Feeds back the distance of its variables to a target; without snapshot_state
    (carried between round jobs pickled whole) unless a subclass adds it."""

    def open(self, ctx):
        self.pid, self.rows = ctx.partition_id, 0

    def process_data(self, stream, batch, ctx, out):
        self.rows = batch.num_rows  # a replayed stream is read again every round

    def process_variables(self, variables, ctx, out):
        self.w = np.array(variables["w"])

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback((self.w - (self.pid + 1.0)) * self.rows)


class StatefulGrad(Grad):
    def snapshot_state(self):
        return {"w": self.w, "rows": self.rows, "pid": self.pid}

    def restore_state(self, state):
        self.w, self.rows, self.pid = state["w"], state["rows"], state["pid"]


class Step(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.w, self.g = np.array(init_variables["w"]), 0.0

    def process_feedback(self, value, ctx, out):
        self.g = self.g + value

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.w = self.w - 0.1 * self.g
        self.g = 0.0
        out.output("w", self.w.copy())
        out.publish_variables(w=self.w)


def _coordinator(n, *, tree=None, hooks=None, max_epochs=5):
    spec = CoordinatorSpec(
        num_subtasks=n,
        num_streams=1,
        staleness=0,
        max_epochs=max_epochs,
        has_criteria=False,
        init_variables={"w": np.zeros(2)},
        operators=cloudpickle.dumps((Step(), None, [])),
        tree=tree,
        hooks=hooks,
        attempt=0,
    )
    return IterationCoordinator(spec)


class _Loop:
    """The coordinator's asyncio loop on a thread of its own (as the actor's)."""

    def __enter__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self.loop

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def _stage(fn, n):
    """``fn(pid)`` in one thread per subtask (a barrier stage); re-raises a failure."""
    errors = []

    def run(pid):
        try:
            fn(pid)
        except Exception as ex:
            errors.append(ex)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a subtask hangs"
    if errors:
        raise errors[0]


def _batches(pid):
    return iter([(0, pa.record_batch({"x": pa.array([1.0] * (pid + 2))}))])


def _whole(op, n=2):
    coord = _coordinator(n)
    plan = _plan(n, operator=cloudpickle.dumps(op))
    with _Loop() as loop:
        link = InProcessLink(coord, loop)
        _stage(lambda pid: run_subtask(plan, pid, _batches(pid), link), n)
    return coord.result()


@pytest.mark.parametrize("op", [Grad(), StatefulGrad()], ids=["pickled whole", "snapshot_state"])
def test_round_jobs_carry_the_operator_through_the_stash_to_the_same_result(op):
    """Replayed streams: one job per round; the operator travels from a round's task to
    the next through the coordinator's stash, in the checkpoints' form."""
    n = 2
    whole = _whole(op, n)
    coord = _coordinator(n)
    plan = _plan(n, operator=cloudpickle.dumps(op), replayed=(True,))
    rounds = 0
    with _Loop() as loop:
        link = InProcessLink(coord, loop)
        while not coord.progress().done:
            _stage(lambda pid, r=rounds: run_round(plan, r, pid, _batches(pid), link), n)
            rounds += 1
    data = coord.result()
    assert rounds == 5 and data.epochs == whole.epochs == 5
    assert data.variables["w"].tobytes() == whole.variables["w"].tobytes()
    assert [r.value.tobytes() for r in data.outputs] == [r.value.tobytes() for r in whole.outputs]


class Broken:
    def merge(self, a, b):
        raise ArithmeticError("cannot merge")


def test_a_combiner_failing_at_the_alignment_fails_the_run_naming_it():
    """Without group actors the coordinator merges the subtasks' partial values at the
    alignment: a combiner that raises there fails the run with a failure that names it
    (every subtask is answered), instead of escaping from one subtask's call."""
    n = 2
    coord = _coordinator(n, tree=TreeSpec(cloudpickle.dumps(Broken()), fan_in=4))
    plan = _plan(n, tree=TreeSpec(cloudpickle.dumps(Broken()), fan_in=4))
    with _Loop() as loop:
        link = InProcessLink(coord, loop)
        _stage(lambda pid: run_subtask(plan, pid, _batches(pid), link), n)
    (failure,) = coord.result().failures
    assert failure.where == "combining feedback" and "cannot merge" in failure.message


class RaisingHook(RuntimeHooks):
    def at_alignment(self, epoch, *, attempt, restarted):
        if epoch == 2:
            raise ValueError("hook raised")


def test_a_hook_raising_at_an_alignment_is_a_failure_at_that_point():
    n = 2
    coord = _coordinator(n, hooks=RaisingHook())
    with _Loop() as loop:
        link = InProcessLink(coord, loop)
        _stage(lambda pid: run_subtask(_plan(n), pid, _batches(pid), link), n)
    data = coord.result()
    (failure,) = data.failures
    assert failure.where == "the at_alignment hook" and failure.epoch == 2
    assert coord.progress().aligned == 2


def test_the_in_process_link_refuses_what_it_cannot_carry():
    coord = _coordinator(1)
    with _Loop() as loop:
        link = InProcessLink(coord, loop)
        payload = link.variables(-1).result(30)
        assert list(link.resolve(payload)) == ["w"]
        assert link.group_of(0).result(30) is None
        reply = link.report(0, 0, 0, Emissions(), [1], 0, None).result(30)
        assert not reply.terminated and reply.epoch == 0
