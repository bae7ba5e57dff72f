"""What a view holds, how a version of side data is folded in, and the task-side context.

Pure Python + pyarrow (no Spark job here): used on the driver (broadcast views, built
from collected side data) and in Spark tasks (keyed shards, and the ``SideInputContext``
the user function gets).

Content layout. A namespace is ``None`` (the global window) or ``(start_us, end_us)``
of a window. A view's content maps namespace -> payload:

* broadcast singleton: the value;  broadcast list: a tuple of values;
* per key (map, multimap, keyed singleton, keyed list): a dict key -> value (singleton,
  map) or key -> tuple of values (list, multimap).

Side rows arrive as Arrow batches with the internal layout ``__k0..`` (key columns),
``__w`` (the window struct, when windowed) and ``__v0..`` (value columns).
"""

from __future__ import annotations

import bisect
import datetime as _dt
import functools
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from ..full_partition._rows import RowReader
from ._errors import SideInputConfigError, SideInputScopeError, SideInputValueError
from ._views import SideInput, _ViewSpec

__all__ = [
    "FastRowReader",
    "SideInputContext",
    "VersionApplier",
    "duplicate_error",
    "key_names",
    "keys_of",
    "namespaces_of",
    "value_names",
]

Namespace = tuple[int, int] | None
_EMPTY: Mapping[Any, Any] = MappingProxyType({})
_UTC = _dt.timezone.utc


def key_names(n: int) -> list[str]:
    return [f"__k{i}" for i in range(n)]


def value_names(n: int) -> list[str]:
    return [f"__v{i}" for i in range(n)]


def namespaces_of(window: pa.Array | pa.ChunkedArray) -> list[Namespace]:
    """Per row, ``(start_us, end_us)`` of a window struct column (Spark's microseconds)."""
    if isinstance(window, pa.ChunkedArray):
        window = window.combine_chunks()
    starts = window.field("start").cast(pa.int64()).to_pylist()
    ends = window.field("end").cast(pa.int64()).to_pylist()
    return list(zip(starts, ends))


class FastRowReader(RowReader):
    """``RowReader`` whose Rows read their fields through C-level properties.

    pyspark's ``Row.__getattr__`` searches the field list on every ``row.name``: half
    the per-record cost of a lookup-and-emit function (measured: 2.4 s vs 4.6 s for
    250,000 rows). Fields named like a tuple method (``count``, ``index``) keep the
    method, as in pyspark.
    """

    def __init__(self, schema: pa.Schema) -> None:
        super().__init__(schema)
        base = self.row_class
        fields: dict[str, Any] = {"__slots__": ()}
        for i, name in enumerate(self.names):
            if name.isidentifier() and not hasattr(base, name) and name not in fields:
                fields[name] = property(operator.itemgetter(i))
        self.row_class = type("Row", (base,), fields)
        self._new = functools.partial(tuple.__new__, self.row_class)


def _plain(t: pa.DataType) -> bool:
    """Types whose ``to_pylist()`` values are already what ``df.collect()`` gives."""
    return bool(
        pat.is_integer(t)
        or pat.is_floating(t)
        or pat.is_boolean(t)
        or pat.is_string(t)
        or pat.is_large_string(t)
        or pat.is_binary(t)
        or pat.is_null(t)
    )


def _pylists(columns: list[pa.Array], names: list[str]) -> list[list[Any]]:
    """Columns as Python values exactly as ``df.collect()`` gives them (the rows' own
    conversion, so a map key equals the main row's field it is looked up with)."""
    if all(_plain(c.type) for c in columns):
        return [c.to_pylist() for c in columns]
    batch = pa.RecordBatch.from_arrays(columns, names=names)
    rows = RowReader(batch.schema).rows(batch)
    return [list(c) for c in zip(*rows)] if rows else [[] for _ in names]


def keys_of(columns: list[pa.Array]) -> list[Any]:
    """Per row, the key: the value of one key column, or a tuple of several."""
    cols = _pylists(columns, [f"k{i}" for i in range(len(columns))])
    if len(cols) == 1:
        return cols[0]
    return list(zip(*cols))


def values_of(spec: _ViewSpec, columns: list[pa.Array]) -> list[Any]:
    """Per row, the value: one column's value, or a Row of the value columns."""
    if spec.scalar:
        return _pylists(columns, list(spec.value))[0]
    batch = pa.RecordBatch.from_arrays(columns, names=list(spec.value))
    return FastRowReader(batch.schema).rows(batch)


def _where(spec: _ViewSpec, ns: Namespace) -> str:
    if ns is None:
        return ""
    start, end = (_dt.datetime.fromtimestamp(t / 1e6, _UTC).isoformat() for t in ns)
    return f" in window [{start}, {end})"


class VersionApplier:
    """Folds the rows of one version into ``content`` (in place).

    Unique views (singleton, map) reject a second value for the same (window, key) within
    the version; a later version replaces it (upsert). List views append. ``replace``
    (a 'complete'-mode micro-batch) clears the content first. Callers make the result
    visible atomically: the driver publishes a new broadcast after ``finish()``, a task
    drops its cached shard if folding fails.
    """

    def __init__(self, spec: _ViewSpec, content: dict[Namespace, Any], *, replace: bool) -> None:
        if replace:
            content.clear()
        self.spec = spec
        self.content = content
        #: namespaces created by this version: their keys are its keys
        self._fresh: set[Namespace] = set()
        self._seen: dict[Namespace, set[Any]] = {}
        self._open: dict[Any, list[Any]] = {}
        self.touched: set[Namespace] = set()
        self.rows = 0

    def add_batch(self, batch: pa.RecordBatch) -> None:
        """Fold one batch in the internal layout (``__k*``, ``__w``, ``__v*``)."""
        spec = self.spec
        if batch.num_rows == 0:
            return
        keys = keys_of([batch.column(n) for n in key_names(len(spec.key))]) if spec.key else None
        values = values_of(spec, [batch.column(n) for n in value_names(len(spec.value))])
        nss = namespaces_of(batch.column("__w")) if spec.window else None
        self.add(nss, keys, values)

    def add(self, nss: list[Namespace] | None, keys: list[Any] | None, values: list[Any]) -> None:
        self.rows += len(values)
        if nss is None:
            self._add_ns(None, keys, values)
            return
        groups: dict[Namespace, tuple[list[Any], list[Any]]] = {}
        for i, ns in enumerate(nss):
            g = groups.get(ns)
            if g is None:
                g = groups[ns] = ([], [])
            if keys is not None:
                g[0].append(keys[i])
            g[1].append(values[i])
        for ns, (ks, vs) in groups.items():
            self._add_ns(ns, ks if keys is not None else None, vs)

    def _add_ns(self, ns: Namespace, keys: list[Any] | None, values: list[Any]) -> None:
        spec, content = self.spec, self.content
        if not values:
            return
        self.touched.add(ns)
        if ns not in content:
            self._fresh.add(ns)
        if keys is None:  # broadcast singleton or list: one payload per namespace
            if spec.kind == "singleton":
                if len(values) > 1 or ns in self._seen:
                    got = [*([content[ns]] if ns in self._seen else []), *values[:2]]
                    raise SideInputValueError(
                        f"SingletonSideInput {spec.name!r} got more than one value{_where(spec, ns)} "
                        f"(e.g. {got[0]!r} and {got[1]!r}); a singleton holds one value at a "
                        f"time: reduce the side input to one row (groupBy().agg(...)), or use "
                        f"a ListSideInput"
                    )
                self._seen[ns] = set()
                content[ns] = values[0]
            else:
                lst = self._open.get(ns)
                if lst is None:
                    lst = self._open[ns] = list(content.get(ns, ()))
                lst.extend(values)
            return
        m = content.get(ns)
        if m is None:
            m = content[ns] = {}
        if spec.unique:
            d = dict(zip(keys, values))
            if len(d) != len(keys):
                raise duplicate_error(spec, ns, _first_duplicate(keys))
            # keys this version already set: all of a namespace it created, else tracked
            prior = m.keys() if ns in self._fresh else self._seen.setdefault(ns, set())
            if not prior.isdisjoint(d):
                raise duplicate_error(spec, ns, next(k for k in d if k in prior))
            if ns not in self._fresh:
                self._seen[ns].update(d)
            m.update(d)
        else:
            for k, v in zip(keys, values):
                lst = self._open.get((ns, k))
                if lst is None:
                    lst = self._open[(ns, k)] = list(m.get(k, ()))
                lst.append(v)

    def finish(self) -> set[Namespace]:
        """Freeze appended lists to tuples; return the namespaces this version touched."""
        for ident, lst in self._open.items():
            if self.spec.key:
                ns, k = ident
                self.content[ns][k] = tuple(lst)
            else:
                self.content[ident] = tuple(lst)
        self._open.clear()
        return self.touched


def duplicate_error(spec: _ViewSpec, ns: Namespace, key: Any) -> SideInputValueError:
    """The error for a second value of a unique view's key within one version."""
    if spec.kind == "singleton":
        return SideInputValueError(
            f"SingletonSideInput {spec.name!r} got more than one value for key {key!r}"
            f"{_where(spec, ns)}; a keyed singleton holds one value per key: deduplicate "
            f"the side input, or use a ListSideInput"
        )
    return SideInputValueError(
        f"MapSideInput {spec.name!r} got key {key!r} more than once in one version"
        f"{_where(spec, ns)}; deduplicate the side input, or use a MultimapSideInput"
    )


def _first_duplicate(keys: Iterable[Any]) -> Any:
    seen: set[Any] = set()
    for k in keys:
        if k in seen:
            return k
        seen.add(k)
    return None


def match_window(windows: list[tuple[int, int]], main: tuple[int, int]) -> Namespace:
    """The side window for a main window: the latest-starting one with start < end <= its end.

    That is the same window, or (for different window functions) the side window that
    contains the main window's last instant. ``windows`` is sorted by (start, end).
    """
    end = main[1]
    i = bisect.bisect_left(windows, (end, -(2**63)))  # windows starting before `end`
    while i > 0:
        i -= 1
        start, stop = windows[i]
        if stop >= end > start:
            return windows[i]
    return None


class _ViewState:
    """One view as a task sees it: the spec, its version and how to find its content."""

    def __init__(
        self,
        spec: _ViewSpec,
        version: int,
        content: dict[Namespace, Any] | None = None,
        shard: Callable[[int], dict[Namespace, Any]] | None = None,
    ) -> None:
        self.spec = spec
        self.version = version
        self._content = content
        self._shard = shard
        self._windows: dict[int, list[tuple[int, int]]] = {}
        self._match: dict[tuple[int, Namespace], Namespace] = {}

    def content(self, bucket: int) -> dict[Namespace, Any]:
        if self._content is not None:
            return self._content
        assert self._shard is not None
        return self._shard(bucket)

    def namespace(self, bucket: int, ns: Namespace) -> Namespace:
        if not self.spec.window or ns is None:
            return None
        hit = self._match.get((bucket, ns))
        if hit is None and (bucket, ns) not in self._match:
            wins = self._windows.get(bucket)
            if wins is None:
                wins = self._windows[bucket] = sorted(
                    w for w in self.content(bucket) if w is not None
                )
            hit = self._match[(bucket, ns)] = match_window(wins, ns)
        return hit


_NONE: Any = object()


def _same_key(a: Any, b: Any) -> bool:
    """Key equality as Spark groups keys (NaN equals NaN, elementwise for tuples)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_key(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False


class _LiveMapping(Mapping):
    """A map view as the current record sees it, resolved at each access (read-only)."""

    __slots__ = ("_ctx", "_state")

    def __init__(self, ctx: SideInputContext, state: _ViewState) -> None:
        self._ctx = ctx
        self._state = state

    def _now(self) -> Mapping[Any, Any]:
        m = self._ctx._payload(self._state)
        m = _EMPTY if m is _NONE else m
        if self._state.spec.keyed:
            # A keyed view lives in keyed state (FLIP-17): a record sees only its own
            # key's entry, never the rest of its task's shard (which would make results
            # depend on the partition count).
            key = self._ctx._key
            return {key: m[key]} if key in m else _EMPTY
        return m

    def _check(self, key: Any) -> None:
        spec = self._state.spec
        if spec.keyed and not _same_key(key, self._ctx._key):
            kind = "MultimapSideInput" if spec.kind == "multimap" else "MapSideInput"
            raise SideInputScopeError(
                f"{kind} {spec.name!r} is keyed: a record sees only its own key's entries "
                f"(the current record's key is {self._ctx._key!r:.100}), so key "
                f"{key!r:.100} cannot be looked up from it. To look up any key, use a "
                f"broadcast view: {kind}(df, key=..., value=...) without keyed=True"
            )

    def __getitem__(self, key: Any) -> Any:
        self._check(key)
        return self._now()[key]

    def get(self, key: Any, default: Any = None) -> Any:
        self._check(key)
        return self._now().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._check(key)
        return key in self._now()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())

    def __repr__(self) -> str:
        return f"SideInputMapping({dict(self._now())!r})"


class SideInputContext:
    """Handed to the user function in a Spark task, next to each record (or partition).

    ``side_input(view)`` reads a view as of the version this task was given (the same
    for every record of a micro-batch, never a half-applied one); ``side_input_version``
    says which version that is. For keyed views and windowed main input the answer is
    scoped to the current record's key and window (``key``, ``window``).
    """

    def __init__(self, partition_id: int, states: Iterable[_ViewState]) -> None:
        self.partition_id = partition_id
        self._states = {s.spec.view_id: s for s in states}
        self._by_name = {s.spec.name: s for s in self._states.values()}
        self._key: Any = None
        self._bucket = 0
        self._ns: Namespace = None
        self._live: dict[str, _LiveMapping] = {}

    # -- the current record (set by the runtime before each call) -----------------------

    @property
    def key(self) -> Any:
        """The current main record's key (None for an operation without key=)."""
        return self._key

    @property
    def window(self) -> tuple[_dt.datetime, _dt.datetime] | None:
        """The current main record's window (UTC start, end), or None when not windowed."""
        if self._ns is None:
            return None
        s, e = self._ns
        return (
            _dt.datetime.fromtimestamp(s / 1e6, _UTC),
            _dt.datetime.fromtimestamp(e / 1e6, _UTC),
        )

    def _state(self, view: SideInput | str) -> _ViewState:
        if isinstance(view, SideInput):
            st = self._states.get(view._spec.view_id)
        elif isinstance(view, str):
            st = self._by_name.get(view)
        else:
            raise SideInputConfigError(
                f"ctx.side_input() takes a side-input view (or its name), got {type(view).__name__}"
            )
        if st is None:
            raise SideInputConfigError(
                f"side input {view!r} is not attached to this operation; pass it to "
                f"with_side_inputs(main, ...); attached: {sorted(self._by_name)}"
            )
        return st

    def _payload(self, st: _ViewState) -> Any:
        """The view's payload for the current record's window (and key group)."""
        bucket = self._bucket
        content = st.content(bucket)
        ns = st.namespace(bucket, self._ns)
        return content.get(ns, _NONE)

    def side_input(self, view: SideInput | str) -> Any:
        """The view's value for the current record (see each view class for its shape).

        Maps and multimaps come back as a live read-only mapping: each access answers for
        the record current at that moment (its window, and for keyed views its key's
        entry only), so a ``map_partition`` function may read the view once and use it for
        every row. Singletons and lists are values: read them per record when the view
        is keyed or windowed.
        """
        st = self._state(view)
        spec = st.spec
        if spec.key and not (spec.keyed and spec.kind in ("singleton", "list")):
            live = self._live.get(spec.view_id)
            if live is None:
                live = self._live[spec.view_id] = _LiveMapping(self, st)
            return live
        payload = self._payload(st)
        if spec.key:  # keyed singleton / list: the current key's entry
            m = payload if payload is not _NONE else {}
            return m.get(self._key, spec.default if spec.kind == "singleton" else ())
        if spec.kind == "singleton":
            return spec.default if payload is _NONE else payload
        return payload if payload is not _NONE else ()

    def side_input_version(self, view: SideInput | str) -> int:
        """The version of the view this task reads: 1 for a bounded side input, n after n
        non-empty micro-batches of a streaming one."""
        return self._state(view).version

    def versions(self) -> dict[str, int]:
        """Every attached view's version, by view name."""
        return {name: st.version for name, st in self._by_name.items()}


def iter_chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for it in items:
        chunk.append(it)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
