"""End to end on real Spark and Ray: a run restored after a fault hands every operator
and every output back exactly as the fault-free run had them (shapes, 0-d included,
dtypes, datetime64 among them, memory order, bits); a value a checkpoint cannot encode
and a user bug that repeats are not relaunched; a run resumes from checkpoints sealed
with the previous key during a key rotation."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import ray
from checkpoint_job import DIMS, ROWS, data
from test_checkpoint_codec import assert_same

import hybrid_iter as hi
from coordinator import (
    CheckpointSpec,
    CoordinatorSpec,
    Emissions,
    IterationCoordinator,
    MissingCheckpoint,
    OnlineCoordinator,
)
from coordinator._checkpoint import KEY_ENV, PREVIOUS_KEY_ENV
from hybrid_iter._runtime.controller import FailurePolicy, RunController, Verdict
from hybrid_iter._runtime.iterate import _missing_failure, _restored_by
from hybrid_iter.testing import FaultInjection

EPOCHS = 16
BASE = np.datetime64("2024-03-01T00:00:00", "s")


@pytest.fixture(scope="module")
def df(spark):
    frame = data(spark).cache()
    frame.count()
    return frame


class Recorder(hi.PartitionOperator):
    """A gradient step whose state is a 0-d counter, a 0-d datetime and a Fortran
    matrix; every epoch it outputs the variables it was handed and its state."""

    def __init__(self, log: str | None = None):
        self.log = log  # a file each epoch run is appended to ("partition epoch")

    def open(self, ctx):
        self.cache = hi.NumpyCache([f"x{j}" for j in range(DIMS)], extra=["y"])
        self.acc = np.zeros((DIMS, 2), order="F")
        self.count = np.array(0, dtype=np.int64)
        self.stamp = np.array(BASE, dtype="M8[ms]")

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.seen = dict(variables)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{ctx.partition_id} {epoch}\n")
        w, scale = self.seen["w"], self.seen["scale"]
        X, y = self.cache.matrix(), self.cache.column("y")
        g = X.T @ (X @ w - y)
        self.acc = np.asfortranarray(self.acc + np.outer(g, [1.0, -0.0]))
        self.count = np.array(self.count + 1)
        self.stamp = np.array(self.stamp + np.timedelta64(epoch, "ms"))
        out.output("partition", {"variables": self.seen, "acc": self.acc, "n": self.count})
        out.output("stamp", self.stamp)
        out.feedback(float(scale) * g)

    def snapshot_state(self):
        return {"acc": self.acc, "count": self.count, "stamp": self.stamp, "seen": self.seen}

    def restore_state(self, state):
        self.acc, self.count, self.stamp = state["acc"], state["count"], state["stamp"]
        self.seen = state["seen"]


class Stepper(hi.CoordinatorOperator):
    """Publishes a vector and a 0-d variable; outputs datetime64, timedelta64, Fortran
    and 0-d arrays, and its own state (a Fortran matrix, a 0-d float) every epoch."""

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])
        self.scale = np.array(init_variables["scale"])
        self.hist = np.zeros((DIMS, 2), order="F")
        self.last = np.array(-0.0)
        self.g = None

    def process_feedback(self, value, ctx, out):
        self.g = value if self.g is None else self.g + value

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.w = self.w - 0.2 * self.g / ROWS
        self.g = None
        self.scale = np.array(self.scale * 0.99)
        self.hist = np.asfortranarray(np.column_stack([self.w, self.hist[:, 0]]))
        self.last = np.array(self.w[0])
        out.publish_variables(w=self.w, scale=self.scale)
        out.output("events", np.array([BASE + epoch, BASE], dtype="M8[s]"))
        out.output("waited", np.array(epoch, dtype="m8[ms]"))
        out.output("fortran", np.asfortranarray(np.outer(self.w, [1.0, epoch])))
        out.output("state", {"hist": self.hist, "last": self.last})

    def snapshot_state(self):
        return {"w": self.w, "scale": self.scale, "hist": self.hist, "last": self.last}

    def restore_state(self, state):
        self.w, self.scale = state["w"], state["scale"]
        self.hist, self.last = state["hist"], state["last"]


def run(df, partition=None, coordinator=None, **config):
    config = {"max_epochs": EPOCHS, "parallelism": 2, **config}
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(DIMS), "scale": np.array(1.0)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(**config),
        hi.IterationBody(partition or Recorder(), coordinator or Stepper()),
    )


def records(result):
    """The output records in a deterministic order (partitions emit concurrently)."""
    return sorted(result.output_records, key=lambda r: (r.tag, r.epoch, str(r.source)))


@pytest.fixture(scope="module")
def clean(df):
    return run(df)


@pytest.mark.parametrize(
    "fault, every, cut",
    [
        (FaultInjection(fail_partition=1, at_epoch=10), 4, 8),  # a relaunched stage
        (FaultInjection(kill_coordinator_at=14), 3, 12),  # a coordinator Ray restarts
    ],
    ids=["task-failure", "coordinator-killed"],
)
def test_a_restore_hands_back_exactly_what_the_fault_free_run_had(
    df, clean, tmp_path, fault, every, cut
):
    faulty = run(df, checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=every), hooks=fault)
    assert len(faulty.attempts) == 1, faulty.attempts
    assert faulty.checkpoint["restored_epoch"] == cut
    assert faulty.variables["scale"].shape == ()
    assert_same(dict(clean.variables), dict(faulty.variables), "variables")
    before, after = records(clean), records(faulty)
    assert [(r.tag, r.epoch, r.source) for r in after] == [
        (r.tag, r.epoch, r.source) for r in before
    ]
    for a, b in zip(before, after, strict=True):
        # what process_variables received, the operators' state, and the outputs of the
        # epochs before the cut (read back from the checkpoint's segments) and after it
        assert_same(a.value, b.value, f"output {a.tag!r} of epoch {a.epoch} from {a.source}")
    events = [r.value for r in after if r.tag == "events"]
    assert events[0].dtype == np.dtype("M8[s]") and events[-1][0] == BASE + EPOCHS - 1


# -- what a relaunch cannot cure is not relaunched --------------------------------------------


def launches(log: Path) -> int:
    """How many launches of the stage ran: within one launch a subtask runs an epoch
    once; a relaunch runs again the epochs after the checkpoint it restores (all of them
    without one), and the failing epoch in particular."""
    return max(Counter(log.read_text().splitlines()).values())


class Handle(Stepper):
    """Outputs a connection-like object (it holds a lock) at epoch 3."""

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        super().on_epoch_watermark_incremented(epoch, ctx, out)
        if epoch == 3:
            out.output("handle", {"conn": threading.Lock()})


class LockedState(Recorder):
    def snapshot_state(self):
        return {"acc": self.acc, "guard": threading.Lock()}


@pytest.mark.parametrize(
    "partition, coordinator, names",
    [
        (Recorder, Handle(), ["output 'handle' of epoch 3", "the coordinator", "['conn']"]),
        (
            LockedState,
            None,
            ["partition operator LockedState", "(partition ", "['guard']", "snapshot_state()"],
        ),
    ],
    ids=["coordinator-output", "partition-state"],
)
def test_a_value_a_checkpoint_cannot_encode_fails_at_once_naming_it(
    df, tmp_path, partition, coordinator, names
):
    log = tmp_path / "epochs"
    with pytest.raises(hi.IterationFailedError) as err:
        run(
            df,
            partition(str(log)),
            coordinator,
            max_restarts=3,
            checkpoint=hi.CheckpointConfig(str(tmp_path / "ckpt"), every_epochs=4),
        )
    assert launches(log) == 1  # not relaunched
    (failure,) = [f for f in err.value.failures.values() if f.cause is not None][:1]
    assert isinstance(failure.cause, hi.CheckpointEncodeError)
    assert "_thread.lock" in str(err.value)
    for words in names:
        assert words in str(err.value), words


class BadRow(Recorder):
    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        super().on_epoch_watermark_incremented(epoch, ctx, out)
        if epoch == 5 and ctx.partition_id == 1:
            raise ValueError("row 17 has a negative weight")


class BadStep(Stepper):
    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if epoch == 5:
            raise ValueError("the step diverged")
        super().on_epoch_watermark_incremented(epoch, ctx, out)


@pytest.mark.parametrize(
    "partition, coordinator, where",
    [(BadRow, None, "partition 1 at epoch 5"), (Recorder, BadStep(), "coordinator at epoch 5")],
    ids=["partition-callback", "coordinator-callback"],
)
def test_a_user_bug_that_repeats_after_a_relaunch_is_not_relaunched_again(
    df, tmp_path, partition, coordinator, where
):
    log = tmp_path / "epochs"
    with pytest.raises(hi.IterationFailedError) as err:
        run(
            df,
            partition(str(log)),
            coordinator,
            max_restarts=3,
            checkpoint=hi.CheckpointConfig(str(tmp_path / "ckpt"), every_epochs=2),
        )
    assert launches(log) == 2  # one relaunch, not three
    message = str(err.value)
    assert where in message and "ValueError" in message
    assert "the same failure as attempt 0" in message and "not retried again" in message


def test_a_restarted_coordinator_that_restored_too_old_a_checkpoint_is_a_typed_failure(
    session, tmp_path
):
    checkpoint = CheckpointSpec(str(tmp_path), run_id="r", key=b"k" * 32)
    spec = CoordinatorSpec(
        num_subtasks=1,
        num_streams=1,
        staleness=0,
        max_epochs=5,
        has_criteria=False,
        init_variables={"w": np.zeros(2)},
        operators=cloudpickle.dumps((None, None, [])),
        checkpoint=checkpoint,
    )
    actor = ray.remote(num_cpus=0)(IterationCoordinator).remote(spec)
    run = RunController(3, checkpoint_uri=checkpoint.uri, expect=6)
    run.running()
    assert run.failed(hi.IterationFailedError("the coordinator actor died", {})).relaunch
    try:
        assert ray.get(actor.checkpoint_info.remote())["restored_epoch"] is None
        restored = _restored_by(actor, run.expect)
    finally:
        ray.kill(actor)
    assert restored.found is None and restored.older and restored.missing
    error = run.restored(restored)
    assert isinstance(error, MissingCheckpoint)
    failure = _missing_failure(error)
    assert isinstance(failure.failures["coordinator"].cause, MissingCheckpoint)
    assert "found no checkpoint" in str(failure) and "checkpoint 6 was written" in str(failure)
    assert FailurePolicy.classify(failure) is Verdict.FATAL


# -- key rotation ---------------------------------------------------------------------------

OLD, NEW = "old-key-" * 4, "new-key-" * 4


def test_a_run_resumes_during_a_key_rotation_and_then_needs_only_the_new_key(
    df, clean, tmp_path, monkeypatch
):
    directory = str(tmp_path / "ckpt")
    config = {"checkpoint": hi.CheckpointConfig(directory, every_epochs=3)}
    monkeypatch.setenv(KEY_ENV, OLD)
    monkeypatch.delenv(PREVIOUS_KEY_ENV, raising=False)
    run(df, max_epochs=8, **config)  # checkpoints 3 and 6, sealed with the old key
    monkeypatch.setenv(KEY_ENV, NEW)
    with pytest.raises(hi.IterationConfigError, match=PREVIOUS_KEY_ENV):
        run(df, resume_from=directory, **config)
    monkeypatch.setenv(PREVIOUS_KEY_ENV, OLD)
    resumed = run(df, resume_from=directory, **config)
    assert resumed.checkpoint["restored_epoch"] == 6
    assert_same(dict(clean.variables), dict(resumed.variables), "variables")
    for a, b in zip(records(clean), records(resumed), strict=True):
        assert_same(a.value, b.value, f"output {a.tag!r} of epoch {a.epoch}")
    # every file was read (and sealed again) or written since: the old key can go
    monkeypatch.delenv(PREVIOUS_KEY_ENV)
    again = run(df, resume_from=directory, max_epochs=EPOCHS + 2, **config)
    assert not again.checkpoint["skipped"]
    assert len(again.output_records) == len(clean.output_records) + 2 * (4 + 4)


# -- online ---------------------------------------------------------------------------------


class Count(hi.CoordinatorOperator):
    """Online: publishes a 0-d running count and a Fortran-ordered matrix."""

    def open(self, init_variables, ctx):
        self.n = np.array(init_variables["n"])

    def process_feedback(self, value, ctx, out):
        self.n = np.array(self.n + value)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.publish_variables(n=self.n)
        out.output("n", np.array(self.n))
        out.output("seen", np.array([BASE + epoch], dtype="M8[s]"))


def _online(tmp_path):
    spec = CoordinatorSpec(
        num_subtasks=1,
        num_streams=1,
        staleness=0,
        max_epochs=None,
        has_criteria=False,
        init_variables={"n": np.array(0.0)},
        operators=cloudpickle.dumps((Count(), None, [])),
        checkpoint=CheckpointSpec(uri=str(tmp_path), keep_last=2, fingerprint={}, restore=True),
    )
    return OnlineCoordinator(spec, put=None)


@pytest.mark.usefixtures("session")
def test_an_online_restore_keeps_a_0d_variable_and_datetime_outputs(tmp_path):
    c = _online(tmp_path)
    for b in range(3):
        asyncio.run(c.online_report(b, 0, Emissions(feedback=[np.array(1.0)])))
        assert c.commit_batch(b, 1, 0).applied
    r = _online(tmp_path)
    assert r.online_state().committed == 2
    assert_same(c.latest_variables(), r.latest_variables(), "variables")
    assert r.latest_variables()["n"].shape == ()
    batch, outputs = r.last_outputs()
    assert batch == 2
    for a, b in zip(c.last_outputs()[1], outputs, strict=True):
        assert_same(a.value, b.value, a.tag)


def test_an_output_that_cannot_reach_the_driver_fails_at_once_naming_it(df, tmp_path):
    """Without checkpoints the coordinator's outputs still travel to the driver pickled:
    one that cannot be pickled fails the run naming it, and no relaunch is spent on it
    (a relaunch would emit the same value)."""
    log = tmp_path / "epochs"
    with pytest.raises(hi.IterationFailedError) as err:
        run(df, Recorder(str(log)), Handle(), max_restarts=3)
    assert launches(log) == 1  # not relaunched
    causes = [f.cause for f in err.value.failures.values() if f.cause is not None]
    assert causes and isinstance(causes[0], hi.ValueEncodeError)
    message = str(err.value)
    for words in ("output 'handle' of epoch 3", "the coordinator", "['conn']", "_thread.lock"):
        assert words in message, words
