"""The model's parameters as one flat vector, and gradients (dense or ``Sparse``) in it.

``Layout`` is built on the driver from ``init`` (an array of any shape, or a dict of
named arrays) and shipped to the Spark tasks, where it turns the pulled flat vector into
the structure the user's ``grad_fn`` expects (views, no copy) and the gradient it returns
into a flat dense array or sorted, unique ``(indices, values)``.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator._finite import check_finite, count_nonfinite, first_nonfinite, index_text

from .._errors import ConfigTypeError, IterationConfigError

__all__ = ["Layout", "Sparse"]


@dataclass(frozen=True)
class Sparse:
    """A sparse gradient: ``values`` at ``indices`` of a parameter array, zero elsewhere.

    ``indices`` index the first axis of the parameter (the flat vector for a 1-D model);
    ``values`` has shape ``(len(indices), *param.shape[1:])``: for an embedding table of
    shape ``(rows, dim)``, the touched row ids and their ``(n, dim)`` gradients. Repeated
    indices are summed.
    """

    indices: Any
    values: Any

    def __post_init__(self) -> None:
        idx = np.asarray(self.indices)
        vals = np.asarray(self.values)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise ConfigTypeError(
                f"Sparse.indices must be a 1-D array of integers, got shape {idx.shape} "
                f"dtype {idx.dtype}"
            )
        if vals.ndim < 1 or len(vals) != len(idx) or vals.dtype.kind not in "biuf":
            raise ConfigTypeError(
                f"Sparse.values must be numbers with one entry (row) per index: "
                f"{len(idx)} indices, values of shape {vals.shape}"
            )
        object.__setattr__(self, "indices", idx.astype(np.int64, copy=False))
        object.__setattr__(self, "values", vals)


@dataclass(frozen=True)
class Layout:
    """Names, shapes and offsets of the parameters inside the flat vector."""

    names: tuple[str, ...] | None  # None: a single array
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    size: int
    dtype: str

    @classmethod
    def of(cls, init: Any) -> tuple[Layout, np.ndarray]:
        """The layout of ``init`` and its values as one flat vector (checked)."""
        if isinstance(init, Mapping):
            if not init:
                raise IterationConfigError("init must hold at least one parameter array")
            keys = tuple(init)
            for n in keys:
                if not isinstance(n, str) or not n:
                    raise IterationConfigError(
                        f"init's keys must be parameter names (strings), got {n!r}"
                    )
            labels = [f"init[{n!r}]" for n in keys]
            arrays = [_numeric(label, init[n]) for label, n in zip(labels, keys)]
            names: tuple[str, ...] | None = keys
        else:
            names, labels = None, ["init"]
            arrays = [_numeric("init", init)]
        for label, a in zip(labels, arrays):
            # refused here, before any job: NaN parameters would fail only after the
            # first epoch, blaming the learning rate
            check_finite(
                label,
                a,
                fix="start ps.train from finite values (e.g. np.zeros, small random numbers)",
            )
        dtype = np.result_type(*arrays)
        if dtype.kind != "f":
            dtype = np.dtype(np.float64)
        shapes = tuple(tuple(a.shape) for a in arrays)
        sizes = [a.size for a in arrays]
        offsets = tuple(int(x) for x in np.concatenate(([0], np.cumsum(sizes)[:-1])))
        size = int(sum(sizes))
        if size == 0:
            raise IterationConfigError("init has no parameters (every array is empty)")
        flat = np.concatenate([a.astype(dtype, copy=False).ravel() for a in arrays])
        return cls(names, shapes, offsets, size, dtype.str), flat

    def unflatten(self, flat: np.ndarray) -> Any:
        """The user's structure as views of ``flat``."""
        views = [
            flat[o : o + int(np.prod(s, dtype=np.int64))].reshape(s)
            for o, s in zip(self.offsets, self.shapes)
        ]
        if self.names is None:
            return views[0]
        return dict(zip(self.names, views))

    def flatten_grad(self, grad: Any) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """A flat dense gradient, or sorted unique ``(indices, values)`` when every part
        is ``Sparse``."""
        if self.names is None:
            parts = [(0, self.shapes[0], grad, "grad", "init")]
        else:
            if not isinstance(grad, Mapping):
                raise ConfigTypeError(
                    f"grad_fn must return the gradient as a dict like init (keys "
                    f"{list(self.names)}), got {type(grad).__name__}"
                )
            unknown = set(grad) - set(self.names)
            if unknown:
                raise ConfigTypeError(
                    f"grad_fn returned gradients of unknown parameters {sorted(unknown)}; "
                    f"init has {list(self.names)}"
                )
            parts = [
                (o, s, grad[n], f"grad[{n!r}]", f"init[{n!r}]")
                for n, o, s in zip(self.names, self.offsets, self.shapes)
                if n in grad and grad[n] is not None
            ]
        dtype = np.dtype(self.dtype)
        if all(isinstance(g, Sparse) for _, _, g, _, _ in parts):
            idx_parts, val_parts = [], []
            for off, shape, g, what, _ in parts:
                idx, vals = _sparse_flat(g, shape, what)
                idx_parts.append(idx + off)
                val_parts.append(vals)
            if not idx_parts:
                return np.zeros(0, np.int64), np.zeros(0, dtype)
            idx = np.concatenate(idx_parts)
            vals = np.concatenate(val_parts).astype(dtype, copy=False)
            if len(idx) > 1 and not (np.diff(idx) > 0).all():
                idx, inverse = np.unique(idx, return_inverse=True)
                vals = np.bincount(inverse, weights=vals, minlength=len(idx)).astype(dtype)
            return idx, vals
        flat = np.zeros(self.size, dtype=dtype) if len(parts) != 1 or self.names else None
        for off, shape, g, what, param in parts:
            n = int(np.prod(shape, dtype=np.int64))
            if isinstance(g, Sparse):
                assert flat is not None
                idx, vals = _sparse_flat(g, shape, what)
                np.add.at(flat, idx + off, vals)
                continue
            arr = np.asarray(g)
            # the exact shape, not just the size: a (2, 3) or (6, 1) gradient of a (3, 2)
            # parameter has its values in other places, and reshaping it scrambles the
            # update. A 1-D parameter of n values takes shape (n,) only: (n, 1) is most
            # often a broadcasting slip upstream (y as a column), better named than guessed
            if arr.shape != shape or arr.dtype.kind not in "biuf":
                raise ConfigTypeError(
                    f"grad_fn returned {what} of shape {arr.shape} ({arr.dtype}); the "
                    f"parameter {param} has shape {shape}: return an array of "
                    f"exactly that shape and a real number dtype (its values in the "
                    f"parameter's places, not reshaped) or a hybrid_iter.ps.Sparse"
                )
            if flat is None:
                return np.ascontiguousarray(arr.reshape(-1), dtype=dtype)
            flat[off : off + n] = arr.reshape(-1)
        assert flat is not None
        return flat

    def locate(self, key: int, prefix: str) -> str:
        """Where flat ``key`` is in the user's structure: ``grad['w'][1, 0]`` (flat index 2
        of the parameter), with ``prefix`` ``"grad"`` or ``"init"``."""
        k = bisect.bisect_right(self.offsets, key) - 1
        local, shape = key - self.offsets[k], self.shapes[k]
        name = prefix if self.names is None else f"{prefix}[{self.names[k]!r}]"
        flat = (
            f" (flat index {local} of its {int(np.prod(shape, dtype=np.int64))})" if shape else ""
        )
        return f"{name}{index_text(shape, local)}{flat}"

    def nonfinite_grad(self, grad: np.ndarray | tuple[np.ndarray, np.ndarray] | None) -> str | None:
        """None when every value of a flattened gradient is finite, else where the first
        NaN/inf is: ``grad['w'][1, 0] (flat index 2 of its 6) is nan``."""
        if grad is None:
            return None
        sparse = isinstance(grad, tuple)
        keys, vals = grad if isinstance(grad, tuple) else (None, grad)
        i = first_nonfinite(vals)
        if i is None:
            return None
        key = int(keys[i]) if keys is not None else i
        count = count_nonfinite(vals)
        return (
            f"{self.locate(key, 'grad')} is {vals[i]}"
            f"{' (a Sparse entry)' if sparse else ''}; {count} of the step's "
            f"{vals.size} gradient values are NaN/inf"
        )


def _numeric(what: str, value: Any) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as ex:
        raise IterationConfigError(f"{what} is not array-like: {ex}") from ex
    if arr.dtype.kind not in "biuf":
        raise IterationConfigError(f"{what} must be a numeric array, got dtype {arr.dtype}")
    return arr


def _sparse_flat(g: Sparse, shape: tuple[int, ...], what: str) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices and values of a ``Sparse`` gradient of a parameter of ``shape``."""
    first = shape[0] if shape else 1
    inner = shape[1:] if shape else ()
    width = int(np.prod(inner, dtype=np.int64)) if inner else 1
    idx, vals = g.indices, g.values
    if tuple(vals.shape[1:]) != tuple(inner):
        raise ConfigTypeError(
            f"grad_fn returned {what} as Sparse with values of shape {vals.shape}; for a "
            f"parameter of shape {shape} they must be (len(indices), *{tuple(inner)})"
        )
    if len(idx) and (idx.min() < 0 or idx.max() >= first):
        raise IndexError(
            f"grad_fn returned {what} as Sparse with an index outside [0, {first}) of the "
            f"parameter of shape {shape}"
        )
    if width == 1:
        return idx, vals.reshape(-1)
    flat_idx = (idx[:, None] * width + np.arange(width)).reshape(-1)
    return flat_idx, vals.reshape(-1)
