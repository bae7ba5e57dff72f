"""Driver-side planning shared by bounded and streaming operations with side inputs.

Runs on the driver: argument checks (before any job), reading broadcast views into
content, and building the ``mapInArrow`` that runs the user function over a bounded
DataFrame (a whole bounded main input, or one micro-batch of a streaming one).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..iteration.barrier import _FRAMED_SCHEMA, _frame_fn
from ._content import VersionApplier, duplicate_error, key_names, value_names
from ._errors import SideInputConfigError, SideInputKeyError
from ._store import KeyedSource
from ._task import (
    BUCKET,
    MAIN,
    TAG,
    OpPlan,
    broadcast_task,
    bucketed_task,
    copartitioned_task,
    side_struct,
)
from ._views import SideInput, _ViewSpec, check_window_column

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import StructType

__all__ = ["MainSpec", "check_main", "collect_arrow", "make_plan", "run_on"]


def col(name: str) -> Column:
    """A column by its exact name, even with dots or backticks in it."""
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


def layout_columns(spec: _ViewSpec) -> list[Column]:
    """The side DataFrame's columns in the internal layout (``__k*``, ``__w``, ``__v*``)."""
    cols = [col(k).alias(n) for k, n in zip(spec.key, key_names(len(spec.key)))]
    if spec.window:
        cols.append(col(spec.window).alias("__w"))
    cols += [col(v).alias(n) for v, n in zip(spec.value, value_names(len(spec.value)))]
    return cols


def collect_arrow(df: DataFrame, *, streamed: bool = False) -> Iterator[pa.RecordBatch]:
    """The DataFrame's rows on the driver as Arrow batches.

    ``streamed`` fetches one partition at a time (``toLocalIterator``), so the driver
    holds one partition's rows, not all of them, while the caller consumes them.
    """
    framed = df.mapInArrow(_frame_fn, _FRAMED_SCHEMA)
    rows = framed.toLocalIterator() if streamed else framed.collect()
    for row in rows:
        yield from pa.ipc.open_stream(pa.py_buffer(row[0])).read_all().to_batches()


def fold_side(spec: _ViewSpec, df: DataFrame, content: dict[Any, Any], *, replace: bool) -> Any:
    """Read a bounded side DataFrame (or one side micro-batch) into ``content``.

    Returns the ``VersionApplier`` after ``finish()`` (its ``rows`` and ``touched``).
    """
    applier = VersionApplier(spec, content, replace=replace)
    for batch in collect_arrow(df.select(*layout_columns(spec))):
        applier.add_batch(batch)
    applier.finish()
    return applier


def fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def check_fn(fn: Any, method: str) -> None:
    if fn is None:
        raise SideInputConfigError(
            f"{method}(fn, ...) needs a function, got None; pass e.g. "
            f"lambda row, ctx: ... (ctx.side_input(view) reads a view)"
        )
    if isinstance(fn, SideInput):
        raise SideInputConfigError(
            f"{method}() got the view {fn!r} as its function; views go to "
            f"with_side_inputs(main, *views), the function comes first here"
        )
    if not callable(fn):
        raise SideInputConfigError(
            f"{method}(fn, ...) needs a callable taking (row, ctx), got {type(fn).__name__}"
        )


def parse_schema(schema: Any, method: str) -> StructType:
    from pyspark.sql.types import StructType, _parse_datatype_string

    from .._spark_compat import ddl_refusals

    if schema is None:
        raise SideInputConfigError(
            f"{method}(fn, schema) needs the output schema: a StructType or a DDL string "
            f"such as 'user_id long, segment string'"
        )
    if isinstance(schema, StructType):
        return schema
    if not isinstance(schema, str):
        raise SideInputConfigError(
            f"{method}(): schema must be a StructType or a DDL string, got {type(schema).__name__}"
        )
    try:
        parsed = _parse_datatype_string(schema)
    except ddl_refusals() as ex:  # Spark refused it; no session to ask raises as itself
        raise SideInputConfigError(
            f"{method}(): schema {schema!r} is not a valid DDL schema ({ex}); write e.g. "
            f"'user_id long, segment string'"
        ) from ex
    if not isinstance(parsed, StructType):
        raise SideInputConfigError(
            f"{method}(): schema {schema!r} is a {parsed.simpleString()}, not a struct; name "
            f"the column, e.g. 'value {schema}'"
        )
    return parsed


@dataclass(frozen=True)
class MainSpec:
    """The main input's side of an operation, checked by ``check_main``."""

    columns: tuple[str, ...]
    key: tuple[str, ...]
    window: str | None
    num_partitions: int | None


def _names(arg: str, what: str | Sequence[str] | None) -> tuple[str, ...]:
    if what is None:
        return ()
    names = (what,) if isinstance(what, str) else tuple(what)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise SideInputConfigError(
            f"with_side_inputs: {arg}= must be a column name or a list of names, got {what!r}"
        )
    return names


def check_main(
    main: Any,
    views: Sequence[Any],
    *,
    key: str | Sequence[str] | None,
    window: str | None,
    num_partitions: int | None,
) -> MainSpec:
    """Every argument of ``with_side_inputs``, checked against the schemas (no job)."""
    from pyspark.sql import DataFrame

    if main is None or not isinstance(main, DataFrame):
        raise SideInputConfigError(
            f"with_side_inputs(main, *views) needs a pyspark.sql.DataFrame as main, got "
            f"{type(main).__name__}"
        )
    if not views:
        raise SideInputConfigError(
            "with_side_inputs(main, *views) needs at least one view, e.g. "
            "MapSideInput(dims_df, key='user_id', value='segment')"
        )
    for v in views:
        if isinstance(v, type) and issubclass(v, SideInput):
            raise SideInputConfigError(
                f"with_side_inputs got the class {v.__name__}; create a view: "
                f"{v.__name__}(side_df, ...)"
            )
        if not isinstance(v, SideInput):
            raise SideInputConfigError(
                f"with_side_inputs takes SingletonSideInput, ListSideInput, MapSideInput or "
                f"MultimapSideInput views after the main DataFrame, got {type(v).__name__}"
            )
        v.df  # noqa: B018 - raises for a view unpickled without its DataFrame
    names = [v.name for v in views]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise SideInputConfigError(
            f"with_side_inputs: views must have distinct names (ctx.side_input accepts a name); "
            f"{dups} appear more than once (pass each view once, or give name=...)"
        )
    columns = tuple(main.columns)
    if len(set(columns)) != len(columns):
        raise SideInputConfigError(
            f"with_side_inputs: the main DataFrame has duplicate column names {list(columns)}; "
            f"rename them first (the function gets Rows by name)"
        )
    if num_partitions is not None and (
        isinstance(num_partitions, bool)
        or not isinstance(num_partitions, int)
        or num_partitions < 1
    ):
        raise SideInputConfigError(
            f"with_side_inputs: num_partitions must be an int >= 1 or None, got {num_partitions!r}"
        )
    keys = _names("key", key)
    missing = [k for k in keys if k not in columns]
    if missing:
        raise SideInputConfigError(
            f"with_side_inputs: key={list(keys)} names {missing}, not columns of the main "
            f"DataFrame {list(columns)}"
        )
    for v in views:
        spec = v._spec
        if not spec.keyed:
            continue
        if not keys:
            raise SideInputKeyError(
                f"{v!r} is keyed, so the main input needs a key to co-partition on: "
                f"with_side_inputs(main, ..., key='<main key column>')"
            )
        if len(spec.key) != len(keys):
            raise SideInputKeyError(
                f"{v!r} has {len(spec.key)} key column(s) {list(spec.key)} but the main key has "
                f"{len(keys)} {list(keys)}; a keyed view's key must match the main input's key"
            )
        for mk, sk in zip(keys, spec.key):
            mt, st = main.schema[mk].dataType, v.df.schema[sk].dataType
            if mt != st:
                raise SideInputKeyError(
                    f"{v!r} key column {sk!r} is {st.simpleString()} but the main key {mk!r} is "
                    f"{mt.simpleString()}; a keyed view's key must have the main key's type "
                    f"(cast one side, e.g. F.col({sk!r}).cast({mt.simpleString()!r}))"
                )
    if window is not None:
        check_window_column(main, window, "with_side_inputs")
    for v in views:
        if v.window is None:
            continue
        if window is None:
            raise SideInputConfigError(
                f"{v!r} is windowed, so the main input must be too: "
                f"with_side_inputs(main, ..., window='<main window column>')"
            )
        mt = main.schema[window].dataType["end"].dataType
        st = v.df.schema[v.window].dataType["end"].dataType
        if mt != st:
            raise SideInputConfigError(
                f"{v!r} window {v.window!r} holds {st.simpleString()} but the main window "
                f"{window!r} holds {mt.simpleString()}; use the same timestamp type on both"
            )
    if not main.isStreaming:
        streaming = [v for v in views if v.is_streaming]
        if streaming:
            raise SideInputConfigError(
                f"{streaming[0]!r} reads a streaming DataFrame but the main input is bounded; "
                f"an evolving side input needs a streaming main input (or read the side "
                f"input with spark.read instead of spark.readStream)"
            )
    return MainSpec(columns, keys, window, num_partitions)


def make_plan(main: DataFrame, spec: MainSpec, op: str, fn: Any, schema: Any) -> tuple[OpPlan, Any]:
    """The task plan and the Spark output schema of ``op`` (checked, no job)."""
    from pyspark.errors import PySparkTypeError

    from .._spark_compat import to_arrow_schema

    check_fn(fn, op)
    if op == "filter":
        struct, arrow = main.schema, None
    else:
        struct = parse_schema(schema, op)
        try:
            arrow = to_arrow_schema(struct)
        except PySparkTypeError as ex:  # PySpark's refusal of a type, nothing else
            raise SideInputConfigError(
                f"{op}(): schema {struct.simpleString()} has a type Arrow cannot carry: {ex}"
            ) from ex
    plan = OpPlan(
        op=op,
        fn=fn,
        fn_name=fn_name(fn),
        main_columns=spec.columns,
        key=spec.key,
        window=spec.window,
        out_schema=arrow,
    )
    return plan, struct


def _key_cols(keys: Sequence[str]) -> list[Column]:
    return [col(k).alias(n) for k, n in zip(keys, key_names(len(keys)))]


def run_on(
    df: DataFrame,
    plan: OpPlan,
    out_struct: Any,
    main: MainSpec,
    *,
    broadcast: tuple[tuple[_ViewSpec, int], ...],
    bcast: Mapping[str, Any],
    keyed_views: Sequence[SideInput] = (),
    keyed_sources: tuple[KeyedSource, ...] = (),
    key_groups: int = 0,
) -> DataFrame:
    """``df`` (bounded) with the operation applied; lazy, no job runs here.

    ``keyed_views``: bounded keyed views, co-partitioned with ``df`` by a shuffle of both
    on the key. ``keyed_sources``: keyed views of a streaming operation, already in the
    side store by key group; ``df`` is shuffled by the same key groups.
    """
    from pyspark.sql import functions as F

    if keyed_sources:
        bucket = F.pmod(F.hash(*[col(k) for k in main.key]), F.lit(key_groups)).alias(BUCKET)
        grouped = df.select(*[col(c) for c in main.columns], bucket)
        # an explicit count: AQE does not coalesce inside a streaming micro-batch
        n = main.num_partitions or min(key_groups, df.sparkSession.sparkContext.defaultParallelism)
        grouped = grouped.repartition(n, BUCKET)
        return grouped.mapInArrow(bucketed_task(plan, broadcast, bcast, keyed_sources), out_struct)
    if not keyed_views:
        return df.mapInArrow(broadcast_task(plan, broadcast, bcast), out_struct)
    knames = key_names(len(main.key))
    parts = []
    for i, v in enumerate(keyed_views):
        s = v._spec
        fields = [col(s.window).alias("__w")] if s.window else []
        fields += [col(c).alias(n) for c, n in zip(s.value, value_names(len(s.value)))]
        parts.append(
            v.df.select(
                F.lit(i).alias(TAG), *_key_cols(s.key), F.struct(*fields).alias(side_struct(i))
            )
        )
    parts.append(
        df.select(
            F.lit(len(keyed_views)).alias(TAG),
            *_key_cols(main.key),
            F.struct(*[col(c) for c in main.columns]).alias(MAIN),
        )
    )
    combined = functools.reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    combined = (
        combined.repartition(main.num_partitions, *knames)
        if main.num_partitions
        else combined.repartition(*knames)
    )
    keyed_specs = tuple(v._spec for v in keyed_views)
    task = copartitioned_task(plan, broadcast, bcast, keyed_specs)
    return combined.sortWithinPartitions(TAG).mapInArrow(task, out_struct)


def check_keyed_unique(views: Sequence[SideInput]) -> None:
    """A bounded keyed singleton / map view holds one value per (window, key): checked on
    the driver, as the broadcast path checks while reading, so a duplicate is a
    ``SideInputValueError`` here rather than Spark's ``PythonException`` from a task.
    One aggregation job per such view (key columns only; ``.cache()`` a side DataFrame
    that is expensive to compute)."""
    from pyspark.sql import functions as F

    for v in views:
        s = v._spec
        if not s.unique:
            continue
        group = _key_cols(s.key)
        if s.window:
            group += [
                F.unix_micros(col(s.window).start).alias("__ws"),
                F.unix_micros(col(s.window).end).alias("__we"),
            ]
        dup = v.df.groupBy(*group).count().where(col("count") > 1).limit(1).collect()
        if dup:
            row = dup[0]
            keys = [row[n] for n in key_names(len(s.key))]
            ns = (row["__ws"], row["__we"]) if s.window else None
            raise duplicate_error(s, ns, keys[0] if len(keys) == 1 else tuple(keys))


def broadcast_contents(views: Sequence[SideInput]) -> dict[str, dict[Any, Any]]:
    """Bounded broadcast views read once on the driver: view id -> content."""
    out: dict[str, dict[Any, Any]] = {}
    for v in views:
        content: dict[Any, Any] = {}
        fold_side(v._spec, v.df, content, replace=False)
        out[v._spec.view_id] = content
    return out
