"""One Spark barrier stage with one task per subtask, fed by one or more DataFrames.

Runs on the driver (planning) and in Spark tasks (the wrappers below). The task body is
a plain function ``task(partition_id, inputs) -> bytes`` where ``inputs`` yields
``(stream_index, pyarrow.RecordBatch)``: every batch of every stream that belongs to the
subtask, each read once.

* One stream: ``mapInArrow(..., barrier=True)`` straight over the DataFrame (after a
  ``repartition`` if its partition count is not the subtask count: Spark refuses a
  barrier stage over ``coalesce``).
* Several streams (co-partitioned per subtask): partition ``j`` of every stream goes to
  subtask ``j % n``. Each stream's batches are framed as Arrow IPC in a ``mapInArrow``,
  shuffled with an exact partitioner and sorted by (subtask, stream, source partition,
  batch), then a barrier ``mapPartitions`` decodes them, so a subtask sees its batches
  in a deterministic order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import reduce
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["BarrierStage", "available_task_slots", "num_partitions"]

TaskFn = Callable[[int, Iterator[tuple[int, pa.RecordBatch]]], bytes]

_RESULT_SCHEMA = "result binary"
_FRAMED_SCHEMA = "target int, stream int, source int, seq int, payload binary"


def available_task_slots(spark: SparkSession) -> int:
    """How many tasks can run at once right now (what a barrier stage may use)."""
    jsc = spark.sparkContext._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def num_partitions(df: DataFrame) -> int:
    """The DataFrame's partition count, without running a job."""
    return int(df._jdf.rdd().getNumPartitions())


def _single_stream_fn(
    task: TaskFn,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import BarrierTaskContext

        pid = BarrierTaskContext.get().partitionId()
        result = task(pid, ((0, b) for b in batches))
        yield pa.RecordBatch.from_pydict(
            {"result": [result]}, schema=pa.schema([("result", pa.binary())])
        )

    return run


def _frame_fn(
    stream: int, n: int
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def frame(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        source = ctx.partitionId() if ctx is not None else 0
        for seq, b in enumerate(batches):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, b.schema) as writer:
                writer.write_batch(b)
            yield pa.RecordBatch.from_pydict(
                {
                    "target": pa.array([source % n], pa.int32()),
                    "stream": pa.array([stream], pa.int32()),
                    "source": pa.array([source], pa.int32()),
                    "seq": pa.array([seq], pa.int32()),
                    "payload": pa.array([sink.getvalue().to_pybytes()], pa.binary()),
                }
            )

    return frame


def _target(key: tuple[int, int, int, int]) -> int:
    return key[0]


def _multi_stream_fn(task: TaskFn) -> Callable[[Iterator[tuple]], Iterator[bytes]]:
    def run(records: Iterator[tuple]) -> Iterator[bytes]:
        from pyspark import BarrierTaskContext

        pid = BarrierTaskContext.get().partitionId()

        def inputs() -> Iterator[tuple[int, pa.RecordBatch]]:
            for key, payload in records:
                yield key[1], pa.ipc.open_stream(pa.py_buffer(payload)).read_next_batch()

        yield task(pid, inputs())

    return run


class BarrierStage:
    """A barrier stage over ``streams`` with ``num_subtasks`` tasks; ``run()`` collects."""

    def __init__(self, streams: Sequence[DataFrame], num_subtasks: int, task: TaskFn) -> None:
        if not streams:
            raise ValueError("a barrier stage needs at least one DataFrame")
        if num_subtasks < 1:
            raise ValueError(f"num_subtasks must be >= 1, got {num_subtasks}")
        self.streams = list(streams)
        self.num_subtasks = num_subtasks
        self.task = task
        self.repartitioned = False

    def run(self) -> list[bytes]:
        n = self.num_subtasks
        if len(self.streams) == 1:
            df = self.streams[0]
            if num_partitions(df) != n:
                df = df.repartition(n)
                self.repartitioned = True
            rows = df.mapInArrow(
                _single_stream_fn(self.task), _RESULT_SCHEMA, barrier=True
            ).collect()
            return [r[0] for r in rows]
        framed = [
            df.mapInArrow(_frame_fn(i, n), _FRAMED_SCHEMA) for i, df in enumerate(self.streams)
        ]
        union = reduce(lambda a, b: a.unionAll(b), framed)
        keyed = union.rdd.map(lambda r: ((r[0], r[1], r[2], r[3]), r[4]))
        shuffled = keyed.repartitionAndSortWithinPartitions(n, partitionFunc=_target)
        self.repartitioned = True
        return list(shuffled.barrier().mapPartitions(_multi_stream_fn(self.task)).collect())
