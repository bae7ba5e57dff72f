"""Spark data plane of hybrid_iter: partition caching to numpy/Arrow and the barrier
stage that feeds each subtask its data once.

Never imports ray or hybrid_iter.
"""

from .aggregate import AggregateFunction
from .barrier import BarrierStage, ReplayPlan, available_task_slots, num_partitions
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

__all__ = [
    "AggregateFunction",
    "BarrierStage",
    "KeyGroupRange",
    "KeyGroupState",
    "KeyedStateSnapshot",
    "LocalAggMetrics",
    "LocalAggregation",
    "LocalKeyedState",
    "LocalKeyedView",
    "NonMergeableAggregateError",
    "NumpyCache",
    "ReplayPlan",
    "available_task_slots",
    "column_to_numpy",
    "is_numeric_arrow_type",
    "key_group_of",
    "key_group_range",
    "local_key_by",
    "num_partitions",
    "redistribute",
]
