"""One micro-batch partition in a Spark task: a fresh partition operator trains on the
partition's good rows (``process_variables`` with the newest variables,
``process_data``, then ``on_epoch_watermark_incremented(round)``), its malformed rows go
to the dead-letter path, and its emissions reach the coordinator keyed by
``(batch_id, partition)``. The task runs under the subtask runtime's guard and watchdog
(``task._guard``, ``task._TaskSteps``), as a bounded subtask does."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from coordinator import BadFile, PartitionTally

from ..task import PartitionCollector, PartitionContext, _coordinator, _guard, _TaskSteps
from .dead_letters import split_malformed, write_dead_letters
from .parquet_source import Piece, read_share

__all__ = ["EPOCH_MAX", "OnlinePlan", "rows_task", "run_partition", "shares_task"]

#: the epoch of every data record of an unbounded iteration (it never moves a watermark)
EPOCH_MAX = sys.maxsize


@dataclass(frozen=True)
class OnlinePlan:
    """Plain data each task of a micro-batch gets."""

    ray_address: str
    namespace: str
    actor_name: str
    operator: bytes
    staleness: int | None
    has_criteria: bool = False
    #: rows with a null (or NaN) in these columns are malformed: not trained on
    numeric_columns: tuple[str, ...] = ()
    #: where malformed rows go (Parquet, one file per batch and partition); None: counted
    dead_letter_path: str | None = None
    #: the stream's schema, when our tasks read the files themselves (Parquet source)
    arrow_schema: pa.Schema | None = None
    #: rows per Arrow batch handed to process_data when we read the files
    batch_rows: int = 10_000
    #: seconds a step of a task may make no progress (``OnlineConfig.call_timeout``)
    call_timeout: float = 600.0


def rows_task(
    plan: OnlinePlan, batch_id: int, round_: int
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of a micro-batch Spark reads: one pass over the
    partition's rows; one row out, the pickled ``PartitionTally``."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        tally = run_partition(plan, batch_id, round_, batches)
        yield pa.RecordBatch.from_pydict({"result": [pickle.dumps(tally)]})

    return run


def shares_task(
    plan: OnlinePlan, batch_id: int, round_: int
) -> Callable[[Iterator[list[Piece]]], Iterator[bytes]]:
    """The ``mapPartitions`` function of a Parquet micro-batch our tasks read: one share
    per RDD partition; one item out, the pickled ``PartitionTally``."""

    def run(shares: Iterator[list[Piece]]) -> Iterator[bytes]:
        schema = plan.arrow_schema
        assert schema is not None
        share = [piece for s in shares for piece in s]
        bad: list[BadFile] = []
        batches = read_share(schema, plan.batch_rows, share, bad)
        yield pickle.dumps(run_partition(plan, batch_id, round_, batches, bad))

    return run


def run_partition(
    plan: OnlinePlan,
    batch_id: int,
    round_: int,
    batches: Iterator[pa.RecordBatch],
    bad_files: list[BadFile] | None = None,
) -> PartitionTally:
    """One micro-batch partition through a fresh partition operator (a Spark task).

    Runs under the task guard the bounded subtasks use (``task._guard``): a callback
    that raises is reported to the coordinator as a ``RemoteFailure`` naming the
    partition, the callback and the micro-batch before Spark sees the task fail, and a
    step without progress for ``call_timeout`` seconds is reported as ``CallTimeout``
    (the driver then cancels the batch's job). ``bad_files`` is filled while
    ``batches`` is read (files of the share that could not be read)."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    pid = tc.partitionId() if tc is not None else 0
    ctx = PartitionContext(pid, -1, plan.staleness)
    ctx.epoch = round_
    ctx.batch_id = batch_id  # type: ignore[attr-defined]
    ctx.data_epoch = EPOCH_MAX  # type: ignore[attr-defined]
    task = _TaskSteps(
        pid,
        ctx,
        None,
        call_timeout=plan.call_timeout,
        config="OnlineConfig",
        note=f" (micro-batch {batch_id})",
    )
    op: Any = None
    try:
        with _guard(task, lambda: _coordinator(plan)):
            op = _load_operator(task, plan.operator)
            rows, dead = _train(plan, task, op, batch_id, round_, batches)
    finally:
        if op is not None:
            try:
                op.close()
            except Exception:
                pass  # close() must not hide the task's own outcome
    return PartitionTally(pid, rows, dead, tuple(bad_files or ()))


def _load_operator(task: _TaskSteps, blob: bytes) -> Any:
    import cloudpickle

    task.step("loading the partition operator")
    return cloudpickle.loads(blob)


def _train(
    plan: OnlinePlan,
    task: _TaskSteps,
    op: Any,
    batch_id: int,
    round_: int,
    batches: Iterator[pa.RecordBatch],
) -> tuple[int, int]:
    """The micro-batch partition's callbacks, each through ``task.call`` (so a failure
    or a stall names it); returns the rows trained on and the malformed rows."""
    ctx, coord, pid = task.ctx, task.coord, task.pid
    assert coord is not None  # connected by ``_guard``
    out = PartitionCollector(False)
    rows = 0
    dead: list[pa.RecordBatch] = []
    task.call(op, "open", ctx)
    payload = task.ask(coord.variables(-1))
    task.step("reading the variables")
    ctx.variables_version = payload.version
    task.call(op, "process_variables", coord.resolve(payload), ctx, out)
    # async: one variables request in flight, taken when it has arrived (never a
    # blocking round trip per Arrow batch)
    pending = coord.variables(ctx.variables_version) if plan.staleness is None else None
    task.step("reading the data")
    for batch in batches:
        if plan.numeric_columns:
            batch, bad = split_malformed(batch, plan.numeric_columns)
            if bad.num_rows:
                dead.append(bad)
            if not batch.num_rows:
                continue
        if pending is not None:
            if pending.ready():
                newer = pending.result()
                if newer is not None:
                    task.step("reading the variables")
                    ctx.variables_version = newer.version
                    task.call(op, "process_variables", coord.resolve(newer), ctx, out)
                pending = coord.variables(ctx.variables_version)
        rows += batch.num_rows
        task.call(op, "process_data", 0, batch, ctx, out)
        task.step("reading the data")
    if rows:
        task.call(op, "on_epoch_watermark_incremented", round_, ctx, out)
    if dead and plan.dead_letter_path is not None:
        task.step("writing the malformed rows to the dead-letter path")
        write_dead_letters(plan.dead_letter_path, batch_id, pid, dead)
    task.ask(coord.online_report(batch_id, pid, out._em))
    return rows, sum(b.num_rows for b in dead)
