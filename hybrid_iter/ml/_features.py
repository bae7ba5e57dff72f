"""Feature columns of ``hybrid_iter.ml`` and ``hybrid_iter.ps``: checked on the driver,
decoded to numpy in Spark tasks.

* Driver: ``resolve_features(df, features_col, ...)`` checks the schema (no Spark job;
  one ``limit(1)`` job only to learn the width of a vector or array column that carries
  no ML metadata) and returns a ``FeaturePlan``: plain, picklable data.
* Spark task: ``FeatureCache(plan)`` takes the Arrow batches of a partition once and
  gives a ``(rows, d)`` Fortran-ordered float64 matrix (what BLAS reads fastest column by
  column), the label and the weights; ``ColumnCache`` does the same for any columns
  (``hybrid_iter.ps``), keeping integer columns as integers, and keeps the columns it is
  told to as CSR (``read_csr``: a vector column, a variable-length array of ids or one
  id per row, read from Arrow without a dense intermediate, whatever the vectors' width).

How Spark hands a ``pyspark.ml.linalg`` vector to ``mapInArrow``: as its UDT's storage
type, ``struct<type: int8, size: int32, indices: list<int32>, values: list<double>>``,
with ``type`` 1 for a dense vector (``values`` holds every element, ``size`` is null) and
0 for a sparse one (``size`` elements, ``values[i]`` at ``indices[i]``). Both are decoded
here without a Python loop over rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from coordinator._finite import all_finite
from spark_ops import column_to_numpy, is_numeric_arrow_type
from spark_ops.iteration.partition_cache import ColumnChunks

from .._errors import DataValidationError, IterationConfigError, UsageError
from .._runtime.array_store import CALL_TIMEOUT, StoredArrays, keep_arrays, read_arrays

__all__ = [
    "ColumnCache",
    "FeatureCache",
    "FeaturePlan",
    "column_kind",
    "decode_vectors",
    "read_csr",
    "resolve_features",
]

#: kinds of feature inputs
VECTOR, ARRAY, COLUMNS = "vector", "array", "columns"
#: FeatureCache's chunk names of the label and weight (no column can be named so)
_LABEL, _WEIGHT = "\0label", "\0weight"


@dataclass(frozen=True)
class FeaturePlan:
    """Which columns hold the features (and label, weight); plain data for the tasks.

    ``kind`` is ``"vector"`` (one ``VectorUDT`` column), ``"array"`` (one array of
    numbers column) or ``"columns"`` (numeric columns, one feature each); ``dim`` is the
    number of features. ``stored``: the array cache's decision for this fit (read the
    arrays an earlier fit kept, or keep the ones read now; ``_runtime.array_store``).
    """

    kind: str
    columns: tuple[str, ...]
    dim: int
    label: str | None = None
    weight: str | None = None
    stored: StoredArrays | None = None

    @property
    def decoding(self) -> tuple[Any, ...]:
        """What makes the decoded arrays what they are (the array cache's key has it)."""
        return ("features", self.kind, self.columns, self.dim, self.label, self.weight)

    @property
    def input_columns(self) -> tuple[str, ...]:
        """Every column the tasks read (select only these before the iteration)."""
        extra = tuple(c for c in (self.label, self.weight) if c is not None)
        return tuple(dict.fromkeys((*self.columns, *extra)))

    @property
    def scalar_columns(self) -> tuple[str, ...]:
        """Columns that must be numeric scalars without nulls (checked while loading)."""
        feats = self.columns if self.kind == COLUMNS else ()
        return tuple(c for c in (*feats, self.label, self.weight) if c is not None)


def column_kind(dtype: Any) -> str | None:
    """``"vector"``, ``"array"``, ``"scalar"`` for a numeric Spark type, else None."""
    from pyspark.sql import types as T

    if type(dtype).__name__ == "VectorUDT":  # pyspark.ml.linalg (and the old mllib one)
        return VECTOR
    if isinstance(dtype, T.ArrayType):
        return ARRAY if isinstance(dtype.elementType, T.NumericType) else None
    if isinstance(dtype, (T.NumericType, T.BooleanType)):
        return "scalar"
    return None


def _fields(df: Any) -> dict[str, Any]:
    return {f.name: f for f in df.schema.fields}


def _probe_width(df: Any, name: str, kind: str, param: str) -> int:
    """The width of a vector/array column: ML metadata when present, else its first row."""
    field = _fields(df)[name]
    attrs = (field.metadata or {}).get("ml_attr", {})
    if isinstance(attrs, dict) and isinstance(attrs.get("num_attrs"), int):
        return int(attrs["num_attrs"])
    from pyspark.sql import functions as F

    if kind == VECTOR:
        from pyspark.ml.functions import vector_to_array

        size = F.size(vector_to_array(F.col(name)))
    else:
        size = F.size(F.col(name))
    row = df.where(F.col(name).isNotNull()).select(size.alias("d")).limit(1).collect()
    if not row:
        raise DataValidationError(
            f"{param}={name!r}: the DataFrame has no rows with a non-null {name!r}; "
            f"training needs data"
        )
    return int(row[0][0])


def resolve_features(
    df: Any,
    features_col: str | Sequence[str],
    *,
    label_col: str | None = None,
    weight_col: str | None = None,
    param: str = "features_col",
    probe: bool = True,
) -> FeaturePlan:
    """Check the feature, label and weight columns against ``df``'s schema.

    ``probe=False`` skips learning the width of a vector or array column (``dim`` is then
    0): what ``transform`` needs, which must not run a job."""
    fields = _fields(df)
    if isinstance(features_col, str):
        names: tuple[str, ...] = (features_col,)
    elif isinstance(features_col, Sequence) and features_col:
        names = tuple(features_col)
        if not all(isinstance(n, str) and n for n in names):
            raise IterationConfigError(f"{param} must name columns (strings), got {features_col!r}")
        if len(set(names)) != len(names):
            raise IterationConfigError(f"{param} lists a column twice: {list(names)}")
    else:
        raise IterationConfigError(
            f"{param} must be a vector column's name or a non-empty list of numeric column "
            f"names, got {features_col!r}"
        )
    for n in names:
        if n not in fields:
            raise IterationConfigError(
                f"{param}: column {n!r} is not in the DataFrame; its columns are {list(fields)}"
            )
    kinds = [column_kind(fields[n].dataType) for n in names]
    if len(names) == 1 and kinds[0] in (VECTOR, ARRAY):
        kind = kinds[0]
    else:
        for n, k in zip(names, kinds):
            if k != "scalar":
                what = {VECTOR: "a vector", ARRAY: "an array"}.get(k or "", "not numeric")
                raise IterationConfigError(
                    f"{param}: column {n!r} has type {fields[n].dataType.simpleString()} "
                    f"({what}); give one vector (or array) column, or a list of numeric "
                    f"columns"
                    + (f"; cast it first (F.col({n!r}).cast('double'))" if k is None else "")
                )
        kind = COLUMNS
    for role, col in (("label_col", label_col), ("weight_col", weight_col)):
        if col is None:
            continue
        if not isinstance(col, str) or not col:
            raise IterationConfigError(f"{role} must be a column name, got {col!r}")
        if col not in fields:
            raise IterationConfigError(
                f"{role}={col!r} is not in the DataFrame; its columns are {list(fields)}"
            )
        if column_kind(fields[col].dataType) != "scalar":
            raise IterationConfigError(
                f"{role}={col!r} has type {fields[col].dataType.simpleString()}, which is not "
                f"numeric; cast it (F.col({col!r}).cast('double'))"
            )
        if col in names:
            raise IterationConfigError(f"{role}={col!r} is also a feature column ({param})")
    if kind == COLUMNS:
        dim = len(names)
    elif not probe:
        return FeaturePlan(kind, names, 0, label_col, weight_col)
    else:
        dim = _probe_width(df, names[0], kind, param)
    if dim < 1:
        raise DataValidationError(f"{param}={names[0]!r} holds empty vectors: no features")
    return FeaturePlan(kind, names, dim, label_col, weight_col)


# -- Spark task side --------------------------------------------------------------------


def _lengths(arr: pa.Array) -> np.ndarray:
    """Per-row lengths of a list array (0 for null rows)."""
    return pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)


def decode_vectors(col: pa.Array, dim: int, name: str) -> np.ndarray:
    """A column of ``VectorUDT`` structs as a dense ``(rows, dim)`` float64 array."""
    n = len(col)
    if col.null_count:
        raise DataValidationError(
            f"vector column {name!r} has {col.null_count} null row(s); drop them first "
            f"(df.na.drop(subset=[{name!r}]))"
        )
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    kind_arr, size_arr, idx_arr, val_arr = col.flatten()  # honours the array's offset
    kinds = kind_arr.to_numpy(zero_copy_only=False)
    lengths = _lengths(val_arr)
    flat = val_arr.flatten().to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    dense = kinds == 1
    if dense.all():
        if n and (lengths != dim).any():
            bad = int(lengths[lengths != dim][0])
            raise DataValidationError(
                f"vector column {name!r} holds a vector of size {bad}, but others have "
                f"{dim}; every row needs the same number of features"
            )
        return flat.reshape(n, dim)
    out = np.zeros((n, dim))
    if dense.any():
        if (lengths[dense] != dim).any():
            bad = int(lengths[dense][lengths[dense] != dim][0])
            raise DataValidationError(
                f"vector column {name!r} holds a vector of size {bad}, but others have "
                f"{dim}; every row needs the same number of features"
            )
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        out[dense] = flat[starts[dense][:, None] + np.arange(dim)]
    sparse = ~dense
    sizes = pc.fill_null(size_arr, -1).to_numpy(zero_copy_only=False)
    if (sizes[sparse] != dim).any():
        bad = int(sizes[sparse][sizes[sparse] != dim][0])
        raise DataValidationError(
            f"vector column {name!r} holds a sparse vector of size {bad}, but others have "
            f"{dim}; every row needs the same number of features"
        )
    elem_row = np.repeat(np.arange(n), lengths)
    in_sparse = sparse[elem_row]
    indices = idx_arr.flatten().to_numpy(zero_copy_only=False)
    out[elem_row[in_sparse], indices] = flat[in_sparse]
    return out


#: one column as CSR: row offsets (rows + 1), ids, values (None: every value is 1)
Csr = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def read_csr(col: pa.Array | pa.ChunkedArray, name: str) -> Csr:
    """A column as CSR ``(offsets, ids, values)``, without a dense intermediate.

    * a ``VectorUDT`` column: a sparse row's ``indices`` and ``values`` as they are (its
      ``size`` is never materialised: a 2^30-wide vector costs its entries only); a dense
      row's ids are ``0 .. len - 1``;
    * an array of integers (any length per row, a null array is a row without ids): ids,
      no values;
    * an integer column: one id per row, no values.

    Nulls that cannot mean "no ids" (a null vector, a null id) raise
    ``DataValidationError`` naming the column.
    """
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    n = len(col)
    t = col.type
    if pat.is_struct(t) and t.get_field_index("indices") >= 0:
        if col.null_count:
            raise DataValidationError(
                f"vector column {name!r} has {col.null_count} null row(s); drop them first "
                f"(df.na.drop(subset=[{name!r}]))"
            )
        kind_arr, _size, idx_arr, val_arr = col.flatten()  # honours the array's offset
        lengths = _lengths(val_arr)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = val_arr.flatten().to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
        dense = kind_arr.to_numpy(zero_copy_only=False) == 1
        sparse_ids = idx_arr.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        if not dense.any():
            return offsets, sparse_ids, values
        ids = np.empty(len(values), dtype=np.int64)
        elem_row = np.repeat(np.arange(n), lengths)
        in_dense = dense[elem_row]
        ids[~in_dense] = sparse_ids
        ids[in_dense] = (np.arange(len(values)) - offsets[elem_row])[in_dense]
        return offsets, ids, values
    value_type = t.value_type if (pat.is_list(t) or pat.is_large_list(t)) else None
    if value_type is not None:
        if not pat.is_integer(value_type):
            raise DataValidationError(
                f"column {name!r} holds arrays of {value_type}, not of integer ids"
            )
        flat = col.flatten()
        if flat.null_count:
            raise DataValidationError(
                f"column {name!r} has {flat.null_count} null id(s) inside its arrays; drop "
                f"them first (F.filter(F.col({name!r}), lambda x: x.isNotNull()))"
            )
        lengths = _lengths(col)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return offsets, ids, None
    if pat.is_integer(t):
        if col.null_count:
            raise DataValidationError(
                f"id column {name!r} has {col.null_count} null value(s); drop or fill them "
                f"first (df.na.drop(subset=[{name!r}]))"
            )
        ids = col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return np.arange(n + 1, dtype=np.int64), ids, None
    raise DataValidationError(
        f"column {name!r} has type {t}; ids are read from integer columns, arrays of "
        f"integers or vector columns"
    )


def _decode(batch: pa.RecordBatch, name: str, kind: str, dim: int | None) -> np.ndarray:
    col = batch.column(batch.schema.get_field_index(name))
    if kind == VECTOR:
        return decode_vectors(col, int(dim or 0), name)
    try:
        out = column_to_numpy(batch, name)
    except (ValueError, TypeError) as ex:
        raise DataValidationError(str(ex)) from ex
    if kind == ARRAY and dim is not None and len(out) and out.shape[1] != dim:
        raise DataValidationError(
            f"array column {name!r} holds arrays of {out.shape[1]} numbers, expected {dim}; "
            f"every row needs the same number of features"
        )
    return out


class FeatureCache:
    """A partition's features as one matrix, its labels and weights. Runs in a Spark task.

    ``add(batch)`` for every Arrow batch, then ``matrix()``, ``label()``, ``weight()``.
    With ``plan.stored`` reading, the arrays come from the array cache instead (the
    batches are the stand-in's, one row per partition) and are read-only; writing,
    ``keep()`` (once the rows are validated) hands them to it.
    """

    def __init__(self, plan: FeaturePlan, partition: int = -1) -> None:
        self.plan = plan
        self.partition = partition
        self._chunks = ColumnChunks()
        self._sealed: tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None = None
        self._kept = False
        self._handing: Any = None  # keep()'s thread
        self._standin: list[int] = []
        self.num_rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        if self._sealed is not None:
            raise UsageError("FeatureCache.add() after matrix(): the cache is sealed")
        p = self.plan
        if p.stored is not None and p.stored.read:
            if batch.schema.names != ["id"]:
                raise UsageError(
                    f"FeatureCache reads partition {self.partition} from the array cache "
                    f"but was given data with columns {batch.schema.names}"
                )
            self._standin.extend(batch.column(0).to_pylist())
            return
        if p.kind == COLUMNS:
            for name in p.columns:
                self._chunks.add(name, column_to_numpy(batch, name))
        else:
            part = _decode(batch, p.columns[0], p.kind, p.dim)
            self._chunks.add(p.columns[0], part.reshape(len(part), p.dim))
        if p.label is not None:
            self._chunks.add(_LABEL, column_to_numpy(batch, p.label))
        if p.weight is not None:
            w = column_to_numpy(batch, p.weight)
            if len(w) and not (all_finite(w) and (w >= 0).all()):
                raise DataValidationError(
                    f"weight column {p.weight!r} holds a negative or non-finite weight; "
                    f"weights must be finite numbers >= 0"
                )
            self._chunks.add(_WEIGHT, w)
        self.num_rows += batch.num_rows

    def _seal(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        if self._sealed is None:
            p = self.plan
            if p.stored is not None and p.stored.read:
                if self._standin != [self.partition]:  # the stage is not the one planned
                    raise UsageError(
                        f"subtask {self.partition} reads its arrays from the array cache "
                        f"but got the stand-in rows {self._standin[:5]}, not "
                        f"[{self.partition}]: the fit must run exactly "
                        f"{p.stored.num_partitions} subtasks, one per cached partition"
                    )
                self._sealed = read_arrays(p.stored, self.partition)
                self.num_rows = len(self._sealed[0])
                return self._sealed
            if p.kind == COLUMNS:
                x = self._chunks.matrix(p.columns, self.num_rows, [1] * len(p.columns))
            else:  # decoded (rows, dim) chunks of one column
                x = self._chunks.matrix(p.columns[:1], self.num_rows, [p.dim])
            label = self._chunks.join(_LABEL) if p.label is not None else None
            weight = self._chunks.join(_WEIGHT) if p.weight is not None else None
            if p.stored is not None:  # kept for later fits: nobody may write into them
                for a in (x, label, weight):
                    if a is not None:
                        a.flags.writeable = False
            self._sealed = (x, label, weight)
        return self._sealed

    def keep(self) -> None:
        """Hand the arrays to the array cache when this fit writes it (once; call after
        the rows passed validation): a thread of this worker puts them into the object
        store while the task goes on with its pass; ``handed_over()`` at the task's end."""
        p = self.plan
        if p.stored is None or p.stored.read or self._kept:
            return
        self._kept = True
        arrays = self._seal()
        nbytes = sum(a.nbytes for a in arrays if a is not None)
        self._handing = keep_arrays(p.stored, self.partition, arrays, nbytes)

    def handed_over(self) -> None:
        """Wait until what ``keep()`` hands over is in the object store and the store
        is told (not its copy): at the task's end, so that the next fit's lookup finds
        it. Long done by then unless the pass took less than the put."""
        if self._handing is not None:
            self._handing.join(CALL_TIMEOUT)
            self._handing = None

    def matrix(self) -> np.ndarray:
        return self._seal()[0]

    def label(self) -> np.ndarray:
        label = self._seal()[1]
        if label is None:
            raise UsageError("this FeatureCache has no label column")
        return label

    def weight(self) -> np.ndarray | None:
        return self._seal()[2]


def _column_numpy(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """Any numeric, array or vector column as numpy; integers and booleans stay so."""
    idx = batch.schema.get_field_index(name)
    if idx < 0:
        raise DataValidationError(
            f"column {name!r} is not in the data; its columns are {batch.schema.names}"
        )
    col = batch.column(idx)
    t = col.type
    if pat.is_struct(t) and t.get_field_index("values") >= 0:
        raise AssertionError("vector columns are decoded with their width")  # pragma: no cover
    value_type = t.value_type if (pat.is_list(t) or pat.is_large_list(t)) else t
    dtype: Any = np.float64
    if pat.is_integer(value_type):
        dtype = np.int64
    elif pat.is_boolean(value_type):
        dtype = np.bool_
    elif not is_numeric_arrow_type(value_type):
        raise DataValidationError(f"column {name!r} has type {t}, which is not numeric")
    try:
        return column_to_numpy(batch, name, dtype=dtype)
    except (ValueError, TypeError) as ex:
        raise DataValidationError(str(ex)) from ex


class ColumnCache:
    """A partition's columns as numpy arrays, by name. Runs in a Spark task.

    ``widths`` gives the width of vector columns (decoded dense, float64); other
    columns keep their kind: float64 for floating point and decimals, int64 for integers,
    bool for booleans, 2-D for array columns. Columns in ``csr_columns`` are kept as CSR
    (``read_csr``; ``csr()``), never densified.
    """

    def __init__(
        self,
        columns: Sequence[str],
        vector_widths: dict[str, int],
        csr_columns: Sequence[str] = (),
    ) -> None:
        self.columns = list(columns)
        self.vector_widths = dict(vector_widths)
        self.csr_columns = list(csr_columns)
        self._chunks = ColumnChunks()
        self._csr_chunks: dict[str, list[Csr]] = {c: [] for c in self.csr_columns}
        self._arrays: dict[str, np.ndarray] | None = None
        self._csr: dict[str, Csr] | None = None
        self.num_rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        for name in self.csr_columns:
            idx = batch.schema.get_field_index(name)
            if idx < 0:
                raise DataValidationError(
                    f"column {name!r} is not in the data; its columns are {batch.schema.names}"
                )
            self._csr_chunks[name].append(read_csr(batch.column(idx), name))
        for name in self.columns:
            if name in self.csr_columns:
                continue
            if name in self.vector_widths:
                part = _decode(batch, name, VECTOR, self.vector_widths[name])
            else:
                part = _column_numpy(batch, name)
            self._chunks.add(name, part)
        self.num_rows += batch.num_rows

    def csr(self) -> dict[str, Csr]:
        """Each CSR column of the partition, its batches joined once."""
        if self._csr is None:
            self._csr = {}
            for name, chunks in self._csr_chunks.items():
                self._csr[name] = _join_csr(chunks)
            self._csr_chunks = {}
        return self._csr

    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {}
            for name in self.columns:
                if name in self.csr_columns:
                    continue
                width = self.vector_widths.get(name)
                # a column keeps its own dtype (ColumnChunks' dtype is only for empties)
                self._arrays[name] = self._chunks.join(name, (0, width) if width else (0,))
        return self._arrays


def _join_csr(chunks: Sequence[Csr]) -> Csr:
    if not chunks:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64), None
    if len(chunks) == 1:
        return chunks[0]
    shift = np.cumsum([0] + [len(c[1]) for c in chunks[:-1]])
    offsets = np.concatenate([chunks[0][0][:1]] + [c[0][1:] + s for c, s in zip(chunks, shift)])
    ids = np.concatenate([c[1] for c in chunks])
    if all(c[2] is None for c in chunks):
        return offsets, ids, None
    values = np.concatenate([c[2] if c[2] is not None else np.ones(len(c[1])) for c in chunks])
    return offsets, ids, values
