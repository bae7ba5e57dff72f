"""Sparse parameter tables: pure numpy pieces, no Ray, no I/O.

Runs in the parameter-server shards (Ray actors) and, for the routing hash and the
initializer, in Spark tasks and on the driver. Everything here is vectorized over a batch
of keys: no Python loop per key on any path a training step takes.

* ``mix64``: a mixing hash of int64 keys (the splitmix64 finalizer). ``shard_of`` routes
  a key to one of ``n`` shards from its high 32 bits (Lemire's multiply-shift), and the
  open-addressing index of a shard probes from the low bits of a second mix, so the keys
  of one shard still spread over all of its slots. Sequential and hashed ids alike
  spread evenly.
* ``KeyIndex``: an open-addressing (linear probing) hash index from int64 keys to row
  numbers ``0 .. n - 1`` in insertion order; any int64 is a key (occupancy is kept
  apart from the keys, so no key value is reserved). Lookups and inserts probe every
  key of the batch at once; the number of numpy passes is the longest probe sequence,
  which the load factor (at most 1/2) keeps short.
* ``Init`` and ``init_rows``: the value a row takes on first touch, derived from
  ``(seed, key)`` only (Philox4x64-10, the counter-based generator of Salmon et al.,
  SC 2011, keyed by the seed with the key as counter), so it is the same whatever shard
  holds the key, whatever order keys arrive in, and whoever touches it first.
* ``Table``: one table's rows on one shard: the index, the values ``(n, dim)``, the
  optimizer's per-row state (created with the row), per-row touch counts and the step
  each row was last updated at. A table with bounds (``_bounds.Bounds``: admission
  after N sightings, expiry, a row cap) creates rows only when a step is applied
  (``admit``) and removes them after it (``expire``); one without creates a row when a
  worker first asks for its key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._bounds import AdmissionSketch, Bounds, evictions
from ._mix import mix64

__all__ = [
    "Init",
    "KeyIndex",
    "Table",
    "TableSpec",
    "init_rows",
    "mix64",
    "philox4x64",
    "shard_of",
]

_U64 = np.uint64
_MASK32 = _U64(0xFFFFFFFF)


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (``0 .. num_shards - 1``) of each key: the high 32 bits of its mix,
    reduced by a multiply-shift (no modulo bias, no correlation with the slot bits)."""
    if num_shards == 1:
        return np.zeros(len(keys), dtype=np.int64)
    hi = mix64(keys) >> _U64(32)
    with np.errstate(over="ignore"):
        return ((hi * _U64(num_shards)) >> _U64(32)).astype(np.int64)


# -- the index ------------------------------------------------------------------------------


class KeyIndex:
    """int64 key -> row number, open addressing with linear probing, vectorized.

    Rows are numbered in insertion order and never move (the index may be rebuilt when
    it grows, the row numbers stay), so arrays indexed by row can grow beside it.
    """

    _SALT = 7  # the slot hash is a second mix, independent of shard_of's bits
    _WINDOW = 8  # slots a lookup round reads per key

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1 << max(4, math.ceil(math.log2(max(capacity, 16))))
        self._alloc(cap)
        self.keys_by_row = np.empty(0, dtype=np.int64)
        self.n = 0

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self.mask = cap - 1
        # one array of (key, row) pairs: a probe reads both from one cache line; row -1
        # marks an empty slot (any key value may be a real key)
        self.slots = np.zeros((cap, 2), dtype=np.int64)
        self.slots[:, 1] = -1

    @classmethod
    def of(cls, keys: np.ndarray) -> KeyIndex:
        """An index of ``keys`` (unique) as rows ``0 .. len - 1``, built at once."""
        keys = np.asarray(keys, dtype=np.int64)
        index = cls(2 * len(keys))
        index.keys_by_row = keys.copy()
        index.n = len(keys)
        if len(keys):
            index._fill(keys, np.arange(len(keys), dtype=np.int64))
        return index

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes + self.keys_by_row.nbytes)

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (mix64(keys, self._SALT) & _U64(self.mask)).astype(np.int64)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key, -1 where it is absent. The first round reads each key's
        home slot (most keys end there); later rounds read a window of ``_WINDOW``
        consecutive slots per key still pending, so a long probe sequence costs a few
        rounds, not one round per slot."""
        keys = np.asarray(keys, dtype=np.int64)
        pos = self._home(keys)
        got = np.take(self.slots, pos, axis=0)
        out = got[:, 1].copy()
        occupied = out >= 0
        hit = occupied & (got[:, 0] == keys)
        out[~hit] = -1
        pending = np.flatnonzero(occupied & ~hit)
        want = keys[pending]
        pos = (pos[pending] + 1) & self.mask
        # (window, keys): numpy's inner loops run along the keys, not along 8 slots
        window = np.arange(self._WINDOW)[:, None]
        while pending.size:
            got = np.take(self.slots, (pos + window) & self.mask, axis=0)
            rows = got[..., 1]
            empty = rows < 0
            match = got[..., 0] == want
            match &= ~empty
            hit = match.any(axis=0)
            if hit.any():
                at = match[:, hit].argmax(axis=0)
                out[pending[hit]] = rows[at, np.flatnonzero(hit)]
            go_on = ~hit & ~empty.any(axis=0)
            pending, want = pending[go_on], want[go_on]
            pos = (pos[go_on] + self._WINDOW) & self.mask
        return out

    def insert_new(self, keys: np.ndarray) -> np.ndarray:
        """Insert ``keys`` (unique, none present) as new rows, numbered in their order;
        returns their rows."""
        keys = np.asarray(keys, dtype=np.int64)
        m = len(keys)
        if m == 0:
            return np.empty(0, dtype=np.int64)
        if 2 * (self.n + m) > self.cap:
            self._grow(self.n + m)
        rows = np.arange(self.n, self.n + m, dtype=np.int64)
        self._place(keys, rows)
        self.keys_by_row = _grown(self.keys_by_row, self.n + m)
        self.keys_by_row[self.n : self.n + m] = keys
        self.n += m
        return rows

    def _place(self, keys: np.ndarray, rows: np.ndarray) -> None:
        pending = np.arange(len(keys))
        pos = self._home(keys)
        while pending.size:
            free = self.slots[pos, 1] < 0
            # several keys may want one free slot: the first of them takes it
            cand = np.flatnonzero(free)
            if cand.size:
                slots, first = np.unique(pos[cand], return_index=True)
                win = cand[first]
                self.slots[slots, 0] = keys[pending[win]]
                self.slots[slots, 1] = rows[pending[win]]
                placed = np.zeros(len(pending), dtype=bool)
                placed[win] = True
            else:
                placed = np.zeros(len(pending), dtype=bool)
            # a key whose slot is taken moves on; one that lost its free slot to another
            # key of the batch looks at it again (now taken) and moves on next round
            step = ~free
            pos = np.where(step, (pos + 1) & self.mask, pos)
            keep = ~placed
            pending, pos = pending[keep], pos[keep]

    def _grow(self, need: int) -> None:
        cap = self.cap
        while 2 * need > cap:
            cap *= 2
        self._alloc(cap)
        if self.n:
            self._fill(self.keys_by_row[: self.n], np.arange(self.n, dtype=np.int64))

    def _fill(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Place unique ``keys`` into an empty index at once: sorted by home slot, key
        ``i`` lands at ``max(home_i, slot_(i-1) + 1)`` (a running maximum), which is where
        inserting them one by one in that order puts them; the few that run past the
        end wrap around through ``_place``."""
        home = self._home(keys)
        order = np.argsort(home, kind="stable")
        h = home[order]
        ramp = np.arange(len(h), dtype=np.int64)
        slot = np.maximum.accumulate(h - ramp) + ramp
        inside = slot < self.cap
        self.slots[slot[inside], 0] = keys[order[inside]]
        self.slots[slot[inside], 1] = rows[order[inside]]
        if not inside.all():
            self._place(keys[order[~inside]], rows[order[~inside]])

    def find_or_insert(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` (unique), inserting the absent ones; ``(rows, new)`` where
        ``new`` are the positions in ``keys`` that were inserted (in order)."""
        keys = np.asarray(keys, dtype=np.int64)
        rows = self.find(keys)
        new = np.flatnonzero(rows < 0)
        if new.size:
            rows[new] = self.insert_new(keys[new])
        return rows, new

    def keys(self) -> np.ndarray:
        """Every key, in row order (a view)."""
        return self.keys_by_row[: self.n]


def _grown(a: np.ndarray, need: int) -> np.ndarray:
    """``a`` with room for ``need`` leading entries (doubling; the data is kept)."""
    if len(a) >= need:
        return a
    cap = max(need, 2 * len(a), 16)
    out = np.empty((cap, *a.shape[1:]), dtype=a.dtype)
    out[: len(a)] = a
    return out


# -- the initializer --------------------------------------------------------------------------

_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B


def _mulhilo(a: int, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(hi, lo)`` 64-bit halves of the 128-bit product of the constant ``a`` and ``b``."""
    a_lo, a_hi = _U64(a & 0xFFFFFFFF), _U64(a >> 32)
    b_lo, b_hi = b & _MASK32, b >> _U64(32)
    ll = a_lo * b_lo
    lh = a_lo * b_hi
    hl = a_hi * b_lo
    hh = a_hi * b_hi
    mid = (ll >> _U64(32)) + (lh & _MASK32) + (hl & _MASK32)
    hi = hh + (lh >> _U64(32)) + (hl >> _U64(32)) + (mid >> _U64(32))
    lo = (mid << _U64(32)) | (ll & _MASK32)
    return hi, lo


def philox4x64(counter: Sequence[np.ndarray], key: tuple[int, int]) -> list[np.ndarray]:
    """Philox4x64-10 of the 4 x uint64 counters (arrays of one length) under the 2 x
    uint64 ``key``: 4 arrays of uint64 outputs (Random123's philox4x64_R(10, ...); equal
    to ``numpy.random.Philox``'s block for the same counter and key)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = key[0] & 0xFFFFFFFFFFFFFFFF, key[1] & 0xFFFFFFFFFFFFFFFF
    with np.errstate(over="ignore"):
        for r in range(10):
            if r:
                k0 = (k0 + _W0) & 0xFFFFFFFFFFFFFFFF
                k1 = (k1 + _W1) & 0xFFFFFFFFFFFFFFFF
            hi0, lo0 = _mulhilo(_M0, c0)
            hi1, lo1 = _mulhilo(_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ _U64(k0), lo1, hi0 ^ c3 ^ _U64(k1), lo0
    return [c0, c1, c2, c3]


@dataclass(frozen=True)
class Init:
    """How a row is initialized on first touch: ``kind`` ``"zeros"``, ``"constant"``
    (``value``), ``"normal"`` (``mean``, ``std``, ``seed``) or ``"uniform"`` (``low``,
    ``high``, ``seed``). Plain data (it travels to shards and tasks)."""

    kind: str = "zeros"
    params: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0

    def to_plain(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": dict(self.params), "seed": self.seed}

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> Init:
        return cls(str(data["kind"]), dict(data.get("params", {})), int(data.get("seed", 0)))


def _uniforms(keys: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """``(len(keys), 4 * ceil(dim / 4))`` uniforms in (0, 1): Philox block ``j`` of key
    ``k`` has the counter ``(k, j, 0, 0)`` under the key ``(seed, 0)``."""
    n = len(keys)
    blocks = -(-dim // 4)
    k = np.repeat(np.asarray(keys, dtype=np.int64).view(np.uint64), blocks)
    j = np.tile(np.arange(blocks, dtype=np.uint64), n)
    zero = np.zeros(n * blocks, dtype=np.uint64)
    out = philox4x64((k, j, zero, zero), (seed, 0))
    bits = np.stack(out, axis=1).reshape(n, 4 * blocks)
    # 53 random bits, shifted half an ulp off 0 so a log of it is finite
    return ((bits >> _U64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def init_rows(init: Init, keys: np.ndarray, dim: int) -> np.ndarray:
    """The first-touch values ``(len(keys), dim)`` of ``keys``: a function of the seed and
    each key only."""
    n = len(keys)
    if init.kind == "zeros":
        return np.zeros((n, dim))
    if init.kind == "constant":
        return np.full((n, dim), float(init.params.get("value", 0.0)))
    if n == 0:
        return np.zeros((0, dim))
    u = _uniforms(keys, dim, init.seed)
    if init.kind == "uniform":
        low, high = float(init.params["low"]), float(init.params["high"])
        return low + (high - low) * u[:, :dim]
    if init.kind == "normal":
        # Box-Muller on pairs (u0, u1), (u2, u3) of each block: both outputs used
        a, b = u[:, 0::2], u[:, 1::2]
        r = np.sqrt(-2.0 * np.log(a))
        t = 2.0 * np.pi * b
        z = np.empty_like(u)
        z[:, 0::2] = r * np.cos(t)
        z[:, 1::2] = r * np.sin(t)
        return float(init.params.get("mean", 0.0)) + float(init.params["std"]) * z[:, :dim]
    raise ValueError(f"unknown initializer kind {init.kind!r}")


# -- one table on one shard ---------------------------------------------------------------


@dataclass(frozen=True)
class TableSpec:
    """A table as the shards need it: name, row width, initializer, update rule, and
    its bounds on this shard (``max_rows`` is this shard's share)."""

    name: str
    dim: int
    init: Init
    rule: str
    rule_params: Mapping[str, float]
    bounds: Bounds = field(default_factory=Bounds)


class Table:
    """One table's rows on one shard: index, values, optimizer state, touch counts.

    ``rule`` is an update rule of ``coordinator._ps`` (``row_state()`` names its per-row
    arrays and their initial values; ``rows(values, state, rows, g)`` updates rows).
    """

    def __init__(self, spec: TableSpec, rule: Any) -> None:
        self.spec = spec
        self.rule = rule
        self.index = KeyIndex()
        self.values = np.empty((0, spec.dim))
        self.state: dict[str, np.ndarray] = {
            name: np.empty((0, spec.dim)) for name in rule.row_state()
        }
        self.touches = np.empty(0, dtype=np.int64)
        #: the step each row was created or last updated at (what expiry reads)
        self.last_step = np.empty(0, dtype=np.int64)
        b = spec.bounds
        #: sightings of keys without a row (None: every key is admitted at once)
        self.sketch = None if b.admits_all else AdmissionSketch.of(b)
        #: rows made only when a step is applied, removed after it (see the module doc)
        self.bounded = self.sketch is not None or b.ttl_steps is not None or b.max_rows is not None
        #: rows made by admission and rows removed by expiry or the cap, so far
        self.admitted = self.expired = 0

    def __len__(self) -> int:
        return self.index.n

    @property
    def nbytes(self) -> int:
        held = self.index.n
        per_row = self.values.itemsize * self.spec.dim * (1 + len(self.state)) + 8
        return self.index.nbytes + held * per_row

    def rows_for(self, keys: np.ndarray, *, create: bool, step: int = 0) -> np.ndarray:
        """Rows of ``keys`` (unique int64); with ``create`` absent keys become rows set
        by the initializer (their optimizer state to its initial value) at ``step``,
        else -1."""
        if not create:
            return self.index.find(keys)
        rows, new = self.index.find_or_insert(keys)
        if new.size:
            self._fill_new(rows[new], keys[new], step)
        return rows

    def _fill_new(self, fresh: np.ndarray, keys: np.ndarray, step: int) -> None:
        self._make_room(self.index.n)
        self.values[fresh] = init_rows(self.spec.init, keys, self.spec.dim)
        for name, start in self.rule.row_state().items():
            self.state[name][fresh] = start
        self.touches[fresh] = 0
        self.last_step[fresh] = step

    def _make_room(self, n: int) -> None:
        self.values = _grown(self.values, n)
        for name in self.state:
            self.state[name] = _grown(self.state[name], n)
        self.touches = _grown(self.touches, n)
        self.last_step = _grown(self.last_step, n)

    def admit(self, keys: np.ndarray, counts: np.ndarray, step: int) -> np.ndarray:
        """The rows of a step's keys (unique) seen ``counts`` times in it: a key without
        a row gets one (its initial value) if the sketch admits it now, or at once
        without a sketch; -1 for a key not admitted (yet)."""
        keys = np.asarray(keys, dtype=np.int64)
        rows = self.index.find(keys)
        absent = np.flatnonzero(rows < 0)
        if absent.size:
            if self.sketch is not None:
                absent = absent[self.sketch.add(keys[absent], np.asarray(counts)[absent])]
            if absent.size:
                rows[absent] = self.index.insert_new(keys[absent])
                self._fill_new(rows[absent], keys[absent], step)
                self.admitted += int(absent.size)
        return rows

    def expire(self, step: int) -> np.ndarray | None:
        """After ``step``: remove the rows its bounds say go (``_bounds.evictions``);
        the new number of every old row (``remove``), or None when none went."""
        b = self.spec.bounds
        n = self.index.n
        if b.ttl_steps is None and (b.max_rows is None or n <= b.max_rows):
            return None
        gone = evictions(
            self.index.keys(), self.last_step[:n], step, ttl_steps=b.ttl_steps, max_rows=b.max_rows
        )
        if not gone.size:
            return None
        self.expired += int(gone.size)
        return self.remove(gone)

    def read(self, rows: np.ndarray) -> np.ndarray:
        """Values of ``rows`` (a copy)."""
        out: np.ndarray = self.values[rows]
        return out

    def read_or_init(self, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Values of ``rows``; where a row is -1, the initial value of its key (a key
        not admitted, or removed, reads as never touched)."""
        miss = rows < 0
        if not miss.any():
            return self.read(rows)
        out = np.empty((len(rows), self.spec.dim))
        out[~miss] = self.values[rows[~miss]]
        out[miss] = init_rows(self.spec.init, np.asarray(keys)[miss], self.spec.dim)
        return out

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Values of ``keys`` without creating rows: an absent key reads as its
        initializer's value (what its first touch would give it)."""
        return self.read_or_init(self.index.find(keys), keys)

    def apply(self, rows: np.ndarray, g: np.ndarray, step: int = 0) -> None:
        """One update of ``rows`` (unique) by the gradient rows ``g``, at ``step``."""
        if len(rows):
            self.touches[rows] += 1
            self.last_step[rows] = step
            self.rule.rows(self.values, self.state, rows, g)

    def remove(self, rows: np.ndarray) -> np.ndarray:
        """Remove ``rows`` (unique row numbers): the rows left keep their order and are
        numbered again from 0. Returns the new number of every old row (-1: removed),
        for whoever remembers row numbers. A removed key reads as its initializer's
        value again, and a later touch makes it a fresh row."""
        n = self.index.n
        keep = np.ones(n, dtype=bool)
        keep[np.asarray(rows, dtype=np.int64)] = False
        remap = np.full(n, -1, dtype=np.int64)
        kept = np.flatnonzero(keep)
        remap[kept] = np.arange(len(kept), dtype=np.int64)
        if len(kept) == n:
            return remap
        self.index = KeyIndex.of(self.index.keys()[kept])
        self.values = self.values[kept]
        self.state = {name: a[kept] for name, a in self.state.items()}
        self.touches = self.touches[kept]
        self.last_step = self.last_step[kept]
        return remap

    # -- snapshot -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every row (keys in row order, values, optimizer state, touches, last steps),
        the rule's scalars and the admission sketch: what ``restore`` takes back
        exactly."""
        n = self.index.n
        return {
            "keys": self.index.keys().copy(),
            "values": self.values[:n].copy(),
            "state": {k: v[:n].copy() for k, v in self.state.items()},
            "touches": self.touches[:n].copy(),
            "last_step": self.last_step[:n].copy(),
            "rule": self.rule.scalars(),
            "sketch": None if self.sketch is None else self.sketch.to_plain(),
            "admitted": self.admitted,
            "expired": self.expired,
        }

    def restore(self, snap: Mapping[str, Any]) -> None:
        keys = np.asarray(snap["keys"], dtype=np.int64)
        self.index = KeyIndex.of(keys)  # the same rows as when it was saved
        self.values = np.array(snap["values"], dtype=np.float64).reshape(len(keys), self.spec.dim)
        self.state = {
            k: np.array(snap["state"][k], dtype=np.float64).reshape(len(keys), self.spec.dim)
            for k in self.rule.row_state()
        }
        self.touches = np.array(snap["touches"], dtype=np.int64)
        # (a checkpoint of a table without bounds may predate the last steps)
        self.last_step = np.array(snap.get("last_step", np.zeros(len(keys))), dtype=np.int64)
        self.rule.set_scalars(snap["rule"])
        if self.sketch is not None:
            self.sketch = AdmissionSketch.from_plain(snap["sketch"])
        self.admitted = int(snap.get("admitted", 0))
        self.expired = int(snap.get("expired", 0))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, values)`` of every row, sorted by key (copies)."""
        keys = self.index.keys()
        order = np.argsort(keys, kind="stable")
        return keys[order], self.values[: self.index.n][order]

    def hottest(self, top: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The ``top`` most touched keys, their touches, and all touches."""
        n = self.index.n
        t = self.touches[:n]
        total = int(t.sum())
        if n == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64), 0
        k = min(top, n)
        idx = np.argpartition(-t, k - 1)[:k]
        idx = idx[np.argsort(-t[idx], kind="stable")]
        return self.index.keys()[idx].copy(), t[idx].copy(), total
