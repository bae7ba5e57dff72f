"""Spark data plane of hybrid_iter: partition caching to numpy/Arrow and the barrier
stage that feeds each subtask its data once.

Never imports ray or hybrid_iter.
"""

from .aggregate import AggregateFunction
from .barrier import BarrierStage, ReplayPlan, available_task_slots, num_partitions
from .partition_cache import NumpyCache, column_to_numpy, is_numeric_arrow_type

__all__ = [
    "AggregateFunction",
    "BarrierStage",
    "NumpyCache",
    "ReplayPlan",
    "available_task_slots",
    "column_to_numpy",
    "is_numeric_arrow_type",
    "num_partitions",
]
