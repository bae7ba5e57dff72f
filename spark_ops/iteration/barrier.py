"""One Spark barrier stage with one task per subtask, fed by one or more DataFrames.

Runs on the driver (planning) and in Spark tasks (the wrappers below). The task body is
a plain function ``task(partition_id, inputs) -> bytes`` where ``inputs`` yields
``(stream_index, pyarrow.RecordBatch)``: every batch of every stream that belongs to the
subtask, each read once.

* One stream: ``mapInArrow(..., barrier=True)`` straight over the DataFrame (after a
  ``repartition`` if its partition count is not the subtask count, or if Spark refuses
  its RDD chain in a barrier stage, as it does for ``coalesce`` and ``union``).
* Several streams (co-partitioned per subtask): partition ``j`` of every stream goes to
  subtask ``j % n``. Each stream's batches are framed as Arrow IPC in a ``mapInArrow``,
  keyed by the stream's own partition index, shuffled with an exact partitioner and
  sorted by (subtask, stream, source partition, batch), then a barrier
  ``mapPartitions`` decodes them, so a subtask sees its batches in a fixed order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "BarrierStage",
    "ReplayPlan",
    "available_task_slots",
    "hold_task_slots",
    "num_partitions",
]

TaskFn = Callable[[int, Iterator[tuple[int, pa.RecordBatch]]], bytes]

_RESULT_SCHEMA = "result binary"
_FRAMED_SCHEMA = "payload binary"


#: application id -> how many of its task slots long-running tasks that are not ours
#: hold (Ray on Spark's worker nodes, registered by ``hybrid_iter.Session.on_spark``)
_HELD_SLOTS: dict[str, Callable[[], int]] = {}


def hold_task_slots(
    spark: SparkSession, held: Callable[[], int] | None
) -> Callable[[], int] | None:
    """Declare that ``held()`` of ``spark``'s task slots are taken by tasks that run for
    the application's life (``None``: none any more); returns the declaration it
    replaces. ``available_task_slots`` then counts only the others, before every barrier
    stage; ``held`` may raise to refuse one (it runs on the driver, before any job)."""
    app = spark.sparkContext.applicationId
    previous = _HELD_SLOTS.pop(app, None)
    if held is not None:
        _HELD_SLOTS[app] = held
    return previous


def available_task_slots(spark: SparkSession) -> int:
    """How many tasks can run at once right now (what a barrier stage may use): every
    slot of the executors but those ``hold_task_slots`` declared held."""
    jsc = spark.sparkContext._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    total = int(jsc.maxNumConcurrentTasks(profile))
    held = _HELD_SLOTS.get(spark.sparkContext.applicationId)
    return total if held is None else max(0, total - held())


def num_partitions(df: DataFrame) -> int | None:
    """The DataFrame's partition count as planned, without running a Spark job. Runs on
    the driver, for validation.

    Without a shuffle the plan's RDD is built without a job. With a shuffle, adaptive
    query execution (Spark 3.5's default) would run the shuffle-map stages to build the
    RDD, so the count is read from the plan instead: exact for ``repartition(n)``; for a
    shuffle Spark inserted itself (``groupBy``, a join) it is the planned count, which
    adaptive execution may still coalesce. ``None`` when the plan cannot tell without
    running (e.g. a ``union`` of shuffled DataFrames).
    """
    exact = exact_num_partitions(df)
    if exact is not None:
        return exact
    plan = df._jdf.queryExecution().executedPlan()
    partitioning = plan.inputPlan().outputPartitioning()
    if partitioning.getClass().getSimpleName() == "UnknownPartitioning":
        return None
    return int(partitioning.numPartitions())


def exact_num_partitions(df: DataFrame) -> int | None:
    """The partition count the DataFrame's tasks will have when the plan can tell
    without running a Spark job (no adaptive shuffle still to run), else None. Runs on
    the driver; the count is what ``BarrierStage(..., partitions=)`` takes."""
    plan = df._jdf.queryExecution().executedPlan()
    if plan.getClass().getSimpleName() != "AdaptiveSparkPlanExec":
        return int(df._jdf.rdd().getNumPartitions())
    if plan.isFinalPlan():  # already executed: its RDD exists
        return int(plan.execute().getNumPartitions())
    return None


def _exact_num_partitions(df: DataFrame) -> int:
    """The partition count the DataFrame's tasks will have. Under adaptive execution this
    runs the shuffle-map stages first: call it only once validation is over."""
    return int(df._jdf.rdd().getNumPartitions())


def _single_stream_fn(
    task: TaskFn,
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import BarrierTaskContext

        pid = BarrierTaskContext.get().partitionId()
        result = task(pid, ((0, b) for b in batches))
        yield pa.RecordBatch.from_pydict(
            {"result": [result]}, schema=pa.schema([("result", pa.binary())])
        )

    return run


def _frame_fn(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Each Arrow batch as one row holding its IPC stream bytes."""
    for b in batches:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, b.schema) as writer:
            writer.write_batch(b)
        yield pa.RecordBatch.from_pydict(
            {"payload": pa.array([sink.getvalue().to_pybytes()], pa.binary())}
        )


def _key_fn(stream: int, n: int) -> Callable[[int, Iterable[Any]], Iterator[tuple[Any, ...]]]:
    """Key the framed rows of one stream by (subtask, stream, source partition, batch).

    The index comes from ``mapPartitionsWithIndex`` of this stream's own RDD: inside a
    union, ``TaskContext.partitionId()`` would count the other streams' partitions too.
    """

    def key(source: int, rows: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
        for seq, row in enumerate(rows):
            yield (source % n, stream, source, seq), row[0]

    return key


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
    """A barrier stage over ``streams`` with ``num_subtasks`` tasks; ``run()`` collects.
    ``partitions``: the one stream's partition count when the caller knows it exactly
    (``exact_num_partitions``), saving a planning of the DataFrame."""

    def __init__(
        self,
        streams: Sequence[DataFrame],
        num_subtasks: int,
        task: TaskFn,
        *,
        partitions: int | None = None,
    ) -> None:
        if not streams:
            raise ValueError("a barrier stage needs at least one DataFrame")
        if num_subtasks < 1:
            raise ValueError(f"num_subtasks must be >= 1, got {num_subtasks}")
        self.streams = list(streams)
        self.num_subtasks = num_subtasks
        self.task = task
        self.partitions = partitions
        self.repartitioned = False

    def run(self) -> list[bytes]:
        if len(self.streams) == 1:
            return self._run_single()
        return self._run_multi()

    def _run_single(self) -> list[bytes]:
        n = self.num_subtasks
        df = self.streams[0]
        known = self.partitions
        if (known if known is not None else _exact_num_partitions(df)) != n:
            df = df.repartition(n)
            self.repartitioned = True
        fn = _single_stream_fn(self.task)
        try:
            rows = df.mapInArrow(fn, _RESULT_SCHEMA, barrier=True).collect()
        except Exception as ex:
            # A DataFrame ending in coalesce() or union() has the right partition count but
            # an RDD chain Spark refuses in a barrier stage (raised before any task runs).
            if self.repartitioned or "BarrierJobUnsupportedRDDChainException" not in str(ex):
                raise
            self.repartitioned = True
            rows = df.repartition(n).mapInArrow(fn, _RESULT_SCHEMA, barrier=True).collect()
        return [r[0] for r in rows]

    def _run_multi(self) -> list[bytes]:
        shuffled = _to_subtasks(self.streams, range(len(self.streams)), self.num_subtasks)
        self.repartitioned = True
        return list(shuffled.barrier().mapPartitions(_multi_stream_fn(self.task)).collect())


def _to_subtasks(streams: Sequence[DataFrame], indices: Sequence[int], n: int) -> Any:
    """The streams ``indices`` as one RDD of framed batches, partition ``p`` = subtask ``p``."""
    keyed = [
        streams[i].mapInArrow(_frame_fn, _FRAMED_SCHEMA).rdd.mapPartitionsWithIndex(_key_fn(i, n))
        for i in indices
    ]
    union = streams[0].sparkSession.sparkContext.union(keyed)
    return union.repartitionAndSortWithinPartitions(n, partitionFunc=_target)


RoundTaskFn = Callable[[int, int, Iterator[tuple[int, pa.RecordBatch]]], bytes]


class ReplayPlan:
    """Replayed streams, framed per subtask and persisted ``MEMORY_AND_DISK``: Spark's cache
    is the replay buffer (memory first, disk beyond it, so data larger than memory still
    replays). ``run_round(e, task)`` runs round ``e`` as one barrier job: round 0 reads the
    not-replayed streams too (partitioned the same way, so the union needs no shuffle of
    the cache), later rounds only the cache.
    """

    def __init__(
        self, streams: Sequence[DataFrame], replayed: Sequence[bool], num_subtasks: int
    ) -> None:
        if len(streams) != len(replayed) or not any(replayed):
            raise ValueError("a ReplayPlan needs at least one replayed stream")
        self.streams = list(streams)
        self.replayed = list(replayed)
        self.num_subtasks = num_subtasks
        self._cache: Any = None
        #: where the replay cache lives once prepared (Spark's storage info)
        self.memory_bytes = 0
        self.disk_bytes = 0

    def prepare(self) -> int:
        """Build and materialise the replay cache (one Spark job); returns its batch count."""
        from pyspark import StorageLevel

        indices = [i for i, r in enumerate(self.replayed) if r]
        self._cache = _to_subtasks(self.streams, indices, self.num_subtasks).persist(
            StorageLevel.MEMORY_AND_DISK
        )
        batches = int(self._cache.count())
        jsc = self.streams[0].sparkSession.sparkContext._jsc.sc()
        for info in jsc.getRDDStorageInfo():
            if info.id() == self._cache.id():
                self.memory_bytes, self.disk_bytes = int(info.memSize()), int(info.diskSize())
        return batches

    @property
    def storage_level(self) -> Any:
        return self._cache.getStorageLevel() if self._cache is not None else None

    def run_round(self, round_: int, task: RoundTaskFn) -> list[bytes]:
        if self._cache is None:
            raise RuntimeError("ReplayPlan.prepare() must run before the first round")
        rdd = self._cache
        once = [i for i, r in enumerate(self.replayed) if not r]
        if round_ == 0 and once:
            rdd = rdd.union(_to_subtasks(self.streams, once, self.num_subtasks))
        fn = _multi_stream_fn(functools.partial(task, round_))
        return list(rdd.barrier().mapPartitions(fn).collect())

    def close(self) -> None:
        if self._cache is not None:
            self._cache.unpersist()
            self._cache = None
