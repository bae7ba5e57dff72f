"""``OnlineConfig``: how an online iteration runs, and the online reading of an
``IterationConfig``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator import OutputRecord

from ..._config import (
    IterationConfig,
    OperatorLifecycle,
    _check_uri,
    _is_int,
    _RunConfig,
)
from ..._errors import IterationConfigError

__all__ = ["OnlineConfig", "online_config"]


@dataclass(frozen=True, kw_only=True)
class OnlineConfig(_RunConfig):
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

    checkpoint_location: str | None = None
    on_corrupt_checkpoint: str = "fail"
    trigger: Mapping[str, Any] | None = None
    dead_letter_path: str | None = None
    output_path: str | None = None
    on_outputs: Callable[[int, list[OutputRecord]], None] | None = None
    parquet_reader: str = "arrow"
    log_every_seconds: float | None = 60.0
    keep_last: int = 2

    def _check_staleness(self) -> None:
        if self.staleness is not None and not (_is_int(self.staleness) and self.staleness == 0):
            raise IterationConfigError(
                f"OnlineConfig.staleness must be 0 (sync: one round per micro-batch) or None "
                f"(async), got {self.staleness!r}; bounded staleness has no meaning when "
                f"micro-batches run one after another"
            )

    def __post_init__(self) -> None:
        super().__post_init__()
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
        return cls(**config.shared_fields())


def online_config(config: Any) -> OnlineConfig:
    """The ``config`` argument of ``iterate_unbounded_streams`` as an ``OnlineConfig``."""
    if config is None:
        return OnlineConfig()
    if isinstance(config, OnlineConfig):
        return config
    if isinstance(config, IterationConfig):
        return OnlineConfig.from_iteration_config(config)
    raise IterationConfigError(
        f"config must be an OnlineConfig (or IterationConfig), got {type(config).__name__}"
    )
