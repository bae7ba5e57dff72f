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
from online_ops import Total

from coordinator import CheckpointSpec, CoordinatorSpec, Emissions, OnlineCoordinator
from coordinator._online import OnlineLedger


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
    assert ledger.gap(1) is None and ledger.gap(2) == "batch 1 has no journal record"
    again = OnlineLedger(sync=sync)
    again.restore(ledger.snapshot())
    assert again.snapshot() == ledger.snapshot()
