"""Nothing hangs: a partition or coordinator operator that blocks fails the run
within ``IterationConfig(call_timeout=...)``, naming who, the method and the epoch."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import hybrid_iter as hi
from coordinator import CallTimeout


class Grad(hi.PartitionOperator):
    def __init__(self, block_partition: int | None = None, at: int = 0):
        self.block_partition, self.at = block_partition, at

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if ctx.partition_id == self.block_partition and epoch == self.at:
            threading.Event().wait()  # blocks for good, in C: nothing interrupts it
        out.feedback(1.0)


class Step(hi.CoordinatorOperator):
    def __init__(self, block_at: int | None = None):
        self.block_at = block_at

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if epoch == self.block_at:
            threading.Event().wait()
        out.publish_variables(w=ctx.variables["w"] + 1)


def run(spark, partition, coordinator, **config):
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(2)},
        hi.ReplayableDataStreamList.not_replay(spark.range(8, numPartitions=2)),
        hi.IterationConfig(max_epochs=6, parallelism=2, **config),
        hi.IterationBody(partition, coordinator),
    )


def test_a_blocking_partition_operator_fails_the_run_naming_it(spark):
    with pytest.raises(hi.IterationFailedError) as info:
        run(spark, Grad(block_partition=1, at=2), Step(), call_timeout=3)
    text = str(info.value)
    assert "partition 1 made no progress" in text
    assert "Grad.on_epoch_watermark_incremented at epoch 2" in text
    assert info.value.failures[1].type_name == "CallTimeout"
    # typed all the way from the Spark task: the driver's policy reads the type
    assert isinstance(info.value.failures[1].cause, CallTimeout)


def test_a_blocking_coordinator_operator_fails_the_run_naming_it(spark):
    with pytest.raises(hi.IterationFailedError) as info:
        run(spark, Grad(), Step(block_at=1), call_timeout=3)
    text = str(info.value)
    assert "coordinator operator made no progress" in text
    assert "Step.on_epoch_watermark_incremented at epoch 1" in text
    assert isinstance(info.value.failures["coordinator"].cause, CallTimeout)


def test_the_session_still_runs_iterations_after_a_timeout(spark):
    result = run(spark, Grad(), Step(), call_timeout=60)
    assert result.variables["w"].tolist() == [6.0, 6.0]


def test_call_timeout_must_be_finite_and_positive():
    for bad in (0, -1, float("inf"), float("nan"), "10", True):
        with pytest.raises(hi.IterationConfigError, match="call_timeout"):
            hi.IterationConfig(call_timeout=bad)
