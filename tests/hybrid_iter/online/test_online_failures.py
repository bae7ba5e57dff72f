"""A failing or blocking partition operator of an online iteration (one task runtime).

The tasks of a micro-batch run under the same guard as a bounded iteration's subtasks:
a callback that raises reaches the user as ``IterationFailedError`` naming the partition,
the micro-batch and the method (not only as Spark's ``StreamingQueryException``), and a
callback that blocks fails the stream after ``call_timeout`` instead of hanging it.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from online_ops import SCHEMA, Sums, Total, write_file, write_parquet_file

import hybrid_iter as hi

FEATURES = ["x0", "x1", "x2", "y"]


class Boom(Sums):
    """Raises ValueError("boom") in ``method`` of partition ``partition`` at micro-batch
    ``at``; every other call does what ``Sums`` does."""

    def __init__(self, method: str, at: int = 1, partition: int = 1):
        self.method, self.at, self.partition = method, at, partition

    def _maybe_fail(self, ctx, method):
        if method == self.method and ctx.batch_id == self.at and ctx.partition_id == self.partition:
            raise ValueError("boom")

    def open(self, ctx):
        self._maybe_fail(ctx, "open")
        super().open(ctx)

    def process_data(self, stream, batch, ctx, out):
        self._maybe_fail(ctx, "process_data")
        super().process_data(stream, batch, ctx, out)


class Blocker(Sums):
    """``process_data`` of partition 0 blocks for good at micro-batch ``at``."""

    def __init__(self, at: int = 1):
        self.at = at

    def process_data(self, stream, batch, ctx, out):
        if ctx.batch_id == self.at and ctx.partition_id == 0:
            threading.Event().wait()  # never set: blocks in C, nothing interrupts it
        super().process_data(stream, batch, ctx, out)


def start(spark, source, directory, partition, **config):
    """An online iteration over ``directory`` (one file per micro-batch): a CSV source
    (read by Spark, tasks via mapInArrow) or a Parquet source (read by our tasks)."""
    reader = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
    if source == "csv":
        stream = reader.csv(str(directory))
        config.setdefault("parallelism", 2)  # partitions 0 and 1 both get rows
    else:
        stream = reader.parquet(str(directory))
    config.setdefault("trigger", {"availableNow": True})
    return hi.iterate_unbounded_streams(
        {"total": np.zeros(5)},
        hi.ReplayableDataStreamList.not_replay(hi.DataStream(stream, FEATURES)),
        hi.IterationBody(partition, Total()),
        hi.OnlineConfig(**config),
    )


def write(source, directory, count):
    for i in range(count):
        (write_file if source == "csv" else write_parquet_file)(directory, i)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "source, method",
    [("csv", "process_data"), ("parquet", "process_data"), ("parquet", "open")],
)
def test_a_raising_callback_fails_the_stream_naming_partition_batch_and_method(
    spark, tmp_path, source, method
):
    write(source, tmp_path, 3)
    with start(spark, source, tmp_path, Boom(method, at=1, partition=1)) as it:
        with pytest.raises(hi.IterationFailedError) as info:
            it.await_termination(240)
        assert it.exception() is info.value  # the same error, not Spark's wrapper
        progress = it.progress
    text = str(info.value)
    assert f"micro-batch 1: partition 1 at epoch 1 in Boom.{method} (micro-batch 1)" in text
    assert "ValueError: boom" in text
    failure = info.value.failures[1]
    assert isinstance(failure, hi.RemoteFailure)
    assert (failure.source, failure.where, failure.type_name) == (
        1,
        f"Boom.{method} (micro-batch 1)",
        "ValueError",
    )
    assert isinstance(failure.cause, ValueError) and "boom" in failure.traceback_text
    assert info.value.__cause__ is failure
    # micro-batch 0 was committed, the failed one was not
    assert (progress.batches, progress.last_batch_id) == (1, 0)


@pytest.mark.timeout(300)
def test_a_blocking_callback_fails_the_stream_after_call_timeout(spark, tmp_path):
    # the timeout is the driver's, the same whatever the source (the raising callbacks
    # above cover both): one source, as each case waits out the timeout
    source = "parquet"
    write(source, tmp_path, 3)
    # long enough that a busy machine starting micro-batch 0's tasks is not "no progress"
    it = start(spark, source, tmp_path, Blocker(at=1), call_timeout=8)
    try:
        it.query.awaitTermination(240)  # Spark's own view: the query ended with an error
    except Exception:
        pass
    assert not it.query.isActive
    with pytest.raises(hi.IterationFailedError) as info:
        it.stop()  # nobody asked for the failure yet: stop() raises it
    text = str(info.value)
    assert "partition 0 made no progress for" in text
    assert "in Blocker.process_data (micro-batch 1) at epoch 1" in text
    assert "OnlineConfig(call_timeout=8)" in text
    assert info.value.failures[0].type_name == "CallTimeout"
    assert it.progress.last_batch_id == 0
    # the blocked task was cancelled: every task slot runs work again
    slots = spark.sparkContext.defaultParallelism
    assert spark.range(slots, numPartitions=slots).count() == slots


def test_call_timeout_must_be_finite_and_positive():
    for bad in (0, -1, math.inf, math.nan, "3", True):
        with pytest.raises(hi.IterationConfigError, match=r"OnlineConfig\.call_timeout"):
            hi.OnlineConfig(call_timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(hi.IterationConfigError, match=r"IterationConfig\.call_timeout"):
            hi.IterationConfig(call_timeout=bad)  # type: ignore[arg-type]
    assert hi.OnlineConfig(call_timeout=2.5).call_timeout == 2.5
    assert hi.OnlineConfig().call_timeout == 600
    carried = hi.OnlineConfig.from_iteration_config(hi.IterationConfig(call_timeout=7))
    assert carried.call_timeout == 7
