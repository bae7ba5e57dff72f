"""``AggregateFunction``: the user extension point of partition and keyed aggregation.

Runs in Spark tasks. Shared by full-partition aggregation (``full_window_partition``) and
local keyed pre-aggregation (``local_key_by``), after Flink's ``AggregateFunction``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

from ._errors import SparkOpsConfigError

__all__ = ["AggregateFunction"]

IN = TypeVar("IN")
ACC = TypeVar("ACC")
OUT = TypeVar("OUT")


class AggregateFunction(ABC, Generic[IN, ACC, OUT]):
    """An aggregate built from an accumulator. Runs in Spark tasks.

    ``create_accumulator()`` starts an empty accumulator, ``add(value, acc)`` folds one
    input into it and returns it, ``get_result(acc)`` turns it into the output, and
    ``merge(a, b)`` combines two partial accumulators (what makes two-phase aggregation
    possible). An aggregate that cannot be merged leaves ``merge`` alone;
    ``is_mergeable()`` then says False and two-phase operators refuse it.
    """

    @abstractmethod
    def create_accumulator(self) -> ACC:
        """A new, empty accumulator."""

    @abstractmethod
    def add(self, value: IN, accumulator: ACC) -> ACC:
        """Fold ``value`` into ``accumulator``; return the accumulator."""

    @abstractmethod
    def get_result(self, accumulator: ACC) -> OUT:
        """The aggregate's result for ``accumulator``."""

    def merge(self, a: ACC, b: ACC) -> ACC:
        """Combine two partial accumulators (override it to make the aggregate mergeable)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement merge(), so partial accumulators "
            f"cannot be combined"
        )

    def is_mergeable(self) -> bool:
        """True when the class overrides ``merge``."""
        return type(self).merge is not AggregateFunction.merge

    def add_batch(self, values: Any, accumulator: ACC) -> ACC:
        """Fold many inputs into ``accumulator`` at once; return the accumulator.

        ``values`` is a numpy array (one input column) or a tuple of numpy arrays (several
        columns, one row per index). Override it with numpy code to vectorize an aggregate:
        operators that group rows (``local_key_by``) then make one call per key and batch
        instead of one ``add`` per row. The default calls ``add`` for each row, with Python
        scalars (or tuples of them).
        """
        if isinstance(values, tuple):
            rows: Any = zip(*(_as_list(c) for c in values))
        else:
            rows = _as_list(values)
        for value in rows:
            accumulator = self.add(value, accumulator)
        return accumulator

    def is_vectorized(self) -> bool:
        """True when the class overrides ``add_batch``."""
        return type(self).add_batch is not AggregateFunction.add_batch

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _as_list(values: Any) -> list:
    """Python scalars of an array-like (numpy's ``tolist`` converts in C)."""
    for name in ("tolist", "to_pylist"):  # numpy / pyarrow
        method = getattr(values, name, None)
        if method is not None:
            return method()
    return list(values)


def _check_aggregate(agg: Any, what: str) -> AggregateFunction:
    """The argument check every operator taking an aggregate uses (clear error before any job)."""
    if agg is None:
        raise SparkOpsConfigError(f"{what} needs an AggregateFunction, got None")
    if isinstance(agg, type):
        raise SparkOpsConfigError(
            f"{what} needs an AggregateFunction instance, got the class {agg.__name__}; write {agg.__name__}()"
        )
    if not isinstance(agg, AggregateFunction):
        raise SparkOpsConfigError(
            f"{what} needs a spark_ops.AggregateFunction, got {type(agg).__name__}"
        )
    return agg
