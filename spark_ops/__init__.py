"""Spark data plane of hybrid_iter, usable on its own (never imports ray or hybrid_iter).

One folder per capability; this module re-exports each one's public surface:

* ``full_partition/`` (FLIP-380): ``map_partition``, ``sort_partition``, ``aggregate``,
  ``reduce`` over whole partitions or key groups, with rich functions (``open(ctx)`` /
  ``close()``).
* ``local_agg/`` (FLIP-323): ``local_key_by`` pre-aggregates in each task before the
  shuffle (skew-proof); ``local_agg.keyed_state``: local keyed state with key groups.
* ``side_inputs/`` (FLIP-17): broadcast and keyed singleton / list / map / multimap
  views for bounded and streaming main inputs.
* ``iteration/``: what hybrid_iter's iterations run on: the barrier stage (``barrier``)
  and the Arrow -> numpy cache each subtask reads its data into once
  (``partition_cache``).
* ``aggregate.py``: the ``AggregateFunction`` contract the capabilities share.
* ``_hadoop.py``: ``require_spark_filesystem``, whether Spark's Hadoop can open a
  storage location (asked through the JVM before a query starts).

Every error raised on purpose derives from ``SparkOpsError`` (the tree: ``_errors``); a
user function that raises in a Spark task makes the action raise ``UserFunctionError``.
"""

from ._errors import (
    SparkOpsConfigError,
    SparkOpsError,
    SparkOpsIndexError,
    UserFunctionError,
    install_error_translation,
)
from ._hadoop import require_spark_filesystem
from .aggregate import AggregateFunction
from .full_partition import (
    FunctionContext,
    KeyedDataFrame,
    KeyedPartitionWindowedStream,
    Order,
    PartitionFunctionError,
    PartitionWindowedStream,
    full_window_partition,
    key_by,
)
from .iteration import (
    BarrierStage,
    CachedSource,
    ColumnChunks,
    NumpyCache,
    ReplayPlan,
    WorkerDeath,
    available_task_slots,
    cached_source,
    cached_view,
    column_to_numpy,
    exact_num_partitions,
    hold_task_slots,
    is_numeric_arrow_type,
    num_partitions,
    persisted_rdd_ids,
    python_worker_death,
    read_columns,
    spark_error_text,
)
from .local_agg import (
    LocalAggMetrics,
    LocalAggregation,
    LocalKeyedView,
    NonMergeableAggregateError,
    local_key_by,
)
from .local_agg.keyed_state import (
    KeyedStateSnapshot,
    KeyGroupRange,
    KeyGroupState,
    LocalKeyedState,
    key_group_of,
    key_group_range,
    redistribute,
)
from .side_inputs import (
    ListSideInput,
    MapSideInput,
    MultimapSideInput,
    RecordBuffer,
    SideInput,
    SideInputConfigError,
    SideInputContext,
    SideInputError,
    SideInputKeyError,
    SideInputNotReadyError,
    SideInputQuery,
    SideInputScopeError,
    SideInputValueError,
    SingletonSideInput,
    with_side_inputs,
)

install_error_translation()  # once per driver process: see UserFunctionError

__all__ = [
    "AggregateFunction",
    "BarrierStage",
    "CachedSource",
    "ColumnChunks",
    "FunctionContext",
    "KeyGroupRange",
    "KeyGroupState",
    "KeyedDataFrame",
    "KeyedPartitionWindowedStream",
    "KeyedStateSnapshot",
    "ListSideInput",
    "LocalAggMetrics",
    "LocalAggregation",
    "LocalKeyedState",
    "LocalKeyedView",
    "MapSideInput",
    "MultimapSideInput",
    "NonMergeableAggregateError",
    "NumpyCache",
    "Order",
    "PartitionFunctionError",
    "PartitionWindowedStream",
    "RecordBuffer",
    "ReplayPlan",
    "SideInput",
    "SideInputConfigError",
    "SideInputContext",
    "SideInputError",
    "SideInputKeyError",
    "SideInputNotReadyError",
    "SideInputQuery",
    "SideInputScopeError",
    "SideInputValueError",
    "SingletonSideInput",
    "SparkOpsConfigError",
    "SparkOpsError",
    "SparkOpsIndexError",
    "UserFunctionError",
    "WorkerDeath",
    "available_task_slots",
    "cached_source",
    "cached_view",
    "column_to_numpy",
    "exact_num_partitions",
    "full_window_partition",
    "hold_task_slots",
    "is_numeric_arrow_type",
    "key_by",
    "key_group_of",
    "key_group_range",
    "local_key_by",
    "num_partitions",
    "persisted_rdd_ids",
    "python_worker_death",
    "read_columns",
    "redistribute",
    "require_spark_filesystem",
    "spark_error_text",
    "with_side_inputs",
]
