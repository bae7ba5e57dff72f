"""Arrow record batches to pyspark Rows and Python records back to Arrow batches.

Runs in Spark tasks. Rows look exactly like the ones ``df.collect()`` returns: a
``pyspark.sql.Row`` per record with its field names (``row.x``, ``row["x"]``,
``row[0]``), structs as nested Rows, maps as dicts, arrays as lists, ``TimestampType``
as naive local datetimes (``TimestampNTZType`` naive as stored), decimals as
``Decimal``, day-time intervals as ``timedelta``, binary as ``bytes`` (Spark >= 4.1) or
``bytearray`` (before; ``_spark_compat.python_binary_type``).

Records going out (what ``map_partition`` functions yield, ``aggregate`` results,
``reduce`` results) may be a Row, a tuple or list (by position), a dict (by name,
missing names are null), or a bare value when the schema has a single column. Integer
columns refuse fractional or out-of-range numbers instead of truncating them.
"""

from __future__ import annotations

import datetime as _dt
import functools
import gc
import operator
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.types as pat
from pyspark.sql import Row

__all__ = ["RowReader", "RowWriter", "conform_batch"]

_Convert = Callable[[pa.Array], list]

_EPOCH = _dt.datetime(1970, 1, 1)


try:  # the C descriptor namedtuple uses for its fields
    from _collections import _tuplegetter  # type: ignore[import-not-found]  # CPython-private, no stub
except ImportError:  # pragma: no cover - other Pythons

    def _tuplegetter(index: int, doc: str) -> Any:
        return property(operator.itemgetter(index), doc=doc)


def _row_class(names: Sequence[str]) -> type:
    """A pyspark Row subclass for one schema.

    The field names live on the class, not on each row, so building a row is one
    ``tuple.__new__`` (pyspark's Row sets ``__fields__`` per instance through a Python
    ``__setattr__``); and ``row.name`` is a namedtuple-style C descriptor instead of
    Row's ``__getattr__`` (a list search in Python on every access). Names Row or tuple
    already define (``count``, ``asDict``) or that are not identifiers keep Row's lookup.
    """
    body: dict[str, Any] = {"__fields__": list(names), "__slots__": ()}
    for i, name in enumerate(names):
        if name.isidentifier() and not name.startswith("_") and not hasattr(Row, name):
            if name not in body:
                body[name] = _tuplegetter(i, f"field {i}: {name}")
    return type("Row", (Row,), body)


def _local_timestamps(micros: list) -> list:
    # What pyspark's TimestampType.fromInternal does: local wall time of the worker.
    fromts = _dt.datetime.fromtimestamp
    return [
        None if us is None else fromts(us // 1_000_000).replace(microsecond=us % 1_000_000)
        for us in micros
    ]


def _split(values: list, lengths: list) -> list:
    out: list[Any] = []
    pos = 0
    for n in lengths:
        if n is None:
            out.append(None)
        else:
            out.append(values[pos : pos + n])
            pos += n
    return out


def _is_binary(t: pa.DataType) -> bool:
    return bool(pat.is_binary(t) or pat.is_large_binary(t) or pat.is_fixed_size_binary(t))


def _needs_conversion(t: pa.DataType) -> bool:
    if _is_binary(t):
        return True
    if pat.is_timestamp(t):
        return t.tz is not None
    if pat.is_struct(t) or pat.is_map(t):
        return True
    if pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t):
        return _needs_conversion(t.value_type)
    return False


def _reader(t: pa.DataType) -> _Convert:
    """Arrow array -> list of Python values as pyspark's Row conversion gives them."""
    if not _needs_conversion(t):
        return pa.Array.to_pylist
    if _is_binary(t):
        from .._spark_compat import python_binary_type

        if python_binary_type() is bytes:
            return pa.Array.to_pylist  # pyarrow's own: bytes

        def binaries(arr: pa.Array) -> list:
            return [None if v is None else bytearray(v) for v in arr.to_pylist()]

        return binaries
    if pat.is_timestamp(t):

        def timestamps(arr: pa.Array) -> list:
            return _local_timestamps(
                arr.cast(pa.timestamp("us", tz=t.tz)).cast(pa.int64()).to_pylist()
            )

        return timestamps
    if pat.is_struct(t):
        cls = _row_class([t.field(i).name for i in range(t.num_fields)])
        children = [_reader(t.field(i).type) for i in range(t.num_fields)]
        new = functools.partial(tuple.__new__, cls)

        def structs(arr: pa.Array) -> list:
            cols = [conv(child) for conv, child in zip(children, arr.flatten())]
            rows: list[Any] = (
                list(map(new, zip(*cols))) if cols else [new(()) for _ in range(len(arr))]
            )
            if arr.null_count:
                valid = arr.is_valid().to_pylist()
                rows = [r if ok else None for r, ok in zip(rows, valid)]
            return rows

        return structs
    if pat.is_map(t):
        keys, items = _reader(t.key_type), _reader(t.item_type)

        def maps(arr: pa.Array) -> list:
            # Offsets are absolute into the (unsliced) keys and items children.
            offsets = arr.offsets.to_pylist()
            start, size = offsets[0], offsets[-1] - offsets[0]
            pairs = list(
                zip(keys(arr.keys.slice(start, size)), items(arr.items.slice(start, size)))
            )
            valid = arr.is_valid().to_pylist()
            lengths = [b - a if ok else None for a, b, ok in zip(offsets, offsets[1:], valid)]
            return [None if p is None else dict(p) for p in _split(pairs, lengths)]

        return maps
    element = _reader(t.value_type)

    def lists(arr: pa.Array) -> list:
        lengths = arr.value_lengths().to_pylist() if not pat.is_fixed_size_list(t) else None
        flat = element(arr.flatten())
        if lengths is None:
            size = t.list_size
            return [
                None if not ok else flat[i * size : (i + 1) * size]
                for i, ok in enumerate(arr.is_valid().to_pylist())
            ]
        return _split(flat, lengths)

    return lists


class RowReader:
    """Turns batches of one schema into lists of Rows (built per batch: bounded memory)."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.names = list(schema.names)
        self.row_class = _row_class(self.names)
        self._new = functools.partial(tuple.__new__, self.row_class)
        self._columns = [_reader(f.type) for f in schema]

    def rows(self, batch: pa.RecordBatch) -> list:
        # The collector off while a batch becomes Rows: they are new, acyclic, and many;
        # with it on, collections triggered by their allocation cost more than building
        # them (measured in a Spark worker: 2.5 vs 0.9 us per row of three columns).
        enabled = gc.isenabled()
        gc.disable()
        try:
            cols = [conv(batch.column(i)) for i, conv in enumerate(self._columns)]
            if not cols:
                return [self._new(()) for _ in range(batch.num_rows)]
            return list(map(self._new, zip(*cols)))
        finally:
            if enabled:
                gc.enable()


# -- out ---------------------------------------------------------------------------------


def _writer(t: pa.DataType) -> Callable[[Any], Any] | None:
    """Python value -> a value pyarrow converts to ``t`` as pyspark would (None: as is)."""
    if pat.is_timestamp(t):
        if t.tz is None:
            return None

        def timestamp(v: Any) -> Any:
            # A naive datetime is local time, as in pyspark (pyarrow would take it as UTC).
            if isinstance(v, _dt.datetime) and v.tzinfo is None:
                return v.astimezone(_dt.timezone.utc)
            return v

        return timestamp
    if pat.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        fields = [_writer(t.field(i).type) for i in range(t.num_fields)]
        if all(f is None for f in fields):

            def plain_struct(v: Any) -> Any:
                if isinstance(v, Row) and hasattr(v, "__fields__"):
                    return v.asDict()
                return v

            return plain_struct

        def struct(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, Row) and hasattr(v, "__fields__"):
                v = v.asDict()
            if isinstance(v, dict):
                return {
                    n: (f(v.get(n)) if f and v.get(n) is not None else v.get(n))
                    for n, f in zip(names, fields)
                }
            return {n: (f(x) if f and x is not None else x) for n, f, x in zip(names, fields, v)}

        return struct
    if pat.is_map(t):
        kw, iw = _writer(t.key_type), _writer(t.item_type)
        if kw is None and iw is None:
            return None

        def mapping(v: Any) -> Any:
            if v is None:
                return None
            items = v.items() if isinstance(v, dict) else v
            return [
                (kw(k) if kw and k is not None else k, iw(x) if iw and x is not None else x)
                for k, x in items
            ]

        return mapping
    if pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t):
        ew = _writer(t.value_type)
        if ew is None:
            return None

        def sequence(v: Any) -> Any:
            return None if v is None else [ew(x) if x is not None else x for x in v]

        return sequence
    return None


_PLAIN_INTS = {int, type(None)}


def _column(values: Sequence[Any], field: pa.Field, write: Callable[[Any], Any] | None) -> pa.Array:
    if write is not None:
        values = [None if v is None else write(v) for v in values]
    t = field.type
    sample = next((v for v in values if v is not None), None)
    try:
        if pat.is_integer(t):
            kinds = set(map(type, values))
            if kinds <= _PLAIN_INTS:
                return pa.array(values, type=t)  # out-of-range values raise
            # pyarrow would truncate 1.5 to 1 for an integer type; infer, then cast safely.
            sample = next((v for v in values if type(v) not in _PLAIN_INTS), sample)
            return pa.array(values).cast(t)
        return pa.array(values, type=t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as ex:
        raise TypeError(
            f"column {field.name!r} has type {t} and cannot hold the value {sample!r:.80} "
            f"({type(sample).__name__}): {ex}"
        ) from ex


class RowWriter:
    """Collects records and turns them into batches of ``schema``.

    ``single_value``: the schema was an atomic type (one column named ``value``) and every
    record is that value itself.
    """

    def __init__(self, schema: pa.Schema, *, single_value: bool = False) -> None:
        self.schema = schema
        self.names = list(schema.names)
        self.single_value = single_value
        self._writers = [_writer(f.type) for f in schema]
        self._index = {n: i for i, n in enumerate(self.names)}
        self._n = len(self.names)

    def record(self, rec: Any) -> tuple:
        """One record as a tuple in schema order (a clear error when it does not fit)."""
        n = self._n
        if self.single_value:
            return (rec,)
        if type(rec) is tuple and len(rec) == n:  # the common case, first
            return rec
        if isinstance(rec, Row) and hasattr(rec, "__fields__"):
            fields = rec.__fields__
            if fields == self.names:
                return tuple(rec)
            rec = dict(zip(fields, rec))
        if isinstance(rec, dict):
            unknown = [k for k in rec if k not in self._index]
            if unknown:
                raise ValueError(
                    f"a record has field(s) {unknown} that are not in the schema's columns {self.names}"
                )
            return tuple(rec.get(name) for name in self.names)
        if isinstance(rec, (tuple, list)):
            if len(rec) != n:
                raise ValueError(
                    f"a record has {len(rec)} value(s) but the schema has {n} column(s) "
                    f"{self.names}: {rec!r:.120}"
                )
            return tuple(rec)
        if n == 1:
            return (rec,)
        raise TypeError(
            f"a record must be a Row, tuple, list or dict for the {n} columns {self.names}, "
            f"got {type(rec).__name__} ({rec!r:.80})"
        )

    def batch(self, records: Sequence[tuple]) -> pa.RecordBatch:
        """Records already passed through ``record()``."""
        if not records:
            return pa.RecordBatch.from_pylist([], schema=self.schema)
        enabled = gc.isenabled()
        gc.disable()  # as in RowReader.rows: nothing built here can form a cycle
        try:
            cols = list(zip(*records))
            arrays = [_column(c, f, w) for c, f, w in zip(cols, self.schema, self._writers)]
        finally:
            if enabled:
                gc.enable()
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def conform_batch(data: Any, schema: pa.Schema) -> list[pa.RecordBatch]:
    """A RecordBatch or Table a user yielded, as batches of exactly ``schema``.

    Columns are matched by name when every name is present, else by position when the
    count matches; each is then cast safely to the schema's type.
    """
    if isinstance(data, pa.Table):
        batches = data.to_batches()
        if not batches:
            return []
    elif isinstance(data, pa.RecordBatch):
        batches = [data]
    else:
        raise TypeError(f"expected a pyarrow.RecordBatch or Table, got {type(data).__name__}")
    out = []
    for b in batches:
        if b.schema.equals(schema):
            out.append(b)
            continue
        names = b.schema.names
        if all(n in names for n in schema.names):
            cols = [b.column(names.index(n)) for n in schema.names]
        elif b.num_columns == len(schema):
            cols = list(b.columns)
        else:
            raise ValueError(
                f"a yielded batch has columns {names}, which match neither the names nor the "
                f"number of the schema's columns {schema.names}"
            )
        arrays = []
        for col, field in zip(cols, schema):
            if col.type.equals(field.type):
                arrays.append(col)
                continue
            try:
                arrays.append(col.cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as ex:
                raise TypeError(
                    f"column {field.name!r} of a yielded batch has type {col.type}, which does "
                    f"not cast safely to the schema's {field.type}: {ex}"
                ) from ex
        out.append(pa.RecordBatch.from_arrays(arrays, schema=schema))
    return out
