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
  sorted by (subtask, stream, source partition, batch), then a barrier task decodes
  them, so a subtask sees its batches in a fixed order. Two ways, the same order:
  DataFrame operations on Spark >= 4.1 (the index from ``spark_partition_id()`` taken
  below the union, ``repartitionById``, ``sortWithinPartitions``, a barrier
  ``mapInArrow``; what a Spark Connect client can also run), RDD operations before
  (``mapPartitionsWithIndex``, ``repartitionAndSortWithinPartitions``, a barrier
  ``mapPartitions``). ``ReplayPlan`` persists the framed streams the same way
  (``DataFrame.persist`` or ``RDD.persist``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .. import _spark_compat

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
#: the DataFrame path's framed rows: where each batch goes and its place in the order
_KEYED_SCHEMA = "subtask int, stream int, source int, seq long, payload binary"
_ORDER = ("stream", "source", "seq")
#: the stream's own partition index, a column put first below the union
_SOURCE = "__hybrid_iter_source_partition"
_PATHS = ("dataframe", "rdd")


def _choose_paths(streams: Sequence[DataFrame], paths: str | None) -> str:
    if paths is None:
        spark = streams[0].sparkSession
        return "dataframe" if _spark_compat.dataframe_barrier_paths(spark) else "rdd"
    if paths not in _PATHS:
        raise ValueError(f"paths must be one of {_PATHS} or None, got {paths!r}")
    if paths == "dataframe" and not hasattr(streams[0], "repartitionById"):
        raise ValueError(
            f"the DataFrame path needs DataFrame.repartitionById (Spark >= 4.1), "
            f"not in PySpark {_spark_compat.spark_version_string()}"
        )
    return paths


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
    app = _app_id(spark)
    previous = _HELD_SLOTS.pop(app, None)
    if held is not None:
        _HELD_SLOTS[app] = held
    return previous


def available_task_slots(spark: SparkSession) -> int:
    """How many tasks can run at once right now (what a barrier stage may use): every
    slot of the executors but those ``hold_task_slots`` declared held."""
    total = _spark_compat.available_task_slots(spark)
    held = None if _spark_compat.is_connect(spark) else _HELD_SLOTS.get(_app_id(spark))
    return total if held is None else max(0, total - held())


def _app_id(spark: SparkSession) -> str:
    return str(spark.sparkContext.applicationId)


def num_partitions(df: DataFrame) -> int | None:
    """The DataFrame's partition count as planned, without running a Spark job. Runs on
    the driver, for validation.

    Without a shuffle the plan's RDD is built without a job. With a shuffle, adaptive
    query execution (Spark's default) would run the shuffle-map stages to build the
    RDD, so the count is read from the plan instead: exact for ``repartition(n)``; for a
    shuffle Spark inserted itself (``groupBy``, a join) it is the planned count, which
    adaptive execution may still coalesce. ``None`` when the plan cannot tell without
    running (e.g. a ``union`` of shuffled DataFrames).
    """
    exact = exact_num_partitions(df)
    if exact is not None:
        return exact
    return _spark_compat.planned_num_partitions(df)


def exact_num_partitions(df: DataFrame) -> int | None:
    """The partition count the DataFrame's tasks will have when the plan can tell
    without running a Spark job (no adaptive shuffle still to run), else None. Runs on
    the driver; the count is what ``BarrierStage(..., partitions=)`` takes."""
    return _spark_compat.exact_num_partitions(df)


def _exact_num_partitions(df: DataFrame) -> int:
    """The partition count the DataFrame's tasks will have. Under adaptive execution this
    runs the shuffle-map stages first: call it only once validation is over."""
    return _spark_compat.rdd_num_partitions(df)


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


def _one_binary(buffer: pa.Buffer) -> pa.Array:
    """A one-element binary array over ``buffer`` (no copy)."""
    offsets = pa.array([0, buffer.size], pa.int32()).buffers()[1]
    return pa.Array.from_buffers(pa.binary(), 1, [None, offsets, buffer])


def _keyed_frame_fn(stream: int, n: int) -> Callable[[Iterable[pa.RecordBatch]], Iterator]:
    """Frame one stream's batches (the DataFrame path): its first column is the stream's
    own partition index (``spark_partition_id()`` evaluated below the union, so it counts
    this stream's partitions only); the rest is the data, framed as Arrow IPC."""

    def frame(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        seq = 0
        for b in batches:
            if b.num_rows == 0:
                continue
            source = int(b.column(0)[0].as_py())
            data = b.select(list(range(1, b.num_columns)))
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, data.schema) as writer:
                writer.write_batch(data)
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array([source % n], pa.int32()),
                    pa.array([stream], pa.int32()),
                    pa.array([source], pa.int32()),
                    pa.array([seq], pa.int64()),
                    _one_binary(sink.getvalue()),
                ],
                names=["subtask", "stream", "source", "seq", "payload"],
            )
            seq += 1

    return frame


def _multi_stream_arrow_fn(
    task: TaskFn,
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The barrier task of the DataFrame path: decode the framed rows in their order."""

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import BarrierTaskContext

        pid = BarrierTaskContext.get().partitionId()

        def inputs() -> Iterator[tuple[int, pa.RecordBatch]]:
            for b in batches:
                streams = b.column("stream").to_pylist()
                payloads = b.column("payload")
                for k, stream in enumerate(streams):
                    reader = pa.ipc.open_stream(payloads[k].as_buffer())
                    yield stream, reader.read_next_batch()

        result = task(pid, inputs())
        yield pa.RecordBatch.from_pydict(
            {"result": [result]}, schema=pa.schema([("result", pa.binary())])
        )

    return run


def _framed(streams: Sequence[DataFrame], indices: Sequence[int], n: int) -> DataFrame:
    """The streams ``indices`` framed (DataFrame path), one row per batch, unshuffled."""
    from pyspark.sql import functions as F

    framed = [
        streams[i]
        .select(F.spark_partition_id().alias(_SOURCE), "*")
        .mapInArrow(_keyed_frame_fn(i, n), _KEYED_SCHEMA)
        for i in indices
    ]
    union = framed[0]
    for other in framed[1:]:
        union = union.unionByName(other)
    return union


def _to_subtasks_df(frame: DataFrame, n: int) -> DataFrame:
    """Framed rows shuffled to their subtask (partition ``p`` = subtask ``p``) in order."""
    return frame.repartitionById(n, "subtask").sortWithinPartitions(*_ORDER)


def _collect_results(df: DataFrame, task: TaskFn) -> list[bytes]:
    rows = df.mapInArrow(_multi_stream_arrow_fn(task), _RESULT_SCHEMA, barrier=True).collect()
    return [r[0] for r in rows]


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
        paths: str | None = None,
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
        #: how several streams reach their subtasks: "dataframe" (Spark >= 4.1) or "rdd"
        self.paths = _choose_paths(self.streams, paths)

    def run(self) -> list[bytes]:
        if len(self.streams) == 1:
            return self._run_single()
        return self._run_multi()

    def _run_single(self) -> list[bytes]:
        n = self.num_subtasks
        df = self.streams[0]
        known = self.partitions
        if known is None and _spark_compat.is_connect(df.sparkSession):
            # a Connect client cannot count partitions without a job: route partition j
            # to subtask j % n by DataFrame operations (the same assignment as a stream
            # of n partitions read in place, so the same results)
            self.repartitioned = True
            frame = _framed(self.streams, [0], n)
            return _collect_results(_to_subtasks_df(frame, n), self.task)
        if (known if known is not None else _exact_num_partitions(df)) != n:
            df = df.repartition(n)
            self.repartitioned = True
        fn = _single_stream_fn(self.task)
        try:
            rows = df.mapInArrow(fn, _RESULT_SCHEMA, barrier=True).collect()
        except Exception as ex:
            # A DataFrame ending in coalesce() or union() has the right partition count but
            # an RDD chain Spark refuses in a barrier stage (raised before any task runs).
            # Its Java class has no Python type (PySpark raises a Py4JJavaError): the class
            # name in the error's text is the one mark of it.
            if self.repartitioned or "BarrierJobUnsupportedRDDChainException" not in str(ex):
                raise
            self.repartitioned = True
            rows = df.repartition(n).mapInArrow(fn, _RESULT_SCHEMA, barrier=True).collect()
        return [r[0] for r in rows]

    def _run_multi(self) -> list[bytes]:
        n = self.num_subtasks
        self.repartitioned = True
        if self.paths == "dataframe":
            frame = _framed(self.streams, range(len(self.streams)), n)
            return _collect_results(_to_subtasks_df(frame, n), self.task)
        shuffled = _to_subtasks(self.streams, range(len(self.streams)), n)
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
    not-replayed streams too (after the cache's batches), later rounds only the cache. On
    the RDD path the two are partitioned alike, so their union needs no shuffle of the
    cache; on the DataFrame path (Spark >= 4.1, whose union concatenates partitions)
    round 0 shuffles the cache beside the not-replayed streams once.
    """

    def __init__(
        self,
        streams: Sequence[DataFrame],
        replayed: Sequence[bool],
        num_subtasks: int,
        *,
        paths: str | None = None,
    ) -> None:
        if len(streams) != len(replayed) or not any(replayed):
            raise ValueError("a ReplayPlan needs at least one replayed stream")
        self.streams = list(streams)
        self.replayed = list(replayed)
        self.num_subtasks = num_subtasks
        #: "dataframe" (DataFrame.persist, Spark >= 4.1) or "rdd" (RDD.persist)
        self.paths = _choose_paths(self.streams, paths)
        self._cache: Any = None
        #: where the replay cache lives once prepared (Spark's storage info)
        self.memory_bytes = 0
        self.disk_bytes = 0

    def prepare(self) -> int:
        """Build and materialise the replay cache (one Spark job); returns its batch count."""
        from pyspark import StorageLevel

        indices = [i for i, r in enumerate(self.replayed) if r]
        n = self.num_subtasks
        spark = self.streams[0].sparkSession
        if self.paths == "dataframe":
            self._cache = _to_subtasks_df(_framed(self.streams, indices, n), n).persist(
                StorageLevel.MEMORY_AND_DISK
            )
            batches = int(self._cache.count())
            if not _spark_compat.is_connect(spark):
                found = _spark_compat.cached_relation(self._cache.select("*"))
                if found is not None:
                    self.memory_bytes, self.disk_bytes = _spark_compat.rdd_storage(spark, found[0])
            return batches
        self._cache = _to_subtasks(self.streams, indices, n).persist(StorageLevel.MEMORY_AND_DISK)
        batches = int(self._cache.count())
        self.memory_bytes, self.disk_bytes = _spark_compat.rdd_storage(spark, self._cache.id())
        return batches

    @property
    def storage_level(self) -> Any:
        if self._cache is None:
            return None
        if self.paths == "dataframe":
            return self._cache.storageLevel
        return self._cache.getStorageLevel()

    def run_round(self, round_: int, task: RoundTaskFn) -> list[bytes]:
        if self._cache is None:
            raise RuntimeError("ReplayPlan.prepare() must run before the first round")
        once = [i for i, r in enumerate(self.replayed) if not r]
        n = self.num_subtasks
        round_task = functools.partial(task, round_)
        if self.paths == "dataframe":
            df = self._cache
            if round_ == 0 and once:
                from pyspark.sql import functions as F

                # the order of the RDD path's union: the cache's batches, then the others'
                both = df.unionByName(_framed(self.streams, once, n))
                df = both.repartitionById(n, "subtask").sortWithinPartitions(
                    F.col("stream").isin(once), *_ORDER
                )
            return _collect_results(df, round_task)
        rdd = self._cache
        if round_ == 0 and once:
            rdd = rdd.union(_to_subtasks(self.streams, once, n))
        return list(rdd.barrier().mapPartitions(_multi_stream_fn(round_task)).collect())

    def close(self) -> None:
        if self._cache is not None:
            self._cache.unpersist()
            self._cache = None
