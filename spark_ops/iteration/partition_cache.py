"""Turn a partition's Arrow record batches into contiguous numpy arrays, once.

Runs in a Spark task (inside a partition operator's ``process_data``). The matrix is
built column-major (Fortran order): copying each Arrow column into it is a contiguous
write, and BLAS reads it as fast as a row-major one (measured: build 0.03 s vs 0.58 s
for 500,000 x 50, and X @ w slightly faster).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

__all__ = ["ColumnChunks", "NumpyCache", "column_to_numpy", "is_numeric_arrow_type"]


def is_numeric_arrow_type(t: pa.DataType) -> bool:
    """Integer, floating point, decimal or boolean: what a feature column may be."""
    return bool(pat.is_integer(t) or pat.is_floating(t) or pat.is_boolean(t) or pat.is_decimal(t))


def _list_value_type(t: pa.DataType) -> pa.DataType | None:
    if pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t):
        return t.value_type
    return None


def column_to_numpy(
    batch: pa.RecordBatch, name: str, *, dtype: np.dtype | type = np.float64
) -> np.ndarray:
    """One column as numpy: ``(rows,)`` for a scalar column, ``(rows, k)`` for an array one.

    Raises ``KeyError`` for a missing column, ``TypeError`` for a non-numeric one and
    ``ValueError`` for nulls or ragged arrays, each naming the column.
    """
    idx = batch.schema.get_field_index(name)
    if idx < 0:
        raise KeyError(f"column {name!r} is not in the data; its columns are {batch.schema.names}")
    col = batch.column(idx)
    if col.null_count:
        raise ValueError(
            f"column {name!r} has {col.null_count} null value(s); drop or fill them first "
            f"(df.na.drop(subset=[{name!r}]) or df.na.fill(...))"
        )
    value_type = _list_value_type(col.type)
    if value_type is not None:
        if not is_numeric_arrow_type(value_type):
            raise TypeError(f"column {name!r} is an array of {value_type}, not of numbers")
        lengths = col.value_lengths().to_numpy(zero_copy_only=False) if len(col) else np.zeros(0)
        width = int(lengths[0]) if len(lengths) else 0
        if len(lengths) and (lengths != width).any():
            raise ValueError(f"column {name!r} holds arrays of different lengths")
        flat = col.flatten()
        if flat.null_count:
            raise ValueError(f"column {name!r} has null elements inside its arrays")
        values = flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        return values.reshape(len(col), width)
    if not is_numeric_arrow_type(col.type):
        raise TypeError(
            f"column {name!r} has type {col.type}, which is not numeric; cast it "
            f"(F.col({name!r}).cast('double')) or leave it out of the columns"
        )
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


class ColumnChunks:
    """Chunks of named columns (1-D, or 2-D for array and vector columns), each joined
    once: the one accumulator behind ``NumpyCache`` and ``hybrid_iter.ml``'s caches.

    ``matrix(names)`` stacks columns into one ``(rows, d)`` Fortran-ordered array, each
    column chunk copied straight into its contiguous matrix column; ``join(name)`` gives
    one column as a contiguous array. Both release the chunks they joined.
    """

    def __init__(self, dtype: np.dtype | type = np.float64) -> None:
        self.dtype = np.dtype(dtype)
        self._chunks: dict[str, list[np.ndarray]] = {}

    def add(self, name: str, part: np.ndarray) -> None:
        self._chunks.setdefault(name, []).append(part)

    def width(self, name: str) -> int:
        """1 for a 1-D column (or one that saw no chunk), else its number of columns."""
        chunks = self._chunks.get(name)
        return 1 if not chunks or chunks[0].ndim == 1 else int(chunks[0].shape[1])

    def matrix(
        self, names: Sequence[str], rows: int, widths: Sequence[int] | None = None
    ) -> np.ndarray:
        widths = [self.width(n) for n in names] if widths is None else list(widths)
        out = np.empty((rows, sum(widths)), dtype=self.dtype, order="F")
        j = 0
        for name, width in zip(names, widths, strict=True):
            chunks = self._chunks.pop(name, [])
            if chunks:
                if width == 1 and chunks[0].ndim == 1:
                    np.concatenate(chunks, out=out[:, j])  # one contiguous copy
                else:
                    np.concatenate(chunks, axis=0, out=out[:, j : j + width])
            j += width
        return out

    def join(self, name: str, empty_shape: tuple[int, ...] = (0,)) -> np.ndarray:
        chunks = self._chunks.pop(name, [])
        if not chunks:
            return np.zeros(empty_shape, dtype=self.dtype)
        return np.ascontiguousarray(chunks[0] if len(chunks) == 1 else np.concatenate(chunks))


class NumpyCache:
    """Accumulates a stream's batches; ``matrix()`` and ``column()`` give numpy arrays.

    ``columns`` picks (in order) the columns stacked by ``matrix()``; array columns
    expand to their length (known from the first batch: a cache that saw no batch, as
    in an empty partition, has zero rows and one column per name). Values are validated
    batch by batch, so a bad row fails the task while loading, before any epoch runs.
    """

    def __init__(
        self,
        columns: Sequence[str] | None = None,
        *,
        extra: Sequence[str] = (),
        dtype: np.dtype | type = np.float64,
    ) -> None:
        self.columns = list(columns) if columns is not None else None
        self.extra = list(extra)
        self.dtype = np.dtype(dtype)
        self._chunks = ColumnChunks(self.dtype)
        self._matrix: np.ndarray | None = None
        self._cols: dict[str, np.ndarray] = {}
        self.num_rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        if self._matrix is not None or self._cols:
            raise RuntimeError("NumpyCache.add() after matrix()/column(): the cache is sealed")
        if self.columns is None:
            self.columns = [n for n in batch.schema.names if n not in self.extra]
        for name in [*self.columns, *self.extra]:
            self._chunks.add(name, column_to_numpy(batch, name, dtype=self.dtype))
        self.num_rows += batch.num_rows

    def extend(self, batches: Iterable[pa.RecordBatch]) -> None:
        for b in batches:
            self.add(b)

    def matrix(self) -> np.ndarray:
        """The feature columns as one ``(rows, d)`` Fortran-ordered array (built once)."""
        if self._matrix is None:
            self._matrix = self._chunks.matrix(self.columns or [], self.num_rows)
        return self._matrix

    def column(self, name: str) -> np.ndarray:
        """One of the ``extra`` columns (e.g. the label) as a contiguous array."""
        if name not in self._cols:
            if name not in self.extra:
                raise KeyError(f"{name!r} is not one of the extra columns {self.extra}")
            self._cols[name] = self._chunks.join(name)
        return self._cols[name]
