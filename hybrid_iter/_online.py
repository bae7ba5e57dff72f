"""``iterate_unbounded_streams``: online iterations on Spark Structured Streaming.

Runs on the driver (the ``foreachBatch`` function) and in Spark tasks (one per micro-batch
partition). Every micro-batch is one round: its rows are split into good rows and
malformed ones (null or NaN in a declared numeric column, which go to a dead-letter
path), the good rows run through fresh partition operators (``process_variables`` with
the newest variables, ``process_data``, then ``on_epoch_watermark_incremented(round)``),
whose emissions reach the coordinator keyed by ``(batch_id, partition)``; then the driver
commits the batch. Sync: the commit applies the batch's feedback in partition order
against the one variables version the batch saw; async: feedback is applied as it
arrives and partitions refresh the variables between Arrow batches. A replayed batch id
is ignored (exactly-once with ``checkpoint_location``). Data records carry epoch MAX: only
the variables advance, one round per micro-batch, and the iteration ends only when it is
stopped.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from coordinator import (
    CheckpointSpec,
    CoordinatorSpec,
    OnlineCoordinator,
    OutputRecord,
    Progress,
    normalize_variables,
)

from ._body import IterationBody
from ._config import IterationConfig, OperatorLifecycle, _check_uri, _is_int
from ._errors import IterationConfigError, IterationFailedError
from ._ray_util import NAMESPACE, connect
from ._shipping import dumps
from ._streams import ReplayableDataStreamList, _is_dataframe
from ._task import PartitionCollector, PartitionContext, _coordinator, _resolve

__all__ = [
    "EPOCH_MAX",
    "OnlineConfig",
    "OnlineIteration",
    "OnlineProgress",
    "iterate_unbounded_streams",
]

log = logging.getLogger("hybrid_iter")

#: the epoch of every data record of an unbounded iteration (it never moves a watermark)
EPOCH_MAX = sys.maxsize


@dataclass(frozen=True, kw_only=True)
class OnlineConfig:
    """How an online iteration runs (all keyword-only).

    * ``staleness``: ``0`` sync (one lock-step round per micro-batch against one variables
      version) or ``None`` async (partitions' feedback applied as it arrives).
    * ``checkpoint_location``: Spark's checkpoint location of the query; the coordinator
      persists its state under ``<location>/hybrid_iter`` at every committed micro-batch,
      so a restarted query or driver continues exactly once.
    * ``trigger``: keyword arguments of ``DataStreamWriter.trigger`` (e.g.
      ``{"processingTime": "2 seconds"}`` or ``{"availableNow": True}``); None: as fast
      as data comes.
    * ``dead_letter_path``: where malformed records go (JSON, one directory per batch);
      None: ``<checkpoint_location>/dead_letter`` when there is a location, else they are
      only counted.
    * ``output_path``: output records as JSON lines, one file per batch; ``on_outputs``: a
      driver-side callback ``(batch_id, records)``.
    * ``parallelism``: repartition every micro-batch to this many tasks (None: as it comes).
    """

    staleness: int | None = 0
    checkpoint_location: str | None = None
    trigger: Mapping[str, Any] | None = None
    dead_letter_path: str | None = None
    output_path: str | None = None
    on_outputs: Callable[[int, list[OutputRecord]], None] | None = None
    parallelism: int | None = None
    progress: bool | None = None
    progress_tag: str = "loss"
    inline_variables_bytes: int = 64 * 1024
    name: str | None = None
    #: fault injection for tests: the driver process exits right after committing this
    #: batch id, before Spark commits it (once: not when resuming)
    kill_driver_after_batch: int | None = None

    def __post_init__(self) -> None:
        if self.staleness not in (0, None):
            raise IterationConfigError(
                f"OnlineConfig.staleness must be 0 (sync: one round per micro-batch) or None "
                f"(async), got {self.staleness!r}; bounded staleness has no meaning when "
                f"micro-batches run one after another"
            )
        for field in ("checkpoint_location", "dead_letter_path", "output_path"):
            if getattr(self, field) is not None:
                _check_uri(f"OnlineConfig.{field}", getattr(self, field))
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
        )


@dataclass(frozen=True)
class OnlineProgress:
    """Where an online iteration is: micro-batches committed, rows trained on, malformed
    rows sent to the dead-letter path, the epoch watermark (rounds completed - 1), the
    newest ``progress_tag`` output, the variables version and the last batch id."""

    batches: int
    rows: int
    dead_letters: int
    epoch_watermark: int
    last_loss: Any
    version: int
    last_batch_id: int
    last_commit: float | None


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


def _run_partition(
    plan: _OnlinePlan, batch_id: int, round_: int, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """One micro-batch partition through a fresh partition operator (a Spark task)."""
    import cloudpickle
    import ray
    from pyspark import TaskContext

    tc = TaskContext.get()
    pid = tc.partitionId() if tc is not None else 0
    coord = _coordinator(plan)  # type: ignore[arg-type]
    ctx = PartitionContext(pid, -1, plan.staleness)
    ctx.epoch = round_
    ctx.batch_id = batch_id  # type: ignore[attr-defined]
    ctx.data_epoch = EPOCH_MAX  # type: ignore[attr-defined]
    out = PartitionCollector(False)
    op = cloudpickle.loads(plan.operator)
    rows = 0
    dead: list[pa.RecordBatch] = []
    try:
        op.open(ctx)
        payload = ray.get(coord.variables.remote(-1))
        ctx.variables_version = payload.version
        op.process_variables(_resolve(payload), ctx, out)
        for batch in batches:
            if plan.numeric_columns:
                batch, bad = _split_malformed(batch, plan.numeric_columns)
                if bad.num_rows:
                    dead.append(bad)
                if not batch.num_rows:
                    continue
            if plan.staleness is None:  # async: the newest variables before each batch
                newer = ray.get(coord.variables.remote(ctx.variables_version))
                if newer is not None:
                    ctx.variables_version = newer.version
                    op.process_variables(_resolve(newer), ctx, out)
            rows += batch.num_rows
            op.process_data(0, batch, ctx, out)
        if rows:
            op.on_epoch_watermark_incremented(round_, ctx, out)
        if dead and plan.dead_letter_path is not None:
            _write_dead_letters(plan.dead_letter_path, batch_id, pid, dead)
        ray.get(coord.online_report.remote(batch_id, pid, out._em))
    finally:
        try:
            op.close()
        except Exception:
            pass  # close() must not hide the task's own outcome
    summary = {"partition": pid, "rows": rows, "dead": sum(b.num_rows for b in dead)}
    yield pa.RecordBatch.from_pydict({"result": [pickle.dumps(summary)]})


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


def _write_dead_letters(path: str, batch_id: int, pid: int, batches: list[pa.RecordBatch]) -> None:
    """Malformed rows of one batch and partition as Parquet (a replay rewrites the file)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, base = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)
    directory = f"{base.rstrip('/')}/batch_id={batch_id}"
    fs.create_dir(directory, recursive=True)
    final = f"{directory}/part-{pid:05d}.parquet"
    tmp = f"{directory}/.part-{pid:05d}.tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp) as f:
        pq.write_table(pa.Table.from_batches(batches), f)
    fs.move(tmp, final)


class OnlineIteration:
    """A running online iteration: a Structured Streaming query plus its coordinator.

    ``stop()``, ``await_termination(timeout)``, ``latest_variables()``, ``progress``,
    ``outputs`` (the newest output records), ``outputs_stream()`` (a streaming DataFrame
    over ``output_path``). A context manager: leaving the block stops it.
    """

    def __init__(
        self, query: Any, actor: Any, spark: Any, config: OnlineConfig, buffer: deque
    ) -> None:
        self.query = query
        self._actor = actor
        self._spark = spark
        self._config = config
        self._buffer = buffer
        self._stopped = False

    def latest_variables(self) -> dict[str, Any]:
        """The newest published variables."""
        import ray

        return ray.get(self._actor.latest_variables.remote())

    @property
    def progress(self) -> OnlineProgress:
        import ray

        s = ray.get(self._actor.online_state.remote())
        return OnlineProgress(
            batches=s["batches"],
            rows=s["rows"],
            dead_letters=s["dead_letters"],
            epoch_watermark=s["round"] - 1,
            last_loss=s["last_loss"],
            version=s["version"],
            last_batch_id=s["committed"],
            last_commit=s["last_commit"],
        )

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
        """Wait for the query to end (``availableNow`` triggers end by themselves)."""
        if timeout is None:
            self.query.awaitTermination()
            return True
        return bool(self.query.awaitTermination(timeout))

    def exception(self) -> Any:
        return self.query.exception()

    def stop(self) -> None:
        """Stop the query, then the coordinator (its state is persisted at every commit)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.query.stop()
        finally:
            import ray

            try:
                ray.kill(self._actor, no_restart=True)
            except Exception as ex:  # pragma: no cover - best effort
                log.warning("could not kill the online coordinator: %s", ex)

    def __enter__(self) -> OnlineIteration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _write_outputs(path: str, batch_id: int, records: list[OutputRecord]) -> None:
    import pyarrow.fs as pafs

    fs, base = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)
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


def iterate_unbounded_streams(
    init_variables: Mapping[str, Any],
    data_streams: ReplayableDataStreamList,
    body: IterationBody,
    config: OnlineConfig | IterationConfig | None = None,
) -> OnlineIteration:
    """Start an online iteration over a streaming DataFrame; returns its handle."""
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
    stream = _the_stream(data_streams)
    try:
        variables = normalize_variables(init_variables, what="init_variables")
    except TypeError as ex:
        raise IterationConfigError(str(ex)) from ex
    df = stream.df
    if stream.numeric_columns:
        stream.validate(0, streaming=True)
    spark = df.sparkSession

    from ._iterate import _fingerprint, _ray_address

    address = _ray_address(spark)
    connect(address, namespace=NAMESPACE)
    import ray

    name = f"hybrid_iter.online.{cfg.name or 'iteration'}.{uuid.uuid4().hex[:12]}"
    checkpoint = None
    dead_letter_path = cfg.dead_letter_path
    if cfg.checkpoint_location is not None:
        location = cfg.checkpoint_location.rstrip("/")
        checkpoint = CheckpointSpec(
            uri=f"{location}/hybrid_iter",
            every_epochs=1,
            keep_last=2,
            fingerprint={**_fingerprint(body, data_streams, variables, 0), "online": True},
            restore=True,
        )
        dead_letter_path = dead_letter_path or f"{location}/dead_letter"
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
    from ._placement import coordinator_actor_options  # the head node, unless configured

    actor = (
        ray.remote(num_cpus=0, max_restarts=0, **coordinator_actor_options())(OnlineCoordinator)
        .options(name=name, namespace=NAMESPACE)
        .remote(spec)
    )
    state = ray.get(actor.online_state.remote())
    if state["failures"]:
        ray.kill(actor)
        failure = state["failures"][0]
        raise IterationConfigError(
            f"the online coordinator could not start: {failure}"
        ) from failure
    resumed = state["committed"] >= 0
    where = {"committed": state["committed"], "round": state["round"]}  # of the last commit
    plan = _OnlinePlan(
        ray_address=address,
        namespace=NAMESPACE,
        actor_name=name,
        operator=dumps(body.partition, f"the partition operator {type(body.partition).__name__}"),
        staleness=cfg.staleness,
        numeric_columns=tuple(stream.numeric_columns or ()),
        dead_letter_path=dead_letter_path,
    )
    buffer: deque = deque(maxlen=10_000)
    from ._progress import ProgressPrinter

    printer = ProgressPrinter(cfg.progress, label=cfg.name or "online")
    lock = threading.Lock()

    def on_batch(batch_df: Any, batch_id: int) -> None:
        with lock:
            _one_batch(batch_df, int(batch_id))

    def _one_batch(batch_df: Any, batch_id: int) -> None:
        if batch_id <= where["committed"]:
            return  # Spark replays a batch whose update is already applied: exactly once
        started = time.perf_counter()
        frame = batch_df
        if cfg.parallelism is not None:
            frame = frame.repartition(cfg.parallelism)
        # one pass: the tasks split off malformed rows, train on the rest, and report
        fn = _partial_run(plan, batch_id, where["round"])
        results = [pickle.loads(r[0]) for r in frame.mapInArrow(fn, "result binary").collect()]
        rows = sum(r["rows"] for r in results)
        dead = sum(r["dead"] for r in results)
        commit = ray.get(actor.commit_batch.remote(batch_id, rows, dead))
        if commit["failure"] is not None:
            failure = commit["failure"]
            raise IterationFailedError(
                f"the online iteration failed: {failure}", {failure.source: failure}
            ) from failure
        if commit["applied"]:
            where["committed"], where["round"] = batch_id, commit["round"]
        records = commit["outputs"]
        buffer.extend(records)
        if records and cfg.output_path is not None:
            _write_outputs(cfg.output_path, batch_id, records)
        if records and cfg.on_outputs is not None:
            cfg.on_outputs(batch_id, records)
        if printer.enabled:
            s = ray.get(actor.online_state.remote())
            printer.update(
                Progress(
                    aligned=s["round"],
                    epochs=s["round"],
                    last_epoch_seconds=time.perf_counter() - started,
                    loss=s["last_loss"],
                    terminated_by=None,
                    done=False,
                    failed=False,
                )
            )
        if cfg.kill_driver_after_batch == batch_id and not resumed:
            os._exit(17)  # fault injection: after our commit, before Spark's

    writer = df.writeStream.foreachBatch(on_batch).queryName(name.replace(".", "_"))
    if cfg.checkpoint_location is not None:
        writer = writer.option("checkpointLocation", cfg.checkpoint_location)
    if cfg.trigger:
        writer = writer.trigger(**dict(cfg.trigger))
    try:
        query = writer.start()
    except Exception:
        ray.kill(actor)
        raise
    return OnlineIteration(query, actor, spark, cfg, buffer)


def _partial_run(
    plan: _OnlinePlan, batch_id: int, round_: int
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return _run_partition(plan, batch_id, round_, batches)

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
