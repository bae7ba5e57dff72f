"""The online coordinator as a plain class (not an actor; no Spark): commits, the journal,
and restores from damaged checkpoint directories, stepped one call at a time. It uses the
session's Ray only because the coordinator asks Ray whether it was restarted (without a
local Ray that question would connect to whatever cluster it finds); the tests without a
checkpoint do not ask it and run without Ray."""

from __future__ import annotations

import asyncio

import cloudpickle
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from online_ops import Total

from coordinator import CheckpointSpec, CoordinatorSpec, Emissions, OnlineCoordinator
from coordinator._online import OnlineLedger

pytestmark = pytest.mark.usefixtures("validate_cores")


def _spec(staleness, checkpoint=None):
    return CoordinatorSpec(
        num_subtasks=1,
        num_streams=1,
        staleness=staleness,
        max_epochs=None,
        has_criteria=False,
        init_variables={"total": np.zeros(5)},
        operators=cloudpickle.dumps((Total(), None, [])),
        checkpoint=checkpoint,
    )


def pure_coordinator(staleness=0):
    """No checkpoint and no Ray: the coordinator as a plain object."""
    return OnlineCoordinator(_spec(staleness), put=None)


def make(tmp_path, staleness=0):
    spec = _spec(
        staleness,
        CheckpointSpec(
            uri=str(tmp_path / "hybrid_iter"), keep_last=2, fingerprint={"t": 1}, restore=True
        ),
    )
    return OnlineCoordinator(spec, put=None)


def feed(c, batch_id, parts, dead=0):
    """Partitions ``parts`` report ``[n, ...]`` feedback; the driver commits."""
    for pid, value in enumerate(parts):
        em = Emissions(feedback=[np.array(value, dtype=float)])
        asyncio.run(c.online_report(batch_id, pid, em))  # False: a replay, ignored
    rows = int(sum(v[0] for v in parts))
    return c.commit_batch(batch_id, rows, dead)


BATCHES = [
    [[3, 1, 1, 1, 1], [2, 1, 0, 0, 0]],
    [[4, 2, 2, 2, 2]],
    [[1, 5, 0, 0, 0], [1, 0, 5, 0, 0]],
    [[6, 0, 0, 0, 9]],
]


def expected(n):
    return np.sum([np.sum(b, axis=0) for b in BATCHES[:n]], axis=0)


@pytest.mark.usefixtures("session")
@pytest.mark.parametrize("staleness", [0, None])
def test_a_corrupt_newest_snapshot_is_rebuilt_from_the_journal(tmp_path, staleness):
    c = make(tmp_path, staleness)
    for b, parts in enumerate(BATCHES):
        assert feed(c, b, parts, dead=b).applied
    assert c.online_state().held_outputs == 0  # delivered: not kept
    d = tmp_path / "hybrid_iter"
    assert sorted(p.name for p in d.iterdir()) == [
        "chk-0000000002.ckpt",
        "chk-0000000003.ckpt",
        "jrn-000000000003.ckpt",
    ]  # bounded: keep_last snapshots and the journal after the oldest of them
    (d / "chk-0000000003.ckpt").write_bytes(b"garbage")
    r = make(tmp_path, staleness)
    s = r.online_state()
    assert s.restore.replayed == [3] and s.restore.skipped
    assert (s.committed, s.batches, s.rows, s.dead_letters) == (3, 4, 17, 6)
    np.testing.assert_array_equal(r.latest_variables()["total"], expected(4))
    assert r.last_outputs()[0] == 3  # the last batch's outputs, for a replay
    assert not feed(r, 3, BATCHES[3]).applied  # Spark's replay of batch 3: ignored
    np.testing.assert_array_equal(r.latest_variables()["total"], expected(4))
    # the damaged snapshot was replaced by one written from the rebuilt state
    assert make(tmp_path, staleness).online_state().restore.skipped == []


@pytest.mark.usefixtures("session")
def test_snapshot_and_journal_lost_is_reported_not_guessed(tmp_path):
    c = make(tmp_path)
    for b, parts in enumerate(BATCHES):
        feed(c, b, parts)
    d = tmp_path / "hybrid_iter"
    (d / "chk-0000000003.ckpt").write_bytes(b"garbage")
    (d / "jrn-000000000003.ckpt").unlink()
    s = make(tmp_path).online_state()
    assert s.committed == 2 and s.restore.newest_on_disk == 3
    assert s.restore.skipped  # the driver holds this against Spark's commit log


@pytest.mark.usefixtures("session")
def test_a_journal_never_applies_across_a_gap(tmp_path):
    c = make(tmp_path)
    for b, parts in enumerate(BATCHES):
        feed(c, b, parts)
    d = tmp_path / "hybrid_iter"
    for name in ("chk-0000000002.ckpt", "chk-0000000003.ckpt"):
        (d / name).write_bytes(b"garbage")
    s = make(tmp_path).online_state()
    # no snapshot left and the journal starts at batch 3: nothing is applied out of order
    assert s.committed == -1 and s.restore.unusable[0][0] == 3


@pytest.mark.parametrize("staleness", [0, None])
def test_result_counts_feedback_per_partition(staleness):
    """Micro-batches have any number of partitions (here more than ``num_subtasks``);
    ``result().feedback_counts`` maps each partition to the records applied from it
    (it once enumerated the keys of the online coordinator's Counter instead)."""
    c = pure_coordinator(staleness)
    for b, parts in enumerate([[[1, 0, 0, 0, 0]] * 3, [[1, 0, 0, 0, 0]], [[1, 0, 0, 0, 0]] * 2]):
        assert feed(c, b, parts).applied
    assert c.result().feedback_counts == {0: 3, 1: 2, 2: 1}
    assert c.online_state().version == 3  # one version a batch
    np.testing.assert_array_equal(c.latest_variables()["total"], [6, 0, 0, 0, 0])


# -- the pure ledger -------------------------------------------------------------------------


@pytest.mark.parametrize("sync", [True, False])
def test_the_ledger_counts_a_batch_once_whatever_spark_replays_or_retries(sync):
    ledger = OnlineLedger(sync=sync)
    first, retry = Emissions(feedback=[1]), Emissions(feedback=[2])
    assert ledger.report(0, 0, first) == ("held" if sync else "apply")
    # a task Spark retries inside the batch: sync keeps the retry's, async the first's
    assert ledger.report(0, 0, retry) == ("held" if sync else "old")
    assert ledger.entries(0) == [(0, retry if sync else first)]
    ledger.close(0, rows=5, dead_letters=1, dead_files=0, now=10.0)
    assert (ledger.committed, ledger.round, ledger.rows) == (0, 1, 5)
    assert ledger.report(0, 1, Emissions()) == "old"  # Spark replays a committed batch
    assert ledger.entries(0) is None
    assert ledger.replay_plan([0, 1, 3]) == ([1], (3, "batch 2 has no journal record"))
    again = OnlineLedger(sync=sync)
    again.restore(ledger.snapshot())
    assert again.snapshot() == ledger.snapshot()


#: one step of what Spark and the driver do to a ledger: a task reports (batch, partition),
#: the driver commits a batch (the last committed one again: Spark's replay after a
#: restart), or the coordinator restarts from the ledger's snapshot (reports in flight
#: are lost with the process; Spark runs their batch again)
_STEP = st.one_of(
    st.tuples(st.just("report"), st.integers(-1, 3), st.integers(0, 2)),
    st.tuples(st.just("commit"), st.integers(-1, 2)),
    st.tuples(st.just("restart")),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sync=st.booleans(), steps=st.lists(_STEP, max_size=40))
def test_every_partition_of_a_batch_is_applied_once_under_any_schedule(sync, steps):
    """Whatever Spark replays, retries or loses to a restart, each committed batch applies
    each partition's emissions exactly once, as the model says: sync the partition's last
    report before the commit (a retry replaces its attempt's), async its first one; a
    batch at or below the last committed one changes nothing."""
    ledger = OnlineLedger(sync=sync)
    held: dict[int, dict[int, Emissions]] = {}  # the model: reports not yet committed
    applied: list[tuple[int, int]] = []
    serial = 0
    for step in steps:
        if step[0] == "report":
            batch, part = ledger.committed + step[1], step[2]
            serial += 1
            em = Emissions(feedback=[serial])
            verdict = ledger.report(batch, part, em)
            if batch <= ledger.committed:
                assert verdict == "old"
            elif sync:
                assert verdict == "held"
                held.setdefault(batch, {})[part] = em
            elif part in held.get(batch, {}):
                assert verdict == "old"  # a retry of an applied partition
            else:
                assert verdict == "apply"
                held.setdefault(batch, {})[part] = em
                applied.append((batch, part))
        elif step[0] == "commit":
            batch = ledger.committed + step[1]
            entries = ledger.entries(batch)
            if batch <= ledger.committed:
                assert entries is None
                continue
            want = held.get(batch, {})
            assert entries is not None
            assert dict(entries) == want and len(entries) == len(want)
            if sync:
                assert [p for p, _ in entries] == sorted(want)
                applied.extend((batch, p) for p in want)
            ledger.close(batch, rows=len(entries), dead_letters=0, dead_files=0, now=0.0)
            held = {b: r for b, r in held.items() if b > batch}
        else:
            again = OnlineLedger(sync=sync)
            again.restore(ledger.snapshot())
            assert again.snapshot() == ledger.snapshot()
            for b in held:  # only uncommitted batches' reports are lost
                assert b > ledger.committed
            ledger, held = again, {}
            # an async batch's partitions applied before the restart are in no snapshot:
            # they count again when Spark reruns the batch
            applied = [(b, p) for b, p in applied if b <= ledger.committed]
        ledger.validate()
    assert len(applied) == len(set(applied)), "a partition of a batch applied twice"


@settings(max_examples=300, deadline=None)
@given(
    committed=st.integers(-1, 6),
    on_disk=st.sets(st.integers(0, 12), max_size=10),
)
def test_a_restore_replays_the_journal_in_order_and_stops_at_a_gap(committed, on_disk):
    """The journal replayed is the run of consecutive batches after the state's; the
    first record past a missing batch is named as unusable, and nothing after it is
    applied (it would skip the missing batch's update)."""
    ledger = OnlineLedger(sync=True)
    ledger.restore({"committed": committed, "round": committed + 1, "batches": 0, "rows": 0,
                    "dead_letters": 0, "dead_files": 0})  # fmt: skip
    plan, gap = ledger.replay_plan(sorted(on_disk))
    assert plan == list(range(committed + 1, committed + 1 + len(plan)))
    assert set(plan) <= on_disk and (committed + 1 + len(plan)) not in on_disk
    later = sorted(b for b in on_disk if b > committed and b not in plan)
    if later:
        assert gap == (later[0], f"batch {committed + 1 + len(plan)} has no journal record")
    else:
        assert gap is None
    for b in plan:  # replaying the plan leaves the ledger at its last batch
        assert ledger.entries(b) == []
        ledger.close(b, rows=0, dead_letters=0, dead_files=0, now=0.0)
    assert ledger.committed == (plan[-1] if plan else committed)
    ledger.validate()
