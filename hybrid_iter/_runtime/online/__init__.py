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

One concept per module, in the order of a micro-batch:

* ``config``: ``OnlineConfig``;
* ``driver``: ``iterate_unbounded_streams`` and ``MicroBatchDriver`` (the ``foreachBatch``
  function: one micro-batch's phases, in order, in ``run_batch``);
* ``partition``: one micro-batch partition in a Spark task;
* ``parquet_source``: a Parquet file source our tasks read;
* ``dead_letters``: malformed rows and rejected files;
* ``storage``: the locations read and written through pyarrow (and the output files);
* ``watch``: the failure watch that cancels a failed micro-batch's jobs;
* ``handle``: ``OnlineIteration`` and ``OnlineProgress``;
* ``recovery``: the restored state held against Spark's commit log.
"""

from __future__ import annotations

from ..._errors import OnlineCheckpointError
from .config import OnlineConfig
from .driver import iterate_unbounded_streams
from .handle import OnlineIteration, OnlineProgress
from .partition import EPOCH_MAX

__all__ = [
    "EPOCH_MAX",
    "OnlineCheckpointError",
    "OnlineConfig",
    "OnlineIteration",
    "OnlineProgress",
    "iterate_unbounded_streams",
]
