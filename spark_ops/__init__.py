"""Spark data plane of hybrid_iter, usable on its own (never imports ray or hybrid_iter).

* The barrier stage and the Arrow -> numpy partition cache (``barrier``,
  ``partition_cache``): each subtask of an iteration reads its data once.
* Full-partition operators (FLIP-380; ``full_partition``): ``map_partition``,
  ``sort_partition``, ``aggregate``, ``reduce`` over whole partitions or key groups, with
  rich functions (``open(ctx)`` / ``close()``).
* Skew-proof local aggregation (FLIP-323; ``local_agg``): ``local_key_by`` pre-aggregates
  in each task before the shuffle.
* Side inputs (FLIP-17; ``side_inputs``): broadcast and keyed singleton / list / map /
  multimap views for bounded and streaming main inputs.

Every error raised on purpose derives from ``SparkOpsError`` (the tree: ``_errors``).
"""

from ._errors import SparkOpsConfigError, SparkOpsError, SparkOpsIndexError
from .aggregate import AggregateFunction
from .barrier import BarrierStage, ReplayPlan, available_task_slots, num_partitions
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
from .keyed_state import (
    KeyedStateSnapshot,
    KeyGroupRange,
    KeyGroupState,
    LocalKeyedState,
    key_group_of,
    key_group_range,
    redistribute,
)
from .local_agg import (
    LocalAggMetrics,
    LocalAggregation,
    LocalKeyedView,
    NonMergeableAggregateError,
    local_key_by,
)
from .partition_cache import NumpyCache, column_to_numpy, is_numeric_arrow_type
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
    "column_to_numpy",
    "full_window_partition",
    "is_numeric_arrow_type",
    "key_by",
    "key_group_of",
    "key_group_range",
    "local_key_by",
    "num_partitions",
    "redistribute",
    "with_side_inputs",
]
