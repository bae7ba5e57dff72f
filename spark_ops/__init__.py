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

Every error raised on purpose derives from ``SparkOpsError`` (the tree: ``_errors``).
"""

from ._errors import SparkOpsConfigError, SparkOpsError, SparkOpsIndexError
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
    available_task_slots,
    cached_source,
    column_to_numpy,
    exact_num_partitions,
    hold_task_slots,
    is_numeric_arrow_type,
    num_partitions,
    persisted_rdd_ids,
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
    "available_task_slots",
    "cached_source",
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
    "redistribute",
    "with_side_inputs",
]
