"""Update rules of the parameter-server shards: SGD, Adam, Adagrad, FTRL-Proximal.

Runs in the shard actors. Each rule updates

* a dense key range ``w`` (``dense(w, g)``: every key; ``sparse(w, idx, vals)``: the
  given keys only, "lazily": the optimizer state of other keys does not move), with its
  state arrays the size of the range;
* rows of a sparse table (``rows(values, state, rows, g)``): ``values`` and each per-row
  state array (``row_state()`` names them with their initial value; the table creates
  them with the row, on first touch) are ``(n, dim)``; only the given rows move.

Regularization is applied here, on the shard, to the keys a step touches (the
``l2`` of SGD and Adagrad adds ``l2 * w`` to the gradient; FTRL's ``l1``/``l2`` are part
of its closed form): a gradient function never needs the whole table for it. Each rule's
arithmetic is written once (``_*_step`` on arrays) and used by the three paths, so a
dense and a table update of the same numbers give the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._errors import IterationConfigError

__all__ = ["AdagradRule", "AdamRule", "FTRLRule", "SGDRule", "make_rule"]


class _Scratch:
    """One reusable work array, allocated on first use (sparse-only shards never pay)."""

    def __init__(self, size: int, dtype: np.dtype[Any]) -> None:
        self.size, self.dtype = size, dtype
        self._a: np.ndarray | None = None

    def get(self) -> np.ndarray:
        if self._a is None:
            self._a = np.empty(self.size, dtype=self.dtype)
        return self._a


class _Rule:
    """What every rule offers besides its arithmetic: its state for checkpoints."""

    def row_state(self) -> dict[str, float]:
        """Per-row state arrays of a table row and their initial values."""
        return {}

    def state(self) -> dict[str, Any]:
        """The dense state (arrays and scalars), for checkpoints."""
        return {}

    def set_state(self, state: Mapping[str, Any]) -> None:
        for k, v in state.items():
            cur = getattr(self, k)
            if isinstance(cur, np.ndarray):
                cur[...] = v
            else:
                setattr(self, k, v)

    def scalars(self) -> dict[str, Any]:
        """A table's scalar state (e.g. Adam's step count)."""
        return {}

    def set_scalars(self, values: Mapping[str, Any]) -> None:
        for k, v in values.items():
            setattr(self, k, v)


class SGDRule(_Rule):
    """``w -= lr * g`` (with ``momentum``: ``v = momentum * v + g; w -= lr * v``; with
    ``l2``: ``g + l2 * w`` first).

    Sparse updates touch only the given keys (their momentum too: "lazy" momentum)."""

    def __init__(
        self,
        size: int,
        dtype: np.dtype[Any],
        *,
        learning_rate: float,
        momentum: float = 0.0,
        l2: float = 0.0,
    ):
        self.lr = learning_rate
        self.momentum = momentum
        self.l2 = l2
        self.v = np.zeros(size, dtype=dtype) if momentum else None
        self._tmp = _Scratch(size, dtype)

    def dense(self, w: np.ndarray, g: np.ndarray) -> None:
        if self.l2:
            g = g + self.l2 * w
        if self.v is not None:
            self.v *= self.momentum
            self.v += g
            g = self.v
        # ``w -= lr * g`` without a fresh temporary: at 1e7 values a new 80 MB array per
        # step costs more in page faults than the arithmetic (same rounding: lr * g first)
        t = self._tmp.get()
        np.multiply(g, self.lr, out=t)
        w -= t

    def sparse(self, w: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
        if self.l2:
            vals = vals + self.l2 * w[idx]
        if self.v is not None:
            v = self.momentum * self.v[idx] + vals
            self.v[idx] = v
            vals = v
        w[idx] -= self.lr * vals

    def row_state(self) -> dict[str, float]:
        return {"v": 0.0} if self.momentum else {}

    def rows(
        self, values: np.ndarray, state: Mapping[str, np.ndarray], rows: np.ndarray, g: np.ndarray
    ) -> None:
        if self.l2:
            g = g + self.l2 * values[rows]
        if self.momentum:
            v = self.momentum * state["v"][rows] + g
            state["v"][rows] = v
            g = v
        values[rows] -= self.lr * g

    def state(self) -> dict[str, Any]:
        return {"v": self.v}


class AdamRule(_Rule):
    """Adam (Kingma & Ba) with bias correction; sparse updates are "lazy" (only the given
    keys' moments move), the step count is the shard's (a table's) number of updates."""

    def __init__(
        self,
        size: int,
        dtype: np.dtype[Any],
        *,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
    ):
        self.lr, self.b1, self.b2, self.eps = learning_rate, beta1, beta2, epsilon
        self.m = np.zeros(size, dtype=dtype)
        self.v = np.zeros(size, dtype=dtype)
        self.t = 0
        self._tmp = _Scratch(size, dtype)
        self._tmp2 = _Scratch(size, dtype)

    def _scale(self) -> np.float64:
        # a numpy scalar, not a float: with float32 shards it makes the update's
        # arithmetic float64 (NEP 50), as it always was
        self.t += 1
        return np.float64(self.lr * np.sqrt(1 - self.b2**self.t) / (1 - self.b1**self.t))

    def dense(self, w: np.ndarray, g: np.ndarray) -> None:
        a = self._scale()
        t, t2 = self._tmp.get(), self._tmp2.get()
        # the textbook expressions evaluated in the same order, into reused buffers
        self.m *= self.b1
        np.multiply(g, 1 - self.b1, out=t)
        self.m += t
        self.v *= self.b2
        np.multiply(g, g, out=t)
        t *= 1 - self.b2
        self.v += t
        np.sqrt(self.v, out=t)
        t += self.eps
        np.multiply(self.m, a, out=t2)
        np.divide(t2, t, out=t)
        w -= t

    def sparse(self, w: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
        a = self._scale()
        m = self.b1 * self.m[idx] + (1 - self.b1) * vals
        v = self.b2 * self.v[idx] + (1 - self.b2) * (vals * vals)
        self.m[idx], self.v[idx] = m, v
        w[idx] -= a * m / (np.sqrt(v) + self.eps)

    def row_state(self) -> dict[str, float]:
        return {"m": 0.0, "v": 0.0}

    def rows(
        self, values: np.ndarray, state: Mapping[str, np.ndarray], rows: np.ndarray, g: np.ndarray
    ) -> None:
        a = self._scale()
        m = self.b1 * state["m"][rows] + (1 - self.b1) * g
        v = self.b2 * state["v"][rows] + (1 - self.b2) * (g * g)
        state["m"][rows], state["v"][rows] = m, v
        values[rows] -= a * m / (np.sqrt(v) + self.eps)

    def state(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v, "t": self.t}

    def scalars(self) -> dict[str, Any]:
        return {"t": self.t}


def _adagrad_step(
    w: np.ndarray, acc: np.ndarray, g: np.ndarray, lr: float, eps: float, l2: float
) -> tuple[np.ndarray, np.ndarray]:
    """New ``(w, acc)``: ``g += l2 * w; acc += g * g; w -= lr * g / (sqrt(acc) + eps)``."""
    if l2:
        g = g + l2 * w
    acc = acc + g * g
    return w - lr * g / (np.sqrt(acc) + eps), acc


class AdagradRule(_Rule):
    """Adagrad (Duchi et al. 2011): a per-key step ``lr / (sqrt(sum of g^2) + eps)``;
    the sum starts at ``initial_accumulator`` when the key is created."""

    def __init__(
        self,
        size: int,
        dtype: np.dtype[Any],
        *,
        learning_rate: float,
        initial_accumulator: float = 0.1,
        epsilon: float = 1e-10,
        l2: float = 0.0,
    ):
        self.lr, self.eps, self.l2 = learning_rate, epsilon, l2
        self.acc0 = initial_accumulator
        self.acc = np.full(size, initial_accumulator, dtype=dtype)

    def dense(self, w: np.ndarray, g: np.ndarray) -> None:
        w[...], self.acc[...] = _adagrad_step(w, self.acc, g, self.lr, self.eps, self.l2)

    def sparse(self, w: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
        w[idx], self.acc[idx] = _adagrad_step(
            w[idx], self.acc[idx], vals, self.lr, self.eps, self.l2
        )

    def row_state(self) -> dict[str, float]:
        return {"acc": self.acc0}

    def rows(
        self, values: np.ndarray, state: Mapping[str, np.ndarray], rows: np.ndarray, g: np.ndarray
    ) -> None:
        acc = state["acc"]
        values[rows], acc[rows] = _adagrad_step(
            values[rows], acc[rows], g, self.lr, self.eps, self.l2
        )

    def state(self) -> dict[str, Any]:
        return {"acc": self.acc}


def ftrl_step(
    w: np.ndarray,
    z: np.ndarray,
    n: np.ndarray,
    g: np.ndarray,
    alpha: float,
    beta: float,
    l1: float,
    l2: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """New ``(w, z, n)`` of FTRL-Proximal (McMahan et al. 2013, Algorithm 1), per
    coordinate: ``sigma = (sqrt(n + g^2) - sqrt(n)) / alpha``, ``z += g - sigma * w``,
    ``n += g^2``, then ``w = 0`` where ``|z| <= l1``, else
    ``-(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)``."""
    n_new = n + g * g
    root = np.sqrt(n_new)
    sigma = (root - np.sqrt(n)) / alpha
    z_new = z + (g - sigma * w)
    shrink = np.abs(z_new) > l1
    w_new = np.zeros_like(z_new)
    np.divide(-(z_new - np.sign(z_new) * l1), (beta + root) / alpha + l2, out=w_new, where=shrink)
    return w_new, z_new, n_new


class FTRLRule(_Rule):
    """FTRL-Proximal with L1 and L2 (McMahan et al., "Ad Click Prediction: a View from
    the Trenches", KDD 2013): per-key ``z`` and ``n`` created with the key (zero); the
    weight is the closed form of them after every update, so keys whose ``|z| <= l1``
    are exactly 0. A key's first update starts from its initial value."""

    def __init__(
        self,
        size: int,
        dtype: np.dtype[Any],
        *,
        alpha: float,
        beta: float = 1.0,
        l1: float = 0.0,
        l2: float = 0.0,
    ):
        self.alpha, self.beta, self.l1, self.l2 = alpha, beta, l1, l2
        self.z = np.zeros(size, dtype=dtype)
        self.n = np.zeros(size, dtype=dtype)

    def _step(
        self, w: np.ndarray, z: np.ndarray, n: np.ndarray, g: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return ftrl_step(w, z, n, g, self.alpha, self.beta, self.l1, self.l2)

    def dense(self, w: np.ndarray, g: np.ndarray) -> None:
        w[...], self.z[...], self.n[...] = self._step(w, self.z, self.n, g)

    def sparse(self, w: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
        w[idx], self.z[idx], self.n[idx] = self._step(w[idx], self.z[idx], self.n[idx], vals)

    def row_state(self) -> dict[str, float]:
        return {"z": 0.0, "n": 0.0}

    def rows(
        self, values: np.ndarray, state: Mapping[str, np.ndarray], rows: np.ndarray, g: np.ndarray
    ) -> None:
        z, n = state["z"], state["n"]
        values[rows], z[rows], n[rows] = self._step(values[rows], z[rows], n[rows], g)

    def state(self) -> dict[str, Any]:
        return {"z": self.z, "n": self.n}


_RULES: dict[str, type] = {
    "sgd": SGDRule,
    "adam": AdamRule,
    "adagrad": AdagradRule,
    "ftrl": FTRLRule,
}


def make_rule(name: str, params: Mapping[str, float], size: int, dtype: np.dtype[Any]) -> Any:
    """The update rule ``name`` for a shard of ``size`` dense parameters (0 for a table)."""
    try:
        klass = _RULES[name]
    except KeyError as ex:
        raise IterationConfigError(f"unknown update rule {name!r}; known: {sorted(_RULES)}") from ex
    return klass(size, dtype, **dict(params))
