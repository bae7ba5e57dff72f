"""The Spark-task side of an operation with side inputs: ``mapInArrow`` functions.

Runs in Spark tasks (Python workers). Three input layouts, one record loop:

* ``broadcast_task``: the main DataFrame's own batches; every view is a broadcast.
* ``copartitioned_task``: a bounded keyed operation. Main and keyed side rows arrive
  in one hash partition of the key, sorted so that side rows (tag ``i`` for keyed view
  ``i``) come before main rows (the last tag); the task folds its share of each keyed
  view, then runs the main rows against it.
* ``bucketed_task``: a streaming micro-batch with keyed views. Main rows carry their
  key group (``__si_bucket``); the task loads the key groups' shards of the side state
  from the versioned files the driver published (``_side_store``).

The record loop hands the user function ``pyspark.sql.Row`` objects with the main
DataFrame's columns and a ``SideInputContext`` set to each record's key and window.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .._errors import failure_line
from ..full_partition._rows import RowWriter
from ._content import (
    FastRowReader,
    SideInputContext,
    VersionApplier,
    _ViewState,
    iter_chunks,
    key_names,
    keys_of,
    namespaces_of,
    value_names,
)
from ._errors import SideInputError
from ._store import KeyedSource, load_shard
from ._views import _ViewSpec

__all__ = ["OpPlan", "broadcast_task", "bucketed_task", "copartitioned_task", "run_op"]

TAG = "__si_tag"
MAIN = "__si_main"
BUCKET = "__si_bucket"


def side_struct(i: int) -> str:
    return f"__si_s{i}"


@dataclass(frozen=True)
class OpPlan:
    """What one operation does, as plain data shipped in the task closure."""

    op: str  # "map" | "filter" | "map_partition"
    fn: Callable[..., Any]
    fn_name: str
    main_columns: tuple[str, ...]
    key: tuple[str, ...]  # the main input's key columns ((), when no keyed view)
    window: str | None  # the main input's window column
    out_schema: pa.Schema | None  # None for filter (the main schema)
    chunk_rows: int = 4096


def _writer(plan: OpPlan) -> RowWriter:
    assert plan.out_schema is not None
    return RowWriter(plan.out_schema)


def _to_batch(writer: RowWriter, results: Iterable[Any], plan: OpPlan) -> pa.RecordBatch:
    """The function's results as one Arrow batch (Rows, tuples, dicts or bare values)."""
    try:
        return writer.batch([writer.record(r) for r in results])
    except (TypeError, ValueError) as ex:
        raise type(ex)(f"{plan.op} function {plan.fn_name} returned a bad record: {ex}") from ex


def _bound_rows(
    ctx: SideInputContext,
    plan: OpPlan,
    batch: pa.RecordBatch,
    buckets: list[int] | None,
    reader: FastRowReader,
) -> Iterator[Any]:
    """The batch's records as Rows, setting the context to each one's key and window."""
    rows = reader.rows(batch)
    keys = keys_of([batch.column(k) for k in plan.key]) if plan.key else None
    nss = namespaces_of(batch.column(plan.window)) if plan.window else None
    if keys is None and nss is None and buckets is None:
        yield from rows
        return
    for i, row in enumerate(rows):
        if keys is not None:
            ctx._key = keys[i]
        if nss is not None:
            ctx._ns = nss[i]
        if buckets is not None:
            ctx._bucket = buckets[i]
        yield row


def _call_failed(plan: OpPlan, ctx: SideInputContext, ex: Exception) -> Exception:
    """The error the task raises for ``ex`` from the user's function, with the failure
    line the driver reads back (``spark_ops.UserFunctionError``). A ``SideInputError``
    (the function asked a view for what it cannot give) keeps its type in the task."""
    key = None if ctx.key is None else f"{ctx.key!r:.200}"
    headline = (
        f"{plan.op} function {plan.fn_name} failed in partition {ctx.partition_id} "
        f"(key {ctx.key!r:.200}): {type(ex).__name__}: {ex}"
    )
    line = failure_line(
        headline, ex, operation=plan.op, function=plan.fn_name, partition=ctx.partition_id, key=key
    )
    if isinstance(ex, SideInputError):
        try:
            wrapped = type(ex)(f"{ex}\n{line}")
            if str(wrapped) == f"{ex}\n{line}":
                return wrapped
        except Exception:
            pass
    return RuntimeError(f"{headline}\n{line}")


def run_op(
    plan: OpPlan,
    ctx: SideInputContext,
    batches: Iterable[tuple[pa.RecordBatch, list[int] | None]],
) -> Iterator[pa.RecordBatch]:
    """Run the user function over the main batches; yield the output batches."""
    fn = plan.fn
    readers: dict[pa.Schema, FastRowReader] = {}

    def reader(batch: pa.RecordBatch) -> FastRowReader:
        r = readers.get(batch.schema)
        if r is None:
            r = readers[batch.schema] = FastRowReader(batch.schema)
        return r

    try:
        if plan.op == "map_partition":
            part_writer = _writer(plan)
            rows = itertools.chain.from_iterable(
                _bound_rows(ctx, plan, b, buckets, reader(b)) for b, buckets in batches
            )
            out = fn(rows, ctx)
            if out is None:
                return
            for chunk in iter_chunks(iter(out), plan.chunk_rows):
                yield _to_batch(part_writer, chunk, plan)
            return
        writer = _writer(plan) if plan.op == "map" else None
        for batch, buckets in batches:
            if batch.num_rows == 0:
                continue
            bound = _bound_rows(ctx, plan, batch, buckets, reader(batch))
            if writer is None:
                mask = [bool(fn(r, ctx)) for r in bound]
                yield batch.filter(pa.array(mask, pa.bool_()))
            else:
                yield _to_batch(writer, [fn(r, ctx) for r in bound], plan)
    except Exception as ex:
        err = _call_failed(plan, ctx, ex)
        if err is ex:
            raise
        raise err from ex


def _partition_id() -> int:
    from pyspark import TaskContext

    tc = TaskContext.get()
    return tc.partitionId() if tc is not None else 0


def _broadcast_states(
    views: tuple[tuple[_ViewSpec, int], ...], bcast: Mapping[str, Any]
) -> list[_ViewState]:
    """``bcast`` maps view id -> the broadcast variable of its content (read once per
    worker process: PySpark keeps a broadcast's value for the worker's lifetime)."""
    return [_ViewState(spec, version, content=bcast[spec.view_id].value) for spec, version in views]


def broadcast_task(
    plan: OpPlan, views: tuple[tuple[_ViewSpec, int], ...], bcast: Mapping[str, Any]
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Every view broadcast: the input batches are the main DataFrame's."""

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        ctx = SideInputContext(_partition_id(), _broadcast_states(views, bcast))
        yield from run_op(plan, ctx, ((b, None) for b in batches))

    return run


def _tag_runs(batch: pa.RecordBatch) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The batch cut into runs of one tag (the rows are sorted by tag)."""
    tags = batch.column(TAG).to_numpy(zero_copy_only=False)
    cuts = [0, *(np.flatnonzero(np.diff(tags)) + 1).tolist(), len(tags)]
    for a, b in itertools.pairwise(cuts):
        if b > a:
            yield int(tags[a]), batch.slice(a, b - a)


def _side_layout(piece: pa.RecordBatch, spec: _ViewSpec, i: int) -> pa.RecordBatch:
    """Rows of keyed view ``i`` in the internal layout (``__k*``, ``__w``, ``__v*``)."""
    struct = piece.column(side_struct(i))
    fields = dict(zip((f.name for f in struct.type), struct.flatten()))
    names = key_names(len(spec.key))
    arrays = [piece.column(n) for n in names]
    if spec.window:
        names.append("__w")
        arrays.append(fields["__w"])
    for n in value_names(len(spec.value)):
        names.append(n)
        arrays.append(fields[n])
    return pa.RecordBatch.from_arrays(arrays, names=names)


def copartitioned_task(
    plan: OpPlan,
    views: tuple[tuple[_ViewSpec, int], ...],
    bcast: Mapping[str, Any],
    keyed: tuple[_ViewSpec, ...],
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Bounded keyed: fold this partition's side rows, then run its main rows."""
    main_tag = len(keyed)

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        shards: list[dict[Any, Any]] = [{} for _ in keyed]
        appliers = [VersionApplier(s, c, replace=False) for s, c in zip(keyed, shards)]
        states = _broadcast_states(views, bcast)
        states += [_ViewState(s, 1, content=c) for s, c in zip(keyed, shards)]
        ctx = SideInputContext(_partition_id(), states)

        def main_batches() -> Iterator[tuple[pa.RecordBatch, None]]:
            folded = False
            for batch in batches:
                for tag, piece in _tag_runs(batch):
                    if tag < main_tag:
                        appliers[tag].add_batch(_side_layout(piece, keyed[tag], tag))
                        continue
                    if not folded:
                        for a in appliers:
                            a.finish()
                        folded = True
                    struct = piece.column(MAIN)
                    yield (
                        pa.RecordBatch.from_arrays(struct.flatten(), names=plan.main_columns),
                        None,
                    )

        yield from run_op(plan, ctx, main_batches())

    return run


def bucketed_task(
    plan: OpPlan,
    views: tuple[tuple[_ViewSpec, int], ...],
    bcast: Mapping[str, Any],
    sources: tuple[KeyedSource, ...],
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Streaming keyed: main rows carry their key group; shards come from the side store."""
    n_main = len(plan.main_columns)

    def run(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        states = _broadcast_states(views, bcast)
        for src in sources:
            states.append(
                _ViewState(src.spec, src.version, shard=functools.partial(load_shard, src))
            )
        ctx = SideInputContext(_partition_id(), states)

        def main_batches() -> Iterator[tuple[pa.RecordBatch, list[int]]]:
            for batch in batches:
                buckets = batch.column(BUCKET).to_pylist()
                main = pa.RecordBatch.from_arrays(
                    batch.columns[:n_main], schema=batch.schema.remove(n_main)
                )
                yield main, buckets

        yield from run_op(plan, ctx, main_batches())

    return run
