"""The iteration plumbing on the Spark side: the barrier stage that runs every subtask
of an iteration at once (``barrier``) and the Arrow -> numpy cache each subtask reads
its data into once (``partition_cache``), which cached RDD a DataFrame reads
unchanged (``cached``), and whether a failed job lost a Python worker (``failures``)."""

from .barrier import (
    BarrierStage,
    ReplayPlan,
    available_task_slots,
    exact_num_partitions,
    hold_task_slots,
    num_partitions,
)
from .cached import CachedSource, cached_source, cached_view, persisted_rdd_ids, read_columns
from .failures import WorkerDeath, python_worker_death, spark_error_text
from .partition_cache import ColumnChunks, NumpyCache, column_to_numpy, is_numeric_arrow_type

__all__ = [
    "BarrierStage",
    "CachedSource",
    "ColumnChunks",
    "NumpyCache",
    "ReplayPlan",
    "WorkerDeath",
    "available_task_slots",
    "cached_source",
    "cached_view",
    "column_to_numpy",
    "exact_num_partitions",
    "hold_task_slots",
    "is_numeric_arrow_type",
    "num_partitions",
    "persisted_rdd_ids",
    "python_worker_death",
    "read_columns",
    "spark_error_text",
]
