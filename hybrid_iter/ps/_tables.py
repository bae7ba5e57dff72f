"""Sparse tables as the user declares them (on the driver): ``Table`` and initializers.

A ``Table(dim, init=..., optimizer=...)`` in ``ps.train``'s ``init`` is a parameter
whose rows are keyed by arbitrary int64 ids and live only on the shards: a row is created
on the shard that owns its key the first time a batch references it, with the value of
its initializer, which depends on ``(seed, key)`` only (Philox4x64-10 keyed by the seed
with the key as counter; ``coordinator._tables.init_rows``): the same value whatever the
number of shards, the order keys arrive in or the worker that touches it first. Reading
an unknown key (``Model.lookup``, ``transform``) gives that value too, without creating it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from coordinator._bounds import Bounds
from coordinator._tables import Init

from .._config import _is_int
from .._errors import IterationConfigError
from ._optim import Optimizer

__all__ = ["Constant", "Initializer", "Normal", "Table", "Uniform", "Zeros"]


class Initializer:
    """Base of the per-key initializers: what a row is on first touch."""

    def plain(self) -> Init:  # pragma: no cover - every subclass defines it
        raise NotImplementedError


def _seed(owner: str, seed: Any) -> None:
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise IterationConfigError(f"{owner}(seed=...) must be an int in [0, 2**64), got {seed!r}")


def _finite(owner: str, name: str, value: Any, *, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and positive:
        ok = value > 0
    if not ok:
        what = "a finite number > 0" if positive else "a finite number"
        raise IterationConfigError(f"{owner}({name}=...) must be {what}, got {value!r}")


@dataclass(frozen=True)
class Zeros(Initializer):
    """Every row starts at 0 (the usual start of a linear model's weights)."""

    def plain(self) -> Init:
        return Init("zeros")


@dataclass(frozen=True)
class Constant(Initializer):
    """Every value of a row starts at ``value``."""

    value: float = 0.0

    def __post_init__(self) -> None:
        _finite("Constant", "value", self.value)

    def plain(self) -> Init:
        return Init("constant", {"value": float(self.value)})


@dataclass(frozen=True)
class Normal(Initializer):
    """``mean + std * N(0, 1)``, drawn per key from ``(seed, key)`` (embeddings,
    factorization machines' factors)."""

    std: float = 0.01
    mean: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        _finite("Normal", "std", self.std, positive=True)
        _finite("Normal", "mean", self.mean)
        _seed("Normal", self.seed)

    def plain(self) -> Init:
        return Init("normal", {"std": float(self.std), "mean": float(self.mean)}, int(self.seed))


@dataclass(frozen=True)
class Uniform(Initializer):
    """Uniform in ``[low, high)``, drawn per key from ``(seed, key)``."""

    low: float = -0.01
    high: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        _finite("Uniform", "low", self.low)
        _finite("Uniform", "high", self.high)
        if not self.low < self.high:
            raise IterationConfigError(
                f"Uniform(low={self.low!r}, high={self.high!r}) needs low < high"
            )
        _seed("Uniform", self.seed)

    def plain(self) -> Init:
        return Init("uniform", {"low": float(self.low), "high": float(self.high)}, int(self.seed))


@dataclass(frozen=True, eq=False)
class Table:
    """A sparse parameter: rows of ``dim`` float64 values keyed by int64 ids from any
    range (negative and hashed 64-bit ids included), created on first touch by ``init``
    (default ``Zeros()``), updated by ``optimizer`` (default: ``ps.train``'s).

    Declare each table once (one ``Table`` object per name): two names given the same
    object would share its seed and get identical rows.

    Bounds, for tables over ids without end (a stream's users, items, ads; see
    docs/ps.md#bounded-tables): ``min_count`` sightings (rows of batches that hold the
    id) before an id takes a row (until then it reads as ``init`` and its gradient is
    dropped; counted in a fixed-size sketch, so ids seen once take no memory);
    ``ttl_steps``: a row not updated for that many steps is removed (it reads as
    ``init`` again); ``max_rows``: at most that many rows in all, the least recently
    updated removed first (each of the ``n`` shards keeps ``max_rows // n``). Sync
    training decides all three from the batches alone: the same batches give the same
    table, bit for bit."""

    dim: int = 1
    init: Initializer = field(default_factory=Zeros)
    optimizer: Optimizer | None = None
    min_count: int = 1
    ttl_steps: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.dim) or self.dim < 1:
            raise IterationConfigError(f"Table(dim=...) must be an int >= 1, got {self.dim!r}")
        if not isinstance(self.init, Initializer):
            raise IterationConfigError(
                f"Table(init=...) must be ps.Zeros(), ps.Normal(...), ps.Uniform(...) or "
                f"ps.Constant(...), got {type(self.init).__name__}"
            )
        for name in ("min_count", "ttl_steps", "max_rows"):
            value = getattr(self, name)
            if (value is not None or name == "min_count") and (not _is_int(value) or value < 1):
                none = "" if name == "min_count" else "None or "
                raise IterationConfigError(
                    f"Table({name}=...) must be {none}an int >= 1, got {value!r}"
                )
        if self.min_count > 65535:
            raise IterationConfigError(
                f"Table(min_count=...) must be at most 65535 (sightings are counted in "
                f"16 bits), got {self.min_count!r}"
            )
        if self.optimizer is not None and not isinstance(self.optimizer, Optimizer):
            raise IterationConfigError(
                f"Table(optimizer=...) must be None (ps.train's optimizer) or ps.SGD(...), "
                f"ps.Adam(...), ps.Adagrad(...), ps.FTRL(...), got "
                f"{type(self.optimizer).__name__}"
            )

    def bounds_on(self, num_shards: int) -> Bounds:
        """The bounds each of ``num_shards`` shards keeps (its share of ``max_rows``)."""
        cap = None if self.max_rows is None else max(1, self.max_rows // num_shards)
        return Bounds(self.min_count, self.ttl_steps, cap)
