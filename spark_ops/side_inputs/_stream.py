"""Evolving side inputs: a streaming main input gated on streaming side inputs.

Runs on the driver; the user function still runs in Spark tasks. One Structured
Streaming query per streaming side input and one for the main input, all with
``foreachBatch`` callbacks into one ``SideInputQuery``:

* A side micro-batch makes a new version of its view. Broadcast views are folded on
  the driver into a copy of their content and published as a new broadcast variable;
  keyed views are written by Spark tasks to the key-group store (``_side_store``) and
  published as a new ``KeyedSource``. Publishing swaps the snapshot under the
  processing lock, so a main micro-batch sees one version of each view for all its
  records, never a half-applied one.
* A main micro-batch runs, under the same lock, against the current snapshot
  (``mapInArrow`` over the batch, output to the sink) if its side inputs are ready;
  otherwise its records go to the ``RecordBuffer``, per window namespace (memory up to
  a budget, then Parquet files). A view is ready once its first data arrived (for a
  windowed view: once the window matching the main window has data).
* When a version makes a namespace ready, its buffered records are read back by Spark
  and processed before any later main record, then deleted.
* A monitor thread fails the query with ``SideInputNotReadyError`` when records waited
  longer than ``ready_timeout``, and surfaces a failed Spark query.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa

import storage_uri

from .._hadoop import require_spark_filesystem
from ._buffer import RecordBuffer
from ._content import duplicate_error, match_window, namespaces_of
from ._errors import SideInputConfigError, SideInputError, SideInputNotReadyError
from ._plan import MainSpec, col, collect_arrow, fold_side, layout_columns, run_on
from ._store import SUMMARY_SCHEMA, Delta, KeyedSource, delta_dir, write_delta_task
from ._task import BUCKET, OpPlan
from ._views import SideInput, _ViewSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["BatchRecord", "SideInputQuery", "SideInputStream"]

Namespace = tuple[int, int] | None

#: How often the monitor thread checks timeouts and the Spark queries (seconds).
_POLL = 0.1


@dataclass(frozen=True)
class BatchRecord:
    """One output batch handed to the sink: where its records came from and which
    version of each view they saw."""

    output_batch: int
    source: str  # "main" (a main micro-batch) or "buffer" (released buffered records)
    main_batch: int | None  # the main micro-batch id (None for released records)
    namespaces: tuple[Namespace, ...]
    versions: Mapping[str, int]
    rows: int | None  # known for released records; None for a direct main micro-batch


def _distinct_windows(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Runs in a Spark task: the distinct (start, end) of a partition's window column."""
    seen: set[tuple[int, int]] = set()
    for b in batches:
        seen.update(w for w in namespaces_of(b.column(0)) if w is not None)
    if seen:
        s, e = zip(*sorted(seen))
        yield pa.RecordBatch.from_pydict({"s": list(s), "e": list(e)})


class _Repr(str):
    """A key already rendered by a task: shown as is in error messages."""

    def __repr__(self) -> str:
        return str(self)


@dataclass
class _View:
    view: SideInput
    spec: _ViewSpec
    version: int = 0
    content: dict[Any, Any] = field(default_factory=dict)  # broadcast views
    deltas: list[Delta] = field(default_factory=list)  # keyed views
    windows: set[tuple[int, int]] = field(default_factory=set)  # windows with data
    bcast: Any = None
    query: Any = None


class SideInputStream:
    """A streaming operation with side inputs, not started: ``start()`` runs it.

    Returned by ``with_side_inputs(streaming_df, ...).map/filter/map_partition``.
    """

    def __init__(
        self,
        main: DataFrame,
        spec: MainSpec,
        views: Sequence[SideInput],
        plan: OpPlan,
        out_struct: Any,
    ) -> None:
        self.main = main
        self.main_spec = spec
        self.views = tuple(views)
        self.plan = plan
        self.schema = out_struct

    def start(
        self,
        foreach_batch: Callable[[DataFrame, int], Any] | None = None,
        *,
        format: str | None = None,
        path: str | None = None,
        options: Mapping[str, str] | None = None,
        ready_timeout: float | None = None,
        buffer_memory: int = 64 << 20,
        work_dir: str | None = None,
        key_groups: int = 32,
        trigger_interval: str | None = None,
        name: str | None = None,
    ) -> SideInputQuery:
        """Start the side and main queries; returns the running ``SideInputQuery``.

        The output goes to ``foreach_batch(df, batch_id)`` (a bounded DataFrame per output
        batch, to be consumed within the call, as with Spark's foreachBatch) or is
        appended with ``df.write.format(format).options(**options).save(path)``.
        ``ready_timeout`` (seconds, None = wait forever): how long records may wait for
        a side input. ``buffer_memory``: bytes of waiting records kept in driver memory
        before spilling to ``work_dir``. ``work_dir`` (checkpoints, buffer, keyed store;
        a temporary directory, deleted on stop, by default) must be reachable by every
        executor on a cluster. ``key_groups``: the key groups keyed views are stored in.
        """
        if (foreach_batch is None) == (format is None):
            raise SideInputConfigError(
                "start() needs one sink: foreach_batch=fn(df, batch_id) or format='parquet' "
                "(with path=...)"
            )
        if foreach_batch is not None and not callable(foreach_batch):
            raise SideInputConfigError(
                f"start(): foreach_batch must be a callable (df, batch_id), got "
                f"{type(foreach_batch).__name__}"
            )
        if format is not None and not isinstance(format, str):
            raise SideInputConfigError(f"start(): format must be a string, got {format!r}")
        if ready_timeout is not None and (
            isinstance(ready_timeout, bool)
            or not isinstance(ready_timeout, int | float)
            or ready_timeout <= 0
        ):
            raise SideInputConfigError(
                f"start(): ready_timeout must be a positive number of seconds or None (wait "
                f"forever), got {ready_timeout!r}"
            )
        if (
            isinstance(buffer_memory, bool)
            or not isinstance(buffer_memory, int)
            or buffer_memory < 0
        ):
            raise SideInputConfigError(
                f"start(): buffer_memory must be an int >= 0 (bytes), got {buffer_memory!r}"
            )
        if isinstance(key_groups, bool) or not isinstance(key_groups, int) or key_groups < 1:
            raise SideInputConfigError(
                f"start(): key_groups must be an int >= 1, got {key_groups!r}"
            )
        if work_dir is not None:
            # Spark keeps the queries' checkpoints there: no pyarrow-only URI options, and
            # a scheme Spark's Hadoop opens (asked before any query starts)
            storage_uri.check(
                work_dir, what="start(): work_dir", error=SideInputConfigError, spark_reads=True
            )
            require_spark_filesystem(
                self.main.sparkSession,
                work_dir,
                what="start(): work_dir",
                error=SideInputConfigError,
            )
        if trigger_interval is not None and not isinstance(trigger_interval, str):
            raise SideInputConfigError(
                f"start(): trigger_interval must be a string such as '1 second', got "
                f"{trigger_interval!r}"
            )
        query = SideInputQuery(
            self,
            foreach_batch=foreach_batch,
            sink_format=format,
            sink_path=path,
            sink_options=dict(options or {}),
            ready_timeout=ready_timeout,
            buffer_memory=buffer_memory,
            work_dir=work_dir,
            key_groups=key_groups,
            trigger_interval=trigger_interval,
            name=name or f"side_inputs_{uuid.uuid4().hex[:8]}",
        )
        query._start()
        return query


class SideInputQuery:
    """A running streaming operation with side inputs (the driver's handle on it).

    ``process_all_available()``, ``await_termination()`` and ``stop()`` as on a Spark
    ``StreamingQuery``; ``ready`` / ``wait_until_ready()`` / ``status()`` show the ready
    condition, the views' versions and the buffer; ``history`` lists each output batch
    with the versions its records saw. Errors of the runtime (a side input never ready,
    two values for a singleton, a failed query) are raised by these methods with their
    original type.
    """

    def __init__(
        self,
        stream: SideInputStream,
        *,
        foreach_batch: Callable[[DataFrame, int], Any] | None,
        sink_format: str | None,
        sink_path: str | None,
        sink_options: dict[str, str],
        ready_timeout: float | None,
        buffer_memory: int,
        work_dir: str | None,
        key_groups: int,
        trigger_interval: str | None,
        name: str,
    ) -> None:
        self._stream = stream
        self._spark = stream.main.sparkSession
        self._foreach_batch = foreach_batch
        self._sink_format = sink_format
        self._sink_path = sink_path
        self._sink_options = sink_options
        self.ready_timeout = ready_timeout
        self.key_groups = key_groups
        self._trigger = trigger_interval
        self.name = name
        self._own_dir = work_dir is None
        self._where = storage_uri.parse(
            work_dir or tempfile.mkdtemp(prefix="side_inputs_"),
            what="start(): work_dir",
            error=SideInputConfigError,
        )
        self.work_dir = self._where.uri
        #: the keyed views' store (written and read through pyarrow by Spark tasks)
        self._state = self._where.join("state").uri
        self.buffer = RecordBuffer(self._where.join("buffer").uri, memory_budget=buffer_memory)
        self._views = [_View(v, v._spec) for v in stream.views]
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._waiting_since: dict[Namespace, float] = {}
        self._failure: BaseException | None = None
        self._done = threading.Event()
        self._stopping = False
        self._next_output = 0
        self.history: list[BatchRecord] = []
        self._main_query: Any = None
        self._monitor: threading.Thread | None = None
        self._main_schema = stream.main.schema

    # -- public -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once every view has its first data (windowed views: any window)."""
        with self._lock:
            return all(v.version >= 1 for v in self._views)

    def versions(self) -> dict[str, int]:
        """Each view's current version by name (0: no data yet)."""
        with self._lock:
            return {v.spec.name: v.version for v in self._views}

    def status(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            return {
                "name": self.name,
                "ready": all(v.version >= 1 for v in self._views),
                "views": {
                    v.spec.name: {
                        "version": v.version,
                        "ready": v.version >= 1,
                        "keyed": v.spec.keyed,
                        "streaming": v.query is not None,
                        "windows": len(v.windows),
                    }
                    for v in self._views
                },
                "buffer": self.buffer.stats(),
                "waiting": {str(ns): now - t for ns, t in self._waiting_since.items()},
                "output_batches": self._next_output,
            }

    def wait_until_ready(self, timeout: float | None = None) -> bool:
        """Block until ``ready`` (True) or ``timeout`` seconds (False); raise a failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not all(v.version >= 1 for v in self._views):
                self._raise_failure()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(_POLL if left is None else min(left, _POLL))
        self._raise_failure()
        return True

    def process_all_available(self) -> None:
        """Process everything available in the side sources, then in the main source."""
        self._raise_failure()
        for q in [*(v.query for v in self._views if v.query is not None), self._main_query]:
            try:
                q.processAllAvailable()
            except Exception:
                self._raise_failure()
                raise
        self._raise_failure()

    def await_termination(self, timeout: float | None = None) -> bool:
        """Wait until the query stops or fails (raising the failure); False on timeout."""
        finished = self._done.wait(timeout)
        self._raise_failure()
        return finished

    def exception(self) -> BaseException | None:
        return self._failure

    @property
    def is_active(self) -> bool:
        return not self._done.is_set()

    def stop(self) -> None:
        """Stop every query, delete the buffer (and the work directory if it made it)."""
        if self._stopping:
            return
        self._stopping = True
        self._done.set()
        for q in [self._main_query, *(v.query for v in self._views)]:
            if q is not None:
                try:
                    q.stop()
                except Exception:  # a failed query may refuse; it is stopped either way
                    pass
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=10)
        with self._lock:
            for v in self._views:
                if v.bcast is not None:
                    v.bcast.unpersist()
            self.buffer.close()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> SideInputQuery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- start ---------------------------------------------------------------------------------

    def _start(self) -> None:
        try:
            for v in self._views:
                if not v.view.is_streaming:
                    self._side_batch(v, v.view.df, None)  # static: read once, version 1
            for v in self._views:
                if v.view.is_streaming:
                    v.query = self._start_query(
                        v.view.df.writeStream.outputMode(v.spec.output_mode),
                        self._side_callback(v),
                        f"side-{v.spec.name}",
                    )
            self._main_query = self._start_query(
                self._stream.main.writeStream, self._main_callback, "main"
            )
        except BaseException:
            self.stop()
            raise
        self._monitor = threading.Thread(
            target=self._watch, name=f"{self.name}-monitor", daemon=True
        )
        self._monitor.start()

    def _start_query(self, writer: Any, callback: Callable[..., None], role: str) -> Any:
        writer = writer.foreachBatch(callback).option(
            "checkpointLocation", self._where.join("checkpoints", role).spark
        )
        if self._trigger:
            writer = writer.trigger(processingTime=self._trigger)
        return writer.queryName(f"{self.name}-{role}").start()

    def _side_callback(self, v: _View) -> Callable[[DataFrame, int], None]:
        def on_batch(df: DataFrame, batch_id: int) -> None:
            try:
                self._side_batch(v, df, batch_id)
            except BaseException as ex:
                self._fail(ex)
                raise

        return on_batch

    def _main_callback(self, df: DataFrame, batch_id: int) -> None:
        try:
            with self._lock:
                self._release_ready()
                self._main_batch(df, batch_id)
        except BaseException as ex:
            self._fail(ex)
            raise

    # -- side input versions -------------------------------------------------------------------

    def _side_batch(self, v: _View, df: DataFrame, batch_id: int | None) -> None:
        replace = v.spec.output_mode == "complete"
        if v.spec.keyed:
            self._side_keyed(v, df, replace)
            return
        content = {ns: dict(p) if isinstance(p, dict) else p for ns, p in v.content.items()}
        applier = fold_side(v.spec, df, content, replace=replace)  # a copy: v.content intact
        if applier.rows == 0:  # no data is not "first data": readiness and version stay
            return
        with self._changed:
            bcast = self._spark.sparkContext.broadcast(content)
            old, v.bcast, v.content = v.bcast, bcast, content
            v.version += 1
            v.windows = {ns for ns in content if ns is not None}
            if old is not None:
                old.unpersist()  # no main batch runs now (we hold the lock)
            self._changed.notify_all()
            self._release_ready()

    def _side_keyed(self, v: _View, df: DataFrame, replace: bool) -> None:
        from pyspark.sql import functions as F

        spec = v.spec
        version = v.version + 1  # only this view's side query writes its versions
        bucket = F.pmod(F.hash(*[col(k) for k in spec.key]), F.lit(self.key_groups)).alias(BUCKET)
        n = min(self.key_groups, self._spark.sparkContext.defaultParallelism)
        laid = df.select(bucket, *layout_columns(spec)).repartition(n, BUCKET)
        summary = laid.mapInArrow(
            write_delta_task(spec, self._state, version), SUMMARY_SCHEMA
        ).collect()
        fs, base = storage_uri.arrow_filesystem(self._state, error=SideInputConfigError)
        dup = next((r for r in summary if r["dup_key"] is not None), None)
        if dup is not None or not any(r["rows"] for r in summary):
            fs.delete_dir_contents(delta_dir(base, spec.view_id, version), missing_dir_ok=True)
            if dup is not None:
                ns = tuple(dup["dup_window"]) if dup["dup_window"] else None
                raise duplicate_error(spec, ns, _Repr(dup["dup_key"]))
            return
        buckets = frozenset(int(r["bucket"]) for r in summary if r["rows"])
        windows = {tuple(w) for r in summary for w in (r["windows"] or ())}
        with self._changed:
            v.deltas.append(Delta(version, replace, buckets))
            v.version = version
            v.windows = windows if replace else v.windows | windows
            self._changed.notify_all()
            self._release_ready()

    # -- main input ------------------------------------------------------------------------------

    def _unready(self, ns: Namespace) -> list[str]:
        """The views a main record of namespace ``ns`` still waits for (empty: ready)."""
        out = []
        for v in self._views:
            if v.version < 1 or (
                v.spec.window and (ns is None or match_window(sorted(v.windows), ns) is None)
            ):
                out.append(v.spec.name)
        return out

    def _ns_ready(self, ns: Namespace) -> bool:
        return not self._unready(ns)

    def _windowed(self) -> bool:
        return any(v.spec.window for v in self._views)

    def _snapshot_run(self, df: DataFrame) -> tuple[DataFrame, dict[str, int]]:
        broadcast = tuple((v.spec, v.version) for v in self._views if not v.spec.keyed)
        bcasts = {v.spec.view_id: v.bcast for v in self._views if not v.spec.keyed}
        sources = tuple(
            KeyedSource(v.spec, self._state, v.version, tuple(v.deltas))
            for v in self._views
            if v.spec.keyed
        )
        out = run_on(
            df,
            self._stream.plan,
            self._stream.schema,
            self._stream.main_spec,
            broadcast=broadcast,
            bcast=bcasts,
            keyed_sources=sources,
            key_groups=self.key_groups,
        )
        return out, {v.spec.name: v.version for v in self._views}

    def _emit(
        self,
        df: DataFrame,
        source: str,
        main_batch: int | None,
        namespaces: tuple[Namespace, ...],
        rows: int | None,
    ) -> None:
        out, versions = self._snapshot_run(df)
        out_id = self._next_output
        self._next_output += 1
        if self._foreach_batch is not None:
            self._foreach_batch(out, out_id)
        else:
            assert self._sink_format is not None  # start(): foreach_batch or a format
            writer = (
                out.write.format(self._sink_format).mode("append").options(**self._sink_options)
            )
            if self._sink_path:
                writer.save(self._sink_path)
            else:
                writer.save()
        self.history.append(BatchRecord(out_id, source, main_batch, namespaces, versions, rows))

    def _buffer(
        self, df: DataFrame, namespace_of: Callable[[pa.RecordBatch], list[Namespace]] | None
    ) -> None:
        now = time.monotonic()
        for batch in collect_arrow(df, streamed=True):
            if namespace_of is None:
                self.buffer.add(None, batch)
                self._waiting_since.setdefault(None, now)
                continue
            nss = namespace_of(batch)
            for ns in set(nss):
                idx = pa.array([i for i, x in enumerate(nss) if x == ns], pa.int64())
                self.buffer.add(ns, batch.take(idx))
                self._waiting_since.setdefault(ns, now)

    def _main_batch(self, df: DataFrame, batch_id: int) -> None:
        window = self._stream.main_spec.window
        if not self._windowed():
            if self._ns_ready(None):
                self._emit(df, "main", batch_id, (None,), None)
            else:
                self._buffer(df, None)
            return
        from pyspark.sql import functions as F

        assert window is not None
        df.persist()
        try:
            # distinct windows per partition in the tasks: no shuffle for a few windows
            found = df.select(col(window)).mapInArrow(_distinct_windows, "s long, e long").collect()
            wins = sorted({(int(r[0]), int(r[1])) for r in found})
            ready = [ns for ns in wins if self._ns_ready(ns)]
            wkey = F.concat_ws(
                ":", F.unix_micros(col(window)["start"]), F.unix_micros(col(window)["end"])
            )
            keys = [f"{s}:{e}" for s, e in ready]
            if ready:
                part = df if len(ready) == len(wins) else df.filter(wkey.isin(keys))
                self._emit(part, "main", batch_id, tuple(ready), None)
            if len(ready) < len(wins):
                pending = df.filter(~wkey.isin(keys)) if ready else df
                self._buffer(pending, lambda b: namespaces_of(b.column(window)))
        finally:
            df.unpersist()

    def _release_ready(self) -> None:
        """Process (in Spark) and drop every buffered namespace whose side inputs are ready."""
        # the buffer holds records under the window namespaces this query gave it
        for ns in cast("list[Namespace]", self.buffer.namespaces()):
            if not self._ns_ready(ns):
                continue
            files = self.buffer.files(ns)
            rows = self.buffer.num_records(ns)
            df = self._spark.read.schema(self._main_schema).parquet(*files)
            self._emit(df, "buffer", None, (ns,), rows)
            self.buffer.clear(ns)
            self._waiting_since.pop(ns, None)

    # -- failures -------------------------------------------------------------------------------

    def _fail(self, ex: BaseException) -> None:
        with self._changed:
            if self._failure is None and not self._stopping:
                self._failure = ex
            self._changed.notify_all()
        self._done.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _watch(self) -> None:
        """Monitor thread: ready timeouts and queries that died; stops the rest on failure."""
        queries = [self._main_query, *(v.query for v in self._views if v.query is not None)]
        while not self._done.wait(_POLL):
            if self.ready_timeout is not None:
                now = time.monotonic()
                for ns, since in list(self._waiting_since.items()):
                    waited = now - since
                    if waited > self.ready_timeout:
                        self._fail(self._not_ready(ns, waited))
                        break
            for q in queries:
                if self._done.is_set():
                    break
                try:
                    active = q.isActive
                    err = None if active else q.exception()
                except Exception as ex:  # the JVM side went away
                    active, err = False, ex
                if not active and not self._stopping:
                    self._fail(
                        err
                        if err is not None
                        else SideInputError(f"streaming query {q.name!r} of {self.name!r} stopped")
                    )
        if self._failure is not None and not self._stopping:
            for q in queries:
                try:
                    q.stop()
                except Exception:
                    pass

    def _not_ready(self, ns: Namespace, waited: float) -> SideInputNotReadyError:
        with self._lock:
            names = tuple(self._unready(ns))
            rows = self.buffer.num_records(ns)
        where = "" if ns is None else f" for main window {ns}"
        return SideInputNotReadyError(
            f"side input(s) {list(names)} of {self.name!r} not ready after {waited:.1f}s "
            f"(ready_timeout={self.ready_timeout}){where}: {rows} main record(s) are waiting "
            f"for their first data; check the side source, or raise ready_timeout",
            names,
            waited,
        )
