"""What keeps a sparse table bounded on an endless stream of ids: pure numpy, no Ray.

Two rules (Monolith, Liu et al. 2022, section 2.2), each a function of the sequence of
steps only, so that a sync run and a single-process loop over the same batches decide
alike:

* **Admission.** A key gets a row only once it has been seen ``min_count`` times (a row
  of a batch that holds it is one sighting). Until then it reads as its initializer's
  value and its gradient is dropped. Sightings are counted in a count-min sketch of
  fixed size (``AdmissionSketch``: ``depth`` rows of ``width`` counters, conservative
  update), so ids that never repeat take no memory beyond it. A sketch over an endless
  stream would fill up and admit everything; as in TinyLFU (Einziger et al., 2017),
  every counter is halved each time ``window`` sightings have been counted since the
  last halving, so a count says how often a key was seen lately: a key must gather its
  sightings within about a window. The sketch may admit a key early (its counters
  shared with others seen often), never late within a window. The window trades the
  two: the default, one sighting per counter of a row, keeps a counter near 1/2 on
  average, so a key seen once is taken for seen twice only where its ``depth``
  counters are all taken (a few percent).
* **Expiry.** A row not touched for ``ttl_steps`` steps is removed, and beyond
  ``max_rows`` rows the least recently touched go first (ties: the smaller key).
  ``evictions`` names them from each row's last step.

Both take their inputs as arrays and give arrays back; the table (``_tables.Table``)
applies them. The sketch's state is three arrays and two counters (``to_plain`` /
``from_plain``): what a checkpoint must carry for a restored run to decide the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._mix import mix64

__all__ = ["AdmissionSketch", "Bounds", "evictions"]

#: a counter never needs to count past the threshold: it saturates there (uint16)
_MAX_COUNT = np.iinfo(np.uint16).max


@dataclass(frozen=True)
class Bounds:
    """A table's bounds: ``min_count`` sightings before a key takes a row (1: at once),
    rows expire after ``ttl_steps`` steps untouched (None: never), at most ``max_rows``
    rows per shard (None: no cap). Plain data (it travels to the shards)."""

    min_count: int = 1
    ttl_steps: int | None = None
    max_rows: int | None = None
    sketch_width: int = 1 << 20
    sketch_depth: int = 4
    #: sightings between two halvings of every counter (None: ``sketch_width``)
    sketch_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("min_count", "sketch_width", "sketch_depth"):
            _positive(name, getattr(self, name))
        for name in ("ttl_steps", "max_rows", "sketch_window"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if self.min_count > _MAX_COUNT:
            raise ValueError(f"min_count must be at most {_MAX_COUNT}, got {self.min_count}")
        if self.sketch_width & (self.sketch_width - 1):
            raise ValueError(
                f"sketch_width must be a power of two (e.g. {1 << 20}), got {self.sketch_width}"
            )

    @property
    def admits_all(self) -> bool:
        return self.min_count == 1

    def to_plain(self) -> dict[str, Any]:
        return {
            "min_count": self.min_count,
            "ttl_steps": self.ttl_steps,
            "max_rows": self.max_rows,
            "sketch_width": self.sketch_width,
            "sketch_depth": self.sketch_depth,
            "sketch_window": self.sketch_window,
        }

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> Bounds:
        return cls(**dict(data))


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class AdmissionSketch:
    """Sightings of keys that have no row yet, in ``depth x width`` saturating counters.

    ``add(keys, counts)`` counts a step's sightings and says which keys reached
    ``min_count``. The result depends on the multiset of the step's ``(key, count)``
    pairs only, not on their order: a step is counted at once (each key's estimate
    before the step, plus its count, is written as a maximum into its counters)."""

    def __init__(
        self, min_count: int, width: int = 1 << 20, depth: int = 4, window: int | None = None
    ) -> None:
        self.min_count = min_count
        self.width = width
        self.depth = depth
        #: halve every counter after this many sightings
        self.window = width if window is None else window
        self.counters = np.zeros((depth, width), dtype=np.uint16)
        #: sightings counted since the last halving
        self.since_halving = 0
        #: halvings so far (a restored sketch must be the same one)
        self.halvings = 0

    @classmethod
    def of(cls, bounds: Bounds) -> AdmissionSketch:
        return cls(bounds.min_count, bounds.sketch_width, bounds.sketch_depth, bounds.sketch_window)

    @property
    def nbytes(self) -> int:
        return int(self.counters.nbytes)

    def _cells(self, keys: np.ndarray) -> np.ndarray:
        """``(depth, len(keys))`` counter positions: one independent mix per row."""
        return np.stack(
            [
                (mix64(keys, 101 + i) & np.uint64(self.width - 1)).astype(np.int64)
                for i in range(self.depth)
            ]
        )

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Sightings of each key as the sketch has them (never fewer than the true ones
        since the last halving, halved with the rest)."""
        keys = np.asarray(keys, dtype=np.int64)
        if not len(keys):
            return np.zeros(0, dtype=np.int64)
        cells = self._cells(keys)
        rows = np.arange(self.depth)[:, None]
        estimates: np.ndarray = self.counters[rows, cells].min(axis=0).astype(np.int64)
        return estimates

    def add(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Count one step's sightings (``keys`` unique, ``counts`` >= 1 each); returns a
        mask of the keys whose estimate reached ``min_count`` (they take a row now)."""
        keys = np.asarray(keys, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        if len(keys) != len(counts):
            raise ValueError(f"{len(keys)} keys but {len(counts)} counts")
        if not len(keys):
            return np.zeros(0, dtype=bool)
        cells = self._cells(keys)
        rows = np.arange(self.depth)[:, None]
        before = self.counters[rows, cells].min(axis=0).astype(np.int64)
        after = np.minimum(before + counts, _MAX_COUNT).astype(np.uint16)
        # conservative update: a counter rises only to the key's new estimate, and of two
        # keys of the step sharing a counter the larger wins whatever their order
        for i in range(self.depth):
            np.maximum.at(self.counters[i], cells[i], after)
        admitted: np.ndarray = after >= self.min_count
        self.since_halving += int(counts.sum())
        while self.since_halving >= self.window:
            self.counters >>= 1
            self.since_halving -= self.window
            self.halvings += 1
        return admitted

    def to_plain(self) -> dict[str, Any]:
        return {
            "min_count": self.min_count,
            "window": self.window,
            "counters": self.counters.copy(),
            "since_halving": self.since_halving,
            "halvings": self.halvings,
        }

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> AdmissionSketch:
        counters = np.asarray(data["counters"], dtype=np.uint16)
        depth, width = counters.shape
        sketch = cls(int(data["min_count"]), width, depth, int(data["window"]))
        sketch.counters = counters.copy()
        sketch.since_halving = int(data["since_halving"])
        sketch.halvings = int(data["halvings"])
        return sketch


def evictions(
    keys: np.ndarray,
    last_step: np.ndarray,
    now: int,
    *,
    ttl_steps: int | None,
    max_rows: int | None,
) -> np.ndarray:
    """The rows to remove after step ``now`` (sorted row numbers): every row whose last
    touch is ``ttl_steps`` or more steps back, then, of the rows left, the least recently
    touched beyond ``max_rows`` (ties: the smaller key). ``keys`` and ``last_step``: per
    row."""
    keys = np.asarray(keys, dtype=np.int64)
    last_step = np.asarray(last_step, dtype=np.int64)
    n = len(keys)
    gone = np.zeros(n, dtype=bool)
    if ttl_steps is not None:
        gone |= last_step <= now - ttl_steps
    if max_rows is not None:
        left = np.flatnonzero(~gone)
        over = len(left) - max_rows
        if over > 0:
            # oldest first, then the smaller key: lexsort's last key is the primary one
            order = np.lexsort((keys[left], last_step[left]))
            gone[left[order[:over]]] = True
    return np.flatnonzero(gone)
