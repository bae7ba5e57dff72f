"""Vectorized kernels of local keyed pre-aggregation: grouping, partials, merges.

Runs in Spark tasks (both phases of ``local_key_by``) and in streaming state functions.
Pure pyarrow + numpy over Arrow tables whose columns were renamed by the driver: key
columns ``__la_k0..``, value columns ``__la_v0..``, partial columns as named below, so no
user column name can collide with an internal one.

Grouping is hash based (Arrow's ``dictionary_encode``, C++), followed by a stable radix
argsort of the group codes (numpy radix-sorts 16-bit integers), so the rows of one key
are a contiguous slice and keep their arrival order. The built-in aggregates never call
Python per row or per key; a user ``AggregateFunction`` is called once per key and
chunk (``add_batch``) or once per row (``add``) when it has no vectorized hook.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..aggregate import AggregateFunction

__all__: list[str] = []

KEY = "__la_k"
VALUE = "__la_v"
N = "__la_n"  # input rows of the key the partial covers
SUM = "__la_sum"
CNT = "__la_cnt"
MIN = "__la_min"
MAX = "__la_max"
RED = "__la_r"  # running value of a ufunc reduce
FMT = "__la_fmt"  # how the accumulator is encoded (see encode_accumulators)
ACC_F = "__la_f"
ACC_I = "__la_i"
ACC_P = "__la_p"

BUILTINS = ("sum", "count", "min", "max", "mean")

_MISSING = object()


def key_names(n: int) -> list[str]:
    return [f"{KEY}{i}" for i in range(n)]


def value_names(n: int) -> list[str]:
    return [f"{VALUE}{i}" for i in range(n)]


# -- grouping ------------------------------------------------------------------------------


class Grouping:
    """Rows grouped by key: group ``g`` is rows ``order[starts[g]:starts[g + 1]]``, in
    arrival order.

    ``keys`` holds each group's key columns (in group order, with the input's Arrow
    types); ``counts`` the rows per group; ``codes[i]`` the group of row ``i`` (computed
    on first use: the vectorized aggregate path never needs it).
    """

    def __init__(
        self,
        order: np.ndarray,
        starts: np.ndarray,
        keys: pa.Table,
        codes: np.ndarray | None = None,
    ) -> None:
        self.order = order
        self.starts = starts
        self.keys = keys
        self.counts = np.diff(starts)
        self._codes = codes

    @property
    def num_groups(self) -> int:
        return len(self.counts)

    @property
    def codes(self) -> np.ndarray:
        if self._codes is None:
            codes = np.empty(len(self.order), dtype=np.int64)
            codes[self.order] = np.repeat(np.arange(self.num_groups, dtype=np.int64), self.counts)
            self._codes = codes
        return self._codes


def stable_argsort(codes: np.ndarray, num_groups: int) -> np.ndarray:
    """A stable argsort of group codes in ``[0, num_groups)``: LSD radix on 16-bit digits."""
    if num_groups <= 1:
        return np.arange(len(codes), dtype=np.int64)
    if num_groups <= 1 << 16:
        return np.argsort(codes.astype(np.uint16, copy=False), kind="stable")
    if num_groups <= 1 << 32:
        c = codes.astype(np.int64, copy=False)
        o1 = np.argsort((c & 0xFFFF).astype(np.uint16), kind="stable")
        o2 = np.argsort((c >> 16).astype(np.uint16)[o1], kind="stable")
        return o1[o2]
    return np.argsort(codes, kind="stable")


def _encode_column(col: pa.Array) -> tuple[np.ndarray, int, pa.Array | None]:
    """(codes, number of distinct values, distinct values or None if taken from rows)."""
    try:
        enc = pc.dictionary_encode(col, null_encoding="encode")
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        # nested types (struct, list, map): hash their Python form
        index: dict[Any, int] = {}
        codes = np.fromiter(
            (index.setdefault(_hashable(v), len(index)) for v in col.to_pylist()),
            dtype=np.int64,
            count=len(col),
        )
        return codes, len(index), None
    codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return codes, len(enc.dictionary), enc.dictionary


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple((k, _hashable(x)) for k, x in v.items())
    return v


def group_rows(table: pa.Table, keys: Sequence[str]) -> Grouping:
    """Group the rows of ``table`` by the columns ``keys`` (nulls form their own group).

    Arrow's hash aggregation lists each group's row indices in arrival order (one C++
    pass; ``use_threads=False`` keeps the order); key types it cannot hash (nested
    ones) fall back to encoding and a radix sort.
    """
    n = table.num_rows
    idx = "__la_row"
    try:
        t = table.select(list(keys)).append_column(idx, pa.array(np.arange(n, dtype=np.int64)))
        g = t.group_by(list(keys), use_threads=False).aggregate([(idx, "list")])
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        return _group_rows_sorted(table, keys)
    lists = g.column(f"{idx}_list").combine_chunks()
    offsets = lists.offsets.to_numpy().astype(np.int64)
    order = pc.list_flatten(lists).to_numpy()
    return Grouping(order, offsets - offsets[0], g.select(list(keys)))


def _group_rows_sorted(table: pa.Table, keys: Sequence[str]) -> Grouping:
    n = table.num_rows
    parts = [_encode_column(table.column(k).combine_chunks()) for k in keys]
    if len(parts) == 1:
        codes, num, dictionary = parts[0]
    else:
        combined = np.zeros(n, dtype=np.int64)
        bound = 1
        for c, g, _ in parts:
            bound *= max(g, 1)
            if bound >= 1 << 62:
                raise ValueError("too many distinct key combinations in one chunk")
            combined = combined * max(g, 1) + c
        codes, num, dictionary = _encode_column(pa.array(combined))
        dictionary = None
    counts = np.bincount(codes, minlength=num).astype(np.int64, copy=False)
    starts = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    order = stable_argsort(codes, num)
    if dictionary is not None:
        key_table = pa.table([dictionary], names=list(keys))
    else:
        key_table = table.select(list(keys)).take(pa.array(order[starts[:-1]]))
    return Grouping(order, starts, key_table, codes)


# -- built-ins -----------------------------------------------------------------------------


def builtin_partials(table: pa.Table, keys: Sequence[str], op: str) -> pa.Table:
    """One row per key: ``N`` and the partial of ``op`` over ``VALUE0`` (nulls skipped)."""
    v = f"{VALUE}0"
    aggs: list[tuple] = [([], "count_all")]
    names = {"count_all": N}
    if op == "sum":
        aggs.append((v, "sum"))
        names[f"{v}_sum"] = SUM
    elif op in ("min", "max"):
        aggs.append((v, op))
        names[f"{v}_{op}"] = MIN if op == "min" else MAX
    elif op == "mean":
        # Spark averages in double; summing as double also keeps int64 from overflowing
        table = table.set_column(
            table.schema.get_field_index(v), v, pc.cast(table.column(v), pa.float64())
        )
        aggs += [(v, "sum"), (v, "count")]
        names[f"{v}_sum"] = SUM
        names[f"{v}_count"] = CNT
    elif op != "count":
        raise ValueError(f"unknown built-in {op!r}")
    out = table.group_by(list(keys), use_threads=False).aggregate(aggs)
    return out.rename_columns([names.get(c, c) for c in out.column_names])


def builtin_merge(table: pa.Table, keys: Sequence[str], op: str) -> pa.Table:
    """Merge partial rows per key: ``N`` summed, partial columns merged, ``count_all`` parts."""
    aggs: list[tuple] = [(N, "sum"), ([], "count_all")]
    names = {f"{N}_sum": N, "count_all": "parts"}
    for col, fn in {"sum": [(SUM, "sum")], "min": [(MIN, "min")], "max": [(MAX, "max")]}.get(
        op, [(SUM, "sum"), (CNT, "sum")] if op == "mean" else []
    ):
        aggs.append((col, fn))
        names[f"{col}_{fn}"] = col
    out = table.group_by(list(keys), use_threads=False).aggregate(aggs)
    return out.rename_columns([names.get(c, c) for c in out.column_names])


def builtin_result(merged: pa.Table, op: str, result_type: pa.DataType) -> pa.Array:
    """The final value of ``op`` per merged row, as ``result_type``."""
    if op == "count":
        col = merged.column(N)
    elif op == "sum":
        col = merged.column(SUM)
    elif op == "min":
        col = merged.column(MIN)
    elif op == "max":
        col = merged.column(MAX)
    else:
        cnt = merged.column(CNT)
        total = pc.cast(merged.column(SUM), pa.float64())
        col = pc.if_else(
            pc.greater(cnt, 0), pc.divide(total, pc.cast(cnt, pa.float64())), pa.scalar(None)
        )
    return pc.cast(col, result_type).combine_chunks()


# -- numpy ufunc reduce (fn is e.g. np.add, np.maximum) ------------------------------------


def ufunc_groups(grouping: Grouping, values: pa.Array, ufunc: np.ufunc) -> pa.Array:
    """``ufunc.reduce`` of each group's non-null values; null where a group has none."""
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    out_type = values.type
    g = grouping.num_groups
    if valid.all():
        vals = values.to_numpy(zero_copy_only=False)[grouping.order]
        reduced = ufunc.reduceat(vals, grouping.starts[:-1]) if len(vals) else vals[:0]
        return pa.array(reduced, type=out_type)
    codes = grouping.codes[valid]
    vals = values.filter(pa.array(valid)).to_numpy(zero_copy_only=False)
    counts = np.bincount(codes, minlength=g)
    present = counts > 0
    result = np.zeros(g, dtype=vals.dtype if len(vals) else np.float64)
    if len(vals):
        order = stable_argsort(codes, g)
        starts = np.zeros(g + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        result[present] = ufunc.reduceat(vals[order], starts[:-1][present])
    return pa.array(result, type=out_type, mask=~present)


# -- top n ---------------------------------------------------------------------------------


def top_n_by_codes(
    table: pa.Table, codes: np.ndarray, num_groups: int, by: str, n: int
) -> tuple[pa.Table, np.ndarray]:
    """The ``n`` rows with the largest ``by`` per group (nulls last).

    Returns the selected rows, ordered by group then ``by`` descending, and the rows kept
    per group.
    """
    counts = np.bincount(codes, minlength=num_groups)
    starts = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    sort_table = pa.table({"c": codes, "b": table.column(by)})
    # nulls sort last by default, in both directions
    idx = pc.sort_indices(sort_table, sort_keys=[("c", "ascending"), ("b", "descending")])
    idx = idx.to_numpy()
    rank = np.arange(len(idx), dtype=np.int64) - starts[codes[idx]]
    return table.take(pa.array(idx[rank < n])), np.minimum(counts, n)


def lists_by_group(column: pa.Array | pa.ChunkedArray, kept: np.ndarray) -> pa.Array:
    """Rows already ordered by group as one list per group (``kept`` rows each)."""
    offsets = np.zeros(len(kept) + 1, dtype=np.int32)
    np.cumsum(kept, out=offsets[1:])
    values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def top_n_lists(
    selected: pa.Table, kept_per_group: np.ndarray, columns: Sequence[str], names: Sequence[str]
) -> pa.Array:
    """A ``list<struct<names>>`` per group from rows already ordered by group."""
    struct = pa.StructArray.from_arrays(
        [selected.column(c).combine_chunks() for c in columns], names=list(names)
    )
    return lists_by_group(struct, kept_per_group)


# -- user aggregates -----------------------------------------------------------------------


def _python_values(col: pa.Array) -> list:
    """Python scalars of a column, None for nulls (numpy's tolist is faster when it can)."""
    t = col.type
    if col.null_count == 0 and (
        pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    ):
        return col.to_numpy(zero_copy_only=False).tolist()
    return col.to_pylist()


def fold_groups(
    agg: AggregateFunction, grouping: Grouping, values: Sequence[pa.Array], multi: bool
) -> list:
    """One accumulator per group: ``add_batch`` per group (vectorized) or ``add`` per row."""
    bounds = grouping.starts.tolist()
    create = agg.create_accumulator
    out = []
    if agg.is_vectorized():
        cols = [v.to_numpy(zero_copy_only=False)[grouping.order] for v in values]
        add_batch = agg.add_batch
        for i in range(grouping.num_groups):
            lo, hi = bounds[i], bounds[i + 1]
            part = tuple(c[lo:hi] for c in cols) if multi else cols[0][lo:hi]
            out.append(add_batch(part, create()))
        return out
    order = pa.array(grouping.order)
    lists = [_python_values(v.take(order)) for v in values]
    rows = list(zip(*lists)) if multi else lists[0]
    add = agg.add
    for i in range(grouping.num_groups):
        acc = create()
        for value in rows[bounds[i] : bounds[i + 1]]:
            acc = add(value, acc)
        out.append(acc)
    return out


def merge_groups(agg: AggregateFunction, codes: np.ndarray, num_groups: int, accs: list) -> list:
    """Merge accumulators by group code, in row order."""
    out: list = [_MISSING] * num_groups
    merge = agg.merge
    for c, a in zip(codes.tolist(), accs):
        cur = out[c]
        out[c] = a if cur is _MISSING else merge(cur, a)
    return out


def results(agg: AggregateFunction, accs: list, result_type: pa.DataType, what: str) -> pa.Array:
    get = agg.get_result
    values = [get(a) for a in accs]
    try:
        return pa.array(values, type=result_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as ex:
        sample = values[0] if values else None
        raise TypeError(
            f"{what}: get_result returned {type(sample).__name__} values ({sample!r}) that do "
            f"not fit result_type {result_type}; pass a result_type matching what "
            f"get_result returns"
        ) from ex


# -- accumulator encoding for the shuffle --------------------------------------------------

_FLOATS = (float, np.floating)
_INTS = (int, np.integer)


def _letter(column: Sequence[Any]) -> str | None:
    """'f', 'i' or 'b' when every value is a float / an int / a bool, else None."""
    types = set(map(type, column))
    if all(t is bool or t is np.bool_ for t in types):
        return "b"
    if all(issubclass(t, _INTS) and t is not bool for t in types):
        return "i"
    if all(issubclass(t, _FLOATS) for t in types):
        return "f"
    return None


def encode_accumulators(accs: list) -> dict[str, pa.Array]:
    """Accumulators as Arrow columns ``FMT``, ``ACC_F``, ``ACC_I``, ``ACC_P``.

    Numbers, and tuples of numbers of one shape, travel as ``list<double>`` /
    ``list<int64>`` columns (numpy scalars arrive as Python scalars); anything else is
    pickled per accumulator. The format string says which: ``"f"``/``"i"``/``"b"`` for a
    scalar, ``"(fi)"`` for a tuple (float, int), ``"p"`` for pickled.
    """
    n = len(accs)
    fmt = _numeric_format(accs)
    empty = pa.ListArray.from_arrays(
        pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.float64())
    )
    empty_i = pa.ListArray.from_arrays(
        pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.int64())
    )
    if fmt is None:
        return {
            FMT: pa.array(["p"] * n, pa.string()),
            ACC_F: empty,
            ACC_I: empty_i,
            ACC_P: pa.array([pickle.dumps(a, protocol=5) for a in accs], pa.binary()),
        }
    letters = fmt.strip("()")
    columns: list[Sequence[Any]] = list(zip(*accs)) if fmt.startswith("(") else [accs]
    floats = [np.asarray(c, dtype=np.float64) for c, x in zip(columns, letters) if x == "f"]
    ints = [np.asarray(c, dtype=np.int64) for c, x in zip(columns, letters) if x != "f"]
    return {
        FMT: pa.array([fmt] * n, pa.string()),
        ACC_F: _fixed_lists(floats, n, pa.float64()),
        ACC_I: _fixed_lists(ints, n, pa.int64()),
        ACC_P: pa.nulls(n, pa.binary()),
    }


def _numeric_format(accs: list) -> str | None:
    if not accs:
        return "f"
    first = accs[0]
    try:
        if isinstance(first, tuple) and type(first) is tuple:
            width = len(first)
            if width == 0 or any(type(a) is not tuple or len(a) != width for a in accs):
                return None
            letters = [_letter(c) for c in zip(*accs)]
            known = [x for x in letters if x is not None]
            if len(known) < len(letters):
                return None
            fmt = "(" + "".join(known) + ")"
        else:
            letter = _letter(accs)
            if letter is None:
                return None
            fmt = letter
        # ints beyond int64 must not wrap: let pickle carry them
        columns: list[Sequence[Any]] = list(zip(*accs)) if fmt.startswith("(") else [accs]
        for c, x in zip(columns, fmt.strip("()")):
            if x == "i":
                np.asarray(c, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return None
    return fmt


def _fixed_lists(columns: list[np.ndarray], n: int, typ: pa.DataType) -> pa.Array:
    width = len(columns)
    flat = np.column_stack(columns).ravel() if width else np.zeros(0)
    offsets = np.arange(n + 1, dtype=np.int32) * width
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=typ))


def decode_accumulators(table: pa.Table) -> list:
    """The accumulators of ``table``'s rows (inverse of ``encode_accumulators``)."""
    fmts = table.column(FMT).combine_chunks()
    n = len(fmts)
    if n == 0:
        return []
    uniq = pc.unique(fmts).to_pylist()
    if len(uniq) == 1:
        return _decode_same(uniq[0], table)
    out: list = [None] * n
    fmt_np = np.asarray(fmts.to_pylist(), dtype=object)
    for f in uniq:
        rows = np.flatnonzero(fmt_np == f)
        for r, acc in zip(rows.tolist(), _decode_same(f, table.take(pa.array(rows)))):
            out[r] = acc
    return out


def _decode_same(fmt: str, table: pa.Table) -> list:
    n = table.num_rows
    if fmt == "p":
        return [pickle.loads(b) for b in table.column(ACC_P).to_pylist()]
    letters = fmt.strip("()")
    f_flat = table.column(ACC_F).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    i_flat = table.column(ACC_I).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    nf = letters.count("f")
    f_cols = f_flat.reshape(n, nf).T if nf else []
    i_cols = i_flat.reshape(n, len(letters) - nf).T if len(letters) > nf else []
    fi = ii = 0
    cols: list[list] = []
    for x in letters:
        if x == "f":
            cols.append(f_cols[fi].tolist())
            fi += 1
        else:
            c = i_cols[ii]
            cols.append(c.astype(bool).tolist() if x == "b" else c.tolist())
            ii += 1
    if fmt.startswith("("):
        return list(zip(*cols))
    return cols[0]


def accumulator_columns() -> list[tuple[str, pa.DataType]]:
    """The Arrow fields ``encode_accumulators`` produces."""
    return [
        (FMT, pa.string()),
        (ACC_F, pa.list_(pa.float64())),
        (ACC_I, pa.list_(pa.int64())),
        (ACC_P, pa.binary()),
    ]


def reduce_numpy(fn: Callable[..., Any]) -> np.ufunc | None:
    """``fn`` when it is a binary numpy ufunc (vectorizable with ``reduceat``)."""
    if isinstance(fn, np.ufunc) and fn.nin == 2 and fn.nout == 1:
        return fn
    return None
