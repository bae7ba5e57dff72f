"""``iterate_unbounded_streams``: online iterations on Spark Structured Streaming.

Runs on the driver (the ``foreachBatch`` function) and in Spark tasks (one per micro-batch
partition). Every micro-batch is one round: its rows are split into good rows and
malformed ones (null or NaN in a declared numeric column, which go to a dead-letter
path), the good rows run through fresh partition operators (``process_variables`` with
the newest variables, ``process_data``, then ``on_epoch_watermark_incremented(round)``),
whose emissions reach the coordinator keyed by ``(batch_id, partition)``; then the driver
commits the batch. Sync: the commit applies the batch's feedback in partition order
against the one variables version the batch saw; async: feedback is applied as it
arrives and partitions pick up newer variables between Arrow batches (prefetched, never
a blocking read per batch). A replayed batch id is ignored (exactly-once with
``checkpoint_location``). Data records carry epoch MAX: only the variables advance, one
round per micro-batch, and the iteration ends only when it is stopped.

A **Parquet file source** (``spark.readStream.schema(...).parquet(dir)``, nothing applied
on top) is read by our own tasks with pyarrow: Spark's file source still decides which
files make up each micro-batch (its offsets and file log give exactly-once), but a file
that is not Parquet or whose columns do not match the stream's schema goes to the
dead-letter path (path, reason, batch id) instead of failing the query. Other sources
(CSV, JSON, Kafka, a transformed DataFrame) are read by Spark as before.
"""

from __future__ import annotations

import functools
import json
import logging
import pickle
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

import storage_uri
from coordinator import (
    CheckpointSpec,
    CoordinatorSpec,
    OnlineCoordinator,
    OnlineStatus,
    OutputRecord,
    RuntimeHooks,
    normalize_variables,
)
from coordinator._finite import check_finite_variables
from spark_ops import require_spark_filesystem
from spark_ops._spark_compat import JobTag, streaming_file_source

from .._body import IterationBody
from .._config import (
    IterationConfig,
    OperatorLifecycle,
    _check_call_timeout,
    _check_uri,
    _is_int,
)
from .._errors import CheckpointError, IterationConfigError, IterationFailedError
from .._streams import ReplayableDataStreamList, _is_dataframe
from .metrics import RunMeter, job_description, online_description, online_meter
from .placement import actor_class, kill, launch
from .ray_util import NAMESPACE, connect
from .shipping import dumps
from .task import (
    PartitionCollector,
    PartitionContext,
    _coordinator,
    _guard,
    _TaskSteps,
)

__all__ = [
    "EPOCH_MAX",
    "OnlineCheckpointError",
    "OnlineConfig",
    "OnlineIteration",
    "OnlineProgress",
    "iterate_unbounded_streams",
]

log = logging.getLogger("hybrid_iter")

#: the epoch of every data record of an unbounded iteration (it never moves a watermark)
EPOCH_MAX = sys.maxsize

#: the fixed schema of Spark's ``binaryFile`` source (we select only ``path``: Spark does
#: not open a file unless its ``content`` column is read)
_BINARY_FILE_SCHEMA = "path string, modificationTime timestamp, length long, content binary"

#: marks the error a micro-batch raises when it starts while ``stop()`` drains
_STOPPING = "hybrid_iter: the online iteration is stopping"


class OnlineCheckpointError(CheckpointError, RuntimeError):
    """The online checkpoint cannot restore every micro-batch Spark has committed; the
    message names the batch ids at risk and the choices."""

    def __init__(self, message: str, at_risk: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.at_risk = tuple(at_risk)

    def __reduce__(self):
        return (OnlineCheckpointError, (self.message, self.at_risk))


@dataclass(frozen=True, kw_only=True)
class OnlineConfig:
    """How an online iteration runs (all keyword-only).

    * ``staleness``: ``0`` sync (one lock-step round per micro-batch against one variables
      version) or ``None`` async (partitions' feedback applied as it arrives).
    * ``checkpoint_location``: Spark's checkpoint location of the query; the coordinator
      persists its state under ``<location>/hybrid_iter`` at every committed micro-batch
      (a journal record of the batch and a snapshot; at most ``2 * keep_last`` files), so
      a restarted query or driver continues exactly once.
    * ``on_corrupt_checkpoint``: what a restart does when the newest state it can restore
      is older than the last batch Spark committed (snapshot and journal lost or corrupt):
      ``"fail"`` (default) raises ``OnlineCheckpointError`` naming the batch ids at risk;
      ``"reset"`` accepts the loss, continues from the newest state it could restore (or
      the initial variables) and lists the lost ids in ``progress.lost_batches``.
    * ``trigger``: keyword arguments of ``DataStreamWriter.trigger`` (e.g.
      ``{"processingTime": "2 seconds"}`` or ``{"availableNow": True}``); None: as fast
      as data comes.
    * ``dead_letter_path``: where malformed records (Parquet, one directory per batch) and
      rejected files (``_bad_files/batch_id=<id>.json``: path, reason, batch id) go;
      None: ``<checkpoint_location>/dead_letter`` when there is a location, else they are
      only counted (and rejected files logged).
    * ``output_path``: output records as JSON lines, one file per batch; ``on_outputs``: a
      driver-side callback ``(batch_id, records)`` (after a driver crash the last batch's
      records are delivered again: the file is rewritten, the callback may see them twice).
    * ``parallelism``: this many tasks per micro-batch (None: as it comes).
    * ``parquet_reader``: ``"arrow"`` (default) reads a Parquet file source's files in our
      tasks with pyarrow (bad files dead-lettered); ``"spark"``: Spark reads them (a bad
      file fails the query).
    * ``log_every_seconds``: a status line (batches/s, rows/s, files waiting, dead
      letters, checkpoint age) on the ``hybrid_iter`` logger this often; None: off.
    * ``keep_last``: snapshots kept under the checkpoint location (>= 2).
    * ``hooks``: a ``RuntimeHooks`` the driver calls after each micro-batch it commits
      (tests pass the fault injections of ``hybrid_iter.testing``); None: no hooks.
    * ``call_timeout``: seconds a partition operator's callback (or a step of a task,
      such as reading the data) may make no progress before the iteration fails with
      ``IterationFailedError`` (``CallTimeout``) naming the partition, the micro-batch
      and the method; the driver cancels the micro-batch's Spark job (default 600; raise
      it for callbacks that legitimately take longer).

    A callback that raises fails the iteration too: ``await_termination()``,
    ``exception()`` and ``stop()`` give an ``IterationFailedError`` naming the partition,
    the micro-batch and the method, with the original traceback.
    """

    staleness: int | None = 0
    checkpoint_location: str | None = None
    on_corrupt_checkpoint: str = "fail"
    trigger: Mapping[str, Any] | None = None
    dead_letter_path: str | None = None
    output_path: str | None = None
    on_outputs: Callable[[int, list[OutputRecord]], None] | None = None
    parallelism: int | None = None
    parquet_reader: str = "arrow"
    progress: bool | None = None
    progress_tag: str = "loss"
    log_every_seconds: float | None = 60.0
    keep_last: int = 2
    inline_variables_bytes: int = 64 * 1024
    name: str | None = None
    hooks: RuntimeHooks | None = None
    call_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.staleness not in (0, None):
            raise IterationConfigError(
                f"OnlineConfig.staleness must be 0 (sync: one round per micro-batch) or None "
                f"(async), got {self.staleness!r}; bounded staleness has no meaning when "
                f"micro-batches run one after another"
            )
        for field in ("checkpoint_location", "dead_letter_path", "output_path"):
            if getattr(self, field) is not None:
                value = _check_uri(
                    f"OnlineConfig.{field}",
                    getattr(self, field),
                    spark_reads=field == "checkpoint_location",  # the query's own files too
                )
                object.__setattr__(self, field, value)
        if self.on_corrupt_checkpoint not in ("fail", "reset"):
            raise IterationConfigError(
                f"OnlineConfig.on_corrupt_checkpoint must be 'fail' (stop with an error naming "
                f"the batches at risk) or 'reset' (accept their loss), got "
                f"{self.on_corrupt_checkpoint!r}"
            )
        if self.parquet_reader not in ("arrow", "spark"):
            raise IterationConfigError(
                f"OnlineConfig.parquet_reader must be 'arrow' or 'spark', got "
                f"{self.parquet_reader!r}"
            )
        if self.trigger is not None and not isinstance(self.trigger, Mapping):
            raise IterationConfigError(
                "OnlineConfig.trigger must be a mapping of DataStreamWriter.trigger keyword "
                "arguments, e.g. {'processingTime': '2 seconds'}"
            )
        if self.on_outputs is not None and not callable(self.on_outputs):
            raise IterationConfigError(
                "OnlineConfig.on_outputs must be callable(batch_id, records)"
            )
        if self.parallelism is not None and (not _is_int(self.parallelism) or self.parallelism < 1):
            raise IterationConfigError("OnlineConfig.parallelism must be None or an int >= 1")
        if self.log_every_seconds is not None and not (
            isinstance(self.log_every_seconds, int | float) and self.log_every_seconds > 0
        ):
            raise IterationConfigError(
                "OnlineConfig.log_every_seconds must be None (no status line) or seconds > 0"
            )
        if not _is_int(self.keep_last) or self.keep_last < 2:
            raise IterationConfigError(
                "OnlineConfig.keep_last must be an int >= 2 (the previous snapshot is what a "
                "corrupt newest one falls back to)"
            )
        if self.hooks is not None and not isinstance(self.hooks, RuntimeHooks):
            raise IterationConfigError(
                f"OnlineConfig.hooks must be None or a RuntimeHooks (e.g. "
                f"hybrid_iter.testing.FaultInjection), got {type(self.hooks).__name__}"
            )
        _check_call_timeout("OnlineConfig.call_timeout", self.call_timeout)

    @classmethod
    def from_iteration_config(cls, config: IterationConfig) -> OnlineConfig:
        """The online reading of an ``IterationConfig`` (what carries over)."""
        if config.max_epochs is not None:
            raise IterationConfigError(
                "an unbounded iteration never ends by itself: drop max_epochs and stop it with "
                "handle.stop()"
            )
        if config.checkpoint is not None or config.resume_from is not None:
            raise IterationConfigError(
                "an unbounded iteration checkpoints with the query: use "
                "OnlineConfig(checkpoint_location=...) instead of checkpoint/resume_from"
            )
        if config.operator_lifecycle is not OperatorLifecycle.ALL_ROUND:
            raise IterationConfigError(
                "operator_lifecycle does not apply online: partition operators live for one "
                "micro-batch partition"
            )
        return cls(
            staleness=config.staleness,
            parallelism=config.parallelism,
            progress=config.progress,
            progress_tag=config.progress_tag,
            inline_variables_bytes=config.inline_variables_bytes,
            name=config.name,
            hooks=config.hooks,
            call_timeout=config.call_timeout,
        )


@dataclass(frozen=True)
class OnlineProgress:
    """Where an online iteration is: micro-batches committed, rows trained on, malformed
    rows and rejected files sent to the dead-letter path, the epoch watermark (rounds
    completed - 1), the newest ``progress_tag`` output, the variables version, the last
    batch id; batches/s and rows/s over the recent commits, files waiting in the source
    (None when the source does not say), seconds since the last checkpoint, and the batch
    ids lost by ``on_corrupt_checkpoint="reset"``, the rows of the last batch committed
    since this handle started (None before that)."""

    batches: int
    rows: int
    dead_letters: int
    epoch_watermark: int
    last_loss: Any
    version: int
    last_batch_id: int
    last_commit: float | None
    dead_files: int = 0
    batches_per_s: float | None = None
    rows_per_s: float | None = None
    lag_files: int | None = None
    last_checkpoint_age_s: float | None = None
    lost_batches: tuple[int, ...] = ()
    last_batch_rows: int | None = None

    def status_line(self) -> str:
        def rate(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        age = self.last_checkpoint_age_s
        return (
            f"batch {self.last_batch_id}: {self.batches} batches ({rate(self.batches_per_s, '.2f')}/s), "
            f"{self.rows} rows ({rate(self.rows_per_s, ',.0f')}/s), "
            f"lag {'-' if self.lag_files is None else self.lag_files} files, "
            f"dead letters {self.dead_letters} rows / {self.dead_files} files, "
            f"last checkpoint {'-' if age is None else f'{age:.1f} s'} ago"
        )


@dataclass(frozen=True)
class _OnlinePlan:
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


def _run_partition(
    plan: _OnlinePlan,
    batch_id: int,
    round_: int,
    batches: Iterator[pa.RecordBatch],
    bad_files: list[dict[str, Any]] | None = None,
) -> Iterator[pa.RecordBatch]:
    """One micro-batch partition through a fresh partition operator (a Spark task).

    Runs under the task guard the bounded subtasks use (``task._guard``): a callback
    that raises is reported to the coordinator as a ``RemoteFailure`` naming the
    partition, the callback and the micro-batch before Spark sees the task fail, and a
    step without progress for ``call_timeout`` seconds is reported as ``CallTimeout``
    (the driver then cancels the batch's job)."""
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
            summary = _train_partition(plan, task, op, batch_id, round_, batches)
    finally:
        if op is not None:
            try:
                op.close()
            except Exception:
                pass  # close() must not hide the task's own outcome
    summary["bad_files"] = list(bad_files or ())
    yield pa.RecordBatch.from_pydict({"result": [pickle.dumps(summary)]})


def _load_operator(task: _TaskSteps, blob: bytes) -> Any:
    import cloudpickle

    task.step("loading the partition operator")
    return cloudpickle.loads(blob)


def _train_partition(
    plan: _OnlinePlan,
    task: _TaskSteps,
    op: Any,
    batch_id: int,
    round_: int,
    batches: Iterator[pa.RecordBatch],
) -> dict[str, Any]:
    """The micro-batch partition's callbacks, each through ``task.call`` (so a failure
    or a stall names it); returns the partition's summary for the driver."""
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
            batch, bad = _split_malformed(batch, plan.numeric_columns)
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
        _write_dead_letters(plan.dead_letter_path, batch_id, pid, dead)
    task.ask(coord.online_report(batch_id, pid, out._em))
    return {"partition": pid, "rows": rows, "dead": sum(b.num_rows for b in dead)}


def _split_malformed(
    batch: pa.RecordBatch, columns: tuple[str, ...]
) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    """(good rows, malformed rows): a null, or a NaN in a float column, is malformed."""
    import pyarrow.compute as pc

    bad = None
    for name in columns:
        col = batch.column(name)
        flag = pc.is_null(col, nan_is_null=pa.types.is_floating(col.type))
        bad = flag if bad is None else pc.or_(bad, flag)
    if bad is None or not pc.any(bad).as_py():
        return batch, batch.slice(0, 0)
    return batch.filter(pc.invert(bad)), batch.filter(bad)


def _filesystem(path: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path in it) of a location we write or read ourselves: the
    user's (Spark's spellings: ``s3a://`` is S3) or one Spark listed (``file:/x``)."""
    return storage_uri.arrow_filesystem(path, error=IterationConfigError)


def _write_dead_letters(path: str, batch_id: int, pid: int, batches: list[pa.RecordBatch]) -> None:
    """Malformed rows of one batch and partition as Parquet (a replay rewrites the file)."""
    import pyarrow.parquet as pq

    fs, base = _filesystem(path)
    directory = f"{base.rstrip('/')}/batch_id={batch_id}"
    fs.create_dir(directory, recursive=True)
    final = f"{directory}/part-{pid:05d}.parquet"
    tmp = f"{directory}/.part-{pid:05d}.tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp) as f:
        pq.write_table(pa.Table.from_batches(batches), f)
    fs.move(tmp, final)


def _write_bad_files(path: str, batch_id: int, records: list[dict[str, Any]]) -> str:
    """The rejected files of one batch, JSON lines ``{path, reason, batch_id}`` under
    ``<dead_letter>/_bad_files/`` (the leading underscore keeps them out of readers of the
    malformed-row Parquet dataset beside them; a replay rewrites the file)."""
    fs, base = _filesystem(path)
    directory = f"{base.rstrip('/')}/_bad_files"
    fs.create_dir(directory, recursive=True)
    final = f"{directory}/batch_id={batch_id}.json"
    tmp = f"{directory}/.batch_id={batch_id}.tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp) as f:
        f.write("".join(json.dumps({**r, "batch_id": batch_id}) + "\n" for r in records).encode())
    fs.move(tmp, final)
    return final


# -- reading a Parquet file source ourselves ------------------------------------------------


def _compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    """A file column of type ``src`` can be read as ``dst`` without changing a value."""
    t = pa.types
    if src == dst:
        return True
    if t.is_dictionary(src):
        return _compatible(src.value_type, dst)
    if t.is_integer(src) and t.is_integer(dst):
        if t.is_signed_integer(src) == t.is_signed_integer(dst):
            return src.bit_width <= dst.bit_width
        return t.is_unsigned_integer(src) and src.bit_width < dst.bit_width
    if t.is_floating(dst) and dst.bit_width == 64:
        return (t.is_integer(src) and src.bit_width <= 32) or t.is_floating(src)
    if t.is_timestamp(src) and t.is_timestamp(dst):
        return True
    if (t.is_string(src) or t.is_large_string(src)) and (
        t.is_string(dst) or t.is_large_string(dst)
    ):
        return True
    if (t.is_binary(src) or t.is_large_binary(src)) and (
        t.is_binary(dst) or t.is_large_binary(dst)
    ):
        return True
    return False


def _schema_problem(file_schema: pa.Schema, schema: pa.Schema) -> str | None:
    """Why a file of ``file_schema`` does not match the stream's ``schema`` (None: it
    does). A column the file lacks reads as nulls, as Spark does; names match case-
    insensitively, as Spark's Parquet reader does by default."""
    by_name = {n.lower(): i for i, n in enumerate(file_schema.names)}
    for field in schema:
        i = by_name.get(field.name.lower())
        if i is None:
            continue
        src = file_schema.field(i).type
        if not _compatible(src, field.type):
            return (
                f"column {field.name!r} is {src} in the file; the stream's schema says {field.type}"
            )
    return None


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly the stream's columns and types (missing ones null)."""
    by_name = {n.lower(): n for n in table.column_names}
    cols = []
    for field in schema:
        name = by_name.get(field.name.lower())
        if name is None:
            cols.append(pa.nulls(table.num_rows, field.type))
            continue
        col = table.column(name)
        cols.append(col if col.type == field.type else col.cast(field.type))
    return pa.Table.from_arrays(cols, schema=schema)


def _file_row_groups(path: str, schema: pa.Schema) -> list[int]:
    """The rows of each row group of Parquet file ``path``; raises when the file cannot
    be used (not Parquet, unreadable footer, columns of the wrong type). Runs on the
    driver: a footer read per file."""
    import pyarrow.parquet as pq

    fs, p = _filesystem(path)
    with fs.open_input_file(p) as f:
        meta = pq.ParquetFile(f).metadata
        problem = _schema_problem(meta.schema.to_arrow_schema(), schema)
        if problem:
            raise ValueError(problem)
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def _assign(
    files: list[tuple[str, list[int]]], tasks: int
) -> list[list[tuple[str, int, int, int]]]:
    """Split the batch's rows into ``tasks`` contiguous shares of (path, row group, start,
    stop) pieces, in path order (so sync results do not depend on listing order)."""
    total = sum(sum(groups) for _, groups in files)
    tasks = max(1, min(tasks, total))
    bounds = [total * k // tasks for k in range(tasks + 1)]
    shares: list[list[tuple[str, int, int, int]]] = [[] for _ in range(tasks)]
    offset = 0
    k = 0
    for path, groups in files:
        for rg, n in enumerate(groups):
            lo, hi = offset, offset + n
            while k < tasks and lo < hi:
                cut = min(hi, bounds[k + 1])
                if cut > lo:
                    shares[k].append((path, rg, lo - offset, cut - offset))
                lo = cut
                if lo >= bounds[k + 1]:
                    k += 1
            offset = hi
    return [s for s in shares if s]


def _read_share(
    plan: _OnlinePlan, share: list[tuple[str, int, int, int]], bad: list[dict[str, Any]]
) -> Iterator[pa.RecordBatch]:
    """The Arrow batches of one task's share (a Spark task). A file is read whole (its
    pieces in this share) before any of it is handed on, so a file that fails here is
    dead-lettered as a whole, never half trained on."""
    import pyarrow.parquet as pq

    schema = plan.arrow_schema
    assert schema is not None
    by_file: dict[str, list[tuple[int, int, int]]] = {}
    for path, rg, lo, hi in share:
        by_file.setdefault(path, []).append((rg, lo, hi))
    for path, pieces in by_file.items():
        try:
            fs, p = _filesystem(path)
            with fs.open_input_file(p) as f:
                pf = pq.ParquetFile(f)
                problem = _schema_problem(pf.schema_arrow, schema)
                if problem:
                    raise ValueError(problem)
                wanted = {n.lower() for n in schema.names}
                columns = [n for n in pf.schema_arrow.names if n.lower() in wanted]
                tables = [
                    _conform(pf.read_row_group(rg, columns=columns).slice(lo, hi - lo), schema)
                    for rg, lo, hi in pieces
                ]
        except Exception as ex:
            groups = sorted({rg for rg, _, _ in pieces})
            bad.append({"path": path, "reason": f"row groups {groups}: {type(ex).__name__}: {ex}"})
            continue
        for table in tables:
            yield from table.to_batches(max_chunksize=plan.batch_rows)


def _files_newer_than(path: str, options: Mapping[str, str], newest: float) -> int:
    """Data files under the source ``path`` modified after ``newest`` (seconds; the
    file source hands files out oldest first, so these are the ones still waiting).
    Hidden files (``.`` or ``_``) do not count, as for Spark's file source."""
    import pyarrow.fs as pafs

    recursive = str(options.get("recursiveFileLookup", "false")).lower() == "true"
    fs, base = _filesystem(path)
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
    cutoff = int(newest * 1000)  # Spark's modification times are in milliseconds
    return sum(
        1
        for i in infos
        if i.type == pafs.FileType.File
        and not i.base_name.startswith((".", "_"))
        and i.mtime_ns is not None
        and i.mtime_ns // 1_000_000 > cutoff
    )


def _parquet_source(df: Any) -> tuple[str, dict[str, str], Any] | None:
    """(path, options, Spark schema) when ``df`` is a Parquet file source as it came from
    ``spark.readStream`` (nothing applied on top); None for anything else."""
    found = streaming_file_source(df)
    if found is None:  # not the plan we know: Spark reads it
        return None
    class_name, options = found
    if not class_name.lower().endswith(("parquet", "parquetfileformat")):
        return None
    path = next((v for k, v in options.items() if k.lower() == "path"), None)
    if path is None:
        return None
    return path, options, df.schema


class OnlineIteration:
    """A running online iteration: a Structured Streaming query plus its coordinator.

    ``stop()`` (drains the micro-batch in progress), ``await_termination(timeout)``,
    ``latest_variables()``, ``progress``, ``outputs`` (the newest output records),
    ``outputs_stream()`` (a streaming DataFrame over ``output_path``). A context manager:
    leaving the block stops it. Runs on the driver.
    """

    def __init__(
        self,
        query: Any,
        actor: Any,
        spark: Any,
        config: OnlineConfig,
        buffer: deque,
        lock: threading.Lock,
        stopping: threading.Event,
        lost_batches: tuple[int, ...] = (),
        files_waiting: Callable[[], int | None] | None = None,
        failed: list[IterationFailedError] | None = None,
        meter: RunMeter | None = None,
    ) -> None:
        self.query = query
        self._actor = actor
        self._spark = spark
        self._config = config
        self._buffer = buffer
        self._lock = lock
        self._stopping = stopping
        self._stopped = False
        #: what a micro-batch raised (filled by the foreachBatch function), and whether
        #: the user has been given it (by await_termination, exception or stop)
        self._failed = failed if failed is not None else []
        self._reported = False
        self._final: OnlineStatus | None = None
        self.lost_batches = tuple(lost_batches)
        self._files_waiting = files_waiting
        self._lag: tuple[float, int | None] = (-1.0, None)  # (when, value): listing is not free
        self._logger: threading.Thread | None = None
        if config.log_every_seconds is not None:
            self._logger = threading.Thread(
                target=self._log_loop, name="hybrid_iter-online-status", daemon=True
            )
            self._logger.start()
        self._meter = meter or RunMeter(None)
        self._meter.watch(lambda: self.progress, query, lambda: bool(self._failed))

    def latest_variables(self) -> dict[str, Any]:
        """The newest published variables."""
        import ray

        return ray.get(self._actor.latest_variables.remote())

    @property
    def progress(self) -> OnlineProgress:
        """Where the iteration is (after ``stop()``: where it stopped)."""
        import ray

        s = self._final if self._final is not None else ray.get(self._actor.online_state.remote())
        now = time.time()
        return OnlineProgress(
            batches=s.batches,
            rows=s.rows,
            dead_letters=s.dead_letters,
            epoch_watermark=s.round - 1,
            last_loss=s.last_loss,
            version=s.version,
            last_batch_id=s.committed,
            last_commit=s.last_commit,
            dead_files=s.dead_files,
            batches_per_s=s.batches_per_s,
            rows_per_s=s.rows_per_s,
            lag_files=self._lag_files(),
            last_checkpoint_age_s=(
                now - s.last_checkpoint if s.last_checkpoint is not None else None
            ),
            lost_batches=self.lost_batches,
            last_batch_rows=s.recent_commits[-1][1] if s.recent_commits else None,
        )

    def _lag_files(self) -> int | None:
        """Files waiting in the source: Spark's ``numFilesOutstanding`` when the source
        reports it, else (a Parquet source we read) the files newer than the newest one
        trained on, listed at most once a second; None for other sources. After
        ``stop()``, the listing is read now when there is one (Spark's figure is of its
        last progress, which may predate the last batch applied)."""
        if self._final is not None and self._files_waiting is not None:
            try:
                return self._files_waiting()
            except Exception as ex:  # a status figure must never take the job down
                log.debug("could not list the source directory: %s", ex)
                return None
        try:
            last = self.query.lastProgress
        except Exception:
            last = None
        total = None
        for source in (last or {}).get("sources", []):
            n = (source.get("metrics") or {}).get("numFilesOutstanding")
            if n is not None:
                total = (total or 0) + int(n)
        if total is not None or self._files_waiting is None:
            return total
        when, value = self._lag
        if time.monotonic() - when >= 1.0:
            try:
                value = self._files_waiting()
            except Exception as ex:  # a status figure must never take the job down
                log.debug("could not list the source directory: %s", ex)
                value = None
            self._lag = (time.monotonic(), value)
        return value

    def _log_loop(self) -> None:
        interval = float(self._config.log_every_seconds or 60.0)
        label = self._config.name or "online"
        while not self._stopping.wait(interval):
            try:
                log.info("online iteration %s: %s", label, self.progress.status_line())
            except Exception as ex:  # the status line must never take the job down
                log.debug("online status line unavailable: %s", ex)

    @property
    def outputs(self) -> list[OutputRecord]:
        return list(self._buffer)

    def outputs_stream(self) -> Any:
        """The output records as a streaming DataFrame (needs ``output_path``)."""
        if self._config.output_path is None:
            raise IterationConfigError("outputs_stream() needs OnlineConfig(output_path=...)")
        schema = "tag string, epoch long, source string, value string, batch_id long"
        return self._spark.readStream.schema(schema).json(self._config.output_path)

    def await_termination(self, timeout: float | None = None) -> bool:
        """Wait for the query to end (``availableNow`` triggers end by themselves).
        Raises ``IterationFailedError`` when a micro-batch failed (a callback raised or
        made no progress for ``call_timeout``), else Spark's error if the query failed."""
        try:
            if timeout is None:
                self.query.awaitTermination()
                return True
            return bool(self.query.awaitTermination(timeout))
        except Exception:
            failure = self._failure()
            if failure is None:
                raise
            # its cause stays the RemoteFailure (partition, micro-batch, method)
            raise failure from failure.__cause__

    def exception(self) -> Any:
        """The error that ended the query, None if none: the ``IterationFailedError``
        of a failed micro-batch, else Spark's ``StreamingQueryException``."""
        ex = self.query.exception()
        if ex is None:
            return None
        failure = self._failure()
        if failure is not None:
            return failure
        if self._stopped and _STOPPING in str(ex):
            return None  # a micro-batch refused to start because stop() was draining
        return ex

    def _failure(self) -> IterationFailedError | None:
        """The micro-batch failure, marked as given to the user."""
        if not self._failed:
            return None
        self._reported = True
        return self._failed[0]

    def stop(self) -> None:
        """Drain the micro-batch in progress (it commits, with its checkpoint), stop the
        query, then the coordinator. A micro-batch that would start meanwhile is refused
        before it reads anything (Spark runs it again after a restart). Raises the
        ``IterationFailedError`` of a failed micro-batch that neither
        ``await_termination()`` nor ``exception()`` has given yet."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        import ray

        try:
            with self._lock:  # the batch in progress commits first
                try:
                    self._final = ray.get(self._actor.online_state.remote())
                except Exception:
                    self._final = None
                self.query.stop()
        finally:
            kill(self._actor, "the online coordinator")
            if self._logger is not None:
                self._logger.join(timeout=5)
            self._meter.close(failed=bool(self._failed), final=lambda: self.progress)
        if self._failed and not self._reported:
            # the query ended with a failed micro-batch nobody asked about: say so
            failure = self._failure()
            assert failure is not None
            raise failure

    def __enter__(self) -> OnlineIteration:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self._reported = True  # an error is on its way out already: do not mask it
        self.stop()


def _write_outputs(path: str, batch_id: int, records: list[OutputRecord]) -> None:
    fs, base = _filesystem(path)
    fs.create_dir(base, recursive=True)
    lines = "".join(
        json.dumps(
            {
                "tag": r.tag,
                "epoch": r.epoch,
                "source": str(r.source),
                "value": json.dumps(r.value, default=str),
                "batch_id": batch_id,
            }
        )
        + "\n"
        for r in records
    )
    final = f"{base}/batch-{batch_id:012d}.json"
    tmp = f"{base}/.batch-{batch_id:012d}.tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp) as f:
        f.write(lines.encode())
    fs.move(tmp, final)  # a replayed batch rewrites the same file


def _spark_last_commit(location: str) -> int | None:
    """The last batch id in Spark's commit log of the query (None: none, or unreadable)."""
    import pyarrow.fs as pafs

    try:
        fs, base = _filesystem(location)
        infos = fs.get_file_info(
            pafs.FileSelector(f"{base.rstrip('/')}/commits", allow_not_found=True)
        )
    except Exception as ex:
        log.warning("could not read Spark's commit log under %s: %s", location, ex)
        return None
    ids = [int(i.base_name) for i in infos if i.base_name.isdigit()]
    return max(ids) if ids else None


def _at_risk(state: OnlineStatus, spark_last: int | None) -> tuple[int, ...]:
    """Batch ids Spark will not run again whose update the restored state lacks."""
    committed = state.committed
    if spark_last is not None:
        return tuple(range(committed + 1, spark_last + 1))
    # no commit log to hold against: anything newer on disk than what was restored
    restore = state.restore
    damaged = bool(restore.skipped or restore.unusable)
    return tuple(range(committed + 1, restore.newest_on_disk + 1)) if damaged else ()


def _checkpoint_error(
    location: str, state: OnlineStatus, at_risk: tuple[int, ...], spark_last: int | None
) -> OnlineCheckpointError:
    restore = state.restore
    problems = [f"{p}: {why}" for p, why in restore.skipped]
    problems += [f"journal of batch {b}: {why}" for b, why in restore.unusable]
    committed = state.committed
    base = f"the state after batch {committed}" if committed >= 0 else "the initial variables"
    ids = ", ".join(map(str, at_risk[:20])) + (" ..." if len(at_risk) > 20 else "")
    log_note = (
        f"Spark's commit log under {location}/commits ends at batch {spark_last}"
        if spark_last is not None
        else "files newer than the restored state are damaged"
    )
    return OnlineCheckpointError(
        f"the online checkpoint under {location}/hybrid_iter cannot restore micro-batches "
        f"[{ids}] ({len(at_risk)} batch(es)): {log_note}, but the newest state that could "
        f"be restored is {base}"
        + (f" ({'; '.join(problems)})" if problems else " (the files are missing)")
        + ". Continuing would skip them silently. Choose: put the files back (e.g. from a "
        "backup) and restart; or accept the loss with OnlineConfig("
        "on_corrupt_checkpoint='reset'), which continues from "
        + base
        + " and reports the lost ids in progress.lost_batches; or start over with a new "
        "checkpoint_location.",
        at_risk,
    )


def iterate_unbounded_streams(
    init_variables: Mapping[str, Any],
    data_streams: ReplayableDataStreamList,
    body: IterationBody,
    config: OnlineConfig | IterationConfig | None = None,
) -> OnlineIteration:
    """Start an online iteration over a streaming DataFrame; returns its handle (driver)."""
    cfg = _online_config(config)
    if not isinstance(body, IterationBody):
        raise IterationConfigError(
            f"body must be a hybrid_iter.IterationBody, got {type(body).__name__}"
        )
    if body.has_criteria:
        raise IterationConfigError(
            "an unbounded iteration has no termination criteria (it runs until stopped); "
            "remove IterationBody(criteria=...)"
        )
    if body.per_round_partition is not None:
        raise IterationConfigError(
            "for_each_round does not apply online: every partition operator already lives for "
            "one micro-batch"
        )
    if getattr(body, "feedback_combine", None) is not None:
        raise IterationConfigError(
            "IterationBody(feedback_combine=...) is for bounded sync iterations; an online "
            "iteration applies each batch's feedback as it arrives: remove feedback_combine"
        )
    stream = _the_stream(data_streams)
    try:
        variables = normalize_variables(init_variables, what="init_variables")
    except TypeError as ex:
        raise IterationConfigError(str(ex)) from ex
    check_finite_variables(variables)
    df = stream.df
    if stream.numeric_columns:
        stream.validate(0, streaming=True)
    spark = df.sparkSession
    if cfg.checkpoint_location is not None:  # Spark writes its own files there: can it?
        require_spark_filesystem(
            spark,
            cfg.checkpoint_location,
            what="OnlineConfig.checkpoint_location",
            error=IterationConfigError,
        )
    parquet = _parquet_source(df) if cfg.parquet_reader == "arrow" else None
    arrow_schema = None
    if parquet is not None:
        from spark_ops._spark_compat import to_arrow_schema

        try:
            arrow_schema = to_arrow_schema(parquet[2])
            _filesystem(parquet[0])  # a filesystem pyarrow cannot open: Spark reads
        except Exception as ex:
            log.warning("the Parquet source %s is read by Spark (%s)", parquet[0], ex)
            parquet = None

    from .iterate import _fingerprint, _ray_address

    address = _ray_address(spark)
    connect(address, namespace=NAMESPACE)
    import ray

    name = f"hybrid_iter.online.{cfg.name or 'iteration'}.{uuid.uuid4().hex[:12]}"
    meter = online_meter(cfg.name or "iteration", name.rsplit(".", 1)[1], cfg.staleness)
    checkpoint = None
    dead_letter_path = cfg.dead_letter_path
    location = None
    if cfg.checkpoint_location is not None:
        # Spark keeps its offsets and commits there (in its spelling), we keep ours under
        # <location>/hybrid_iter through pyarrow
        here = storage_uri.parse(cfg.checkpoint_location, error=IterationConfigError)
        location = here.uri
        checkpoint = CheckpointSpec(
            uri=here.join("hybrid_iter").uri,
            every_epochs=1,
            keep_last=cfg.keep_last,
            fingerprint={**_fingerprint(body, data_streams, variables, 0), "online": True},
            restore=True,
        )
        dead_letter_path = dead_letter_path or here.join("dead_letter").uri
    spec = CoordinatorSpec(
        num_subtasks=1,
        num_streams=1,
        staleness=cfg.staleness,
        max_epochs=None,
        has_criteria=False,
        init_variables=variables,
        operators=dumps(
            (body.coordinator, None, list(body.coordinator_listeners)),
            "the coordinator operator or a listener",
        ),
        inline_limit=cfg.inline_variables_bytes,
        progress_tag=cfg.progress_tag,
        checkpoint=checkpoint,
    )
    actor = launch(actor_class(OnlineCoordinator), name, spec)
    state = ray.get(actor.online_state.remote())
    if state.failures:
        kill(actor, "the online coordinator")
        failure = state.failures[0]
        raise IterationConfigError(
            f"the online coordinator could not start: {failure}"
        ) from failure
    lost: tuple[int, ...] = ()
    if location is not None:
        spark_last = _spark_last_commit(location)
        lost = _at_risk(state, spark_last)
        if lost and cfg.on_corrupt_checkpoint == "fail":
            kill(actor, "the online coordinator")
            raise _checkpoint_error(location, state, lost, spark_last)
        if lost:
            log.warning(
                "online iteration %s: on_corrupt_checkpoint='reset': micro-batches %s are "
                "lost (Spark committed them; the restored state is after batch %d)",
                cfg.name or "online",
                list(lost),
                state.committed,
            )
    resumed = state.committed >= 0
    where: dict[str, Any] = {
        "committed": state.committed,
        "round": state.round,
        "redelivered": False,
        "newest_file": None,  # modification time of the newest file trained on (lag)
    }
    plan = _OnlinePlan(
        ray_address=address,
        namespace=NAMESPACE,
        actor_name=name,
        operator=dumps(body.partition, f"the partition operator {type(body.partition).__name__}"),
        staleness=cfg.staleness,
        numeric_columns=tuple(stream.numeric_columns or ()),
        dead_letter_path=dead_letter_path,
        arrow_schema=arrow_schema,
        batch_rows=int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")),
        call_timeout=float(cfg.call_timeout),
    )
    buffer: deque = deque(maxlen=10_000)
    from .progress import ProgressPrinter

    printer = ProgressPrinter(cfg.progress, label=cfg.name or "online")
    lock = threading.Lock()
    stopping = threading.Event()
    #: the IterationFailedError a micro-batch raised: Spark hands it to the user only as
    #: text inside its StreamingQueryException, the handle raises the object itself
    failed: list[IterationFailedError] = []
    watch = _FailureWatch(spark, actor, name)
    describe = functools.partial(
        online_description, cfg.name or "iteration", "sync" if cfg.staleness == 0 else "async"
    )

    def on_batch(batch_df: Any, batch_id: int) -> None:
        # never block on the lock while stop() drains: stop() holds it across query.stop(),
        # which waits for this very call to return
        while not lock.acquire(timeout=0.05):
            if stopping.is_set():
                raise RuntimeError(_STOPPING)
        try:
            if stopping.is_set():
                raise RuntimeError(_STOPPING)  # not run, not committed: replayed later
            _one_batch(batch_df, int(batch_id))
        except IterationFailedError as ex:
            failed.append(ex)
            raise
        finally:
            lock.release()

    def _deliver(batch_id: int, records: list[OutputRecord]) -> None:
        buffer.extend(records)
        if records and cfg.output_path is not None:
            _write_outputs(cfg.output_path, batch_id, records)
        if records and cfg.on_outputs is not None:
            cfg.on_outputs(batch_id, records)

    def _one_batch(batch_df: Any, batch_id: int) -> None:
        if batch_id <= where["committed"]:
            # Spark replays a batch whose update is already applied: exactly once. If it is
            # the last one we committed, the driver may have died before delivering its
            # outputs: deliver them again (the output file is rewritten in place).
            if batch_id == where["committed"] and not where["redelivered"]:
                where["redelivered"] = True
                last_id, records = ray.get(actor.last_outputs.remote())
                if last_id == batch_id:
                    _deliver(batch_id, records)
            return
        started = time.perf_counter()
        bad: list[dict[str, Any]] = []
        with (
            watch.batch(batch_id, f"{name}.batch-{batch_id}"),
            job_description(spark.sparkContext, describe(batch_id)),
        ):
            if parquet is not None:
                results = _run_files(batch_df, batch_id, bad)
            else:
                frame = batch_df
                if cfg.parallelism is not None:
                    frame = frame.repartition(cfg.parallelism)
                # one pass: the tasks split off malformed rows, train on the rest, and report
                fn = _partial_run(plan, batch_id, where["round"])
                rows_out = frame.mapInArrow(fn, "result binary").collect()
                results = [pickle.loads(r[0]) for r in rows_out]
        rows = sum(r["rows"] for r in results)
        dead = sum(r["dead"] for r in results)
        for r in results:
            bad.extend(r.get("bad_files", ()))
        if bad:
            for b in bad:
                log.warning(
                    "micro-batch %d: file %s rejected: %s", batch_id, b["path"], b["reason"]
                )
            if dead_letter_path is not None:
                _write_bad_files(dead_letter_path, batch_id, bad)
        commit = ray.get(actor.commit_batch.remote(batch_id, rows, dead, len(bad)))
        if commit.failure is not None:
            failures = _recorded_failures(actor) or [commit.failure]
            raise _batch_failed(batch_id, failures) from failures[0]
        if commit.applied:
            where["committed"], where["round"] = batch_id, commit.round
        _deliver(batch_id, commit.outputs)
        if commit.applied:
            meter.batch_seconds(time.perf_counter() - started)
        if printer.enabled:
            s = ray.get(actor.online_state.remote())
            printer.update_online(s, time.perf_counter() - started)
        if cfg.hooks is not None:
            cfg.hooks.after_batch(batch_id, resumed=resumed)

    def _run_files(batch_df: Any, batch_id: int, bad: list[dict[str, Any]]) -> list[dict]:
        """A Parquet source's micro-batch: footers checked here, shares read by tasks."""
        assert arrow_schema is not None
        listed = batch_df.select("path", "modificationTime").collect()
        paths = sorted(r[0] for r in listed)
        files: list[tuple[str, list[int]]] = []
        for path in paths:
            try:
                files.append((path, _file_row_groups(path, arrow_schema)))
            except Exception as ex:
                bad.append({"path": path, "reason": f"{type(ex).__name__}: {ex}"})
        stamps = [r[1].timestamp() for r in listed if r[1] is not None]
        if stamps:  # for the lag: files newer than this one are still waiting
            where["newest_file"] = max(stamps)
        tasks = cfg.parallelism or spark.sparkContext.defaultParallelism
        shares = _assign(files, tasks) if files else []
        if not shares:  # nothing readable: the round still closes (counts, watermark)
            return []
        fn = _share_run(plan, batch_id, where["round"])
        rdd = spark.sparkContext.parallelize(shares, len(shares))
        return [pickle.loads(b) for b in rdd.mapPartitions(fn).collect()]

    writer_df = df
    if parquet is not None:
        path, options, _ = parquet
        writer_df = (
            spark.readStream.format("binaryFile")
            .schema(_BINARY_FILE_SCHEMA)
            .options(**{k: v for k, v in options.items() if k.lower() != "path"})
            .load(path)
            .select("path", "modificationTime")
        )
    writer = writer_df.writeStream.foreachBatch(on_batch).queryName(name.replace(".", "_"))
    if cfg.checkpoint_location is not None:
        writer = writer.option("checkpointLocation", storage_uri.spark_uri(cfg.checkpoint_location))
    if cfg.trigger:
        writer = writer.trigger(**dict(cfg.trigger))
    try:
        query = writer.start()
    except Exception:
        kill(actor, "the online coordinator")
        raise
    files_waiting = None
    if parquet is not None:
        source_path, source_options = parquet[0], parquet[1]

        def files_waiting() -> int | None:
            newest = where.get("newest_file")
            if newest is None:
                return None
            return _files_newer_than(source_path, source_options, newest)

    return OnlineIteration(
        query,
        actor,
        spark,
        cfg,
        buffer,
        lock,
        stopping,
        lost,
        files_waiting=files_waiting,
        failed=failed,
        meter=meter,
    )


def _batch_failed(batch_id: int, failures: list[Any]) -> IterationFailedError:
    """The error of micro-batch ``batch_id`` from the failures the coordinator recorded
    (the first is the cause; one per partition, or "coordinator")."""
    by_source: dict[int | str, BaseException] = {}
    for f in failures:
        by_source.setdefault(f.source, f)
    return IterationFailedError(
        f"the online iteration failed in micro-batch {batch_id}: {failures[0]}", by_source
    )


def _recorded_failures(actor: Any) -> list[Any]:
    """The failures the coordinator recorded ([] when it cannot say: it is gone)."""
    import ray

    try:
        return list(ray.get(actor.online_state.remote(), timeout=30).failures)
    except Exception:
        return []


#: the local properties ``SparkContext.setJobGroup`` sets on the calling thread
class _FailureWatch:
    """The driver's watch over an online iteration's micro-batches: one daemon thread
    per iteration long-polls the coordinator (one call per 5 s, off every batch's path)
    and, as soon as a failure is recorded (a callback raised, or a task's watchdog
    reported a stuck one), cancels the Spark jobs of the micro-batch in progress (by
    their job tag), as the bounded path's monitor does: a task stuck in a callback never
    returns by itself. ``batch`` runs one micro-batch's Spark jobs under the tag."""

    def __init__(self, spark: Any, actor: Any, name: str) -> None:
        self._spark, self._actor = spark, actor
        self._lock = threading.Lock()
        self._tag: JobTag | None = None
        self._failed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while True:
            try:
                # returns at a failure or after 5 s; raises once the coordinator is gone
                p = ray.get(
                    self._actor.wait_progress.remote(sys.maxsize, 5.0, False, sys.maxsize),
                    timeout=60,
                )
            except Exception:
                return  # the iteration was stopped (or its coordinator died)
            if p.failed:
                with self._lock:
                    self._failed, tag = True, self._tag
                if tag is not None:
                    tag.cancel()
                return

    @contextmanager
    def batch(self, batch_id: int, tag_name: str) -> Iterator[None]:
        """Run micro-batch ``batch_id``'s Spark jobs (in ``foreachBatch``) under job tag
        ``tag_name``, which the watch cancels on a failure.

        When a job fails and the coordinator holds a failure (a task reported the
        callback that raised, or a ``CallTimeout``), raise ``IterationFailedError`` naming
        the partition, the micro-batch and the method; without one (an executor died,
        ...), Spark's own error goes on unchanged. After a failure no batch starts."""
        tag = JobTag(self._spark, tag_name)
        with self._lock:  # either the watch sees this tag, or this batch sees the failure
            self._tag, failed = tag, self._failed
        try:
            with tag.on_this_thread(f"hybrid_iter online micro-batch {batch_id}"):
                if failed:
                    failures = _recorded_failures(self._actor)
                    if failures:
                        raise _batch_failed(batch_id, failures) from failures[0]
                yield
        except IterationFailedError:
            raise
        except Exception:
            failures = _recorded_failures(self._actor)
            if not failures:
                raise
            raise _batch_failed(batch_id, failures) from failures[0]
        finally:
            with self._lock:
                self._tag = None


def _partial_run(
    plan: _OnlinePlan, batch_id: int, round_: int
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return _run_partition(plan, batch_id, round_, batches)

    return run


def _share_run(
    plan: _OnlinePlan, batch_id: int, round_: int
) -> Callable[[Iterator[list[tuple[str, int, int, int]]]], Iterator[bytes]]:
    """The task function of a Parquet micro-batch: one share per RDD partition."""

    def run(shares: Iterator[list[tuple[str, int, int, int]]]) -> Iterator[bytes]:
        share = [piece for s in shares for piece in s]
        bad: list[dict[str, Any]] = []
        batches = _read_share(plan, share, bad)
        for out in _run_partition(plan, batch_id, round_, batches, bad):
            yield out.column(0)[0].as_py()

    return run


def _online_config(config: Any) -> OnlineConfig:
    if config is None:
        return OnlineConfig()
    if isinstance(config, OnlineConfig):
        return config
    if isinstance(config, IterationConfig):
        return OnlineConfig.from_iteration_config(config)
    raise IterationConfigError(
        f"config must be an OnlineConfig (or IterationConfig), got {type(config).__name__}"
    )


def _the_stream(data_streams: Any) -> Any:
    if _is_dataframe(data_streams):
        raise IterationConfigError(
            "data_streams must be a ReplayableDataStreamList; wrap the streaming DataFrame: "
            "hi.ReplayableDataStreamList.not_replay(stream_df)"
        )
    if not isinstance(data_streams, ReplayableDataStreamList) or len(data_streams) == 0:
        raise IterationConfigError(
            "data_streams must be a non-empty ReplayableDataStreamList of streaming DataFrames"
        )
    if data_streams.any_replayed:
        raise IterationConfigError(
            "an unbounded stream cannot be replayed (every record is seen once); use not_replay"
        )
    if len(data_streams) != 1:
        raise IterationConfigError(
            f"an online iteration takes one streaming DataFrame, got {len(data_streams)}; "
            f"union them first (same schema) or add a stream column"
        )
    stream = data_streams.streams[0]
    if not stream.df.isStreaming:
        raise IterationConfigError(
            "iterate_unbounded_streams needs a streaming DataFrame (spark.readStream...); for "
            "bounded data use iterate_bounded_streams_until_termination"
        )
    return stream
