"""The handle of a running online iteration (``OnlineIteration``) and where it is
(``OnlineProgress``): stop, await termination, the newest variables and outputs, the
status line, the failure of a micro-batch handed to the user."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordinator import OnlineStatus, OutputRecord

from ..._cluster.placement import kill
from ..._errors import IterationConfigError, IterationFailedError
from ..metrics import RunMeter

if TYPE_CHECKING:
    from .driver import MicroBatchDriver

__all__ = ["STOPPING", "OnlineIteration", "OnlineProgress"]

log = logging.getLogger("hybrid_iter")

#: marks the error a micro-batch raises when it starts while ``stop()`` drains
STOPPING = "hybrid_iter: the online iteration is stopping"


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
        driver: MicroBatchDriver,
        lost_batches: tuple[int, ...] = (),
        meter: RunMeter | None = None,
    ) -> None:
        self.query = query
        self._driver = driver
        self._actor = driver.actor
        self._config = driver.cfg
        self._stopped = False
        #: whether the micro-batch failure (``driver.failed``) has been given to the user
        #: (by await_termination, exception or stop)
        self._reported = False
        self._final: OnlineStatus | None = None
        self.lost_batches = tuple(lost_batches)
        self._lag: tuple[float, int | None] = (-1.0, None)  # (when, value): listing is not free
        self._logger: threading.Thread | None = None
        if self._config.log_every_seconds is not None:
            self._logger = threading.Thread(
                target=self._log_loop, name="hybrid_iter-online-status", daemon=True
            )
            self._logger.start()
        self._meter = meter or RunMeter(None)
        self._meter.watch(lambda: self.progress, query, lambda: bool(self._driver.failed))

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
        if self._final is not None and self._driver.parquet is not None:
            try:
                return self._driver.files_waiting()
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
        if total is not None or self._driver.parquet is None:
            return total
        when, value = self._lag
        if time.monotonic() - when >= 1.0:
            try:
                value = self._driver.files_waiting()
            except Exception as ex:  # a status figure must never take the job down
                log.debug("could not list the source directory: %s", ex)
                value = None
            self._lag = (time.monotonic(), value)
        return value

    def _log_loop(self) -> None:
        interval = float(self._config.log_every_seconds or 60.0)
        label = self._config.name or "online"
        while not self._driver.stopping.wait(interval):
            try:
                log.info("online iteration %s: %s", label, self.progress.status_line())
            except Exception as ex:  # the status line must never take the job down
                log.debug("online status line unavailable: %s", ex)

    @property
    def outputs(self) -> list[OutputRecord]:
        return list(self._driver.outputs)

    def outputs_stream(self) -> Any:
        """The output records as a streaming DataFrame (needs ``output_path``)."""
        if self._config.output_path is None:
            raise IterationConfigError("outputs_stream() needs OnlineConfig(output_path=...)")
        schema = "tag string, epoch long, source string, value string, batch_id long"
        return self._driver.spark.readStream.schema(schema).json(self._config.output_path)

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
        if self._stopped and self._driver.refused_on_stop:
            return None  # a micro-batch refused to start because stop() was draining
        return ex

    def _failure(self) -> IterationFailedError | None:
        """The micro-batch failure, marked as given to the user."""
        if not self._driver.failed:
            return None
        self._reported = True
        return self._driver.failed[0]

    def stop(self) -> None:
        """Drain the micro-batch in progress (it commits, with its checkpoint), stop the
        query, then the coordinator. A micro-batch that would start meanwhile is refused
        before it reads anything (Spark runs it again after a restart). Raises the
        ``IterationFailedError`` of a failed micro-batch that neither
        ``await_termination()`` nor ``exception()`` has given yet."""
        if self._stopped:
            return
        self._stopped = True
        self._driver.stopping.set()
        import ray

        try:
            with self._driver.lock:  # the batch in progress commits first
                try:
                    self._final = ray.get(self._actor.online_state.remote())
                except Exception:
                    self._final = None
                self.query.stop()
        finally:
            kill(self._actor, "the online coordinator")
            if self._logger is not None:
                self._logger.join(timeout=5)
            self._meter.close(failed=bool(self._driver.failed), final=lambda: self.progress)
        if self._driver.failed and not self._reported:
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
