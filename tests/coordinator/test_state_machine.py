"""The pure epoch/termination state machine, stepped one event at a time (no Ray); the
random schedules drive it inside the whole core (``CoordinatorCore.handle``)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import (
    CoordinatorCore,
    Emissions,
    EpochStateMachine,
    Release,
    StateMachineError,
    TerminationReason,
)
from coordinator._core import Answer, Done, Finish, Report, UserCall, Watermark

pytestmark = pytest.mark.usefixtures("validate_cores")


def sm(n=2, staleness=0, max_epochs=None, has_criteria=False):
    return EpochStateMachine(
        n, staleness=staleness, max_epochs=max_epochs, has_criteria=has_criteria
    )


def align_all(m: EpochStateMachine, published_per_epoch: int = 1) -> list[int]:
    """Complete every ready alignment the way the actor does; returns them."""
    done = []
    while (k := m.next_alignment()) is not None:
        if k >= 1:
            m.record_coordinator(k - 1, published=published_per_epoch)
        m.complete_alignment(k)
        done.append(k)
    return done


def test_sync_lock_step_releases_only_at_alignment():
    m = sm(2)
    m.report(0, 0)
    assert align_all(m) == []
    assert m.releasable() == []  # subtask 1 has not consumed its input yet
    m.report(1, 0)
    assert align_all(m) == [0]
    assert m.releasable() == [Release(0, 0, False), Release(1, 0, False)]
    m.report(0, 1, feedback=1)
    assert align_all(m) == [] and m.releasable() == []
    m.report(1, 1, feedback=1)
    assert align_all(m) == [1]
    assert m.releasable() == [Release(0, 1, False), Release(1, 1, False)]
    m.validate()


def test_epoch_zero_never_terminates_even_with_nothing_circulating():
    m = sm(1)
    m.report(0, 0)
    assert align_all(m, published_per_epoch=0) == [0]
    assert m.terminated is None
    assert m.releasable() == [Release(0, 0, False)]


def test_terminates_when_nothing_circulated_into_the_epoch():
    m = sm(2)
    for p in (0, 1):
        m.report(p, 0)
    align_all(m)
    m.releasable()
    for p in (0, 1):
        m.report(p, 1)  # no feedback from anybody
    m.next_alignment()
    assert m.complete_alignment(1) is TerminationReason.NO_VARIABLES_PUBLISHED
    assert m.releasable() == [Release(0, 1, True), Release(1, 1, True)]
    assert m.epochs_completed == 1
    assert m.terminating_round is None  # nothing was fed back into round 1


def test_partition_feedback_alone_does_not_keep_it_alive():
    """The feedback edge is publish_variables: partitions that keep reporting while the
    coordinator stopped publishing end the iteration at the next alignment."""
    m = sm(2)
    for p in (0, 1):
        m.report(p, 0)
    align_all(m)
    m.releasable()
    for p in (0, 1):
        m.report(p, 1, feedback=3)  # partitions report in epoch 0 ...
    assert m.next_alignment() == 1  # ... but the coordinator published nothing in it
    assert m.complete_alignment(1) is TerminationReason.NO_VARIABLES_PUBLISHED
    assert m.epochs_completed == 1


def test_a_reason_is_its_string_value_and_names_no_other():
    reason = TerminationReason.NO_VARIABLES_PUBLISHED
    assert TerminationReason("no_variables_published") is reason
    assert reason == "no_variables_published" and str(reason) == "no_variables_published"
    assert reason != "criteria" and TerminationReason.CRITERIA == "criteria"
    assert TerminationReason.CRITERIA != reason
    assert {reason: 1}["no_variables_published"] == 1  # hashes as its value (JSON keys)
    with pytest.raises(ValueError):
        TerminationReason("no_feedback")  # not a reason: a typo must not pass


def test_terminating_round_is_the_round_variables_were_fed_into():
    m = sm(1, has_criteria=True)
    m.report(0, 0)
    align_all(m)
    m.releasable()
    m.report(0, 1)
    m.record_coordinator(0, published=1)  # variables fed into round 1 ...
    assert m.complete_alignment(1) is TerminationReason.CRITERIA  # ... but no criteria
    assert m.terminating_round == 1
    m = sm(1, max_epochs=1)
    m.report(0, 0)
    align_all(m)
    m.releasable()
    m.report(0, 1)
    m.record_coordinator(0, published=2)
    assert m.complete_alignment(1) is TerminationReason.MAX_EPOCHS
    assert m.terminating_round is None  # max_epochs caps the rounds: none runs epoch 1


def test_a_coordinator_publish_alone_keeps_it_running():
    m = sm(1)
    m.report(0, 0)
    align_all(m)
    m.releasable()
    m.report(0, 1)  # no partition feedback
    m.record_coordinator(0, published=1)
    assert m.complete_alignment(1) is None


def test_criteria_stream_that_emitted_nothing_terminates():
    m = sm(1, has_criteria=True)
    m.report(0, 0)
    align_all(m)
    m.releasable()
    m.report(0, 1, feedback=1, criteria=1)
    m.record_coordinator(0, published=1)
    assert m.complete_alignment(1) is None
    m.releasable()
    m.report(0, 2, feedback=1)
    m.record_coordinator(1, published=1)
    assert m.complete_alignment(2) is TerminationReason.CRITERIA


def test_criteria_from_coordinator_counts():
    m = sm(1, has_criteria=True)
    m.report(0, 0)
    align_all(m)
    m.releasable()
    m.report(0, 1, feedback=1)
    m.record_coordinator(0, criteria=1, published=1)
    assert m.complete_alignment(1) is None


def test_epoch_zero_starts_at_alignment_zero_in_every_mode():
    for staleness in (None, 0, 1, 3):
        m = sm(2, staleness=staleness)
        m.report(0, 0)
        assert align_all(m) == [] and m.releasable() == []  # subtask 1 still loading
        m.report(1, 0)
        assert align_all(m) == [0]
        assert m.releasable() == [Release(0, 0, False), Release(1, 0, False)]


def test_max_epochs_holds_calls_and_terminates():
    m = sm(2, staleness=None, max_epochs=2)
    m.report(0, 0)
    m.report(1, 0)
    align_all(m)
    assert len(m.releasable()) == 2
    m.report(0, 1, feedback=1)
    assert m.releasable() == [Release(0, 1, False)]
    m.report(0, 2, feedback=1)
    assert m.releasable() == []  # epoch 2 >= max_epochs: held
    for e in (1, 2):
        m.report(1, e, feedback=1)
        align_all(m)
        released = m.releasable()
    assert m.terminated is TerminationReason.MAX_EPOCHS
    assert set(released) == {Release(0, 2, True), Release(1, 2, True)}
    assert m.epochs_completed == 2


def test_protocol_violations_are_errors():
    m = sm(2)
    with pytest.raises(StateMachineError):
        m.report(0, 1)  # skipped call 0
    m.report(0, 0)
    with pytest.raises(StateMachineError):
        m.report(0, 1)  # call 0 still pending
    with pytest.raises(StateMachineError):
        m.report(2, 0)
    with pytest.raises(StateMachineError):
        m.finish(0)  # not terminated
    with pytest.raises(StateMachineError):
        m.complete_alignment(0)  # not ready


def test_finish_after_termination():
    m = sm(1, max_epochs=1)
    m.report(0, 0)
    align_all(m)
    m.releasable()
    m.report(0, 1, feedback=1)
    align_all(m)
    assert m.releasable() == [Release(0, 1, True)]
    assert m.finish(0) is True
    with pytest.raises(StateMachineError):
        m.finish(0)


def drive(core: CoordinatorCore, event, publish) -> list:
    """``core.handle(event)``, answering each user callback the way a coordinator
    operator would (``publish(epoch)``: whether its watermark callback of ``epoch``
    publishes); returns the other instructions, in order."""
    out, todo = [], core.handle(event)
    while todo:
        *rest, last = todo
        out += rest
        if not isinstance(last, UserCall):
            out.append(last)
            break
        counts = (
            ((last.epoch, 1, 0),) if isinstance(last, Watermark) and publish(last.epoch) else ()
        )
        todo = core.handle(Done(counts=counts, version=core.version + len(counts)))
    return out


def run_schedule(n, staleness, max_epochs, seed, publish):
    """Subtasks make their calls in a random order through the whole core (reports,
    alignments, watermark callbacks, releases, termination, finish); checks the
    staleness bound at every release and the core's invariants after every event."""
    rng = random.Random(seed)
    core = CoordinatorCore(
        n,
        num_streams=1,
        staleness=staleness,
        max_epochs=max_epochs,
        has_criteria=False,
        attempt=0,
    )
    next_call = dict.fromkeys(range(n), 0)
    waiting: set[int] = set()
    stopped: set[int] = set()
    steps = 0
    while len(stopped) < n:
        steps += 1
        assert steps < 10_000
        idle = [p for p in range(n) if p not in stopped and p not in waiting]
        if not idle:
            pytest.fail(f"deadlock: every live subtask is waiting: {core.sm.pending}")
        p = rng.choice(idle)
        k = next_call[p]
        em = Emissions(feedback=[1.0] if k else [])
        waiting.add(p)
        for ins in drive(core, Report(p, k, 0, em, [1] if k == 0 else None, 0, None, p), publish):
            if not isinstance(ins, Answer):
                continue
            assert ins.error is None, ins.error
            for pid in ins.slots:
                waiting.discard(pid)
                if ins.terminated:
                    stopped.add(pid)
                    continue
                assert max_epochs is None or ins.epoch < max_epochs
                if staleness is not None:
                    slowest = min(core.sm.last_call)
                    assert ins.epoch - slowest <= staleness, (ins, core.sm.last_call)
                next_call[pid] = ins.epoch + 1
        core.validate()
    for p in range(n):
        drive(core, Finish(p, Emissions()), publish)
        core.validate()
    assert core.closed
    return core


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 4),
    staleness=st.one_of(st.none(), st.integers(0, 3)),
    max_epochs=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_schedules_keep_the_staleness_bound(n, staleness, max_epochs, seed):
    """Under any arrival order, driven through the whole core: no subtask starts an
    epoch more than `staleness` ahead of the slowest subtask's current epoch, none starts
    epoch >= max_epochs, and the run ends by max_epochs with every subtask told to stop."""
    core = run_schedule(n, staleness, max_epochs, seed, publish=lambda epoch: True)
    assert core.sm.terminated is TerminationReason.MAX_EPOCHS
    assert core.sm.epochs_completed == max_epochs


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 3),
    staleness=st.one_of(st.none(), st.integers(0, 2)),
    publish_until=st.integers(0, 6),
    max_epochs=st.one_of(st.none(), st.integers(1, 8)),
    seed=st.integers(0, 2**32 - 1),
)
def test_termination_follows_the_publishes_not_the_partition_feedback(
    n, staleness, publish_until, max_epochs, seed
):
    """Partitions always report feedback; the coordinator publishes in epochs
    < publish_until. Under any arrival order, through the whole core, the iteration ends
    at alignment max(1, min(publish_until + 1, max_epochs)): by no_variables_published
    unless max_epochs comes first; neither has a terminating round to run."""
    core = run_schedule(n, staleness, max_epochs, seed, publish=lambda e: e < publish_until)
    m = core.sm
    by_publish = max(publish_until, 0) + 1
    expected = by_publish if max_epochs is None else min(by_publish, max_epochs)
    assert m.aligned == expected
    if max_epochs is not None and max_epochs < by_publish:
        assert m.terminated is TerminationReason.MAX_EPOCHS
    else:
        assert m.terminated is TerminationReason.NO_VARIABLES_PUBLISHED
    assert m.terminating_round is None
