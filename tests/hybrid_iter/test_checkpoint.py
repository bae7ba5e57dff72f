"""Checkpoints and failover: task, coordinator and driver failures, corrupt and foreign
checkpoints. A sync run that survived a fault ends with exactly the fault-free variables."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoint_job import EPOCHS, Grad, Step, data, iterate
from paths import TESTS

import hybrid_iter as hi
from hybrid_iter.testing import FaultInjection


@pytest.fixture(scope="module")
def df(spark):
    frame = data(spark).cache()
    frame.count()
    return frame


@pytest.fixture(scope="module")
def clean(df):
    return iterate(df)


def test_a_failed_task_is_relaunched_from_the_last_checkpoint(df, clean, tmp_path):
    result = iterate(
        df,
        checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=4),
        hooks=FaultInjection(fail_partition=1, at_epoch=10),
    )
    assert result.variables["w"].tobytes() == clean.variables["w"].tobytes()
    assert result.outputs["w0"] == clean.outputs["w0"]  # outputs are neither lost nor doubled
    assert len(result.attempts) == 1 and "InjectedFault" in result.attempts[0]
    assert result.checkpoint["restored_from"].endswith("chk-0000000008.ckpt")
    assert result.epochs == EPOCHS


def test_a_dead_coordinator_is_restarted_by_ray_and_reloads_the_checkpoint(df, clean, tmp_path):
    result = iterate(
        df,
        checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=3),
        hooks=FaultInjection(kill_coordinator_at=14),
    )
    assert result.variables["w"].tobytes() == clean.variables["w"].tobytes()
    info = result.checkpoint
    assert info["reconstructed"] is True  # the same actor, restarted by Ray
    assert info["restored_from"].endswith("chk-0000000012.ckpt")
    assert "coordinator actor died" in result.attempts[0]


def test_a_coordinator_whose_creation_arguments_live_in_the_object_store_is_restarted(
    df, clean, tmp_path
):
    # 2 MB of initial variables: the actor's creation argument goes through the object
    # store (Ray inlines only up to 100 KiB). Ray restarts a dead actor by running its
    # creation task again; if nobody held that argument, the restart fails
    # (ReferenceCountingAssertionError) and the run falls back to a slower relaunch.
    from checkpoint_job import DIMS

    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(DIMS), "big": np.arange(250_000.0)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(
            max_epochs=EPOCHS,
            parallelism=2,
            checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=3),
            hooks=FaultInjection(kill_coordinator_at=14),
        ),
        hi.IterationBody(Grad(), Step()),
    )
    assert result.variables["w"].tobytes() == clean.variables["w"].tobytes()
    assert result.checkpoint["reconstructed"] is True, result.attempts
    np.testing.assert_array_equal(result.variables["big"], np.arange(250_000.0))


def test_without_checkpoints_a_failure_is_not_retried_by_default(df):
    with pytest.raises(hi.IterationFailedError, match="injected fault"):
        iterate(df, hooks=FaultInjection(fail_partition=0, at_epoch=2))


def test_restarts_without_checkpoints_start_over(df, clean):
    result = iterate(df, max_restarts=1, hooks=FaultInjection(fail_partition=0, at_epoch=2))
    assert result.variables["w"].tobytes() == clean.variables["w"].tobytes()


@pytest.mark.integration
def test_a_killed_driver_is_resumed_from_its_checkpoints(df, clean, tmp_path):
    """The run's driver (a process of its own) is SIGKILLed with everything it started;
    another driver (this test's, on the suite's session) resumes it from its checkpoints
    and ends with the fault-free variables and outputs."""
    directory = str(tmp_path / "ckpt")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    # imported, not run as __main__: the resume's operators are checkpoint_job's classes,
    # and a checkpoint is resumed only by the same body
    job = [sys.executable, "-c", "import sys, checkpoint_job as j; sys.exit(j.main(sys.argv[1]))"]
    proc = subprocess.Popen(
        [*job, directory],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        # wait until a few checkpoints are on disk (a condition, with a deadline)
        deadline = time.monotonic() + 240
        while not (
            Path(directory).exists()
            and any(p.name >= "chk-0000000010" for p in Path(directory).glob("chk-*.ckpt"))
        ):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # the same body as the killed run (a resume with other operator parameters is
    # refused: the checkpoint's fingerprint covers them)
    resumed = iterate(
        df,
        pace=0.05,
        checkpoint=hi.CheckpointConfig(directory, every_epochs=2),
        resume_from=directory,
    )
    assert resumed.epochs == EPOCHS
    assert resumed.variables["w"].tobytes() == clean.variables["w"].tobytes()
    assert resumed.outputs["w0"] == clean.outputs["w0"]
    assert resumed.checkpoint["restored_from"] is not None


def test_a_corrupt_checkpoint_is_skipped_for_the_previous_valid_one(df, clean, tmp_path):
    directory = str(tmp_path)
    first = iterate(
        df, max_epochs=12, checkpoint=hi.CheckpointConfig(directory, every_epochs=2, keep_last=3)
    )
    files = sorted(Path(directory).glob("chk-*.ckpt"))
    assert [f.name for f in files] == [
        "chk-0000000006.ckpt",
        "chk-0000000008.ckpt",
        "chk-0000000010.ckpt",
    ]
    newest = files[-1]
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated
    result = iterate(
        df,
        checkpoint=hi.CheckpointConfig(directory, every_epochs=2, keep_last=3),
        resume_from=directory,
    )
    info = result.checkpoint
    assert info["restored_from"].endswith("chk-0000000008.ckpt")
    assert any("truncated" in why for _, why in info["skipped"])
    assert result.variables["w"].tobytes() == clean.variables["w"].tobytes()
    assert first.epochs == 12


def test_checkpoints_of_another_iteration_are_refused(spark, df, tmp_path):
    directory = str(tmp_path)
    iterate(df, max_epochs=4, checkpoint=hi.CheckpointConfig(directory, every_epochs=2))
    with pytest.raises(hi.IterationConfigError, match=r"another iteration.*variables"):
        hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(5)},
            hi.ReplayableDataStreamList.not_replay(df),
            hi.IterationConfig(max_epochs=8, parallelism=2, resume_from=directory),
            hi.IterationBody(Grad(), Step()),
        )
    with pytest.raises(
        hi.IterationConfigError, match=r"another iteration.*subtasks: checkpoint has 2"
    ):
        hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(3)},
            hi.ReplayableDataStreamList.not_replay(df),
            hi.IterationConfig(max_epochs=8, parallelism=1, resume_from=directory),
            hi.IterationBody(Grad(), Step()),
        )
    # a fresh run does not overwrite them
    with pytest.raises(hi.IterationConfigError, match="already holds checkpoints"):
        iterate(df, checkpoint=hi.CheckpointConfig(directory))
    with pytest.raises(hi.IterationConfigError, match="holds no valid checkpoint"):
        iterate(df, resume_from=str(tmp_path / "empty"))


def test_checkpoint_size_does_not_grow_with_the_epochs_behind_it(df, tmp_path):
    result = iterate(
        df,
        max_epochs=30,
        checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=1, keep_last=2),
    )
    files = sorted(Path(tmp_path).glob("chk-*.ckpt"))
    assert len(files) == 2  # keep_last prunes
    assert len(result.checkpoint["checkpoints"]) == 29
    # the newest checkpoint file is as large as an early one would be: outputs live in
    # per-checkpoint segments, not in every checkpoint
    early = iterate(
        df, max_epochs=3, checkpoint=hi.CheckpointConfig(str(tmp_path / "early"), every_epochs=1)
    )
    early_size = max(p.stat().st_size for p in (tmp_path / "early").glob("chk-*.ckpt"))
    late_size = max(f.stat().st_size for f in files)
    assert abs(late_size - early_size) < 0.1 * early_size + 200, (early_size, late_size)
    assert early.epochs == 3


class Ids(hi.PartitionOperator):
    """Async: feeds back (partition, its own epoch) ids; partition 1 is slower."""

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if ctx.partition_id == 1:
            time.sleep(0.01)  # a simulated straggler
        out.feedback((ctx.partition_id, epoch))


class Applied(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.applied = []

    def process_feedback(self, value, ctx, out):
        self.applied.append(tuple(value))
        out.publish_variables(n=len(self.applied))

    def on_iteration_terminated(self, ctx, out):
        out.output("applied", list(self.applied))


def test_async_recovery_neither_loses_nor_repeats_an_acknowledged_update(df, tmp_path):
    result = hi.iterate_bounded_streams_until_termination(
        {"n": 0},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(
            staleness=None,
            max_epochs=30,
            parallelism=2,
            checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=5),
            hooks=FaultInjection(fail_partition=0, at_epoch=20),
        ),
        hi.IterationBody(Ids(), Applied()),
    )
    (applied,) = result.outputs["applied"]
    assert len(result.attempts) == 1
    assert len(applied) == len(set(applied))  # nothing applied twice
    for pid in (0, 1):
        mine = sorted(e for p, e in applied if p == pid)
        assert mine == list(range(len(mine)))  # nothing lost: every epoch's update, once
        assert result.feedback_counts[pid] == len(mine)
    assert int(result.variables["n"]) == len(applied)


def test_checkpoint_arguments():
    with pytest.raises(hi.IterationConfigError, match="every_epochs"):
        hi.CheckpointConfig("/tmp/x", every_epochs=0)
    with pytest.raises(hi.IterationConfigError, match="keep_last"):
        hi.CheckpointConfig("/tmp/x", keep_last=0)
    with pytest.raises(hi.IterationConfigError, match=r"pyarrow\.fs"):
        hi.CheckpointConfig("nope://bucket/x")
    with pytest.raises(hi.IterationConfigError, match="CheckpointConfig"):
        hi.IterationConfig(checkpoint="/tmp/x")  # type: ignore[arg-type]
    with pytest.raises(hi.IterationConfigError, match="fail_partition"):
        FaultInjection(fail_partition=-1)


def test_checkpoints_with_replayed_streams_are_refused(spark, tmp_path):
    with pytest.raises(hi.IterationConfigError, match="not supported with replayed streams"):
        hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(3)},
            hi.ReplayableDataStreamList.replay(spark.range(4)),
            hi.IterationConfig(checkpoint=hi.CheckpointConfig(str(tmp_path))),
            hi.IterationBody(Grad(), Step()),
        )
