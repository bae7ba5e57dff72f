"""The task side of ``local_key_by``: the two phases and the streaming state function.

Runs in Spark tasks: ``local_phase`` inside ``mapInArrow`` over the input (no shuffle
before it), ``final_phase`` inside ``mapInArrow`` after the partials were repartitioned by
key, ``stream_state_fn`` inside ``applyInPandasWithState`` of a streaming query. The
driver (``local_agg.py``) builds one frozen ``Plan`` of plain data and ships it in the
closures.

A partial is one row per key and local task (per chunk, when a task holds more keys than
``max_local_keys``): the key columns, ``N`` (input rows it covers) and the kind's partial
columns (see ``_local_agg_kernels``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.accumulators import AccumulatorParam

from .._errors import failure_line
from ..aggregate import AggregateFunction
from . import _kernels as K

__all__: list[str] = []

_OUT_ROWS = 1 << 16


@dataclass(frozen=True)
class Plan:
    """What both phases need, as plain picklable data (built and checked on the driver)."""

    kind: str  # "builtin" | "ufunc" | "aggregate" | "top_n"
    op: str  # the built-in name, or "aggregate" / "reduce" / "top_n"
    what: str  # how the user wrote it, for error messages
    num_keys: int
    num_values: int
    multi_value: bool
    aggregate: AggregateFunction | None
    ufunc: Any  # np.ufunc | None
    top_n: int
    top_columns: tuple[str, ...]  # internal names of the columns of the top_n structs
    top_names: tuple[str, ...]  # their user names
    by: str | None  # internal name of top_n's order column
    partial_schema: pa.Schema
    out_schema: pa.Schema
    result_type: pa.DataType
    buffer_bytes: int
    max_local_keys: int

    @property
    def keys(self) -> list[str]:
        return K.key_names(self.num_keys)

    @property
    def values(self) -> list[str]:
        return K.value_names(self.num_values)


class MetricsParam(AccumulatorParam):
    """A dict accumulator of per-task figures keyed by (phase, partition id).

    A re-executed task overwrites its own entry instead of adding to it, so the figures
    describe the latest execution of each task, not a sum over retries.
    """

    def zero(self, value: dict) -> dict:
        return {}

    def addInPlace(self, value1: dict, value2: dict) -> dict:
        value1.update(value2)
        return value1


@dataclass
class _Merged:
    """Partials merged per key: key columns, input rows and partials per key, payload."""

    keys: pa.Table
    rows: np.ndarray
    parts: np.ndarray
    payload: Any


# -- the kinds -----------------------------------------------------------------------------


def _from_rows(plan: Plan, table: pa.Table) -> _Merged:
    """First aggregation of raw input rows."""
    keys = plan.keys
    if plan.kind == "builtin":
        t = K.builtin_partials(table, keys, plan.op)
        rows = t.column(K.N).to_numpy()
        return _Merged(t.select(keys), rows, np.ones(len(rows), np.int64), t)
    grouping = K.group_rows(table, keys)
    ones = np.ones(grouping.num_groups, np.int64)
    if plan.kind == "top_n":
        top = K.top_n_by_codes(
            table, grouping.codes, grouping.num_groups, plan.by or "", plan.top_n
        )
        return _Merged(grouping.keys, grouping.counts, ones, top)
    if plan.kind == "ufunc":
        red = K.ufunc_groups(grouping, table.column(plan.values[0]).combine_chunks(), plan.ufunc)
        return _Merged(grouping.keys, grouping.counts, ones, red)
    values = [table.column(v).combine_chunks() for v in plan.values]
    assert plan.aggregate is not None
    accs = K.fold_groups(plan.aggregate, grouping, values, plan.multi_value)
    return _Merged(grouping.keys, grouping.counts, ones, accs)


def _merge(plan: Plan, table: pa.Table) -> _Merged:
    """Merge partial rows (``plan.partial_schema``) per key."""
    keys = plan.keys
    if plan.kind == "builtin":
        t = K.builtin_merge(table, keys, plan.op)
        return _Merged(t.select(keys), t.column(K.N).to_numpy(), t.column("parts").to_numpy(), t)
    n_col = table.column(K.N).to_numpy()
    grouping = K.group_rows(table, keys)
    rows = np.bincount(grouping.codes, weights=n_col, minlength=grouping.num_groups)
    rows = rows.astype(np.int64)
    if plan.kind == "top_n":
        # a partial row holds a key's top rows of one task as lists: flatten, select again
        lengths = pc.list_value_length(table.column(plan.values[0])).to_numpy()
        flat = pa.table({v: table.column(v).combine_chunks().flatten() for v in plan.values})
        codes = np.repeat(grouping.codes, lengths)
        top = K.top_n_by_codes(flat, codes, grouping.num_groups, plan.by or "", plan.top_n)
        return _Merged(grouping.keys, rows, grouping.counts, top)
    if plan.kind == "ufunc":
        red = K.ufunc_groups(grouping, table.column(K.RED).combine_chunks(), plan.ufunc)
        return _Merged(grouping.keys, rows, grouping.counts, red)
    assert plan.aggregate is not None
    accs = K.decode_accumulators(table)
    merged = K.merge_groups(plan.aggregate, grouping.codes, grouping.num_groups, accs)
    return _Merged(grouping.keys, rows, grouping.counts, merged)


def _to_partials(plan: Plan, m: _Merged) -> pa.Table:
    """``m`` as partial rows of ``plan.partial_schema``."""
    cols: dict[str, Any] = {k: m.keys.column(k) for k in plan.keys}
    if plan.kind == "builtin":
        t = m.payload
        for name in plan.partial_schema.names[plan.num_keys :]:
            cols[name] = t.column(name) if name != K.N else pa.array(m.rows, pa.int64())
    elif plan.kind == "top_n":
        selected, kept = m.payload
        cols[K.N] = pa.array(m.rows, pa.int64())
        for v in plan.values:
            cols[v] = K.lists_by_group(selected.column(v), kept)
    else:
        cols[K.N] = pa.array(m.rows, pa.int64())
        if plan.kind == "ufunc":
            cols[K.RED] = m.payload
        else:
            cols.update(K.encode_accumulators(m.payload))
    table = pa.table({name: cols[name] for name in plan.partial_schema.names})
    return table.cast(plan.partial_schema)


def _results(plan: Plan, m: _Merged) -> pa.Array:
    if plan.kind == "builtin":
        return K.builtin_result(m.payload, plan.op, plan.result_type)
    if plan.kind == "top_n":
        selected, kept = m.payload
        lists = K.top_n_lists(selected, kept, plan.top_columns, plan.top_names)
        return lists.cast(plan.result_type)
    if plan.kind == "ufunc":
        return pc.cast(m.payload, plan.result_type)
    assert plan.aggregate is not None
    return K.results(plan.aggregate, m.payload, plan.result_type, plan.what)


def _concat(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _batches(table: pa.Table) -> Iterator[pa.RecordBatch]:
    yield from table.combine_chunks().to_batches(max_chunksize=_OUT_ROWS)


def _partition_id() -> int:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return ctx.partitionId() if ctx is not None else -1


def _user_function(plan: Plan) -> str | None:
    """The name of the user's code a phase of ``plan`` runs (None: built-ins only)."""
    if plan.kind == "aggregate" and plan.op == "reduce":  # reduce(fn): fn in an aggregate
        fn = getattr(plan.aggregate, "fn", None)
        return str(getattr(fn, "__qualname__", None) or type(fn).__name__).rsplit(".", 1)[-1]
    if plan.kind == "aggregate":
        return type(plan.aggregate).__name__
    if plan.kind == "ufunc":
        return str(getattr(plan.ufunc, "__name__", None) or repr(plan.ufunc))
    return None


def _with_context(plan: Plan, phase: str, ex: Exception) -> Exception:
    """Name the operation and the task in an error raised by user code; the error
    keeps the user's type where it renders its message as given (else RuntimeError),
    and carries the failure line the driver reads back (``UserFunctionError``)."""
    pid = _partition_id()
    msg = f"{plan.what} failed in the {phase} phase (Spark partition {pid}): {ex}"
    function = _user_function(plan)
    if function is not None:
        headline = (
            f"{plan.what} failed in the {phase} phase (Spark partition {pid}): "
            f"{type(ex).__name__}: {ex}"
        )
        line = failure_line(headline, ex, operation=plan.what, function=function, partition=pid)
        msg = f"{msg}\n{line}"
    try:
        wrapped = type(ex)(msg)
        if str(wrapped) != msg:  # KeyError quotes its message: the line must stay intact
            wrapped = RuntimeError(msg)
    except Exception:
        wrapped = RuntimeError(msg)
    return wrapped


# -- the phases ----------------------------------------------------------------------------


def local_phase(
    plan: Plan, metrics: Any
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Partials of one input partition: buffer up to ``buffer_bytes``, group, aggregate."""

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        chunks: list[pa.Table] = []
        held = rows_in = emitted = 0
        buf: list[pa.RecordBatch] = []
        size = 0
        try:
            for b in batches:
                if not b.num_rows:
                    continue
                buf.append(b)
                size += b.nbytes
                rows_in += b.num_rows
                if size < plan.buffer_bytes:
                    continue
                part = _to_partials(plan, _from_rows(plan, pa.Table.from_batches(buf)))
                buf, size = [], 0
                chunks.append(part)
                held += part.num_rows
                if held > plan.max_local_keys:
                    if len(chunks) > 1:
                        merged = _to_partials(plan, _merge(plan, _concat(chunks, part.schema)))
                        chunks, held = [merged], merged.num_rows
                    if held > plan.max_local_keys:  # too many keys to hold: flush them
                        emitted += held
                        yield from _batches(chunks[0])
                        chunks, held = [], 0
            if buf:
                chunks.append(_to_partials(plan, _from_rows(plan, pa.Table.from_batches(buf))))
            if len(chunks) > 1:
                chunks = [_to_partials(plan, _merge(plan, _concat(chunks, plan.partial_schema)))]
            if chunks:
                emitted += chunks[0].num_rows
                yield from _batches(chunks[0])
        except Exception as ex:
            raise _with_context(plan, "local", ex) from ex
        if metrics is not None:
            metrics.add({("map", _partition_id()): (rows_in, emitted)})

    return run


def final_phase(
    plan: Plan, metrics: Any
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Merge the partials of the keys this reducer got, and emit one result per key."""

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        got = [b for b in batches if b.num_rows]
        partials = sum(b.num_rows for b in got)
        stats = (partials, 0, 0, 0, 0)
        if got:
            try:
                table = pa.Table.from_batches(got).cast(plan.partial_schema)
                m = _merge(plan, table)
                result = _results(plan, m)
            except Exception as ex:
                raise _with_context(plan, "merge", ex) from ex
            out = pa.table([*(m.keys.column(k) for k in plan.keys), result], schema=plan.out_schema)
            stats = (
                partials,
                int(m.rows.sum()),
                out.num_rows,
                int(m.parts.max()),
                int(m.rows.max()),
            )
            yield from _batches(out)
        if metrics is not None:
            metrics.add({("reduce", _partition_id()): stats})

    return run


def premerge_phase(plan: Plan) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Merge a micro-batch's partials per key, emitting partials: one row per key.

    Runs after ``repartition(keys)`` in front of ``applyInPandasWithState``. Besides
    shrinking the state operator's input, it works around PySpark 3.5 with recent
    pyarrow: when a group has several rows in a batch, the state operator's serializer
    converts the chunk offsets to floats and ``RecordBatch.slice`` rejects them.
    """

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        got = [b for b in batches if b.num_rows]
        if not got:
            return
        try:
            table = pa.Table.from_batches(got).cast(plan.partial_schema)
            merged = _to_partials(plan, _merge(plan, table))
        except Exception as ex:
            raise _with_context(plan, "streaming merge", ex) from ex
        yield from _batches(merged)

    return run


def stream_state_fn(plan: Plan) -> Callable[..., Iterator[Any]]:
    """``applyInPandasWithState`` function: merge a key's partials of a micro-batch into its state.

    The state is the key's merged partial row itself (Arrow IPC bytes), so the merge is
    the same code as the bounded final phase.
    """

    def fn(key: tuple, pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
        tables = [
            pa.Table.from_pandas(pdf, schema=plan.partial_schema, preserve_index=False)
            for pdf in pdfs
        ]
        if state.exists:
            (blob,) = state.get
            tables.insert(0, pa.ipc.open_stream(pa.py_buffer(blob)).read_all())
        table = _concat(tables, plan.partial_schema)
        try:
            m = _merge(plan, table.cast(plan.partial_schema))
            merged = _to_partials(plan, m)
            result = _results(plan, m)
        except Exception as ex:
            raise _with_context(plan, "streaming merge", ex) from ex
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, merged.schema) as writer:
            writer.write_table(merged)
        state.update((sink.getvalue().to_pybytes(),))
        out = pa.table([*(m.keys.column(k) for k in plan.keys), result], schema=plan.out_schema)
        yield out.to_pandas()

    return fn
