"""The array cache: the numpy arrays a fit decoded from a cached DataFrame, kept in Ray's
object store for the next fit of the same data (``hybrid_iter.ml``).

Why: a one-pass fit (least squares by the normal equations) spends most of its time
handing the cached rows from Spark's JVM to Python (Arrow) and decoding them; a second
fit of the same cached DataFrame (another ``reg``, a grid search, ``CrossValidator``'s
param maps on a cached fold, a refit after a look at the summary) gets the same arrays
again. Kept, they are read zero-copy from the object store instead.

Which data is "the same" (``spark_ops.cached_view``): the fit's DataFrame reads plain
columns of one cached DataFrame, nothing computed on top, and the fit has as many
subtasks as the cached RDD has partitions (no repartition), so subtask ``p`` reads
cached partition ``p``. The key is (application id, cached RDD id, which columns, how
they are decoded); RDD ids are never reused in an application, and an entry is dropped
as soon as its RDD is no longer persisted (checked on the driver before each fit), so an
unpersisted, re-cached or changed DataFrame is always read from Spark again.

Who holds what:

* the driver's ``ArrayStore`` actor (one per driver, ``num_cpus=0``, placed with the
  coordinator, ends with the driver): the keys and the object references;
* the objects: a fit's Spark task puts its arrays into the object store and hands the
  reference to the store, which copies them into an object of its own (an object dies
  with the process that put it, and Spark ends idle Python workers; Ray >= 2.56 has no
  ``ray.put(_owner=...)``). The task does not wait for the copy: it keeps its reference
  alive in its worker until the store has it; a worker gone before that only means the
  partition is not kept;
* a bound: ``capacity`` bytes (least recently used keys go first; a key larger than it
  is not kept and not written again).

A fit decides on the driver (``plan_reuse``): READ (every partition is kept: the stage
runs over a stand-in of one row per partition and the tasks read the arrays), WRITE
(the tasks read from Spark and keep what they decoded) or nothing. A READ that finds an
array gone (the store actor killed, a node lost) fails its task with
``StoredArraysLost``; the fit then forgets the key and runs from Spark (``hybrid_iter.ml``
does it once, with a warning).

Spark's conf ``spark.hybrid_iter.ml.arrayCache`` (``true`` by default) turns it off,
``spark.hybrid_iter.ml.arrayCacheBytes`` bounds it (default: a quarter of the cluster's
object store memory); both are read at each fit.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from spark_ops import CachedSource, persisted_rdd_ids

from .._cluster.spares import register_warmer
from .._errors import StoredArraysLost

log = logging.getLogger(__name__)

__all__ = [
    "CALL_TIMEOUT",
    "CONF_BYTES",
    "CONF_ENABLED",
    "ArrayStore",
    "StoredArrays",
    "clear",
    "drop_store",
    "forget",
    "keep_arrays",
    "plan_reuse",
    "purge",
    "read_arrays",
    "start_store",
    "store_stats",
]

CONF_ENABLED = "spark.hybrid_iter.ml.arrayCache"
CONF_BYTES = "spark.hybrid_iter.ml.arrayCacheBytes"
#: without CONF_BYTES: this share of the cluster's object store memory
DEFAULT_SHARE = 0.25

READ, WRITE = "read", "write"
#: seconds any call of the array cache may take before the cache is skipped (a fit never
#: waits longer on it than reading the data from Spark would be worth)
CALL_TIMEOUT = 60.0


@dataclass(frozen=True)
class StoredArrays:
    """What a fit's tasks need: the store actor's name, the key, READ or WRITE."""

    store: str
    key: tuple[Any, ...]
    mode: str
    num_partitions: int
    #: READ: the rows of each partition (what the fit's result reports)
    rows: tuple[int, ...] = ()

    @property
    def read(self) -> bool:
        return self.mode == READ


@dataclass
class _Entry:
    num_partitions: int
    parts: dict[int, tuple[Any, int, int]]  # partition -> ([ObjectRef], bytes, rows)

    @property
    def nbytes(self) -> int:
        return sum(b for _, b, _ in self.parts.values())

    @property
    def complete(self) -> bool:
        return set(self.parts) == set(range(self.num_partitions))

    @property
    def rows(self) -> list[int]:
        return [self.parts[p][2] for p in range(self.num_partitions)]


class ArrayStore:
    """The Ray actor holding the keys and object references (one thread: its methods
    never interleave). Keys are ``(app_id, rdd_id, ...)``."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self.refused: set[tuple[Any, ...]] = set()
        self.capacity = 0
        self.counts = {"reads": 0, "writes": 0, "evicted": 0, "purged": 0, "refused": 0}

    def ready(self) -> bool:
        return True

    def purge(self, app_id: str, alive: list[int] | frozenset[int]) -> None:
        """Forget every key of another application or of an RDD no longer persisted."""
        alive = frozenset(alive)
        for key in [k for k in self.entries if k[0] != app_id or k[1] not in alive]:
            del self.entries[key]
            self.counts["purged"] += 1
        self.refused = {k for k in self.refused if k[0] == app_id and k[1] in alive}

    def lookup(
        self, key: tuple[Any, ...], n: int, alive: list[int], capacity: int
    ) -> tuple[str | None, list[int]]:
        """``(READ, rows per partition)``, ``(WRITE, [])`` or ``(None, [])`` (the key is
        larger than the capacity); forgets every key whose RDD is no longer persisted
        first."""
        self.capacity = int(capacity)
        self.purge(key[0], alive)
        if key in self.refused:
            return None, []
        entry = self.entries.get(key)
        if entry is not None and entry.num_partitions == n and entry.complete:
            self.entries.move_to_end(key)
            self.counts["reads"] += 1
            return READ, entry.rows
        if entry is not None and entry.num_partitions != n:
            del self.entries[key]
        self.counts["writes"] += 1
        return WRITE, []

    def refs(self, key: tuple[Any, ...], pid: int) -> Any:
        """``[ObjectRef]`` of a kept partition, None when it is gone."""
        entry = self.entries.get(key)
        if entry is None or pid not in entry.parts:
            return None
        return entry.parts[pid][0]

    def adopt(self, key: tuple[Any, ...], pid: int, n: int, refs: list[Any], nbytes: int) -> bool:
        """Keep a copy of partition ``pid`` of ``key`` (``refs``: ``[ObjectRef]`` the
        task put), owned by this actor; False when it does not fit (the key is then
        refused until its RDD goes) or cannot be read."""
        import ray

        if not 0 <= pid < n or not self._make_room(key, pid, n, int(nbytes)):
            return False
        try:
            value = ray.get(refs[0], timeout=CALL_TIMEOUT)
            own = ray.put(value)  # a copy this process owns
            rows = len(value[0])
            del value
        except Exception:
            return False
        self._insert(key, pid, n, [own], nbytes, rows)  # room made above; nothing ran since
        return True

    def _make_room(self, key: tuple[Any, ...], pid: int, n: int, nbytes: int) -> bool:
        if key in self.refused:
            return False
        entry = self.entries.get(key)
        have = 0 if entry is None or entry.num_partitions != n else entry.nbytes
        if entry is not None and pid in entry.parts and entry.num_partitions == n:
            have -= entry.parts[pid][1]
        # a whole key is expected to take about n times a partition's bytes
        expected = max(have + nbytes, nbytes * n)
        if expected > self.capacity:
            self.entries.pop(key, None)
            self.refused.add(key)
            self.counts["refused"] += 1
            return False
        others = sum(e.nbytes for k, e in self.entries.items() if k != key)
        while others + expected > self.capacity:
            oldest = next(k for k in self.entries if k != key)
            others -= self.entries.pop(oldest).nbytes
            self.counts["evicted"] += 1
        return True

    def add(
        self, key: tuple[Any, ...], pid: int, n: int, refs: list[Any], nbytes: int, rows: int
    ) -> bool:
        """Keep partition ``pid`` of ``key`` (``refs``: ``[ObjectRef]`` this actor
        owns, ``rows`` rows); False when it does not fit or ``pid`` is not one of
        ``0 .. n-1``."""
        if not 0 <= pid < n or not self._make_room(key, pid, n, int(nbytes)):
            return False
        self._insert(key, pid, n, refs, nbytes, rows)
        return True

    def _insert(
        self, key: tuple[Any, ...], pid: int, n: int, refs: list[Any], nbytes: int, rows: int
    ) -> None:
        entry = self.entries.get(key)
        if entry is None or entry.num_partitions != n:
            entry = self.entries[key] = _Entry(n, {})
        entry.parts[pid] = (refs, int(nbytes), int(rows))
        self.entries.move_to_end(key)

    def drop(self, key: tuple[Any, ...]) -> None:
        self.entries.pop(key, None)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts,
            "keys": len(self.entries),
            "bytes": sum(e.nbytes for e in self.entries.values()),
            "capacity": self.capacity,
        }


# -- driver ----------------------------------------------------------------------------------

_STORES: dict[Any, tuple[Any, str]] = {}
_STORES_LOCK = threading.Lock()


def _store(create: bool) -> tuple[Any, str] | None:
    """This driver's store actor (started on first use), and its name."""
    import uuid

    import ray

    from .._cluster.placement import actor_class, launch

    if not ray.is_initialized():
        return None
    job = ray.get_runtime_context().get_job_id()
    with _STORES_LOCK:
        got = _STORES.get(job)
        if got is None and create:
            _STORES.clear()  # an earlier Ray job's
            name = f"hybrid_iter.arrays.{uuid.uuid4().hex[:12]}"
            got = _STORES[job] = (launch(actor_class(ArrayStore), name), name)
        return got


def start_store() -> tuple[Any, str] | None:
    """Start this driver's store actor ahead of the first fit (the session's warm-up:
    a first fit's ``plan_reuse`` then finds its process up); its handle and name, or
    None when Ray is not connected (driver)."""
    return _store(create=True)


def drop_store() -> None:
    """Kill this driver's store actor, if any, and forget it (its cluster's Ray ends:
    ``hybrid_iter._cluster.spares.drop_spares``); never raises."""
    from .._cluster.placement import kill

    with _STORES_LOCK:
        doomed = list(_STORES.values())
        _STORES.clear()
    for handle, name in doomed:
        kill(handle, f"the array store {name}")


def _warm_store(ctx: Any) -> tuple[str | None, list[Any]]:
    """The warm-up's step: this driver's store started ahead of the first fit."""
    got = start_store()
    if got is None:
        return None, []
    handle, name = got
    return name, [handle.ready.remote()]


register_warmer("store", 20, _warm_store, forget=drop_store)


def _lost(handle: Any, ex: BaseException) -> None:
    """Forget a store that died (a new one starts at the next fit); a timeout keeps it."""
    import ray.exceptions

    if isinstance(ex, ray.exceptions.RayActorError):
        with _STORES_LOCK:
            for job, (h, _) in list(_STORES.items()):
                if h is handle:
                    del _STORES[job]


def _settings(spark: Any) -> tuple[bool, int | None]:
    """``(on, capacity in bytes or None for the default)`` from Spark's conf, checked."""
    from .._errors import IterationConfigError

    text = str(spark.conf.get(CONF_ENABLED, "true")).strip().lower()
    if text not in ("true", "false"):
        raise IterationConfigError(
            f"Spark conf {CONF_ENABLED}={text!r} must be 'true' or 'false' (spark.conf.set("
            f"{CONF_ENABLED!r}, 'false') turns the array cache off)"
        )
    raw = spark.conf.get(CONF_BYTES, None)
    capacity = None
    if raw is not None:
        try:
            capacity = int(raw)
        except ValueError:
            capacity = -1
        if capacity < 0:
            raise IterationConfigError(
                f"Spark conf {CONF_BYTES}={raw!r} must be a number of bytes >= 0 (0 keeps nothing)"
            )
    return text == "true", capacity


def _default_capacity() -> int:
    import ray

    total = ray.cluster_resources().get("object_store_memory", 0.0)
    return int(total * DEFAULT_SHARE)


def plan_reuse(
    spark: Any,
    source: CachedSource | None,
    describe: tuple[Any, ...],
    num_subtasks: int,
    hooks: Any = None,
) -> StoredArrays | None:
    """READ / WRITE for a fit whose tasks read the cached data ``source``
    (``spark_ops.cached_view`` of ``df.select(*columns)``, asked now: a DataFrame's own
    plan is fixed when first used, and keeps a relation unpersisted since; None: not a
    cached DataFrame read whole) with ``num_subtasks`` subtasks, the arrays decoded as
    ``describe`` says; None when the cache cannot serve this fit (turned off, not
    cached, a repartition, larger than the capacity). Runs on the driver; no Spark job."""
    on, capacity = _settings(spark)
    if not on or source is None or source.num_partitions != num_subtasks:
        if on:  # drop what is not needed any more (off: everything)
            purge(spark)
        else:
            clear()
        return None
    import ray

    from .._cluster import context as cluster
    from .._cluster.ray_util import NAMESPACE, connect

    connect(cluster.ray_address(spark), namespace=NAMESPACE)
    got = _store(create=True)
    assert got is not None
    handle, name = got
    key = (source.app_id, source.rdd_id, source.ordinals, *describe)
    alive = sorted(persisted_rdd_ids(spark))
    try:
        mode, rows = ray.get(
            handle.lookup.remote(
                key, num_subtasks, alive, _default_capacity() if capacity is None else capacity
            ),
            timeout=CALL_TIMEOUT,
        )
    except Exception as ex:  # the store died or is stuck: read from Spark
        log.warning("hybrid_iter: the array cache is unavailable (%s); reading from Spark", ex)
        _lost(handle, ex)
        return None
    if mode == READ and hooks is not None:  # RuntimeHooks (hybrid_iter.testing)
        hooks.after_array_lookup(handle)
    if mode is None:
        return None
    return StoredArrays(name, key, mode, num_subtasks, tuple(rows))


def _call(method: str, *args: Any) -> None:
    """Call the store (if started) and wait; never raises (driver)."""
    import ray

    got = _store(create=False)
    if got is not None:
        try:
            ray.get(getattr(got[0], method).remote(*args), timeout=CALL_TIMEOUT)
        except Exception as ex:
            _lost(got[0], ex)


def forget(stored: StoredArrays) -> None:
    """Drop a key the fit could not read back or keep right (driver); never raises."""
    _call("drop", stored.key)


def purge(spark: Any) -> None:
    """Drop every key whose cached RDD is no longer persisted (driver); never raises."""
    _call("purge", str(spark.sparkContext.applicationId), sorted(persisted_rdd_ids(spark)))


def clear() -> None:
    """Drop everything the array cache keeps (driver; ``hybrid_iter.ml.clear_array_cache``)."""
    _call("purge", "", [])


def store_stats() -> dict[str, Any] | None:
    """The store's counters (reads, writes, evicted, purged, refused, keys, bytes), or
    None before the first fit that could use it (driver)."""
    import ray

    got = _store(create=False)
    return None if got is None else dict(ray.get(got[0].stats.remote()))


# -- Spark task --------------------------------------------------------------------------------

_HANDLES: dict[str, Any] = {}


def _handle(name: str) -> Any:
    import ray

    from .._cluster.ray_util import NAMESPACE

    handle = _HANDLES.get(name)
    if handle is None:
        _HANDLES.clear()
        handle = _HANDLES[name] = ray.get_actor(name, namespace=NAMESPACE)
    return handle


def read_arrays(stored: StoredArrays, pid: int) -> Any:
    """Partition ``pid``'s kept arrays (zero-copy, read-only views of the object store);
    ``StoredArraysLost`` when they are gone. Runs in a Spark task (Ray connected)."""
    import ray.exceptions

    def lost(why: str) -> StoredArraysLost:
        return StoredArraysLost(
            f"partition {pid}'s arrays kept from an earlier fit are gone or out of reach "
            f"({why}); the fit reads the DataFrame from Spark again"
        )

    try:
        handle = _handle(stored.store)
    except ValueError as ex:  # ray.get_actor: no actor of that name, the store ended
        raise lost(f"{type(ex).__name__}: {ex}") from ex
    # only what says the store or its objects are gone (or out of reach); anything else
    # is a failure of its own, raised as it is
    try:
        refs = ray.get(handle.refs.remote(stored.key, pid), timeout=CALL_TIMEOUT)
        if refs is None:
            raise lost(f"the store no longer keeps partition {pid}")
        return ray.get(refs[0], timeout=CALL_TIMEOUT)
    except (
        ray.exceptions.RayActorError,
        ray.exceptions.ObjectLostError,
        ray.exceptions.GetTimeoutError,
    ) as ex:
        raise lost(f"{type(ex).__name__}: {ex}") from ex


#: the task's objects until the store has copied them (then released: the object store
#: would otherwise hold both copies for as long as this Python worker lives)
_PENDING: dict[int, Any] = {}


def keep_arrays(stored: StoredArrays, pid: int, arrays: Any, nbytes: int) -> threading.Thread:
    """Hand partition ``pid``'s arrays (read-only: nothing writes into them any more) to
    the store actor, which keeps a copy of its own, from a thread of this Python worker:
    the task goes on with its pass (a one-pass fit answers) while the arrays are put
    into the object store; the reference stays alive in this worker until the store
    has copied them. Never raises, never waits (an optimisation: a worker that ends
    first only means the partition is not kept); returns the thread, which the task
    joins at its end (the next fit's lookup then comes after the store was told).
    Runs in a Spark task."""
    thread = threading.Thread(
        target=_hand_over,
        args=(stored, pid, arrays, nbytes),
        name=f"hybrid_iter-keep-{pid}",
        daemon=True,
    )
    thread.start()
    return thread


def _hand_over(stored: StoredArrays, pid: int, arrays: Any, nbytes: int) -> None:
    import ray

    try:
        store = _handle(stored.store)
        ref = ray.put(arrays)
        del arrays
        call = store.adopt.remote(stored.key, pid, stored.num_partitions, [ref], nbytes)
        token = id(ref)
        _PENDING[token] = ref
        call.future().add_done_callback(lambda _: _PENDING.pop(token, None))
    except Exception as ex:
        log.warning("hybrid_iter: partition %d's arrays not kept: %s", pid, ex)
