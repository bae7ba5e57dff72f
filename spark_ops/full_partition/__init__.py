"""Full-partition processing on bounded Spark DataFrames (FLIP-380).

Runs on the driver (argument checks and planning, before any Spark job) and in Spark
tasks (the bodies in ``_full_partition_tasks``, shipped inside ``mapInArrow``).

``full_window_partition(df)`` collects each Spark partition of ``df`` into one full
window, emitted at the end of its input; ``key_by(df, "k").full_window_partition()``
does the same for all records of each key. On the result:

* ``map_partition(fn, schema)``: ``fn(records)`` gets an iterator over every record of the
  window and yields results. Records stream from Spark's Arrow stream one batch at a time
  (the bounded queue: ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows, lower it for
  very wide rows), so a partition far larger than the Python worker's memory works.
* ``sort_partition(field, order)``: by a field index, a column name (``"a.b"`` for a
  nested field), a Column, or a key function. Spark's external sort
  (``sortWithinPartitions``) does the sorting and spills to disk; a key function's keys
  are computed batch by batch into an order-preserving binary column that Spark sorts
  by and then drops.
* ``aggregate(agg, schema)``: one result per window from a ``spark_ops.AggregateFunction``,
  also for an empty partition (``get_result(create_accumulator())``).
* ``reduce(fn)``: ``fn(a, b)`` folds the window's records into one of the input's schema;
  an empty partition gives nothing.

Each returns a lazy DataFrame. Records given to functions are ``pyspark.sql.Row``
objects as ``df.collect()`` returns them (see ``_full_partition_rows``), or
``pyarrow.RecordBatch`` objects with ``batches=True``. Keyed windows stream too: the
input is hash-partitioned by key (a shuffle) and sorted by key within each partition
(Spark's external sort), and each key's run of records is handed to the function as it
passes, so a key with more records than memory holds works as well.

Rich functions (FLIP-380, after Flink's ``RichMapPartitionFunction``): a function or
aggregate given to ``map_partition``, ``aggregate``, ``reduce`` or ``sort_partition`` (its
key function), keyed or not, that defines ``open(ctx)`` and/or ``close()`` gets
``open`` once per Spark partition before its first record and ``close`` once after its
last (also after a failure). ``ctx`` is a ``FunctionContext`` with ``partition_id`` and
``num_partitions``. Each task works on its own copy of the object, so ``open`` is the
place for per-partition resources (a model, a connection).

Functions and aggregates ship to the workers as any PySpark UDF does (cloudpickle):
those defined in a script, a notebook or inside a function travel by value; those in the
user's own modules must be importable on the executors (``--py-files``, ``addPyFile``).

Partitions: every partition Spark runs gives its result, an empty one included (Spark
calls the function with an empty iterator). A DataFrame that the optimizer proves empty
as a whole (``filter(lit(False))``, ``limit(0)``; under adaptive execution on Spark 3.5,
a shuffle whose output is entirely empty) has no partitions at run time, so it gives no
results. Spark 4's adaptive execution keeps an empty shuffle's partitions: each gives its
(empty) result.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .._errors import PartitionFunctionError, SparkOpsConfigError, SparkOpsIndexError
from ..aggregate import AggregateFunction, _check_aggregate
from ..iteration.barrier import num_partitions
from ._tasks import FunctionContext, TaskSpec, run_task

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType, StructType

__all__ = [
    "FunctionContext",
    "KeyedDataFrame",
    "KeyedPartitionWindowedStream",
    "Order",
    "PartitionFunctionError",
    "PartitionWindowedStream",
    "full_window_partition",
    "key_by",
]

_SORT_KEY = "__spark_ops_sort_key"


class Order(str, Enum):
    """The order of ``sort_partition`` (Spark's nulls: first ascending, last descending)."""

    ASCENDING = "ASCENDING"
    DESCENDING = "DESCENDING"


# -- argument checks (driver, before any job) ------------------------------------------------


def _check_dataframe(df: Any, what: str) -> DataFrame:
    from pyspark.sql import DataFrame

    if not isinstance(df, DataFrame):
        raise SparkOpsConfigError(f"{what} needs a pyspark.sql.DataFrame, got {type(df).__name__}")
    if df.isStreaming:
        raise SparkOpsConfigError(
            f"{what} needs a bounded DataFrame, but df is a streaming DataFrame "
            f"(df.isStreaming is True): a full window is emitted at the end of the input, "
            f"which a stream never reaches. Apply it to each micro-batch instead "
            f"(df.writeStream.foreachBatch(lambda batch, _: ...)), or read the source as a "
            f"batch (spark.read instead of spark.readStream)"
        )
    return df


def _check_function(fn: Any, what: str, shape: str) -> Callable:
    if fn is None:
        raise SparkOpsConfigError(f"{what} needs a function {shape}, got None")
    if not callable(fn):
        raise SparkOpsConfigError(
            f"{what} needs a function {shape}, got a {type(fn).__name__} ({fn!r:.80})"
        )
    return fn


def _check_order(order: Any) -> Order:
    if isinstance(order, Order):
        return order
    if isinstance(order, str) and order.upper() in Order.__members__:
        return Order[order.upper()]
    raise SparkOpsConfigError(
        f"order must be Order.ASCENDING or Order.DESCENDING, got {order!r:.80}"
    )


def _check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise SparkOpsConfigError(f"{name} must be True or False, got {value!r:.80}")
    return value


def _fn_name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not name:
        return repr(fn)
    return repr(name.rsplit("<locals>.", 1)[-1])  # "Class.method", not "f.<locals>.g"


def _output_schema(schema: Any, what: str) -> tuple[StructType, bool]:
    """``schema`` as a StructType; True when it was an atomic type (one ``value`` column)."""
    from pyspark.sql.types import DataType, StructField, StructType, _parse_datatype_string

    from .._spark_compat import ddl_refusals

    if schema is None:
        raise SparkOpsConfigError(
            f'{what} needs the schema of its results: a DDL string ("id long, total '
            f'double"), a pyspark StructType, or an atomic type ("double") for one column '
            f"named value"
        )
    if isinstance(schema, str):
        try:
            parsed = _parse_datatype_string(schema)
        except ddl_refusals() as ex:  # Spark refused it; no session to ask raises as itself
            raise SparkOpsConfigError(
                f"{what}: schema {schema!r} is not a valid DDL schema or type "
                f'(e.g. "id long, total double" or "double"): {str(ex).splitlines()[0]}'
            ) from ex
    elif isinstance(schema, DataType):
        parsed = schema
    else:
        raise SparkOpsConfigError(
            f"{what}: schema must be a DDL string or a pyspark DataType, got "
            f"{type(schema).__name__}"
        )
    if isinstance(parsed, StructType):
        if not parsed.fields:
            raise SparkOpsConfigError(f"{what}: schema has no columns")
        return parsed, False
    return StructType([StructField("value", parsed, True)]), True


def _arrow(schema: StructType, what: str) -> pa.Schema:
    from pyspark.errors import PySparkTypeError

    from .._spark_compat import to_arrow_schema

    try:
        return to_arrow_schema(schema)
    except PySparkTypeError as ex:  # PySpark's refusal of a type, nothing else
        raise SparkOpsConfigError(
            f"{what}: the schema {schema.simpleString()} has a type Spark cannot exchange "
            f"with Python through Arrow: {ex}"
        ) from ex


def _orderable(t: DataType) -> bool:
    """What Spark can sort by (its RowOrdering.isOrderable)."""
    from pyspark.sql.types import (
        ArrayType,
        AtomicType,
        NullType,
        StructType,
        UserDefinedType,
    )

    if isinstance(t, (NullType, AtomicType)):
        return True
    if isinstance(t, StructType):
        return all(_orderable(f.dataType) for f in t.fields)
    if isinstance(t, ArrayType):
        return _orderable(t.elementType)
    if isinstance(t, UserDefinedType):
        return _orderable(t.sqlType())
    return False  # maps, intervals of the calendar kind, ...


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _case_sensitive(df: DataFrame) -> bool:
    return str(df.sparkSession.conf.get("spark.sql.caseSensitive", "false")).lower() == "true"


def _find_field(fields: Sequence[Any], name: str, case_sensitive: bool) -> Any | None:
    for f in fields:
        if f.name == name:
            return f
    if not case_sensitive:
        matches = [f for f in fields if f.name.lower() == name.lower()]
        if len(matches) == 1:
            return matches[0]
    return None


def _resolve_name(df: DataFrame, name: str, what: str) -> tuple[Column, str, DataType]:
    """A column name, or a dotted path into structs, as (Column, display name, type)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    cs = _case_sensitive(df)
    top = _find_field(df.schema.fields, name, cs)
    if top is not None:  # a top-level column, dots in its name or not
        return F.col(_quote(top.name)), top.name, top.dataType
    parts = name.split(".")
    field = _find_field(df.schema.fields, parts[0], cs)
    if field is None:
        raise SparkOpsConfigError(
            f"{what}: column {name!r} is not in the DataFrame; its columns are {df.columns}"
        )
    col = F.col(_quote(field.name))
    path = [field.name]
    for part in parts[1:]:
        if not isinstance(field.dataType, StructType):
            raise SparkOpsConfigError(
                f"{what}: {'.'.join(path)!r} has type {field.dataType.simpleString()}, which "
                f"has no field {part!r} (only struct columns have nested fields)"
            )
        child = _find_field(field.dataType.fields, part, cs)
        if child is None:
            raise SparkOpsConfigError(
                f"{what}: {'.'.join(path)!r} has no field {part!r}; its fields are "
                f"{field.dataType.names}"
            )
        field = child
        col = col.getField(field.name)
        path.append(field.name)
    return col, ".".join(path), field.dataType


def _sort_column(df: DataFrame, field: Any, what: str) -> tuple[Column, str]:
    """A field index, name or Column as an orderable Column (checked, no job)."""
    from pyspark.sql import Column

    if isinstance(field, bool) or not isinstance(field, (int, str, Column)):
        raise SparkOpsConfigError(
            f'{what}: field must be a field index (int), a column name (str, "a.b" for '
            f"a nested field), a Column, or a key function, got {type(field).__name__}"
        )
    if isinstance(field, int):
        n = len(df.columns)
        if not 0 <= field < n:
            raise SparkOpsIndexError(
                f"{what}: field index {field} is out of range: the DataFrame has {n} "
                f"column(s), so use 0..{n - 1} ({df.columns})"
            )
        f = df.schema.fields[field]
        col, label, dtype = _resolve_name(df, f.name, what)
    elif isinstance(field, str):
        col, label, dtype = _resolve_name(df, field, what)
    else:
        from pyspark.errors import AnalysisException

        col = field
        try:
            dtype = df.select(field).schema.fields[0].dataType
        except AnalysisException as ex:  # Spark's analysis refused it; others raise as they are
            raise SparkOpsConfigError(
                f"{what}: the Column {field} does not resolve against the DataFrame "
                f"(columns {df.columns}): {str(ex).splitlines()[0]}"
            ) from ex
        label = str(field)
    if not _orderable(dtype):
        raise SparkOpsConfigError(
            f"{what}: {label!r} has type {dtype.simpleString()}, which Spark cannot sort "
            f"(maps and calendar intervals have no order); sort by a field inside it or by "
            f"a key function"
        )
    return col, label


def _unused_name(columns: Sequence[str], base: str) -> str:
    name, i = base, 0
    while name in columns:
        i += 1
        name = f"{base}_{i}"
    return name


def _max_rows(df: DataFrame) -> int:
    try:
        n = int(
            df.sparkSession.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000")
            or "10000"
        )
    except (TypeError, ValueError):
        n = 10_000
    return n if n > 0 else 10_000


# -- the windows ---------------------------------------------------------------------------


def _coalescable(df: DataFrame) -> bool:
    """True when adaptive execution may coalesce a shuffle whose size Spark chose (the
    keyed shuffle without ``key_by(num_partitions=...)``): its planned count is only an
    upper bound."""
    conf = df.sparkSession.conf
    return all(
        str(conf.get(k, "true")).lower() == "true"
        for k in ("spark.sql.adaptive.enabled", "spark.sql.adaptive.coalescePartitions.enabled")
    )


def _map_in_arrow(
    df: DataFrame, spec: TaskSpec, user: Any, schema: StructType, *, sized: bool = True
) -> DataFrame:
    """``sized``: False when the last shuffle's size is Spark's own choice."""
    if callable(getattr(user, "open", None)):
        # a rich function's open(ctx) learns the partition count: read from the plan
        # (no job), only for functions that ask; unknown rather than a wrong number
        n = num_partitions(df) if sized or not _coalescable(df) else None
        spec = dataclasses.replace(spec, num_partitions=n)
    return df.mapInArrow(functools.partial(run_task, spec, user), schema)


@dataclass(frozen=True, eq=False)
class PartitionWindowedStream:
    """Each Spark partition of a bounded DataFrame as one full window (FLIP-380).

    Made on the driver by ``full_window_partition(df)``; every method checks its
    arguments and returns a lazy DataFrame whose work runs in Spark tasks.
    """

    df: DataFrame

    def map_partition(self, fn: Callable, schema: Any, *, batches: bool = False) -> DataFrame:
        """``fn(records)`` once per partition; it yields results of ``schema``.

        ``records`` is an iterator over every record of the partition: pyspark Rows, or
        ``pyarrow.RecordBatch`` objects with ``batches=True``. ``fn`` yields Rows, tuples,
        dicts, or bare values for a one-column schema (RecordBatches or Tables with
        ``batches=True``). ``schema``: a DDL string, a StructType, or an atomic type for
        one column named ``value``.
        """
        return _map_partition(self.df, (), fn, schema, batches)

    def sort_partition(self, field: Any, order: Order | str = Order.ASCENDING) -> DataFrame:
        """The records of each partition sorted by ``field``.

        ``field``: a field index, a column name (``"a.b"`` for a nested field), a Column,
        or a key function ``key(row)`` returning any orderable Python value (numbers,
        strings, bytes, dates, datetimes, None, tuples of those).
        """
        return _sort_partition(self.df, (), None, field, order)

    def aggregate(self, agg: AggregateFunction, schema: Any, *, batches: bool = False) -> DataFrame:
        """One ``agg.get_result`` per partition, an empty partition included.

        ``agg.add(record, acc)`` gets each Row (each RecordBatch with ``batches=True``).
        """
        return _aggregate(self.df, (), None, agg, schema, batches)

    def reduce(self, fn: Callable[[Any, Any], Any]) -> DataFrame:
        """``fn(a, b)`` folds each partition's Rows into one record of ``df``'s schema;
        an empty partition gives nothing."""
        return _reduce(self.df, (), None, fn)


@dataclass(frozen=True, eq=False)
class KeyedPartitionWindowedStream:
    """All records of each key as one full window (``key_by(df, key).full_window_partition()``).

    The input is hash-partitioned by key (``num_partitions`` partitions, or
    ``spark.sql.shuffle.partitions``) and sorted by key within each partition; a key's
    records then stream to the function in bounded memory, however many there are.
    """

    df: DataFrame
    keys: tuple[str, ...]
    num_partitions: int | None = None

    def map_partition(self, fn: Callable, schema: Any, *, batches: bool = False) -> DataFrame:
        """``fn(records)`` once per key (the key is in every record); yields ``schema``."""
        return _map_partition(self.df, self.keys, fn, schema, batches, self.num_partitions)

    def sort_partition(self, field: Any, order: Order | str = Order.ASCENDING) -> DataFrame:
        """Records grouped by key, each key's records sorted by ``field``."""
        return _sort_partition(self.df, self.keys, self.num_partitions, field, order)

    def aggregate(self, agg: AggregateFunction, schema: Any, *, batches: bool = False) -> DataFrame:
        """One row per key: the key columns, then the columns of ``schema``."""
        return _aggregate(self.df, self.keys, self.num_partitions, agg, schema, batches)

    def reduce(self, fn: Callable[[Any, Any], Any]) -> DataFrame:
        """One record per key, of ``df``'s schema, folded by ``fn(a, b)``."""
        return _reduce(self.df, self.keys, self.num_partitions, fn)


@dataclass(frozen=True, eq=False)
class KeyedDataFrame:
    """A bounded DataFrame with key columns (``key_by``); ``full_window_partition()``."""

    df: DataFrame
    keys: tuple[str, ...]
    num_partitions: int | None = None

    def full_window_partition(self) -> KeyedPartitionWindowedStream:
        """All records of each key as one full window."""
        return KeyedPartitionWindowedStream(self.df, self.keys, self.num_partitions)


def full_window_partition(df: DataFrame) -> PartitionWindowedStream:
    """Each partition of the bounded DataFrame ``df`` as one full window."""
    return PartitionWindowedStream(_check_dataframe(df, "full_window_partition"))


def key_by(
    df: DataFrame, key: str | Sequence[str], *, num_partitions: int | None = None
) -> KeyedDataFrame:
    """``df`` keyed by one or more top-level columns (Spark groups: null and NaN are keys).

    ``num_partitions``: how many partitions the keys are hashed into (default:
    ``spark.sql.shuffle.partitions``, which adaptive execution may coalesce).
    """
    what = "key_by"
    _check_dataframe(df, what)
    names = (key,) if isinstance(key, str) else key
    if isinstance(names, (list, tuple)) and not names:
        raise SparkOpsConfigError(f"{what} needs at least one key column, got {key!r}")
    if not isinstance(names, (list, tuple)) or not all(isinstance(k, str) for k in names):
        raise SparkOpsConfigError(
            f"{what}: key must be a column name or a list of column names, got {key!r:.80}"
        )
    if num_partitions is not None and (
        isinstance(num_partitions, bool)
        or not isinstance(num_partitions, int)
        or num_partitions < 1
    ):
        raise SparkOpsConfigError(
            f"{what}: num_partitions must be an int >= 1 or None, got {num_partitions!r}"
        )
    cs = _case_sensitive(df)
    resolved = []
    for name in names:
        field = _find_field(df.schema.fields, name, cs)
        if field is None:
            hint = (
                f"; for a nested field, add it as a column first "
                f"(df.withColumn({name.split('.')[-1]!r}, F.col({name!r})))"
                if "." in name
                else ""
            )
            raise SparkOpsConfigError(
                f"{what}: key column {name!r} is not in the DataFrame; its columns are "
                f"{df.columns}{hint}"
            )
        if not _orderable(field.dataType):
            raise SparkOpsConfigError(
                f"{what}: key column {field.name!r} has type {field.dataType.simpleString()}, "
                f"which Spark cannot group and sort by; key by a field inside it instead"
            )
        resolved.append(field.name)
    if len(set(resolved)) != len(resolved):
        raise SparkOpsConfigError(f"{what}: key columns repeat: {resolved}")
    return KeyedDataFrame(df, tuple(resolved), num_partitions)


# -- planning --------------------------------------------------------------------------------


def _clustered(df: DataFrame, keys: tuple[str, ...], n: int | None) -> DataFrame:
    """Hash-partitioned by the keys: all records of a key in one partition."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType, FloatType

    types = {f.name: f.dataType for f in df.schema.fields}
    # -0.0 and 0.0 are one key to Spark's grouping but hash apart; + 0.0 makes both 0.0.
    exprs = [
        F.col(_quote(k)) + F.lit(0.0)
        if isinstance(types[k], (FloatType, DoubleType))
        else F.col(_quote(k))
        for k in keys
    ]
    return df.repartition(n, *exprs) if n is not None else df.repartition(*exprs)


def _grouped(df: DataFrame, keys: tuple[str, ...], n: int | None) -> DataFrame:
    """Clustered by the keys and sorted by them within each partition (external sort),
    so each key's records arrive as one run."""
    return _clustered(df, keys, n).sortWithinPartitions(*[_quote(k) for k in keys])


def _map_partition(
    df: DataFrame,
    keys: tuple[str, ...],
    fn: Any,
    schema: Any,
    batches: Any,
    n: int | None = None,
) -> DataFrame:
    what = "map_partition"
    _check_function(fn, what, "fn(records) that yields results")
    _check_flag(batches, "batches")
    _arrow(df.schema, what)  # the records must reach Python
    struct, single = _output_schema(schema, what)
    spec = TaskSpec(
        op=what,
        fn_name=_fn_name(fn),
        out_schema=_arrow(struct, what),
        single_value=single,
        batches=batches,
        key_columns=keys,
        max_rows=_max_rows(df),
    )
    if keys:
        df = _grouped(df, keys, n)
    return _map_in_arrow(df, spec, fn, struct, sized=not keys or n is not None)


def _sort_partition(
    df: DataFrame, keys: tuple[str, ...], n: int | None, field: Any, order: Any
) -> DataFrame:
    from pyspark.sql import Column
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType, StructField, StructType

    what = "sort_partition"
    if field is None:
        raise SparkOpsConfigError(
            f"{what} needs a field: a field index, a column name, a Column, or a key "
            f"function, got None"
        )
    direction = _check_order(order)
    key_cols = [F.col(_quote(k)).asc() for k in keys]
    base = _clustered(df, keys, n) if keys else df
    if callable(field) and not isinstance(field, Column):
        _arrow(df.schema, what)  # the records must reach Python
        name = _unused_name(df.columns, _SORT_KEY)
        spec = TaskSpec(op=what, fn_name=_fn_name(field), sort_key_column=name)
        with_key = StructType([*df.schema.fields, StructField(name, BinaryType(), False)])
        keyed = _map_in_arrow(base, spec, field, with_key, sized=not keys or n is not None)
        sort_key = F.col(name).asc() if direction is Order.ASCENDING else F.col(name).desc()
        return keyed.sortWithinPartitions(*key_cols, sort_key).drop(name)
    col, _ = _sort_column(df, field, what)
    by = col.asc() if direction is Order.ASCENDING else col.desc()
    return base.sortWithinPartitions(*key_cols, by)


def _aggregate(
    df: DataFrame,
    keys: tuple[str, ...],
    n: int | None,
    agg: Any,
    schema: Any,
    batches: Any,
) -> DataFrame:
    from pyspark.sql.types import StructType

    what = "aggregate"
    _check_aggregate(agg, what)
    _check_flag(batches, "batches")
    _arrow(df.schema, what)  # the records must reach Python
    struct, single = _output_schema(schema, what)
    result_arrow = _arrow(struct, what)
    if keys:
        clash = [f.name for f in struct.fields if f.name in keys]
        if clash:
            raise SparkOpsConfigError(
                f"{what}: the result columns {clash} have the names of key columns; the "
                f"output is the key columns followed by the result's, so rename them"
            )
        key_fields = [df.schema[k] for k in keys]
        out = StructType([*key_fields, *struct.fields])
    else:
        out = struct
    spec = TaskSpec(
        op=what,
        fn_name=repr(type(agg).__name__),
        out_schema=_arrow(out, what),
        single_value=single,
        batches=batches,
        key_columns=keys,
        result_schema=result_arrow,
        max_rows=_max_rows(df),
    )
    if keys:
        df = _grouped(df, keys, n)
    return _map_in_arrow(df, spec, agg, out, sized=not keys or n is not None)


def _reduce(df: DataFrame, keys: tuple[str, ...], n: int | None, fn: Any) -> DataFrame:
    what = "reduce"
    _check_function(fn, what, "fn(a, b) that combines two records into one")
    spec = TaskSpec(
        op=what,
        fn_name=_fn_name(fn),
        out_schema=_arrow(df.schema, what),
        key_columns=keys,
        max_rows=_max_rows(df),
    )
    if keys:
        df = _grouped(df, keys, n)
    return _map_in_arrow(df, spec, fn, df.schema, sized=not keys or n is not None)
