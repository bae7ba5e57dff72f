"""What a ``grad_fn`` sees of sparse inputs and tables: ``CSR`` and ``Rows``.

Both run in Spark tasks (inside ``grad_fn`` and ``predict_fn``). A ``CSR`` is one
batch's rows of a column of ids (a ``SparseVector`` column, a variable-length array of
ids, or one id per row); a ``Rows`` is the rows of one table that the batch references,
pulled from the shards for this step. ``x.local`` maps each entry of ``x`` to its row
in the table it keys, so a dense gradient function ports in a few lines::

    z = x.dot(params["w"])[:, 0]          # X @ w over the batch's rows only
    grad_w = x.t_dot(r)                   # X.T @ r, aligned with params["w"].ids

Sums run in the order of the entries (``np.bincount``): a batch gives the same bits
whatever else the table holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import ConfigTypeError, UsageError
from ._layout import Sparse

__all__ = ["CSR", "Rows"]


class Rows:
    """The rows of table ``name`` that one batch references: ``ids`` (unique int64 keys)
    and ``values`` ``(len(ids), dim)`` (read-only). A gradient for the table is an array
    ``(len(ids), dim)`` aligned with ``ids``."""

    __slots__ = ("dim", "ids", "name", "values")

    def __init__(self, name: str, ids: np.ndarray, values: np.ndarray) -> None:
        self.name = name
        self.ids = ids
        self.values = values
        self.dim = values.shape[1]
        for a in (ids, values):
            if a.flags.writeable:
                a.flags.writeable = False

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"Rows({self.name!r}, {len(self.ids)} keys, dim {self.dim})"

    def with_values(self, values: Any) -> Rows:
        """The same rows with other values (e.g. ``v.with_values(v.values ** 2)``), for
        ``CSR.dot``/``t_dot`` against them."""
        values = np.asarray(values, dtype=np.float64)
        if values.ndim != 2 or len(values) != len(self.ids):
            raise ConfigTypeError(
                f"Rows.with_values takes one row per id ({len(self.ids)}), got shape {values.shape}"
            )
        return Rows(self.name, self.ids, values)

    def positions(self, keys: Any) -> np.ndarray:
        """The row of each of ``keys`` in ``ids`` (every key must be among them)."""
        keys = np.asarray(keys, dtype=np.int64)
        order = np.argsort(self.ids, kind="stable")
        at = np.searchsorted(self.ids, keys, sorter=order)
        at = np.minimum(at, len(self.ids) - 1) if len(self.ids) else at
        found = order[at] if len(self.ids) else at
        if len(keys) and (len(self.ids) == 0 or (self.ids[found] != keys).any()):
            raise KeyError(f"some keys are not among the {len(self.ids)} rows of {self.name!r}")
        return found


class CSR:
    """One batch of a sparse column: row ``i`` has the entries ``offsets[i]:offsets[i +
    1]`` of ``ids`` and ``values`` (``values`` None: every value is 1, an array of ids).

    ``local``: the position of each entry's id in ``params[table].ids`` of the table this
    column keys (a column that keys tables of different key sets has one per table:
    ``local_in(name)``)."""

    __slots__ = ("_locals", "_row_of", "ids", "name", "offsets", "values")

    def __init__(
        self,
        name: str,
        offsets: np.ndarray,
        ids: np.ndarray,
        values: np.ndarray | None,
        locals_: Mapping[str, tuple[np.ndarray, int]] | None = None,
    ) -> None:
        self.name = name
        self.offsets = offsets
        self.ids = ids
        self.values = values
        self._locals: dict[str, tuple[np.ndarray, int]] = dict(locals_ or {})
        self._row_of: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, entries)``."""
        return len(self), len(self.ids)

    @property
    def nnz(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"CSR({self.name!r}, {len(self)} rows, {self.nnz} entries)"

    @property
    def row_of(self) -> np.ndarray:
        """The batch row of each entry."""
        if self._row_of is None:
            lengths = np.diff(self.offsets)
            self._row_of = np.repeat(np.arange(len(lengths)), lengths)
        return self._row_of

    @property
    def local(self) -> np.ndarray:
        """Positions of the entries' ids in the rows of the table this column keys."""
        got = {id(p): p for p, _ in self._locals.values()}
        if len(got) == 1:
            return next(iter(got.values()))
        if not got:
            raise UsageError(
                f"column {self.name!r} keys no table (ps.train(keys=...)): it has no local "
                f"positions; use its ids"
            )
        raise UsageError(
            f"column {self.name!r} keys tables with different key sets "
            f"{sorted(self._locals)}: use x.local_in(name)"
        )

    def local_in(self, table: str) -> np.ndarray:
        """Positions of the entries' ids in ``params[table].ids``."""
        try:
            return self._locals[table][0]
        except KeyError as ex:
            raise UsageError(
                f"column {self.name!r} does not key table {table!r} (it keys "
                f"{sorted(self._locals) or 'none'}); see ps.train(keys=...)"
            ) from ex

    def _target(self, like: Any) -> tuple[np.ndarray, int]:
        if isinstance(like, Rows):
            try:
                return self._locals[like.name]
            except KeyError as ex:
                raise UsageError(
                    f"column {self.name!r} does not key table {like.name!r} (it keys "
                    f"{sorted(self._locals) or 'none'}); see ps.train(keys=...)"
                ) from ex
        got = {id(p): (p, n) for p, n in self._locals.values()}
        if len(got) != 1:
            self.local  # noqa: B018 - raises the error that says why
        return next(iter(got.values()))

    def _weights(self) -> np.ndarray | None:
        return self.values

    def dot(self, w: Any) -> np.ndarray:
        """``X @ w``: for a table's ``Rows``, ``(rows, dim)``; for a dense parameter
        ``(D,)`` or ``(D, k)`` indexed by the ids, ``(rows,)`` or ``(rows, k)``."""
        if isinstance(w, Rows):
            pos, _ = self._target(w)
            gathered = w.values[pos]
        else:
            arr = np.asarray(w)
            if arr.ndim not in (1, 2):
                raise ConfigTypeError(
                    f"CSR.dot takes a table's Rows or a (D,) / (D, k) array, got shape {arr.shape}"
                )
            gathered = arr[self.ids]
        n = len(self)
        rows = self.row_of
        v = self._weights()
        if gathered.ndim == 1:
            return np.bincount(
                rows, weights=gathered * v if v is not None else gathered, minlength=n
            )
        out = np.empty((n, gathered.shape[1]))
        for j in range(gathered.shape[1]):
            col = gathered[:, j]
            out[:, j] = np.bincount(rows, weights=col * v if v is not None else col, minlength=n)
        return out

    def t_dot(self, r: Any, like: Any = None) -> Any:
        """``X.T @ r`` for ``r`` ``(rows,)`` or ``(rows, k)``: the gradient rows of the
        table this column keys, ``(len(ids), 1)`` or ``(len(ids), k)``, aligned with its
        ``ids`` (``like``: that table's ``Rows``, when the column keys several). With a
        dense parameter as ``like`` (an array ``(D,)`` or ``(D, k)``), a ``ps.Sparse`` of
        the ids the batch holds."""
        r = np.asarray(r, dtype=np.float64)
        if r.ndim not in (1, 2) or len(r) != len(self):
            raise ConfigTypeError(
                f"CSR.t_dot takes one value (or row) per batch row: {len(self)} rows, got "
                f"shape {r.shape}"
            )
        r2 = r[:, None] if r.ndim == 1 else r
        rows = self.row_of
        v = self._weights()
        if like is not None and not isinstance(like, Rows):
            uniq, pos = np.unique(self.ids, return_inverse=True)
            size = len(uniq)
        else:
            pos, size = self._target(like)
            uniq = None
        out = np.empty((size, r2.shape[1]))
        for j in range(r2.shape[1]):
            contrib = r2[rows, j]
            if v is not None:
                contrib = contrib * v
            out[:, j] = np.bincount(pos, weights=contrib, minlength=size)
        if uniq is not None:
            return Sparse(uniq, out[:, 0] if np.ndim(like) == 1 else out)
        return out

    def square(self) -> CSR:
        """The same entries with squared values (``X ** 2``, e.g. for a factorization
        machine)."""
        values = self.values * self.values if self.values is not None else None
        return CSR(self.name, self.offsets, self.ids, values, self._locals)

    def take(self, rows: np.ndarray) -> CSR:
        """The given batch rows, in that order (a copy of their entries)."""
        starts = self.offsets[rows]
        lengths = self.offsets[rows + 1] - starts
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        entry = np.arange(offsets[-1]) - np.repeat(offsets[:-1] - starts, lengths)
        values = self.values[entry] if self.values is not None else None
        return CSR(self.name, offsets, self.ids[entry], values)

    def slice(self, lo: int, hi: int) -> CSR:
        """Batch rows ``lo:hi`` (views of the entries)."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        offsets = self.offsets[lo : hi + 1] - a
        values = self.values[a:b] if self.values is not None else None
        return CSR(self.name, offsets, self.ids[a:b], values)

    def with_locals(self, locals_: Mapping[str, tuple[np.ndarray, int]]) -> CSR:
        return CSR(self.name, self.offsets, self.ids, self.values, locals_)
