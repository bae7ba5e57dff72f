"""The coordinator core stepped one event at a time through ``handle`` (no Ray, no
asyncio, no user code): which instructions each event gives, in which order. Slots are
plain strings here (the actor uses futures); every core is validated at the end."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from coordinator import CoordinatorCore, CoreError, Emissions, RemoteFailure, TerminationReason
from coordinator._core import (
    Aligned,
    Answer,
    Apply,
    ApplyCombined,
    BeginAttempt,
    Done,
    Fail,
    Finish,
    GroupReport,
    Notify,
    Report,
    Restore,
    StateSent,
    Terminate,
    TerminatingRound,
    Watermark,
    WriteCheckpoint,
)

pytestmark = pytest.mark.usefixtures("validate_cores")


def make(n=2, *, staleness=0, max_epochs=None, criteria=False, every=0, tree=False, attempt=0):
    return CoordinatorCore(
        n,
        num_streams=1,
        staleness=staleness,
        max_epochs=max_epochs,
        has_criteria=criteria,
        checkpoint_every=every,
        tree=tree,
        attempt=attempt,
    )


def published(epoch, version):
    """The outcome of a callback that published once at ``epoch``."""
    return Done(counts=((epoch, 1, 0),), version=version)


def test_a_sync_run_step_by_step_from_loading_to_termination():
    c = make(2)
    assert c.handle(Report(0, 0, 0, Emissions(), [5], slot="a0")) == []
    assert c.handle(Report(1, 0, 0, Emissions(), [5], slot="a1")) == [
        Aligned(0, False),
        Answer(("a0", "a1"), 0, False, 0),  # one answer for both: equal replies, one object
    ]
    em0, em1 = Emissions(feedback=[1.0]), Emissions(feedback=[2.0])
    assert c.handle(Report(1, 1, 0, em1, slot="b1")) == []  # sync: held for alignment 1
    # applied in partition order whatever the arrival order, one callback at a time
    assert c.handle(Report(0, 1, 0, em0, slot="b0")) == [Apply(0, 0, em0)]
    with pytest.raises(CoreError, match="awaited"):
        c.handle(Report(0, 2, 0, Emissions(), slot="x"))
    assert c.handle(Done()) == [Apply(0, 1, em1)]
    assert c.handle(Done()) == [Watermark(0)]
    assert c.handle(published(0, 1)) == [
        Aligned(1, False),
        Answer(("b0", "b1"), 1, False, 1, variables=True),
    ]
    assert c.handle(Report(0, 2, 1, Emissions(), slot="c0")) == []
    assert c.handle(Report(1, 2, 1, Emissions(), slot="c1")) == [Watermark(1)]
    # nothing published in epoch 1: nothing is fed back into epoch 2, the loop ends
    assert c.handle(Done(version=1)) == [Aligned(2, False), Answer(("c0", "c1"), 2, True, 2)]
    assert c.sm.terminated is TerminationReason.NO_VARIABLES_PUBLISHED
    assert c.handle(Finish(1, Emissions(outputs=[("bye", 1)]))) == [Notify()]
    assert c.handle(Finish(0, Emissions(outputs=[("bye", 0)]))) == [
        Terminate(1, [(0, [("bye", 0)]), (1, [("bye", 1)])])  # partition order
    ]
    assert c.handle(Done()) == [Notify()]
    assert c.closed and c.done
    assert dict(c.feedback_counts) == {0: 1, 1: 1} and c.rows == [10]


def test_the_terminating_round_runs_before_on_iteration_terminated():
    """Criteria end the iteration at alignment 2 while variables were published into
    round 2: its per-round records are applied (their publishes dropped), its per-round
    operators end their round, then everything hears on_iteration_terminated."""
    c = make(1, criteria=True)
    c.handle(Report(0, 0, 0, Emissions(), [1], slot="s"))
    assert c.handle(Report(0, 1, 0, Emissions(), slot="s")) == [Watermark(0)]
    assert c.handle(Done(counts=((0, 1, 1),), version=1)) == [
        Aligned(1, False),
        Answer(("s",), 1, False, 1, variables=True),
    ]
    assert c.handle(Report(0, 2, 1, Emissions(), slot="s")) == [Watermark(1)]
    assert c.handle(published(1, 2)) == [  # published, but no criteria record: the end
        Aligned(2, False),
        Answer(("s",), 2, True, 2, variables=True, terminating_round=2),
    ]
    last_round = Emissions(feedback=[3.0])
    out = c.handle(Finish(0, Emissions(outputs=[("last", 1)]), 0, last_round))
    assert out == [Apply(2, 0, last_round, terminating=True)]
    assert c.handle(Done()) == [TerminatingRound(2)]
    assert c.handle(Done()) == [Terminate(1, [(0, [("last", 1)])])]
    assert c.handle(Done()) == [Notify()]
    assert c.sm.terminated is TerminationReason.CRITERIA and c.closed


def test_a_cut_asks_only_for_missing_states_writes_then_releases_and_restores():
    c = make(2, every=2)
    c.handle(Report(0, 0, 0, Emissions(), [1], slot="a0"))
    c.handle(Report(1, 0, 0, Emissions(), [1], slot="a1"))
    c.handle(Report(0, 1, 0, Emissions(), slot="b0"))
    assert c.handle(Report(1, 1, 0, Emissions(), slot="b1")) == [Watermark(0)]
    c.handle(published(0, 1))
    # subtask 0 sends its state with the cut's call; subtask 1 is asked for it
    assert c.handle(Report(0, 2, 1, Emissions(), None, 0, (("state", b"s0"),), "c0")) == []
    assert c.handle(Report(1, 2, 1, Emissions(), slot="c1")) == [Watermark(1)]
    assert c.handle(published(1, 2)) == [
        Aligned(2, True),
        Answer(("c1",), 2, False, 2, need_state=True),
    ]
    (write,) = c.handle(StateSent(1, 2, 1, ("state", b"s1"), 0, "d1"))
    assert isinstance(write, WriteCheckpoint) and write.epoch == 2
    assert write.state["sm"]["calls"] == {0: 2, 1: 2}
    assert c.handle(Done(version=2)) == [  # written: now released, with the new variables
        Answer(("c0", "d1"), 2, False, 2, variables=True)
    ]
    state = pickle.loads(pickle.dumps(write.state))  # plain data
    r = make(2, every=2, attempt=None)
    r.handle(Restore(state, 2))
    assert r.restore_instruction(0) == (2, 1, ("state", b"s0"))
    assert r.restore_instruction(1) == (2, 1, ("state", b"s1"))
    r.handle(BeginAttempt(1))
    (stale,) = r.handle(Report(0, 2, 1, Emissions(), None, 0, None, "late"))  # old launch
    assert stale.slots == ("late",) and stale.error.type_name == "StaleAttempt"
    # the held call is made again: released at once with the variables it had not seen
    assert r.handle(Report(0, 2, 1, Emissions(), None, 1, None, "again")) == [
        Answer(("again",), 2, False, 2, variables=True)
    ]


def test_a_stale_call_is_answered_itself_and_leaves_the_waiting_call_alone():
    c = make(2, attempt=1)
    assert c.handle(Report(0, 0, 0, Emissions(), [1], 1, None, "current")) == []
    (stale,) = c.handle(Report(0, 0, 0, Emissions(), [1], 0, None, "old"))
    assert stale.slots == ("old",) and stale.terminated
    assert c.waiters[0][2] == "current"
    assert c.handle(Report(1, 0, 0, Emissions(), [1], 1, None, "other"))[-1] == Answer(
        ("current", "other"), 0, False, 0
    )


def test_a_failing_callback_answers_every_waiting_call_and_every_later_one():
    c = make(2)
    c.handle(Report(0, 0, 0, Emissions(), [1], slot="a0"))
    c.handle(Report(1, 0, 0, Emissions(), [1], slot="a1"))
    c.handle(Report(0, 1, 0, Emissions(feedback=[1.0]), slot="b0"))
    assert isinstance(c.handle(Report(1, 1, 0, Emissions(feedback=[2.0]), slot="b1"))[0], Apply)
    failure = RemoteFailure("coordinator", 0, "Op.process_feedback", "ValueError", "x", "")
    assert c.handle(Done(failure)) == [
        Fail(failure),
        Answer(("b0", "b1"), 1, True, 0, error=failure),
    ]
    (late,) = c.handle(Report(0, 2, 0, Emissions(), slot="late"))
    assert late.error is failure
    assert c.handle(Finish(0, Emissions())) == []  # a failed run finishes nothing
    assert c.done and not c.closed


def test_async_feedback_is_applied_on_arrival_and_mismatched_shapes_fail_the_run():
    c = make(2, staleness=None)
    c.handle(Report(0, 0, 0, Emissions(), [1], slot="a0"))
    c.handle(Report(1, 0, 0, Emissions(), [1], slot="a1"))
    em = Emissions(feedback=[np.zeros(3)])
    assert c.handle(Report(0, 1, 0, em, slot="b0")) == [Apply(0, 0, em)]
    assert c.handle(Done())[-1] == Answer(("b0",), 1, False, 0)  # async: not held
    out = c.handle(Report(1, 1, 0, Emissions(feedback=[np.zeros((1, 3))]), slot="b1"))
    assert isinstance(out[0], Fail) and out[0].failure.type_name == "FeedbackShapeMismatch"
    assert out[1] == Answer(("b1",), 1, True, 0, error=out[0].failure)


def test_feedback_combine_merges_partials_in_partition_order_and_answers_group_members():
    c = make(4, tree=True)
    members = [(p, 0, Emissions(), [1]) for p in (2, 3)]
    assert c.handle(GroupReport(2, 0, members, Emissions(), 0, ["m2", "m3"])) == []
    members = [(p, 0, Emissions(), [1]) for p in (0, 1)]
    out = c.handle(GroupReport(0, 0, members, Emissions(), 0, ["m0", "m1"]))
    assert out == [Aligned(0, False), Answer(("m0", "m1", "m2", "m3"), 0, False, 0)]
    g1 = [(p, 0, Emissions(combined_count=1), None) for p in (2, 3)]
    c.handle(GroupReport(2, 1, g1, Emissions(feedback=[5.0], combined_count=0), 0, ["x2", "x3"]))
    lone = Emissions(feedback=[1.0, 2.0])  # not pre-combined: its values, in order
    c.handle(Report(1, 1, 0, lone, slot="x1"))
    assert lone.feedback == [] and lone.combined_count == 2  # counted, not applied twice
    out = c.handle(Report(0, 1, 0, Emissions(feedback=[0.5]), slot="x0"))
    assert out == [ApplyCombined(0, [0.5, 1.0, 2.0, 5.0], [])]
    assert c.handle(Done()) == [Watermark(0)]
    assert c.handle(published(0, 1))[-1] == Answer(
        ("x0", "x1", "x2", "x3"), 1, False, 1, variables=True
    )
    assert c.feedback_counts[1] == 2 and c.feedback_counts[2] == 1


def test_an_event_is_refused_while_an_outcome_is_awaited_and_done_without_one():
    c = make(1)
    with pytest.raises(CoreError, match="Done without"):
        c.handle(Done())
    with pytest.raises(CoreError, match="not an event"):
        c.handle("report")  # type: ignore[arg-type]
