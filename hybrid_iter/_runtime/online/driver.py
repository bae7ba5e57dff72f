"""``iterate_unbounded_streams`` and the driver's side of every micro-batch.

``iterate_unbounded_streams`` checks its arguments, starts the online coordinator (which
restores its state from ``checkpoint_location``), holds the restored state against
Spark's commit log (``recovery``), and starts the Structured Streaming query whose
``foreachBatch`` function is a ``MicroBatchDriver``. ``MicroBatchDriver.run_batch`` is one
micro-batch, in order: a replay is skipped; the partitions run (Spark reads the rows, or
our tasks read a Parquet source's files); their tallies are summed and rejected files
dead-lettered; the coordinator commits the batch; its outputs are delivered; progress
is reported.
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from typing import Any

import storage_uri
from coordinator import (
    BadFile,
    CoordinatorSpec,
    OnlineCommit,
    OnlineCoordinator,
    OnlineStatus,
    OutputRecord,
    PartitionTally,
)
from coordinator._spec import online_checkpoint_spec
from spark_ops import require_spark_filesystem

from ..._body import IterationBody
from ..._cluster import context as cluster
from ..._cluster.placement import actor_class, kill, launch
from ..._cluster.ray_util import NAMESPACE, connect
from ..._config import IterationConfig
from ..._errors import IterationConfigError, IterationFailedError
from ..._streams import ReplayableDataStreamList
from ..endpoint import refuse_on_connect
from ..entry import check_online_entry
from ..metrics import RunMeter, job_description, online_description, online_meter
from ..progress import ProgressPrinter
from ..shipping import dumps
from .config import OnlineConfig, online_config
from .dead_letters import write_bad_files
from .handle import STOPPING, OnlineIteration
from .parquet_source import (
    BINARY_FILE_SCHEMA,
    ParquetSource,
    assign,
    file_row_groups,
    files_newer_than,
    parquet_source,
)
from .partition import OnlinePlan, rows_task, shares_task
from .recovery import reconcile
from .storage import filesystem, write_outputs
from .watch import FailureWatch, batch_failed, recorded_failures

__all__ = ["MicroBatchDriver", "iterate_unbounded_streams"]

log = logging.getLogger("hybrid_iter")


class MicroBatchDriver:
    """The driver's side of an online iteration's micro-batches; ``__call__`` is the
    query's ``foreachBatch`` function (Spark calls it on one thread, one batch at a time).

    ``committed`` and ``round`` follow the coordinator's commits (a batch at or below
    ``committed`` is a replay); ``outputs`` holds the newest output records; ``lock`` is
    held across a batch (``stop()`` takes it to let the batch in progress commit first)
    and ``stopping`` refuses batches that would start meanwhile; ``failed`` holds the
    ``IterationFailedError`` a batch raised (Spark hands it to the user only as text
    inside its ``StreamingQueryException``; the handle raises the object itself)."""

    def __init__(
        self,
        *,
        spark: Any,
        actor: Any,
        name: str,
        cfg: OnlineConfig,
        plan: OnlinePlan,
        parquet: ParquetSource | None,
        state: OnlineStatus,
        meter: RunMeter,
    ) -> None:
        self.spark = spark
        self.actor = actor
        self.name = name
        self.cfg = cfg
        self.plan = plan
        self.parquet = parquet
        self.meter = meter
        #: whether the coordinator restored a committed batch (what the hooks are told)
        self.resumed = state.committed >= 0
        self.committed = state.committed
        self.round = state.round
        #: whether the last committed batch's outputs were delivered again on its replay
        self.redelivered = False
        #: modification time of the newest source file trained on (for the lag)
        self.newest_file: float | None = None
        self.outputs: deque[OutputRecord] = deque(maxlen=10_000)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.failed: list[IterationFailedError] = []
        #: a micro-batch was refused because ``stop()`` was draining (the query then
        #: ends with that refusal, which is no failure of the user's)
        self.refused_on_stop = False
        self.printer = ProgressPrinter(cfg.progress, label=cfg.name or "online")
        self.watch = FailureWatch(spark, actor, name)
        self._describe = functools.partial(
            online_description, cfg.name or "iteration", "sync" if cfg.staleness == 0 else "async"
        )

    # -- foreachBatch -----------------------------------------------------------------------

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        # never block on the lock while stop() drains: stop() holds it across query.stop(),
        # which waits for this very call to return
        while not self.lock.acquire(timeout=0.05):
            if self.stopping.is_set():
                self.refused_on_stop = True
                raise RuntimeError(STOPPING)
        try:
            if self.stopping.is_set():
                self.refused_on_stop = True
                raise RuntimeError(STOPPING)  # not run, not committed: replayed later
            self.run_batch(batch_df, int(batch_id))
        except IterationFailedError as ex:
            self.failed.append(ex)
            raise
        finally:
            self.lock.release()

    def run_batch(self, batch_df: Any, batch_id: int) -> None:
        """One micro-batch, in order."""
        if batch_id <= self.committed:
            self.replayed(batch_id)
            return
        started = time.perf_counter()
        tallies, rejected = self.run_partitions(batch_df, batch_id)
        rows, dead, rejected = self.tally(batch_id, tallies, rejected)
        commit = self.commit(batch_id, rows, dead, rejected)
        self.deliver(batch_id, commit.outputs)
        self.after_commit(batch_id, commit, time.perf_counter() - started)

    # -- the phases of a micro-batch ----------------------------------------------------------

    def replayed(self, batch_id: int) -> None:
        """Spark replays a batch whose update is already applied: exactly once. If it is
        the last one we committed, the driver may have died before delivering its
        outputs: deliver them again (the output file is rewritten in place)."""
        if batch_id == self.committed and not self.redelivered:
            import ray

            self.redelivered = True
            last_id, records = ray.get(self.actor.last_outputs.remote())
            if last_id == batch_id:
                self.deliver(batch_id, records)

    def run_partitions(
        self, batch_df: Any, batch_id: int
    ) -> tuple[list[PartitionTally], list[BadFile]]:
        """The batch's Spark job(s), under the failure watch's job tag: each partition's
        tally, and the files rejected on the driver (Parquet footers)."""
        rejected: list[BadFile] = []
        with (
            self.watch.batch(batch_id, f"{self.name}.batch-{batch_id}"),
            job_description(self.spark.sparkContext, self._describe(batch_id)),
        ):
            if self.parquet is not None:
                return self._run_files(batch_df, batch_id, rejected), rejected
            frame = batch_df
            if self.cfg.parallelism is not None:
                frame = frame.repartition(self.cfg.parallelism)
            # one pass: the tasks split off malformed rows, train on the rest, and report
            fn = rows_task(self.plan, batch_id, self.round)
            rows_out = frame.mapInArrow(fn, "result binary").collect()
            return [pickle.loads(r[0]) for r in rows_out], rejected

    def _run_files(
        self, batch_df: Any, batch_id: int, rejected: list[BadFile]
    ) -> list[PartitionTally]:
        """A Parquet source's micro-batch: footers checked here, shares read by tasks."""
        schema = self.plan.arrow_schema
        assert schema is not None
        listed = batch_df.select("path", "modificationTime").collect()
        paths = sorted(r[0] for r in listed)
        files: list[tuple[str, list[int]]] = []
        for path in paths:
            try:
                files.append((path, file_row_groups(path, schema)))
            except Exception as ex:
                rejected.append(BadFile(path, f"{type(ex).__name__}: {ex}"))
        stamps = [r[1].timestamp() for r in listed if r[1] is not None]
        if stamps:  # for the lag: files newer than this one are still waiting
            self.newest_file = max(stamps)
        tasks = self.cfg.parallelism or self.spark.sparkContext.defaultParallelism
        shares = assign(files, tasks) if files else []
        if not shares:  # nothing readable: the round still closes (counts, watermark)
            return []
        fn = shares_task(self.plan, batch_id, self.round)
        rdd = self.spark.sparkContext.parallelize(shares, len(shares))
        return [pickle.loads(b) for b in rdd.mapPartitions(fn).collect()]

    def tally(
        self, batch_id: int, tallies: list[PartitionTally], rejected: list[BadFile]
    ) -> tuple[int, int, list[BadFile]]:
        """The batch's rows, malformed rows and rejected files; the rejected files are
        logged and written to the dead-letter path."""
        rows = sum(t.rows for t in tallies)
        dead = sum(t.dead_letters for t in tallies)
        bad = [*rejected, *(b for t in tallies for b in t.bad_files)]
        if bad:
            for b in bad:
                log.warning("micro-batch %d: file %s rejected: %s", batch_id, b.path, b.reason)
            if self.plan.dead_letter_path is not None:
                write_bad_files(self.plan.dead_letter_path, batch_id, bad)
        return rows, dead, bad

    def commit(self, batch_id: int, rows: int, dead: int, bad: list[BadFile]) -> OnlineCommit:
        """The coordinator closes the batch's round (sync: applies its feedback first) and
        persists it; raises the batch's ``IterationFailedError`` when it failed."""
        import ray

        commit: OnlineCommit = ray.get(
            self.actor.commit_batch.remote(batch_id, rows, dead, len(bad))
        )
        if commit.failure is not None:
            failures = recorded_failures(self.actor) or [commit.failure]
            raise batch_failed(batch_id, failures) from failures[0]
        if commit.applied:
            assert commit.round is not None
            self.committed, self.round = batch_id, commit.round
        return commit

    def deliver(self, batch_id: int, records: list[OutputRecord]) -> None:
        """The batch's output records: to ``outputs``, ``output_path`` and ``on_outputs``."""
        self.outputs.extend(records)
        if records and self.cfg.output_path is not None:
            write_outputs(self.cfg.output_path, batch_id, records)
        if records and self.cfg.on_outputs is not None:
            self.cfg.on_outputs(batch_id, records)

    def after_commit(self, batch_id: int, commit: OnlineCommit, seconds: float) -> None:
        """The batch's time to the meter, the progress line, the hooks."""
        if commit.applied:
            self.meter.batch_seconds(seconds)
        if self.printer.enabled:
            import ray

            self.printer.update_online(ray.get(self.actor.online_state.remote()), seconds)
        if self.cfg.hooks is not None:
            self.cfg.hooks.after_batch(batch_id, resumed=self.resumed)

    # -- the handle's figures -----------------------------------------------------------------

    def files_waiting(self) -> int | None:
        """Files of the Parquet source newer than the newest one trained on (None before
        the first file, or when Spark reads the source)."""
        if self.parquet is None or self.newest_file is None:
            return None
        return files_newer_than(self.parquet[0], self.parquet[1], self.newest_file)


def iterate_unbounded_streams(
    init_variables: Mapping[str, Any],
    data_streams: ReplayableDataStreamList,
    body: IterationBody,
    config: OnlineConfig | IterationConfig | None = None,
) -> OnlineIteration:
    """Start an online iteration over a streaming DataFrame; returns its handle (driver)."""
    cfg = online_config(config)
    variables, stream = check_online_entry(init_variables, data_streams, body)
    df = stream.df
    spark = df.sparkSession
    refuse_on_connect("iterate_unbounded_streams", spark)
    if cfg.checkpoint_location is not None:  # Spark writes its own files there: can it?
        require_spark_filesystem(
            spark,
            cfg.checkpoint_location,
            what="OnlineConfig.checkpoint_location",
            error=IterationConfigError,
        )
    parquet, arrow_schema = _our_parquet_source(df, cfg) or (None, None)

    address = cluster.ray_address(spark)
    connect(address, namespace=NAMESPACE)
    name = f"hybrid_iter.online.{cfg.name or 'iteration'}.{uuid.uuid4().hex[:12]}"
    checkpoint = None
    dead_letter_path = cfg.dead_letter_path
    location = None
    if cfg.checkpoint_location is not None:
        # Spark keeps its offsets and commits there (in its spelling), we keep ours under
        # <location>/hybrid_iter through pyarrow
        here = storage_uri.parse(cfg.checkpoint_location, error=IterationConfigError)
        location = here.uri
        checkpoint = online_checkpoint_spec(
            here.join("hybrid_iter").uri, cfg.keep_last, body, data_streams, variables
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
    plan = OnlinePlan(  # pickles the partition operator: before the coordinator starts
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
    meter = online_meter(cfg.name or "iteration", name.rsplit(".", 1)[1], cfg.staleness)
    actor = launch(actor_class(OnlineCoordinator), name, spec)
    try:  # from here on, an error stops the coordinator it started
        state, lost = _restored(actor, location, cfg)
        driver = MicroBatchDriver(
            spark=spark,
            actor=actor,
            name=name,
            cfg=cfg,
            plan=plan,
            parquet=parquet,
            state=state,
            meter=meter,
        )
        query = _start_query(driver, df)
    except BaseException:
        kill(actor, "the online coordinator")
        raise
    return OnlineIteration(query, driver, lost, meter=meter)


def _restored(
    actor: Any, location: str | None, cfg: OnlineConfig
) -> tuple[OnlineStatus, tuple[int, ...]]:
    """The state the coordinator started from (restored from ``location`` if there is
    one), and the batch ids lost against Spark's commit log (``on_corrupt_checkpoint``
    decides whether losing some fails the start)."""
    import ray

    state: OnlineStatus = ray.get(actor.online_state.remote())
    if state.failures:
        failure = state.failures[0]
        raise IterationConfigError(
            f"the online coordinator could not start: {failure}"
        ) from failure
    if location is None:
        return state, ()
    return state, reconcile(location, state, cfg.on_corrupt_checkpoint, cfg.name or "online")


def _our_parquet_source(df: Any, cfg: OnlineConfig) -> tuple[ParquetSource, Any] | None:
    """``(the Parquet file source, its Arrow schema)`` when our tasks read the stream's
    files; None when Spark reads the stream (another source, ``parquet_reader="spark"``,
    or a location pyarrow cannot open)."""
    found = parquet_source(df) if cfg.parquet_reader == "arrow" else None
    if found is None:
        return None
    from spark_ops._spark_compat import to_arrow_schema

    try:
        arrow_schema = to_arrow_schema(found[2])
        filesystem(found[0])  # a filesystem pyarrow cannot open: Spark reads
    except Exception as ex:
        log.warning("the Parquet source %s is read by Spark (%s)", found[0], ex)
        return None
    return found, arrow_schema


def _start_query(driver: MicroBatchDriver, df: Any) -> Any:
    """The streaming query whose ``foreachBatch`` function is ``driver``: over ``df``, or,
    for a Parquet source our tasks read, over the ``binaryFile`` listing of its files."""
    cfg, writer_df = driver.cfg, df
    if driver.parquet is not None:
        path, options, _ = driver.parquet
        writer_df = (
            driver.spark.readStream.format("binaryFile")
            .schema(BINARY_FILE_SCHEMA)
            .options(**{k: v for k, v in options.items() if k.lower() != "path"})
            .load(path)
            .select("path", "modificationTime")
        )
    writer = writer_df.writeStream.foreachBatch(driver).queryName(driver.name.replace(".", "_"))
    if cfg.checkpoint_location is not None:
        writer = writer.option("checkpointLocation", storage_uri.spark_uri(cfg.checkpoint_location))
    if cfg.trigger:
        writer = writer.trigger(**dict(cfg.trigger))
    return writer.start()
