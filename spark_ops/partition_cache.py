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

__all__ = ["NumpyCache", "column_to_numpy", "is_numeric_arrow_type"]


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


class NumpyCache:
    """Accumulates a stream's batches; ``matrix()`` and ``column()`` give numpy arrays.

    ``columns`` picks (in order) the columns stacked by ``matrix()``; array columns
    expand to their length (known from the first batch: a cache that saw no batch, as
    in an empty partition, has zero rows and one column per name). Values are validated batch by batch, so a bad row fails the
    task while loading, before any epoch runs.
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
        self._chunks: dict[str, list[np.ndarray]] = {}
        self._matrix: np.ndarray | None = None
        self._cols: dict[str, np.ndarray] = {}
        self.num_rows = 0

    def add(self, batch: pa.RecordBatch) -> None:
        if self._matrix is not None or self._cols:
            raise RuntimeError("NumpyCache.add() after matrix()/column(): the cache is sealed")
        if self.columns is None:
            self.columns = [n for n in batch.schema.names if n not in self.extra]
        for name in [*self.columns, *self.extra]:
            self._chunks.setdefault(name, []).append(column_to_numpy(batch, name, dtype=self.dtype))
        self.num_rows += batch.num_rows

    def extend(self, batches: Iterable[pa.RecordBatch]) -> None:
        for b in batches:
            self.add(b)

    def _joined(self, name: str) -> np.ndarray:
        chunks = self._chunks.get(name, [])
        if not chunks:
            return np.zeros((0,), dtype=self.dtype)
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def matrix(self) -> np.ndarray:
        """The feature columns as one ``(rows, d)`` Fortran-ordered array (built once)."""
        if self._matrix is None:
            names = self.columns or []
            widths = []
            for n in names:
                first = self._chunks.get(n, [np.zeros(0)])[0]
                widths.append(1 if first.ndim == 1 else first.shape[1])
            out = np.empty((self.num_rows, sum(widths)), dtype=self.dtype, order="F")
            j = 0
            for n, width in zip(names, widths):
                chunks = self._chunks.pop(n, [])
                if width == 1:
                    # one copy, straight into the matrix's contiguous column
                    if chunks:
                        np.concatenate(chunks, out=out[:, j])
                else:
                    np.concatenate(chunks, axis=0, out=out[:, j : j + width])
                j += width
            self._matrix = out
        return self._matrix

    def column(self, name: str) -> np.ndarray:
        """One of the ``extra`` columns (e.g. the label) as a contiguous array."""
        if name not in self._cols:
            if name not in self.extra:
                raise KeyError(f"{name!r} is not one of the extra columns {self.extra}")
            self._cols[name] = np.ascontiguousarray(self._joined(name))
            self._chunks.pop(name, None)
        return self._cols[name]
