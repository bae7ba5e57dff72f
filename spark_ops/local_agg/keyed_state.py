"""Local keyed state with Flink-style key groups, snapshots and rescaling.

Runs wherever the operator that holds it runs: inside a Spark task (an iteration
``PartitionOperator``), in a Ray actor, or on the driver (``redistribute`` on restore).
Pure Python + numpy: no Spark, no Ray.

The model (the "Support Local Aggregation in Flink" design, sections 2 and 3.4):

* A key belongs to key group ``stable_hash(key) % max_parallelism`` (``key_group_of``):
  the hash is the same in every process and every run (Python's ``hash`` is salted per
  process, so it cannot be used). Subtask ``i`` of ``p`` owns the contiguous key-group
  range ``key_group_range(i, p, max_parallelism)``, as in Flink's
  ``KeyGroupRangeAssignment``.
* *Local* keyed state is filled from records that were never shuffled, so every subtask
  may hold every key group: the same key can live in several subtasks, each holding a
  partial accumulator. That is what pre-aggregation wants.
* ``LocalKeyedState.snapshot()`` writes the state by key group: one ``KeyGroupState`` per
  non-empty key group, tagged with the subtask that wrote it. With parallelism 3 and
  max parallelism 12 a checkpoint holds up to 36 local key groups.
* ``redistribute(snapshots, new_parallelism)`` assigns those local key groups to the new
  subtasks. ``strategy="even"`` is the design's rule (section 2.1): all
  ``parallelism x max_parallelism`` local key-group slots, in (old subtask, key group)
  order, are cut into ``new_parallelism`` contiguous runs of nearly equal length, splitting
  an old subtask's snapshot where a run ends inside it. ``strategy="key_group"`` sends key
  group ``g`` to its owner ``subtask_for_key_group(g, ...)`` instead, so every key ends up
  in exactly one new subtask.
* ``LocalKeyedState.restore(aggregate, snapshot)`` merges the instances of one key that
  came from different old subtasks with the aggregate's ``merge`` (section 2.2), eagerly:
  the restoring operator holds the aggregate, so the reason the design gives for lazy
  merging (the user function is not in the checkpoint) does not apply here, and eager
  merging keeps exactly one accumulator per key in memory and in the next snapshot.

A ``PartitionOperator`` holds a ``LocalKeyedState`` and returns ``state.snapshot()`` from
``snapshot_state``; ``restore_state`` gets back this subtask's ``KeyedStateSnapshot``
(after ``redistribute`` when the parallelism changed) and calls
``LocalKeyedState.restore``. Snapshots are frozen dataclasses of plain Python values:
they pickle, and a ``restore`` never needs the objects that wrote them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from .._errors import SparkOpsConfigError
from ..aggregate import AggregateFunction, _check_aggregate

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "KeyGroupRange",
    "KeyGroupState",
    "KeyedStateSnapshot",
    "LocalKeyedState",
    "key_group_of",
    "key_group_range",
    "key_groups_of",
    "redistribute",
    "stable_hash",
    "subtask_for_key_group",
]

#: Flink's default lower bound for the max parallelism (number of key groups).
DEFAULT_MAX_PARALLELISM = 128

#: Largest max parallelism accepted (Flink's upper bound, 2^15).
_MAX_MAX_PARALLELISM = 1 << 15

_SNAPSHOT_VERSION = 1
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_NONE_HASH = 0x6A09E667F3BCC908
_NAN_HASH = 0xBB67AE8584CAA73B

IN = TypeVar("IN")
ACC = TypeVar("ACC")
OUT = TypeVar("OUT")


# -- stable hashing ------------------------------------------------------------------------


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words with good avalanche."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _digest(tag: bytes, data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(tag + data, digest_size=8).digest(), "little")


def stable_hash(key: Any) -> int:
    """A 64-bit hash of ``key`` that is the same in every process and every run.

    Keys that Python considers equal hash equal (``1``, ``1.0``, ``True`` and
    ``numpy.int64(1)`` are one key, as in a ``dict``). Supported: ``None``, bool, int,
    float, str, bytes, numpy scalars, ``decimal.Decimal``, dates/times (by ISO text) and
    tuples of those. Anything else raises ``TypeError``.
    """
    if key is None:
        return _NONE_HASH
    if isinstance(key, np.generic):
        key = key.item()
    if isinstance(key, int):  # bool included: True == 1
        return _mix64(key & _MASK64)
    if isinstance(key, float):
        if key != key:
            return _NAN_HASH
        if key.is_integer():
            return _mix64(int(key) & _MASK64)
        return _mix64(struct.unpack("<Q", struct.pack("<d", key))[0])
    if isinstance(key, str):
        return _digest(b"s", key.encode("utf-8", "surrogatepass"))
    if isinstance(key, (bytes, bytearray, memoryview)):
        return _digest(b"b", bytes(key))
    if isinstance(key, tuple):
        h = 0x3C6EF372FE94F82B ^ len(key)
        for element in key:
            h = _mix64(h ^ stable_hash(element))
        return h
    import datetime
    import decimal

    if isinstance(key, decimal.Decimal):
        if key.is_nan():
            return _NAN_HASH
        if key == key.to_integral_value():
            return _mix64(int(key) & _MASK64)
        return stable_hash(float(key)) if float(key) == key else _digest(b"d", str(key).encode())
    if isinstance(key, (datetime.date, datetime.time, datetime.timedelta)):
        return _digest(b"t" + type(key).__name__.encode(), str(key).encode())
    raise SparkOpsConfigError(
        f"a state key must be None, bool, int, float, str, bytes, a numpy scalar, a "
        f"Decimal, a date/time or a tuple of those; got {type(key).__name__} ({key!r}). "
        f"Convert it to one of them (e.g. str(key) or a tuple of its fields)"
    )


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """``_mix64`` over a uint64 array (numpy's uint64 arithmetic wraps, like the masks)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        return z ^ (z >> np.uint64(31))


def _check_max_parallelism(max_parallelism: Any) -> int:
    if (
        not isinstance(max_parallelism, int)
        or isinstance(max_parallelism, bool)
        or not 1 <= max_parallelism <= _MAX_MAX_PARALLELISM
    ):
        raise SparkOpsConfigError(
            f"max_parallelism must be an int in [1, {_MAX_MAX_PARALLELISM}], got "
            f"{max_parallelism!r}; it is the number of key groups and bounds how far the "
            f"state can be rescaled (default {DEFAULT_MAX_PARALLELISM})"
        )
    return max_parallelism


def key_group_of(key: Any, max_parallelism: int = DEFAULT_MAX_PARALLELISM) -> int:
    """The key group of ``key``: ``stable_hash(key) % max_parallelism``."""
    return stable_hash(key) % _check_max_parallelism(max_parallelism)


def key_groups_of(keys: Any, max_parallelism: int = DEFAULT_MAX_PARALLELISM) -> np.ndarray:
    """``key_group_of`` for many keys at once (vectorized for integer arrays)."""
    _check_max_parallelism(max_parallelism)
    arr = np.asarray(keys) if not isinstance(keys, np.ndarray) else keys
    if arr.ndim == 1 and (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        words = arr.astype(np.int64, copy=False).view(np.uint64) if arr.dtype != np.uint64 else arr
        return (_mix64_array(words) % np.uint64(max_parallelism)).astype(np.int64)
    return np.fromiter(
        (stable_hash(k) % max_parallelism for k in keys), dtype=np.int64, count=len(keys)
    )


# -- key-group ranges ----------------------------------------------------------------------


@dataclass(frozen=True)
class KeyGroupRange:
    """Key groups ``start`` (inclusive) to ``end`` (exclusive)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise SparkOpsConfigError(f"KeyGroupRange needs 0 <= start <= end, got {self}")

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group < self.end

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


def _check_subtask(subtask_index: Any, parallelism: Any, max_parallelism: int) -> None:
    if not isinstance(parallelism, int) or isinstance(parallelism, bool) or parallelism < 1:
        raise SparkOpsConfigError(f"parallelism must be an int >= 1, got {parallelism!r}")
    if parallelism > max_parallelism:
        raise SparkOpsConfigError(
            f"parallelism {parallelism} exceeds max_parallelism {max_parallelism}: every "
            f"subtask needs at least one key group; raise max_parallelism"
        )
    if (
        not isinstance(subtask_index, int)
        or isinstance(subtask_index, bool)
        or not 0 <= subtask_index < parallelism
    ):
        raise SparkOpsConfigError(
            f"subtask_index must be an int in [0, {parallelism}), got {subtask_index!r}"
        )


def key_group_range(
    subtask_index: int, parallelism: int, max_parallelism: int = DEFAULT_MAX_PARALLELISM
) -> KeyGroupRange:
    """The key groups subtask ``subtask_index`` of ``parallelism`` owns (Flink's split)."""
    _check_max_parallelism(max_parallelism)
    _check_subtask(subtask_index, parallelism, max_parallelism)
    start = (subtask_index * max_parallelism + parallelism - 1) // parallelism
    end = ((subtask_index + 1) * max_parallelism + parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(
    key_group: int, parallelism: int, max_parallelism: int = DEFAULT_MAX_PARALLELISM
) -> int:
    """The subtask of ``parallelism`` whose ``key_group_range`` holds ``key_group``."""
    _check_max_parallelism(max_parallelism)
    if not isinstance(key_group, int) or not 0 <= key_group < max_parallelism:
        raise SparkOpsConfigError(
            f"key_group must be an int in [0, {max_parallelism}), got {key_group!r}"
        )
    _check_subtask(0, parallelism, max_parallelism)
    return key_group * parallelism // max_parallelism


# -- snapshots -----------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyGroupState:
    """One local key group written by one subtask: parallel tuples of keys and accumulators."""

    key_group: int
    source_subtask: int
    keys: tuple
    accumulators: tuple

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.accumulators):
            raise SparkOpsConfigError("KeyGroupState needs as many accumulators as keys")


@dataclass(frozen=True)
class KeyedStateSnapshot:
    """The state of one subtask, by key group (what ``snapshot_state`` returns).

    ``subtask_index`` / ``parallelism`` name the subtask the snapshot is *for*: the writer
    for a fresh snapshot, the new subtask after ``redistribute``. ``key_groups`` may hold
    several instances of one key group (written by different old subtasks) after a
    rescale; ``LocalKeyedState.restore`` merges them.
    """

    subtask_index: int
    parallelism: int
    max_parallelism: int
    key_groups: tuple[KeyGroupState, ...] = ()
    version: int = _SNAPSHOT_VERSION

    def __post_init__(self) -> None:
        _check_max_parallelism(self.max_parallelism)
        _check_subtask(self.subtask_index, self.parallelism, self.max_parallelism)
        if self.version != _SNAPSHOT_VERSION:
            raise SparkOpsConfigError(
                f"KeyedStateSnapshot version {self.version} is not supported (this code "
                f"reads version {_SNAPSHOT_VERSION})"
            )
        for kg in self.key_groups:
            if not 0 <= kg.key_group < self.max_parallelism:
                raise SparkOpsConfigError(
                    f"key group {kg.key_group} is outside [0, {self.max_parallelism})"
                )

    @property
    def num_entries(self) -> int:
        """Key/accumulator pairs stored (a key counted once per instance)."""
        return sum(len(kg.keys) for kg in self.key_groups)


def _check_snapshots(snapshots: Any) -> list[KeyedStateSnapshot]:
    if isinstance(snapshots, KeyedStateSnapshot):
        snapshots = [snapshots]
    if snapshots is None or isinstance(snapshots, (str, bytes)):
        raise SparkOpsConfigError(
            f"snapshots must be a list of KeyedStateSnapshot, got {snapshots!r}"
        )
    snaps = list(snapshots)
    if not snaps:
        raise SparkOpsConfigError(
            "snapshots is empty: pass the KeyedStateSnapshot of every old subtask"
        )
    for i, s in enumerate(snaps):
        if not isinstance(s, KeyedStateSnapshot):
            raise SparkOpsConfigError(
                f"snapshots[{i}] is a {type(s).__name__}, not a KeyedStateSnapshot (what "
                f"LocalKeyedState.snapshot() returns)"
            )
    maxp = {s.max_parallelism for s in snaps}
    if len(maxp) != 1:
        raise SparkOpsConfigError(
            f"the snapshots disagree on max_parallelism ({sorted(maxp)}); they must come "
            f"from one checkpoint"
        )
    return snaps


def redistribute(
    snapshots: Sequence[KeyedStateSnapshot],
    new_parallelism: int,
    *,
    strategy: str = "even",
) -> list[KeyedStateSnapshot]:
    """Assign the local key groups of the old subtasks' snapshots to ``new_parallelism`` subtasks.

    Runs wherever restore is planned (the driver or the coordinator). Every key-group
    instance goes to exactly one new subtask; nothing is merged here (that happens in
    ``LocalKeyedState.restore``, which has the aggregate). ``strategy``:

    * ``"even"`` (the design's rule): the ``parallelism x max_parallelism`` local key-group
      slots, ordered by (old subtask, key group), are split into ``new_parallelism``
      contiguous runs of nearly equal length; an old snapshot is split where a run ends.
    * ``"key_group"``: key group ``g`` goes to ``subtask_for_key_group(g, new_parallelism)``,
      so all instances of a key meet in one subtask and are merged into one value.
    """
    snaps = _check_snapshots(snapshots)
    if strategy not in ("even", "key_group"):
        raise SparkOpsConfigError(f'strategy must be "even" or "key_group", got {strategy!r}')
    maxp = snaps[0].max_parallelism
    _check_subtask(0, new_parallelism, maxp)
    old_p = {s.parallelism for s in snaps}
    if len(old_p) != 1 or len(snaps) != next(iter(old_p)):
        raise SparkOpsConfigError(
            f"redistribute needs the snapshot of every old subtask exactly once: got "
            f"{len(snaps)} snapshot(s) for parallelism {sorted(old_p)}"
        )
    if sorted(s.subtask_index for s in snaps) != list(range(len(snaps))):
        raise SparkOpsConfigError(
            "redistribute got two snapshots of the same subtask (subtask indexes "
            f"{sorted(s.subtask_index for s in snaps)}); pass one per old subtask"
        )
    buckets: list[list[KeyGroupState]] = [[] for _ in range(new_parallelism)]
    total = len(snaps) * maxp
    for s in sorted(snaps, key=lambda s: s.subtask_index):
        for kg in sorted(s.key_groups, key=lambda kg: (kg.source_subtask, kg.key_group)):
            if strategy == "key_group":
                target = subtask_for_key_group(kg.key_group, new_parallelism, maxp)
            else:
                # the slot of this local key group in (old subtask, key group) order; the
                # runs are Flink's key-group ranges over `total` slots
                slot = s.subtask_index * maxp + kg.key_group
                target = slot * new_parallelism // total
            buckets[target].append(kg)
    return [KeyedStateSnapshot(i, new_parallelism, maxp, tuple(b)) for i, b in enumerate(buckets)]


# -- the state -----------------------------------------------------------------------------


def _first_grouping(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique keys, stable order, group starts) of a 1-d array, by sorting."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    starts = np.zeros(len(uniq) + 1, dtype=np.int64)
    np.cumsum(np.bincount(inverse, minlength=len(uniq)), out=starts[1:])
    return uniq, order, starts


@dataclass
class LocalKeyedState(Generic[IN, ACC, OUT]):
    """Accumulators by key for one subtask, built on an ``AggregateFunction``.

    Runs where its operator runs. ``add``/``add_batch`` fold inputs in,
    ``merge_accumulator`` folds in a partial from elsewhere, ``get`` gives a key's result,
    ``drain`` hands out (and forgets) all partials, ``snapshot`` writes the state by key
    group and ``restore`` reads it back, merging instances of a key.
    """

    aggregate: AggregateFunction[IN, ACC, OUT]
    subtask_index: int = 0
    parallelism: int = 1
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    _accs: dict[Hashable, ACC] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_aggregate(self.aggregate, "LocalKeyedState(aggregate)")
        if not self.aggregate.is_mergeable():
            raise SparkOpsConfigError(
                f"LocalKeyedState needs a mergeable aggregate: {type(self.aggregate).__name__} "
                f"does not implement merge(), so the instances of a key written by different "
                f"subtasks could not be combined on restore with another parallelism"
            )
        _check_max_parallelism(self.max_parallelism)
        _check_subtask(self.subtask_index, self.parallelism, self.max_parallelism)

    # -- access ----------------------------------------------------------------------------

    def add(self, key: Hashable, value: IN) -> None:
        """Fold one input of ``key`` in."""
        acc = self._accs[key] if key in self._accs else self.aggregate.create_accumulator()
        self._accs[key] = self.aggregate.add(value, acc)

    def add_batch(self, keys: Any, values: Any) -> None:
        """Fold many inputs in: one ``aggregate.add_batch`` call per distinct key.

        ``keys`` is a 1-d array-like; ``values`` a numpy array of the same length (or a
        tuple of them, for several input columns). Each key's values keep their order.
        """
        keys_arr = np.asarray(keys)
        cols = values if isinstance(values, tuple) else (values,)
        cols = tuple(np.asarray(c) for c in cols)
        if keys_arr.ndim != 1 or any(len(c) != len(keys_arr) for c in cols):
            raise SparkOpsConfigError(
                f"add_batch needs 1-d keys and values of the same length, got "
                f"{keys_arr.shape} keys and {[c.shape for c in cols]} values"
            )
        if not len(keys_arr):
            return
        try:
            uniq, order, starts = _first_grouping(keys_arr)
        except TypeError:  # unorderable object keys: group by hashing instead
            groups: dict[Hashable, list[int]] = {}
            for i, k in enumerate(keys_arr.tolist()):
                groups.setdefault(k, []).append(i)
            for k, idx in groups.items():
                taken = tuple(c[idx] for c in cols)
                self._fold_batch(k, taken if isinstance(values, tuple) else taken[0])
            return
        sorted_cols = tuple(c[order] for c in cols)
        bounds = starts.tolist()
        for i, k in enumerate(uniq.tolist()):
            taken = tuple(c[bounds[i] : bounds[i + 1]] for c in sorted_cols)
            self._fold_batch(k, taken if isinstance(values, tuple) else taken[0])

    def _fold_batch(self, key: Hashable, values: Any) -> None:
        acc = self._accs[key] if key in self._accs else self.aggregate.create_accumulator()
        self._accs[key] = self.aggregate.add_batch(values, acc)

    def merge_accumulator(self, key: Hashable, accumulator: ACC) -> None:
        """Fold a partial accumulator of ``key`` (e.g. from another subtask) in."""
        if key in self._accs:
            self._accs[key] = self.aggregate.merge(self._accs[key], accumulator)
        else:
            self._accs[key] = accumulator

    def accumulator(self, key: Hashable) -> ACC:
        """The accumulator of ``key`` (``KeyError`` if the key has none)."""
        return self._accs[key]

    def get(self, key: Hashable, default: Any = None) -> OUT | Any:
        """The aggregate's result for ``key``, or ``default`` for a key never seen."""
        if key not in self._accs:
            return default
        return self.aggregate.get_result(self._accs[key])

    def results(self) -> dict[Hashable, OUT]:
        """Every key's result."""
        return {k: self.aggregate.get_result(a) for k, a in self._accs.items()}

    def keys(self) -> list[Hashable]:
        return list(self._accs)

    def items(self) -> Iterator[tuple[Hashable, ACC]]:
        """(key, accumulator) pairs."""
        return iter(list(self._accs.items()))

    def drain(self) -> list[tuple[Hashable, ACC]]:
        """All (key, accumulator) partials, and an empty state (a pre-aggregation flush)."""
        out = list(self._accs.items())
        self._accs.clear()
        return out

    def clear(self) -> None:
        self._accs.clear()

    def __len__(self) -> int:
        return len(self._accs)

    def __contains__(self, key: object) -> bool:
        return key in self._accs

    # -- checkpoints -----------------------------------------------------------------------

    def key_group_of(self, key: Any) -> int:
        return key_group_of(key, self.max_parallelism)

    def snapshot(self) -> KeyedStateSnapshot:
        """The state by key group (plain data; the accumulators are not copied)."""
        maxp = self.max_parallelism
        by_group: dict[int, tuple[list, list]] = {}
        for k, acc in self._accs.items():
            keys, accs = by_group.setdefault(stable_hash(k) % maxp, ([], []))
            keys.append(k)
            accs.append(acc)
        groups = tuple(
            KeyGroupState(g, self.subtask_index, tuple(ks), tuple(acs))
            for g, (ks, acs) in sorted(by_group.items())
        )
        return KeyedStateSnapshot(self.subtask_index, self.parallelism, maxp, groups)

    @classmethod
    def restore(
        cls,
        aggregate: AggregateFunction[IN, ACC, OUT],
        snapshot: KeyedStateSnapshot,
    ) -> LocalKeyedState[IN, ACC, OUT]:
        """The state of ``snapshot``'s subtask; instances of one key merged with ``merge``.

        Instances are merged in (source subtask, key group) order, so a restore is
        deterministic. After a rescale pass this subtask's entry of ``redistribute(...)``.
        """
        if not isinstance(snapshot, KeyedStateSnapshot):
            raise SparkOpsConfigError(
                f"restore needs a KeyedStateSnapshot (what LocalKeyedState.snapshot() "
                f"returns), got {type(snapshot).__name__}; after a rescale pass one entry of "
                f"redistribute(snapshots, new_parallelism)"
            )
        state = cls(
            aggregate,
            subtask_index=snapshot.subtask_index,
            parallelism=snapshot.parallelism,
            max_parallelism=snapshot.max_parallelism,
        )
        for kg in sorted(snapshot.key_groups, key=lambda g: (g.source_subtask, g.key_group)):
            for k, acc in zip(kg.keys, kg.accumulators):
                state.merge_accumulator(k, acc)
        return state

    @classmethod
    def restore_rescaled(
        cls,
        aggregate: AggregateFunction[IN, ACC, OUT],
        snapshots: Iterable[KeyedStateSnapshot],
        *,
        subtask_index: int,
        parallelism: int,
        strategy: str = "even",
    ) -> LocalKeyedState[IN, ACC, OUT]:
        """``restore`` of subtask ``subtask_index`` after ``redistribute(snapshots, parallelism)``."""
        parts = redistribute(list(snapshots), parallelism, strategy=strategy)
        _check_subtask(subtask_index, parallelism, parts[0].max_parallelism)
        return cls.restore(aggregate, parts[subtask_index])
