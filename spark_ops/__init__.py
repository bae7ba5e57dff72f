"""Spark data plane of hybrid_iter: partition caching to numpy/Arrow and the barrier
stage that feeds each subtask its data once.

Never imports ray or hybrid_iter.
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
