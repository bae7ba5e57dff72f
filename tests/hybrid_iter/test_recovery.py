"""Recovery you can trust, end to end on real Spark and Ray: restored operator
state, faults from outside (SIGKILL of a Python worker and of the coordinator's process),
and the sync guarantee that a run that survived a fault ends bit for bit like one that
had none."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from checkpoint_job import DIMS, Step, data

import hybrid_iter as hi
from hybrid_iter.testing import FaultInjection


@pytest.fixture(scope="module")
def df(spark):
    frame = data(spark).cache()
    frame.count()
    return frame


class CopyingGrad(hi.PartitionOperator):
    """Keeps its own copy of the variables, and says so in snapshot_state."""

    def open(self, ctx):
        self.cache = hi.NumpyCache([f"x{j}" for j in range(DIMS)], extra=["y"])
        self.w = None

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = np.array(variables["w"])  # a private copy

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        X, y = self.cache.matrix(), self.cache.column("y")
        out.feedback(X.T @ (X @ self.w - y))

    def snapshot_state(self):
        return {"w": self.w}

    def restore_state(self, state):
        self.w = state["w"]


class CountingGrad(hi.PartitionOperator):
    """State without snapshot_state: a counter that scales its gradient, and an RNG.
    Only the pickled operator object carries them through a restore."""

    def __init__(self, marker: str | None = None, block_at: int | None = None):
        self.marker, self.block_at = marker, block_at

    def open(self, ctx):
        self.cache = hi.NumpyCache([f"x{j}" for j in range(DIMS)], extra=["y"])
        self.calls = 0
        self.rng = np.random.default_rng(ctx.partition_id)

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = variables["w"]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if self.marker and epoch == self.block_at and ctx.partition_id == 1:
            marker = Path(self.marker)
            if not marker.exists():  # first life only: wait here to be SIGKILLed
                marker.write_text(str(os.getpid()))
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    time.sleep(0.05)
                raise RuntimeError("the test did not kill this worker")
        self.calls += 1
        X, y = self.cache.matrix(), self.cache.column("y")
        noise = 1.0 + 1e-3 * self.rng.standard_normal()
        out.feedback((1.0 + 0.01 * self.calls) * noise * (X.T @ (X @ self.w - y)))


class BlockingStep(Step):
    """The sync coordinator operator of checkpoint_job, whose process can be SIGKILLed
    from outside at one epoch (it writes its pid and waits to be killed, first life only)."""

    def __init__(self, marker: str, at: int):
        self.marker, self.at = marker, at

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        marker = Path(self.marker)
        if epoch == self.at and not marker.exists():
            marker.write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.05)
        super().on_epoch_watermark_incremented(epoch, ctx, out)


def run(df, partition, coordinator=None, **config):
    config = {"max_epochs": 24, "parallelism": 2, **config}
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(DIMS)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(**config),
        hi.IterationBody(partition, coordinator or Step()),
    )


@pytest.fixture(scope="module")
def clean_copying(df):
    return run(df, CopyingGrad())


@pytest.fixture(scope="module")
def clean_counting(df):
    return run(df, CountingGrad())


def _kill_when_written(marker: Path, done: threading.Event) -> threading.Thread:
    """SIGKILL the pid written to ``marker`` (a condition with a deadline, no timing)."""

    def target() -> None:
        deadline = time.monotonic() + 240
        while not done.is_set() and time.monotonic() < deadline:
            if marker.exists() and marker.read_text():
                os.kill(int(marker.read_text()), signal.SIGKILL)
                return
            time.sleep(0.05)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_an_operator_keeping_a_copy_of_the_variables_restores_bit_for_bit(
    df, clean_copying, tmp_path
):
    clean = clean_copying
    faulty = run(
        df,
        CopyingGrad(),
        checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=4),
        hooks=FaultInjection(fail_partition=1, at_epoch=10),
    )
    assert faulty.checkpoint["restored_from"].endswith("chk-0000000008.ckpt")
    assert faulty.variables["w"].tobytes() == clean.variables["w"].tobytes()
    assert faulty.outputs["w0"] == clean.outputs["w0"]


def test_an_operator_without_snapshot_state_is_checkpointed_whole(df, clean_counting, tmp_path):
    clean = clean_counting
    faulty = run(
        df,
        CountingGrad(),
        checkpoint=hi.CheckpointConfig(str(tmp_path), every_epochs=4),
        hooks=FaultInjection(fail_partition=0, at_epoch=14),
    )
    assert faulty.checkpoint["restored_from"].endswith("chk-0000000012.ckpt")
    assert faulty.variables["w"].tobytes() == clean.variables["w"].tobytes()


def test_a_sigkilled_python_worker_is_recovered_bit_for_bit(df, clean_counting, tmp_path):
    clean = clean_counting
    marker, done = tmp_path / "worker.pid", threading.Event()
    killer = _kill_when_written(marker, done)
    try:
        faulty = run(
            df,
            CountingGrad(str(marker), block_at=11),
            checkpoint=hi.CheckpointConfig(str(tmp_path / "ckpt"), every_epochs=5),
        )
    finally:
        done.set()
        killer.join()
    assert marker.exists()
    assert len(faulty.attempts) == 1
    assert faulty.checkpoint["restored_from"].endswith("chk-0000000010.ckpt")
    assert faulty.variables["w"].tobytes() == clean.variables["w"].tobytes()


def test_a_sigkilled_coordinator_process_is_restarted_bit_for_bit(df, clean_copying, tmp_path):
    clean = clean_copying
    marker, done = tmp_path / "coordinator.pid", threading.Event()
    killer = _kill_when_written(marker, done)
    try:
        faulty = run(
            df,
            CopyingGrad(),
            BlockingStep(str(marker), at=9),
            checkpoint=hi.CheckpointConfig(str(tmp_path / "ckpt"), every_epochs=3),
        )
    finally:
        done.set()
        killer.join()
    assert marker.exists()
    info = faulty.checkpoint
    assert info["restored_from"].endswith("chk-0000000009.ckpt")
    assert faulty.variables["w"].tobytes() == clean.variables["w"].tobytes()


def test_a_forged_checkpoint_given_to_resume_from_never_runs(df, tmp_path):
    from test_checkpoint_store import _forge

    directory, marker = tmp_path / "ckpt", tmp_path / "pwned"
    directory.mkdir()
    _forge(directory / "chk-0000000004.ckpt", marker)
    with pytest.raises(hi.IterationConfigError, match="authentication failed") as info:
        run(df, CopyingGrad(), resume_from=str(directory))
    assert "holds no valid checkpoint" in str(info.value)
    assert not marker.exists()


def test_a_corrupt_output_segment_does_not_make_resume_impossible(df, clean_copying, tmp_path):
    clean = clean_copying
    directory = str(tmp_path)
    first = run(df, CopyingGrad(), max_epochs=12, checkpoint=hi.CheckpointConfig(directory))
    assert first.epochs == 12
    segment = tmp_path / "out-0000000005.pkl"
    segment.write_bytes(segment.read_bytes()[:-10] + b"0123456789")  # tampered tag
    resumed = run(
        df, CopyingGrad(), checkpoint=hi.CheckpointConfig(directory), resume_from=directory
    )
    assert resumed.variables["w"].tobytes() == clean.variables["w"].tobytes()
    skipped = dict(resumed.checkpoint["skipped"])
    assert "authentication failed" in skipped[str(segment)]
    assert len(resumed.outputs["w0"]) == len(clean.outputs["w0"]) - 1  # epoch 4's record


def test_a_resume_with_another_body_is_refused_naming_the_run(df, tmp_path):
    directory = str(tmp_path)
    run(df, CopyingGrad(), max_epochs=4, checkpoint=hi.CheckpointConfig(directory))

    class OtherStep(Step):
        lr = 0.3  # another learning rate: another body

    with pytest.raises(hi.IterationConfigError, match=r"another iteration \(run '[0-9a-f]+'\)"):
        run(df, CopyingGrad(), OtherStep(), resume_from=directory)
    with pytest.raises(hi.IterationConfigError, match="init_variables"):
        hi.iterate_bounded_streams_until_termination(
            {"w": np.ones(DIMS)},
            hi.ReplayableDataStreamList.not_replay(df),
            hi.IterationConfig(max_epochs=8, parallelism=2, resume_from=directory),
            hi.IterationBody(CopyingGrad(), Step()),
        )


class LockedStep(Step):
    def open(self, init_variables, ctx):
        super().open(init_variables, ctx)
        self.lock = threading.Lock()  # cannot be pickled


class LockedGrad(CopyingGrad):
    snapshot_state = hi.PartitionOperator.snapshot_state  # no hook of its own

    def open(self, ctx):
        super().open(ctx)
        self.lock = threading.Lock()


def test_an_unpicklable_operator_is_refused_naming_it(df, tmp_path):
    with pytest.raises(hi.IterationConfigError, match="operator LockedStep cannot be pickled"):
        run(df, CopyingGrad(), LockedStep(), checkpoint=hi.CheckpointConfig(str(tmp_path / "a")))
    with pytest.raises(
        hi.IterationConfigError,
        match=r"partition operator LockedGrad \(partition \d+\) cannot be pickled",
    ) as info:
        run(df, LockedGrad(), checkpoint=hi.CheckpointConfig(str(tmp_path / "b")))
    assert "define snapshot_state() and restore_state()" in str(info.value)
