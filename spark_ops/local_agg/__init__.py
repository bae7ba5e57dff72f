"""Local keyed pre-aggregation: skew-proof two-phase aggregation of Python aggregates.

Runs on the driver (planning and checks: no Spark job starts until you run an action);
the two phases run in Spark tasks (``_local_agg_tasks``).

``local_key_by(df, key)`` groups rows by key *inside each Spark task*, without a shuffle
(Flink's ``localKeyBy``). Its aggregations build one partial per key and task, shuffle
only the partials by key, and merge them with the aggregate's ``merge``::

    view = local_key_by(df, "user")
    view.sum("amount").df                     # DataFrame[user, sum(amount)]
    agg = view.aggregate(Mean(), "amount", result_type="double")
    agg.to_dict()                             # {user: mean}
    agg.metrics                               # rows in, partials shuffled, max per reducer

A hot key costs one partial row per task instead of one row per record, so no reducer
receives more than (local tasks x its keys) rows. The result equals the one-phase
result for any mergeable aggregate.

Bounded plan: ``select(keys, values)`` -> ``mapInArrow`` (local phase: buffer, group by
hash, aggregate; vectorized for the built-ins, numpy ufunc reduces and aggregates with
``add_batch``) -> ``repartition(keys)`` (Spark's hash shuffle; with no ``num_reducers``
AQE may coalesce it) -> ``mapInArrow`` (merge phase). Streaming plan: the same local
phase per micro-batch, then a Spark stateful operator merges the partials into state:
a native streaming aggregation for ``sum/count/min/max/mean`` (update or complete
output mode) and ``applyInPandasWithState`` for ``aggregate``, ``reduce`` and ``top_n``
(update output mode). Checkpointing and exactly-once are Spark's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import NonMergeableAggregateError, SparkOpsConfigError
from .._spark_compat import ddl_refusals
from ..aggregate import AggregateFunction, _check_aggregate

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType, StructType

    from ._tasks import Plan

__all__ = [
    "LocalAggMetrics",
    "LocalAggregation",
    "LocalKeyedView",
    "NonMergeableAggregateError",
    "local_key_by",
]

_DEFAULT_BUFFER_BYTES = 128 << 20
_DEFAULT_MAX_LOCAL_KEYS = 1 << 20


# -- metrics -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalAggMetrics:
    """What the local phase saved, per execution (see ``LocalAggregation.metrics``).

    ``rows_in`` input rows; ``partials_shuffled`` rows that crossed the shuffle;
    ``max_rows_per_reducer`` partial rows the busiest merge task received, against
    ``one_phase_max_rows_per_reducer``: the input rows that task would have received
    had every row been shuffled (same keys, same partitioning). ``max_rows_per_key``
    is the hottest key's input rows, ``max_partials_per_key`` its most partials (at most
    the number of local tasks, per flush). Streaming queries report only ``rows_in`` and
    ``partials_shuffled`` (per micro-batch); the other fields are None there.
    """

    rows_in: int
    partials_shuffled: int
    local_tasks: int | None = None
    reducers: int | None = None
    keys: int | None = None
    max_rows_per_reducer: int | None = None
    one_phase_max_rows_per_reducer: int | None = None
    max_partials_per_key: int | None = None
    max_rows_per_key: int | None = None

    @property
    def reduction(self) -> float:
        """Input rows per shuffled row."""
        return self.rows_in / self.partials_shuffled if self.partials_shuffled else float("inf")

    @property
    def skew_reduction(self) -> float | None:
        """How many times fewer rows the busiest reducer got than it would in one phase."""
        if not self.max_rows_per_reducer or self.one_phase_max_rows_per_reducer is None:
            return None
        return self.one_phase_max_rows_per_reducer / self.max_rows_per_reducer

    def __str__(self) -> str:
        text = f"{self.rows_in:,} rows in, {self.partials_shuffled:,} partials shuffled"
        if self.max_rows_per_reducer is not None:
            text += (
                f", busiest reducer got {self.max_rows_per_reducer:,} rows "
                f"(one phase: {self.one_phase_max_rows_per_reducer:,})"
            )
        return text


def _metrics_from_accumulator(value: dict) -> LocalAggMetrics | None:
    maps = [v for (phase, _), v in value.items() if phase == "map"]
    reds = [v for (phase, _), v in value.items() if phase == "reduce"]
    if not reds:
        return None
    return LocalAggMetrics(
        rows_in=sum(r for r, _ in maps),
        partials_shuffled=sum(e for _, e in maps),
        local_tasks=len(maps),
        reducers=len(reds),
        keys=sum(r[2] for r in reds),
        max_rows_per_reducer=max(r[0] for r in reds),
        one_phase_max_rows_per_reducer=max(r[1] for r in reds),
        max_partials_per_key=max(r[3] for r in reds),
        max_rows_per_key=max(r[4] for r in reds),
    )


# -- argument checks -----------------------------------------------------------------------


def _check_positive_int(value: Any, name: str, fix: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SparkOpsConfigError(f"{name} must be an int >= 1, got {value!r}; {fix}")
    return value


def _names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        names: tuple = (value,)
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        names = tuple(value)
    else:
        raise SparkOpsConfigError(
            f"{what} must be a column name or a list of column names, got {value!r}"
        )
    if not names:
        raise SparkOpsConfigError(f"{what} is empty: name at least one column")
    for n in names:
        if not isinstance(n, str) or not n:
            raise SparkOpsConfigError(f"{what} must hold column names (non-empty str), got {n!r}")
    if len(set(names)) != len(names):
        raise SparkOpsConfigError(f"{what} names a column twice: {list(names)}")
    return names


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _is_numeric(dt: DataType) -> bool:
    from pyspark.sql.types import DecimalType, NumericType

    return isinstance(dt, NumericType) and not isinstance(dt, DecimalType)


def _is_orderable(dt: DataType) -> bool:
    from pyspark.sql.types import (
        BinaryType,
        BooleanType,
        DateType,
        DecimalType,
        StringType,
        TimestampNTZType,
        TimestampType,
    )

    return _is_numeric(dt) or isinstance(
        dt,
        (
            DecimalType,
            StringType,
            BinaryType,
            BooleanType,
            DateType,
            TimestampType,
            TimestampNTZType,
        ),
    )


def _non_mergeable_message(agg: AggregateFunction, what: str) -> str:
    name = type(agg).__name__
    return (
        f"{what}: {name} is not mergeable (it does not implement merge()), so the partial "
        f"results computed in different Spark tasks cannot be combined and two-phase "
        f"aggregation would be wrong. Implement {name}.merge(a, b) if partial accumulators "
        f"can be combined; for a distinct count use a mergeable sketch (e.g. a HyperLogLog "
        f"accumulator, or Spark's F.approx_count_distinct); or aggregate in one phase with "
        f"df.groupBy(...).applyInPandas(...), which shuffles every row"
    )


# -- the view ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    num_reducers: int | None
    buffer_bytes: int
    max_local_keys: int


def local_key_by(
    df: DataFrame,
    key: str | Sequence[str],
    *,
    num_reducers: int | None = None,
    buffer_bytes: int = _DEFAULT_BUFFER_BYTES,
    max_local_keys: int = _DEFAULT_MAX_LOCAL_KEYS,
) -> LocalKeyedView:
    """A local keyed view of ``df``: rows grouped by ``key`` inside each task (driver).

    ``key`` is a column name or a list of them (null keys form a group, as in Spark).
    Options: ``num_reducers`` tasks of the merge phase (default: Spark's
    ``spark.sql.shuffle.partitions``, which AQE may coalesce; not for streaming, whose
    state partitions Spark fixes); ``buffer_bytes`` of input a local task groups at once
    (more means fewer partials); ``max_local_keys`` partials a local task holds before it
    flushes them (bounds its memory on very many keys).
    """
    from pyspark.sql import DataFrame

    if df is None or not isinstance(df, DataFrame):
        raise SparkOpsConfigError(
            f"local_key_by needs a pyspark DataFrame, got {type(df).__name__}"
        )
    keys = _names(key, "local_key_by(key)")
    missing = [k for k in keys if k not in df.columns]
    if missing:
        raise SparkOpsConfigError(
            f"local_key_by(key): column(s) {missing} are not in the DataFrame; its columns "
            f"are {df.columns}"
        )
    if num_reducers is not None:
        _check_positive_int(num_reducers, "num_reducers", "or None for Spark's default")
        if df.isStreaming:
            raise SparkOpsConfigError(
                "num_reducers cannot be set for a streaming DataFrame: the partitions of "
                "a streaming aggregation's state are fixed by spark.sql.shuffle.partitions "
                "when the query first starts; leave num_reducers=None"
            )
    _check_positive_int(buffer_bytes, "buffer_bytes", "e.g. 128 << 20 (128 MiB)")
    _check_positive_int(max_local_keys, "max_local_keys", "e.g. 1 << 20")
    return LocalKeyedView(df, keys, _Options(num_reducers, buffer_bytes, max_local_keys))


class LocalKeyedView:
    """``df`` grouped by key inside each task; each method plans one aggregation (driver).

    Methods return a ``LocalAggregation``; nothing runs until an action on its ``df``
    (or ``to_dict()``). Result columns are the key columns and one result column named
    like Spark's (``sum(x)``, ``count``, ``min(x)``, ``max(x)``, ``avg(x)``) unless
    ``alias`` is given.
    """

    def __init__(self, df: DataFrame, keys: tuple[str, ...], options: _Options) -> None:
        self._df = df
        self.keys = keys
        self._options = options
        self._fields = {f.name: f for f in df.schema.fields}

    def __repr__(self) -> str:
        return f"local_key_by({list(self.keys)!r})"

    # -- helpers ---------------------------------------------------------------------------

    def _what(self, call: str) -> str:
        key = self.keys[0] if len(self.keys) == 1 else list(self.keys)
        return f"local_key_by({key!r}).{call}"

    def _column(self, name: Any, arg: str, what: str) -> Any:
        if not isinstance(name, str) or not name:
            raise SparkOpsConfigError(f"{what}: {arg} must be a column name (str), got {name!r}")
        if name not in self._fields:
            raise SparkOpsConfigError(
                f"{what}: {arg}={name!r} is not a column of the DataFrame; its columns are "
                f"{self._df.columns}"
            )
        return self._fields[name]

    def _alias(self, alias: Any, default: str, what: str) -> str:
        name = default if alias is None else alias
        if not isinstance(name, str) or not name:
            raise SparkOpsConfigError(f"{what}: alias must be a non-empty str, got {alias!r}")
        if name in self.keys:
            raise SparkOpsConfigError(
                f"{what}: the result column {name!r} would clash with a key column; pass "
                f"another alias="
            )
        return name

    def _plan(
        self,
        *,
        kind: str,
        op: str,
        what: str,
        values: Sequence[str],
        result_type: DataType,
        alias: str,
        multi_value: bool = False,
        aggregate: AggregateFunction | None = None,
        ufunc: Any = None,
        top_n: int = 0,
        top_columns: Sequence[str] = (),
        by: str | None = None,
    ) -> LocalAggregation:
        import pyarrow as pa
        from pyspark.sql.types import StructField, StructType

        from .._spark_compat import from_arrow_schema, to_arrow_type
        from . import _kernels as K
        from ._tasks import Plan

        key_fields = [self._fields[k] for k in self.keys]
        value_fields = [self._fields[v] for v in values]
        kn, vn = K.key_names(len(key_fields)), K.value_names(len(value_fields))
        key_arrow = [pa.field(n, to_arrow_type(f.dataType)) for n, f in zip(kn, key_fields)]
        val_arrow = [pa.field(n, to_arrow_type(f.dataType)) for n, f in zip(vn, value_fields)]
        extra: list[pa.Field]
        if kind == "builtin":
            if op == "count":
                extra = []
            elif op == "sum":
                extra = [pa.field(K.SUM, to_arrow_type(result_type))]
            elif op in ("min", "max"):
                extra = [pa.field(K.MIN if op == "min" else K.MAX, val_arrow[0].type)]
            else:
                extra = [pa.field(K.SUM, pa.float64()), pa.field(K.CNT, pa.int64())]
            partial = [*key_arrow, pa.field(K.N, pa.int64()), *extra]
        elif kind == "ufunc":
            partial = [*key_arrow, pa.field(K.N, pa.int64()), pa.field(K.RED, val_arrow[0].type)]
        elif kind == "aggregate":
            acc = [pa.field(n, t) for n, t in K.accumulator_columns()]
            partial = [*key_arrow, pa.field(K.N, pa.int64()), *acc]
        else:  # top_n: a key's top rows of one task, as one list per column
            lists = [pa.field(f.name, pa.list_(f.type)) for f in val_arrow]
            partial = [*key_arrow, pa.field(K.N, pa.int64()), *lists]
        partial_schema = pa.schema(partial)
        out_struct = StructType([*key_fields, StructField(alias, result_type, nullable=True)])
        out_schema = pa.schema(
            [
                *(pa.field(f.name, to_arrow_type(f.dataType)) for f in key_fields),
                pa.field(alias, to_arrow_type(result_type)),
            ]
        )
        internal = {v: n for v, n in zip(values, vn)}
        plan = Plan(
            kind=kind,
            op=op,
            what=what,
            num_keys=len(kn),
            num_values=len(vn),
            multi_value=multi_value,
            aggregate=aggregate,
            ufunc=ufunc,
            top_n=top_n,
            top_columns=tuple(internal[c] for c in top_columns),
            top_names=tuple(top_columns),
            by=internal.get(by) if by is not None else None,
            partial_schema=partial_schema,
            out_schema=out_schema,
            result_type=to_arrow_type(result_type),
            buffer_bytes=self._options.buffer_bytes,
            max_local_keys=self._options.max_local_keys,
        )
        from pyspark.sql import functions as F

        selected = self._df.select(
            *(F.col(_quoted(k)).alias(n) for k, n in zip(self.keys, kn)),
            *(F.col(_quoted(v)).alias(n) for v, n in zip(values, vn)),
        )
        return LocalAggregation(
            plan,
            selected,
            from_arrow_schema(partial_schema),
            out_struct,
            self.keys,
            self._options,
        )

    # -- built-ins -------------------------------------------------------------------------

    def _numeric(self, op: str, column: Any, alias: Any, label: str) -> LocalAggregation:
        from pyspark.sql.types import DoubleType, FractionalType, LongType

        what = self._what(f"{op}({column!r})")
        field = self._column(column, "column", what)
        if op in ("sum", "mean") and not _is_numeric(field.dataType):
            raise SparkOpsConfigError(
                f"{what}: {op} needs an integer or floating-point column, but {column!r} "
                f"has type {field.dataType.simpleString()}; cast it "
                f"(F.col({column!r}).cast('double'))"
            )
        if op in ("min", "max") and not _is_orderable(field.dataType):
            raise SparkOpsConfigError(
                f"{what}: column {column!r} has type {field.dataType.simpleString()}, which "
                f"has no order {op} can use; pick a numeric, string, date or timestamp column"
            )
        if op == "mean":
            rtype: DataType = DoubleType()
        elif op == "sum":
            rtype = DoubleType() if isinstance(field.dataType, FractionalType) else LongType()
        else:
            rtype = field.dataType
        return self._plan(
            kind="builtin",
            op=op,
            what=what,
            values=[column],
            result_type=rtype,
            alias=self._alias(alias, f"{label}({column})", what),
        )

    def sum(self, column: str, *, alias: str | None = None) -> LocalAggregation:
        """Sum of ``column`` per key (nulls skipped; bigint for integers, double otherwise)."""
        return self._numeric("sum", column, alias, "sum")

    def min(self, column: str, *, alias: str | None = None) -> LocalAggregation:
        """Smallest non-null value of ``column`` per key."""
        return self._numeric("min", column, alias, "min")

    def max(self, column: str, *, alias: str | None = None) -> LocalAggregation:
        """Largest non-null value of ``column`` per key."""
        return self._numeric("max", column, alias, "max")

    def mean(self, column: str, *, alias: str | None = None) -> LocalAggregation:
        """Mean of the non-null values of ``column`` per key, as double (Spark's ``avg``)."""
        return self._numeric("mean", column, alias, "avg")

    avg = mean

    def count(self, *, alias: str | None = None) -> LocalAggregation:
        """Rows per key (bigint)."""
        from pyspark.sql.types import LongType

        what = self._what("count()")
        return self._plan(
            kind="builtin",
            op="count",
            what=what,
            values=[],
            result_type=LongType(),
            alias=self._alias(alias, "count", what),
        )

    def top_n(
        self,
        n: int,
        by: str,
        *,
        columns: Sequence[str] | None = None,
        alias: str | None = None,
    ) -> LocalAggregation:
        """The ``n`` rows with the largest ``by`` per key, largest first (rows with a null
        ``by`` come last; ties are broken arbitrarily).

        The result is an ``array<struct<columns>>`` (default: every non-key column).
        """
        from pyspark.sql.types import ArrayType, StructField, StructType

        what = self._what(f"top_n({n!r}, {by!r})")
        _check_positive_int(n, "top_n(n)", "the number of rows to keep per key")
        field = self._column(by, "by", what)
        if not _is_orderable(field.dataType):
            raise SparkOpsConfigError(
                f"{what}: by={by!r} has type {field.dataType.simpleString()}, which has no "
                f"order; pick a numeric, string, date or timestamp column"
            )
        if columns is None:
            cols = tuple(c for c in self._df.columns if c not in self.keys)
        else:
            cols = _names(columns, f"{what}: columns")
            for c in cols:
                self._column(c, "columns", what)
        values = list(dict.fromkeys([*cols, by]))
        struct = StructType([StructField(c, self._fields[c].dataType, True) for c in cols])
        return self._plan(
            kind="top_n",
            op="top_n",
            what=what,
            values=values,
            result_type=ArrayType(struct, containsNull=False),
            alias=self._alias(alias, f"top_{n}({by})", what),
            top_n=n,
            top_columns=cols,
            by=by,
        )

    # -- user functions --------------------------------------------------------------------

    def aggregate(
        self,
        aggregate: AggregateFunction,
        value: str | Sequence[str],
        *,
        result_type: str | DataType | None = None,
        alias: str | None = None,
    ) -> LocalAggregation:
        """Aggregate ``value`` per key with a mergeable ``AggregateFunction``.

        ``value`` is one column (``add`` gets a scalar, ``add_batch`` a numpy array) or a
        list of them (a tuple per row / a tuple of arrays). ``result_type`` is the Spark
        type of ``get_result``'s values (a DDL string such as ``"double"`` or
        ``"array<bigint>"``, or a DataType). With ``add_batch`` overridden, the local
        phase makes one call per key and chunk; otherwise one ``add`` per row. Nulls reach
        ``add`` as None and ``add_batch`` as numpy does them (NaN in float arrays, integer
        columns with nulls become float, None in object arrays).
        """
        name = type(aggregate).__name__ if aggregate is not None else "None"
        what = self._what(f"aggregate({name}())")
        agg = _check_aggregate(aggregate, f"{what}: aggregate")
        if not agg.is_mergeable():
            raise NonMergeableAggregateError(_non_mergeable_message(agg, what))
        values = _names(value, f"{what}: value")
        for v in values:
            self._column(v, "value", what)
        if result_type is None:
            raise SparkOpsConfigError(
                f"{what}: pass result_type=, the Spark type of {name}.get_result's values "
                f"(e.g. result_type='double', 'bigint', 'array<double>' or a DataType)"
            )
        rtype = _parse_type(result_type, what)
        return self._plan(
            kind="aggregate",
            op="aggregate",
            what=what,
            values=values,
            result_type=rtype,
            alias=self._alias(alias, f"{name}({', '.join(values)})", what),
            multi_value=not isinstance(value, str),
            aggregate=agg,
        )

    def reduce(
        self,
        fn: Callable[[Any, Any], Any],
        value: str,
        *,
        result_type: str | DataType | None = None,
        alias: str | None = None,
    ) -> LocalAggregation:
        """Combine the non-null values of ``value`` per key with ``fn(a, b)`` (associative
        and commutative: partials are combined in any order).

        A binary numpy ufunc (``np.add``, ``np.maximum``, ...) runs vectorized in both
        phases (``ufunc.reduceat``); any other callable is called once per row. The result
        has the column's type unless ``result_type`` says otherwise.
        """
        from . import _kernels as K

        what = self._what(f"reduce({getattr(fn, '__name__', type(fn).__name__)})")
        if fn is None or not callable(fn):
            raise SparkOpsConfigError(
                f"{what}: fn must be a callable fn(a, b) -> value, got {fn!r}"
            )
        field = self._column(value, "value", what)
        rtype = field.dataType if result_type is None else _parse_type(result_type, what)
        alias_name = self._alias(alias, f"reduce({value})", what)
        ufunc = K.reduce_numpy(fn)
        if ufunc is not None:
            if not (_is_numeric(field.dataType) or field.dataType.typeName() == "boolean"):
                raise SparkOpsConfigError(
                    f"{what}: a numpy ufunc reduces numbers, but {value!r} has type "
                    f"{field.dataType.simpleString()}; pass a Python function instead"
                )
            if result_type is not None and rtype != field.dataType:
                raise SparkOpsConfigError(
                    f"{what}: a numpy ufunc reduce keeps the column's type "
                    f"({field.dataType.simpleString()}); cast the column instead of result_type"
                )
            return self._plan(
                kind="ufunc",
                op="reduce",
                what=what,
                values=[value],
                result_type=rtype,
                alias=alias_name,
                ufunc=ufunc,
            )
        return self._plan(
            kind="aggregate",
            op="reduce",
            what=what,
            values=[value],
            result_type=rtype,
            alias=alias_name,
            aggregate=_Reduce(fn),
        )


def _parse_type(result_type: Any, what: str) -> DataType:
    from pyspark.sql.types import DataType, _parse_datatype_string

    if isinstance(result_type, DataType):
        return result_type
    if not isinstance(result_type, str):
        raise SparkOpsConfigError(
            f"{what}: result_type must be a Spark DDL type string or a DataType, got "
            f"{result_type!r}"
        )
    try:
        return _parse_datatype_string(result_type)
    except ddl_refusals() as ex:  # Spark refused it; no session to ask raises as itself
        raise SparkOpsConfigError(
            f"{what}: result_type={result_type!r} is not a Spark type (try 'double', "
            f"'bigint', 'string', 'array<double>', 'struct<a: double, b: bigint>')"
        ) from ex


class _Reduce(AggregateFunction):
    """``reduce(fn)`` as an aggregate: the accumulator is the value so far (None: empty)."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        self.fn = fn

    def create_accumulator(self) -> Any:
        return None

    def add(self, value: Any, accumulator: Any) -> Any:
        if value is None:
            return accumulator
        return value if accumulator is None else self.fn(accumulator, value)

    def merge(self, a: Any, b: Any) -> Any:
        if a is None:
            return b
        return a if b is None else self.fn(a, b)

    def get_result(self, accumulator: Any) -> Any:
        return accumulator


# -- the planned aggregation ---------------------------------------------------------------


class LocalAggregation:
    """One planned two-phase aggregation (driver). ``df`` is its lazy result.

    ``metrics`` (bounded) reads the figures of the latest execution of each task, from a
    Spark accumulator; ``metrics_from(query)`` (streaming) reads a micro-batch's figures
    from the query's progress (``observedMetrics``).
    """

    def __init__(
        self,
        plan: Plan,
        selected: DataFrame,
        partial_struct: StructType,
        out_struct: StructType,
        keys: tuple[str, ...],
        options: _Options,
    ) -> None:
        self._plan = plan
        self.keys = keys
        self.is_streaming = bool(selected.isStreaming)
        self.observed_name = f"local_agg_{uuid.uuid4().hex[:12]}"
        self._selected = selected
        self._partial_struct = partial_struct
        self._out_struct = out_struct
        self._options = options
        self._df: DataFrame | None = None
        self._metrics = None
        self._collected = False
        if not self.is_streaming:
            from ._tasks import MetricsParam

            self._metrics = selected.sparkSession.sparkContext.accumulator({}, MetricsParam())

    def __repr__(self) -> str:
        return f"LocalAggregation({self._plan.what})"

    @property
    def result_column(self) -> str:
        return self._plan.out_schema.names[-1]

    @property
    def df(self) -> DataFrame:
        """The result: key columns and the result column (lazy; a streaming DataFrame for
        a streaming input)."""
        if self._df is None:
            self._df = self._build_streaming() if self.is_streaming else self._build_bounded()
        return self._df

    def _partials(self, metrics: Any) -> DataFrame:
        from ._tasks import local_phase

        return self._selected.mapInArrow(local_phase(self._plan, metrics), self._partial_struct)

    def _build_bounded(self) -> DataFrame:
        from ._tasks import final_phase

        keys = [_quoted(k) for k in self._plan.keys]
        partials = self._partials(self._metrics)
        n = self._options.num_reducers
        shuffled = partials.repartition(n, *keys) if n else partials.repartition(*keys)
        return shuffled.mapInArrow(final_phase(self._plan, self._metrics), self._out_struct)

    def _build_streaming(self) -> DataFrame:
        from pyspark.sql import functions as F

        from . import _kernels as K
        from ._tasks import premerge_phase, stream_state_fn

        plan = self._plan
        partials = self._partials(None).observe(
            self.observed_name,
            F.coalesce(F.sum(K.N), F.lit(0)).alias("rows_in"),
            F.count(F.lit(1)).alias("partials_shuffled"),
        )
        keys = [F.col(_quoted(k)) for k in plan.keys]
        out_keys = [F.col(_quoted(k)).alias(u) for k, u in zip(plan.keys, self.keys)]
        alias = self.result_column
        if plan.kind == "builtin":
            if plan.op == "count":
                result = F.sum(K.N)
            elif plan.op == "sum":
                result = F.sum(K.SUM)
            elif plan.op == "min":
                result = F.min(K.MIN)
            elif plan.op == "max":
                result = F.max(K.MAX)
            else:
                cnt = F.sum(K.CNT)
                result = F.when(cnt > 0, F.sum(K.SUM) / cnt)
            grouped = partials.groupBy(*keys).agg(result.alias(alias))
            return grouped.select(*out_keys, F.col(_quoted(alias)))
        # one row per key and micro-batch into the state operator (see premerge_phase)
        merged = partials.repartition(*keys).mapInArrow(premerge_phase(plan), self._partial_struct)
        return merged.groupBy(*keys).applyInPandasWithState(
            stream_state_fn(plan),
            outputStructType=self._out_struct,
            stateStructType="partial binary",
            outputMode="update",
            timeoutConf="NoTimeout",
        )

    # -- results and metrics ---------------------------------------------------------------

    def _bounded_only(self, call: str) -> None:
        if self.is_streaming:
            raise SparkOpsConfigError(
                f"{self._plan.what}.{call} needs a bounded DataFrame, but the input is "
                f"streaming: start a query on .df (e.g. .df.writeStream.outputMode('update')"
                f".format(...).start()) and read the results from its sink"
            )

    def to_dict(self) -> dict[Any, Any]:
        """Run the aggregation and return {key: result} (a tuple key for several key
        columns). Bounded only."""
        from .._spark_compat import collect_arrow

        self._bounded_only("to_dict()")
        table = collect_arrow(self.df)  # Arrow all the way: 10x faster than Rows
        cols = [c.to_pylist() for c in table.columns] if table.num_rows else []
        self._collected = True
        if not cols:
            return {}
        results = cols[-1]
        if len(self.keys) == 1:
            return dict(zip(cols[0], results))
        return dict(zip(zip(*cols[:-1]), results))

    @property
    def metrics(self) -> LocalAggMetrics | None:
        """Figures of the latest execution of each task (None before any task ran). Bounded only;
        for a streaming query use ``metrics_from(query)``."""
        if self.is_streaming:
            raise SparkOpsConfigError(
                f"{self._plan.what}: a streaming aggregation reports metrics per micro-batch; "
                f"use .metrics_from(query) (or query.lastProgress['observedMetrics']"
                f"[{self.observed_name!r}])"
            )
        assert self._metrics is not None
        metrics = _metrics_from_accumulator(self._metrics.value)
        if metrics is None and self._collected:
            # the plan ran without a single task (e.g. an input Spark knows to be empty)
            return LocalAggMetrics(0, 0, 0, 0, 0, 0, 0, 0, 0)
        return metrics

    def metrics_from(self, progress: Any) -> LocalAggMetrics | None:
        """The metrics of a micro-batch, from a ``StreamingQuery`` (its last progress) or a
        progress dict. None when that batch had no data."""
        from .._spark_compat import observed_metrics

        if hasattr(progress, "lastProgress"):
            progress = progress.lastProgress
        observed = observed_metrics(progress, self.observed_name)
        if not observed:
            return None
        return LocalAggMetrics(
            rows_in=int(observed.get("rows_in") or 0),
            partials_shuffled=int(observed.get("partials_shuffled") or 0),
        )
