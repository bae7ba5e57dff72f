"""The task bodies of full-partition processing: what runs inside ``mapInArrow``.

Runs in Spark tasks (Python workers). Every body takes the partition's Arrow batches as
Spark streams them and yields Arrow batches; nothing holds more than one input batch
(``spark.sql.execution.arrow.maxRecordsPerBatch`` rows) plus ``max_rows`` pending
output records. Spark's Arrow stream to the worker, with its socket back-pressure, is the
bounded queue between the task's producer (the JVM) and the user's function: the
function starts on the first batch and the JVM blocks when the worker falls behind.

Keyed bodies get their input clustered by key and sorted by key within the partition
(Spark's external sort), and cut it into runs of equal keys on the fly: a key's records
stream to the function like a partition's do.

Any exception in user code (or in converting what it returned) is raised again as a
``PartitionFunctionError`` naming the operation, the function, the partition id and, for
keyed operations, the key; the original exception and traceback are chained to it and
their text is in its message, with the failure line the driver turns into a
``spark_ops.UserFunctionError`` (``_errors``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from .._errors import PartitionFunctionError, failure_line, user_traceback
from ._keys import encode_keys
from ._rows import RowReader, RowWriter, conform_batch

__all__ = ["FunctionContext", "TaskSpec", "run_task"]

_MISSING = object()


@dataclass(frozen=True)
class TaskSpec:
    """Plain data shipped to the tasks of one operation."""

    op: str  # what the user called: "map_partition", "aggregate", ...
    fn_name: str
    out_schema: pa.Schema | None = None  # None: the operation adds a sort key column
    single_value: bool = False  # the output schema was an atomic type (one "value" column)
    batches: bool = False  # the function takes Arrow batches instead of Rows
    key_columns: tuple[str, ...] = ()  # keyed: input clustered and sorted by these
    result_schema: pa.Schema | None = None  # keyed aggregate: the result part of out_schema
    sort_key_column: str = ""
    max_rows: int = 10_000
    #: the partitions Spark planned for the operation (None: the plan cannot tell)
    num_partitions: int | None = None


class _Where:
    """What the task is working on (for error messages), and its one RowReader."""

    def __init__(self) -> None:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        self.partition = ctx.partitionId() if ctx is not None else -1
        self.key: Any = _MISSING
        self.hook: str | None = None  # "open" / "close" while a rich function's hook runs
        self._reader: RowReader | None = None

    def reader(self, batch: pa.RecordBatch) -> RowReader:
        # One per task: every batch of a partition has the same schema.
        if self._reader is None:
            self._reader = RowReader(batch.schema)
        return self._reader

    def rows(self, batches: Iterator[pa.RecordBatch]) -> Iterator[Any]:
        for b in batches:
            yield from self.reader(b).rows(b)

    def key_of(self, first: pa.RecordBatch, columns: tuple[str, ...]) -> tuple:
        """The key of a group as Rows show it (from its first row)."""
        row = self.reader(first).rows(first.slice(0, 1))[0]
        return tuple(row[first.schema.get_field_index(c)] for c in columns)

    def key_text(self) -> str | None:
        if self.key is _MISSING:
            return None
        key = self.key[0] if len(self.key) == 1 else self.key
        return f"{key!r:.200}"

    def describe(self) -> str:
        text = f"partition {self.partition}"
        if self.hook is not None:
            text += f" (its {self.hook}())"
        key = self.key_text()
        if key is not None:
            text += f", key {key}"
        return text


@dataclass(frozen=True)
class FunctionContext:
    """What a rich function's ``open(ctx)`` gets (Flink's ``RuntimeContext``, in short).
    Runs in a Spark task.

    ``partition_id``: the Spark partition this task processes; ``num_partitions``: how
    many partitions the operation was planned with, read from Spark's plan without a
    job; ``None`` when the plan cannot tell before running: a ``union`` of shuffled
    DataFrames, or a shuffle Spark sizes itself that adaptive execution may coalesce
    (the keyed one without ``key_by(num_partitions=...)``).
    """

    partition_id: int
    num_partitions: int | None
    op: str


def _hook(user: Any, name: str) -> Callable[..., Any] | None:
    hook = getattr(user, name, None)
    return hook if callable(hook) else None


def run_task(
    spec: TaskSpec, user: Any, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of every operation (``functools.partial`` binds the rest).

    A rich function (one defining ``open(ctx)`` and/or ``close()``, FLIP-380 after
    Flink's ``RichFunction``) gets ``open`` once in this task before its first record,
    keyed or not, and ``close`` once after its last (also when it failed)."""
    where = _Where()
    close = _hook(user, "close")
    opened = False
    try:
        open_ = _hook(user, "open")
        if open_ is not None:
            where.hook = "open"
            open_(FunctionContext(where.partition, spec.num_partitions, spec.op))
            where.hook = None
        opened = True
        yield from _BODIES[spec.op](spec, user, batches, where)
        if close is not None:
            opened = False  # a failing close() is reported, not called again
            where.hook = "close"
            close()
            where.hook = None
    except PartitionFunctionError:
        raise
    except Exception as ex:
        detail = user_traceback(ex)
        headline = (
            f"{spec.op} function {spec.fn_name} failed in {where.describe()}: "
            f"{type(ex).__name__}: {ex}"
        )
        line = failure_line(
            headline,
            ex,
            operation=spec.op,
            function=spec.fn_name.strip("'"),
            partition=where.partition,
            key=where.key_text(),
            traceback_text=detail,
        )
        raise PartitionFunctionError(
            f"{headline}\n--- the function's traceback:\n{detail}\n{line}"
        ) from ex
    finally:
        if opened and close is not None:
            try:
                close()  # after a failure: release, but never hide the first error
            except Exception:
                pass


# -- runs of equal keys ---------------------------------------------------------------------

_VECTOR_EQ = (
    pat.is_integer,
    pat.is_floating,
    pat.is_boolean,
    pat.is_string,
    pat.is_large_string,
    pat.is_binary,
    pat.is_large_binary,
    pat.is_fixed_size_binary,
    pat.is_date,
    pat.is_timestamp,
    pat.is_decimal,
    pat.is_duration,
    pat.is_time,
)


def _same(a: Any, b: Any) -> bool:
    """Key equality as Spark groups: null equals null, NaN equals NaN."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _changes(col: pa.Array) -> np.ndarray:
    """``out[i]``: row ``i + 1`` has a different key than row ``i`` (length n - 1)."""
    n = len(col)
    nxt, cur = col.slice(1), col.slice(0, n - 1)
    if any(test(col.type) for test in _VECTOR_EQ):
        same = pc.fill_null(pc.equal(nxt, cur), False)
        if col.null_count:
            same = pc.or_(same, pc.and_(pc.is_null(nxt), pc.is_null(cur)))
        if pat.is_floating(col.type):
            same = pc.or_(same, pc.fill_null(pc.and_(pc.is_nan(nxt), pc.is_nan(cur)), False))
        return ~same.to_numpy(zero_copy_only=False)
    values = col.to_pylist()
    return np.fromiter(
        (not _same(values[i + 1], values[i]) for i in range(n - 1)), dtype=bool, count=n - 1
    )


def _key_at(batch: pa.RecordBatch, idx: list[int], row: int) -> tuple:
    return tuple(batch.column(i)[row].as_py() for i in idx)


def _key_runs(
    batches: Iterator[pa.RecordBatch], columns: tuple[str, ...]
) -> Iterator[tuple[bool, pa.RecordBatch]]:
    """Slices of consecutive rows with one key; True when a slice starts a new key."""
    idx: list[int] | None = None
    last: Any = _MISSING
    for b in batches:
        n = b.num_rows
        if n == 0:
            continue
        if idx is None:
            idx = [b.schema.get_field_index(c) for c in columns]
        starts = [0]
        if n > 1:
            change = _changes(b.column(idx[0]))
            for i in idx[1:]:
                change |= _changes(b.column(i))
            starts += (np.flatnonzero(change) + 1).tolist()
        first_new = last is _MISSING or not _same(last, _key_at(b, idx, 0))
        ends = [*starts[1:], n]
        for j, (s, e) in enumerate(zip(starts, ends)):
            yield (first_new if j == 0 else True), b.slice(s, e - s)
        last = _key_at(b, idx, n - 1)


class _Groups:
    """The input as one batch iterator per key; what a function leaves unread is skipped."""

    def __init__(self, batches: Iterator[pa.RecordBatch], columns: tuple[str, ...]) -> None:
        self._runs = _key_runs(batches, columns)
        self._pending = next(self._runs, None)
        self._columns = columns

    def __iter__(self) -> Iterator[tuple[pa.RecordBatch, Iterator[pa.RecordBatch]]]:
        while self._pending is not None:
            first = self._pending[1]
            self._pending = None
            group = self._group(first)
            yield first, group
            for _ in group:
                pass

    def _group(self, first: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
        yield first
        for new, piece in self._runs:
            if new:
                self._pending = (new, piece)
                return
            yield piece


# -- bodies -----------------------------------------------------------------------------------


def _input(spec: TaskSpec, batches: Iterator[pa.RecordBatch], where: _Where) -> Iterator[Any]:
    return batches if spec.batches else where.rows(batches)


def _results(spec: TaskSpec, fn: Callable, records: Iterator[Any]) -> Iterator[Any]:
    out = fn(records)
    if out is None:
        raise TypeError(
            f"{spec.op} function {spec.fn_name} returned None; it must return or yield its "
            f"results (write it as a generator with `yield`)"
        )
    try:
        return iter(out)
    except TypeError as ex:
        raise TypeError(
            f"{spec.op} function {spec.fn_name} returned a {type(out).__name__}, not an "
            f"iterable of results (write it as a generator with `yield`)"
        ) from ex


class _Out:
    """Output records batched ``max_rows`` at a time."""

    def __init__(
        self, spec: TaskSpec, schema: pa.Schema, *, single_value: bool | None = None
    ) -> None:
        single = spec.single_value if single_value is None else single_value
        self.writer = RowWriter(schema, single_value=single)
        self.max_rows = spec.max_rows
        self.pending: list[tuple] = []

    def add(self, record: Any) -> pa.RecordBatch | None:
        self.pending.append(self.writer.record(record))
        if len(self.pending) >= self.max_rows:
            return self.flush()
        return None

    def flush(self) -> pa.RecordBatch | None:
        if not self.pending:
            return None
        batch = self.writer.batch(self.pending)
        self.pending = []
        return batch


def _emit(spec: TaskSpec, results: Iterator[Any], out: _Out) -> Iterator[pa.RecordBatch]:
    """Yielded Arrow data passes through (conformed); other records are batched."""
    assert spec.out_schema is not None
    record, pending, max_rows = out.writer.record, out.pending, out.max_rows
    width = -1 if out.writer.single_value else len(out.writer.names)  # -1: never a record
    for item in results:
        if type(item) is tuple and len(item) == width:  # the common case, first
            pending.append(item)
        elif isinstance(item, (pa.RecordBatch, pa.Table)):
            batch = out.flush()  # keep the order the function yielded in
            if batch is not None:
                yield batch
            pending = out.pending
            yield from conform_batch(item, spec.out_schema)
            continue
        else:
            pending.append(record(item))
        if len(pending) >= max_rows:
            yield out.flush()
            pending = out.pending


def _map_partition(spec: TaskSpec, fn: Callable, batches: Iterator[pa.RecordBatch], where: _Where):
    assert spec.out_schema is not None
    out = _Out(spec, spec.out_schema)
    if not spec.key_columns:
        yield from _emit(spec, _results(spec, fn, _input(spec, batches, where)), out)
    else:
        for first, group in _Groups(batches, spec.key_columns):
            where.key = where.key_of(first, spec.key_columns)
            yield from _emit(spec, _results(spec, fn, _input(spec, group, where)), out)
    where.key = _MISSING
    last = out.flush()
    if last is not None:
        yield last


def _fold_aggregate(spec: TaskSpec, agg: Any, items: Iterator[Any]) -> Any:
    acc = agg.create_accumulator()
    add = agg.add
    for item in items:
        acc = add(item, acc)
        if acc is None:
            raise TypeError(
                f"{type(agg).__name__}.add() returned None; it must return the accumulator "
                f"(end add() with `return accumulator`)"
            )
    return agg.get_result(acc)


def _aggregate(spec: TaskSpec, agg: Any, batches: Iterator[pa.RecordBatch], where: _Where):
    assert spec.out_schema is not None
    if not spec.key_columns:
        writer = RowWriter(spec.out_schema, single_value=spec.single_value)
        result = _fold_aggregate(spec, agg, _input(spec, batches, where))
        yield writer.batch([writer.record(result)])
        return
    assert spec.result_schema is not None
    result_writer = RowWriter(spec.result_schema, single_value=spec.single_value)
    # The output row is the key columns plus the result's: never one value, even when
    # the result schema was an atomic type (one "value" column after the keys).
    out = _Out(spec, spec.out_schema, single_value=False)
    for first, group in _Groups(batches, spec.key_columns):
        where.key = key = where.key_of(first, spec.key_columns)
        result = _fold_aggregate(spec, agg, _input(spec, group, where))
        batch = out.add(key + result_writer.record(result))
        if batch is not None:
            yield batch
    where.key = _MISSING
    last = out.flush()
    if last is not None:
        yield last


def _fold_reduce(fn: Callable, rows: Iterator[Any]) -> Any:
    acc = _MISSING
    for row in rows:
        acc = row if acc is _MISSING else fn(acc, row)
    return acc


def _reduce(spec: TaskSpec, fn: Callable, batches: Iterator[pa.RecordBatch], where: _Where):
    assert spec.out_schema is not None
    out = _Out(spec, spec.out_schema)
    if not spec.key_columns:
        result = _fold_reduce(fn, where.rows(batches))
        if result is not _MISSING:  # an empty partition reduces to nothing
            out.add(result)
    else:
        for first, group in _Groups(batches, spec.key_columns):
            where.key = where.key_of(first, spec.key_columns)
            batch = out.add(_fold_reduce(fn, where.rows(group)))
            if batch is not None:
                yield batch
        where.key = _MISSING
    last = out.flush()
    if last is not None:
        yield last


def _sort_key(spec: TaskSpec, key_fn: Callable, batches: Iterator[pa.RecordBatch], where: _Where):
    """Append the encoded key; Spark sorts on it afterwards and drops it."""
    field = pa.field(spec.sort_key_column, pa.binary())
    for b in batches:
        keys = encode_keys(list(map(key_fn, where.reader(b).rows(b))))
        yield b.append_column(field, keys)


_BODIES: dict[str, Callable[..., Iterator[pa.RecordBatch]]] = {
    "map_partition": _map_partition,
    "aggregate": _aggregate,
    "reduce": _reduce,
    "sort_partition": _sort_key,
}
