"""Data streams of an iteration: Spark DataFrames, each replayed per round or not."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spark_ops import is_numeric_arrow_type

from ._errors import IterationConfigError

__all__ = ["DataStream", "ReplayableDataStreamList"]


def _is_dataframe(obj: Any) -> bool:
    try:
        from pyspark.sql import DataFrame
    except ImportError:  # pragma: no cover - pyspark is a dependency
        return False
    return isinstance(obj, DataFrame)


@dataclass(frozen=True)
class DataStream:
    """A DataFrame fed to the body, with optional checks.

    ``numeric_columns``: columns that must exist and be numeric (checked against the
    schema before any job starts) and hold no nulls (checked batch by batch while the
    subtasks load, before epoch 0 runs).
    """

    df: Any
    numeric_columns: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not _is_dataframe(self.df):
            raise IterationConfigError(
                f"a data stream must be a pyspark.sql.DataFrame, got {type(self.df).__name__}"
            )
        if self.numeric_columns is not None:
            cols = (
                (self.numeric_columns,)
                if isinstance(self.numeric_columns, str)
                else tuple(self.numeric_columns)
            )
            object.__setattr__(self, "numeric_columns", cols)

    def validate(self, index: int, *, streaming: bool = False) -> None:
        """Schema checks that need no Spark job."""
        if self.df.isStreaming and not streaming:
            raise IterationConfigError(
                f"data stream {index} is a streaming DataFrame, but "
                f"iterate_bounded_streams_until_termination needs bounded data; use "
                f"iterate_unbounded_streams for streams, or read the data with spark.read"
            )
        if self.numeric_columns is None:
            return
        from pyspark.errors import PySparkTypeError

        from spark_ops._spark_compat import to_arrow_type

        fields = {f.name: f for f in self.df.schema.fields}
        for name in self.numeric_columns:
            if name not in fields:
                raise IterationConfigError(
                    f"data stream {index}: numeric column {name!r} is not in the DataFrame; "
                    f"its columns are {list(fields)}"
                )
            dtype = fields[name].dataType
            try:
                arrow = to_arrow_type(dtype)
            except PySparkTypeError as ex:  # PySpark's refusal of the type, nothing else
                raise IterationConfigError(
                    f"data stream {index}: column {name!r} has type {dtype.simpleString()}, "
                    f"which Spark cannot hand to Python through Arrow ({ex}); cast it to a "
                    f"numeric type (F.col({name!r}).cast('double')) or leave it out of "
                    f"numeric_columns"
                ) from ex
            element = getattr(arrow, "value_type", None)
            ok = is_numeric_arrow_type(arrow) or (
                element is not None and is_numeric_arrow_type(element)
            )
            if not ok:
                raise IterationConfigError(
                    f"data stream {index}: column {name!r} has type {dtype.simpleString()}, "
                    f"which is not numeric; cast it (F.col({name!r}).cast('double')) or "
                    f"leave it out of numeric_columns"
                )


def _as_stream(obj: Any) -> DataStream:
    return obj if isinstance(obj, DataStream) else DataStream(obj)


@dataclass(frozen=True)
class ReplayableDataStreamList:
    """The data streams of an iteration, each marked replayed or not.

    ``ReplayableDataStreamList.not_replay(df1, df2)``: every stream is read once, at
    epoch 0, and the partition operators cache what they need (the fast path: one Spark
    stage for the whole iteration).
    ``ReplayableDataStreamList.replay(a).and_not_replay(b)``: ``a`` is re-emitted to the
    body in every round ``e`` with epoch ``e``, once the global watermark reached
    ``e - 1`` (Spark's cache, ``MEMORY_AND_DISK``, is the replay buffer; each round is
    one Spark job).
    """

    streams: tuple[DataStream, ...]
    replayed: tuple[bool, ...]

    @classmethod
    def not_replay(cls, *streams: Any) -> ReplayableDataStreamList:
        return cls((), ()).and_not_replay(*streams)

    @classmethod
    def replay(cls, *streams: Any) -> ReplayableDataStreamList:
        return cls((), ()).and_replay(*streams)

    def and_not_replay(self, *streams: Any) -> ReplayableDataStreamList:
        return self._add(streams, False)

    def and_replay(self, *streams: Any) -> ReplayableDataStreamList:
        return self._add(streams, True)

    def _add(self, streams: tuple[Any, ...], replayed: bool) -> ReplayableDataStreamList:
        if len(streams) == 1 and isinstance(streams[0], (list, tuple)):
            streams = tuple(streams[0])
        new = tuple(_as_stream(s) for s in streams)
        return ReplayableDataStreamList(self.streams + new, self.replayed + (replayed,) * len(new))

    @property
    def any_replayed(self) -> bool:
        return any(self.replayed)

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def dataframes(self) -> Sequence[Any]:
        return [s.df for s in self.streams]
