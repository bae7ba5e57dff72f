"""Side-input views: which side DataFrame, which columns, and how a task sees them.

Declared on the driver. A view pickles without its DataFrame (only its ``_ViewSpec``
travels), so a user function can capture it and call ``ctx.side_input(view)`` in a Spark
task. Arguments are checked here, against the DataFrame's schema, before any job.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ._errors import SideInputConfigError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = [
    "ListSideInput",
    "MapSideInput",
    "MultimapSideInput",
    "SideInput",
    "SingletonSideInput",
]

_OUTPUT_MODES = ("append", "update", "complete")
_counter = itertools.count(1)


@dataclass(frozen=True)
class _ViewSpec:
    """Everything a task needs to know about a view: plain, picklable data."""

    view_id: str
    name: str
    kind: str  # "singleton" | "list" | "map" | "multimap"
    keyed: bool
    key: tuple[str, ...]  # the side's key columns (empty for broadcast singleton/list)
    value: tuple[str, ...]  # the side's value columns
    scalar: bool  # a value is one column's value (else a Row of the value columns)
    window: str | None  # the side's window column (struct<start, end>)
    default: Any
    output_mode: str

    @property
    def per_key(self) -> bool:
        """Values grouped by key: map and multimap always, singleton and list when keyed."""
        return bool(self.key)

    @property
    def unique(self) -> bool:
        """At most one value per (window, key) and version: singleton and map."""
        return self.kind in ("singleton", "map")


def _is_dataframe(df: Any) -> bool:
    from pyspark.sql import DataFrame

    return isinstance(df, DataFrame)


def _columns(
    arg: str, what: str | Sequence[str] | None, df: DataFrame, view: str
) -> tuple[str, ...]:
    if what is None:
        return ()
    names = (what,) if isinstance(what, str) else tuple(what)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise SideInputConfigError(
            f"{view}: {arg}= must be a column name or a non-empty list of column names, got {what!r}"
        )
    missing = [n for n in names if n not in df.columns]
    if missing:
        raise SideInputConfigError(
            f"{view}: {arg}= names {missing}, which the side DataFrame does not have; its "
            f"columns are {df.columns}"
        )
    return names


def check_window_column(df: DataFrame, column: str, where: str) -> None:
    """A window column is a struct with ``start`` and ``end`` timestamps (``F.window``)."""
    from pyspark.sql.types import StructType, TimestampType

    if not isinstance(column, str) or column not in df.columns:
        raise SideInputConfigError(
            f"{where}: window={column!r} is not a column of the DataFrame; its columns are "
            f"{df.columns} (add one with F.window('event_time', '1 minute'))"
        )
    dtype = df.schema[column].dataType
    ok = isinstance(dtype, StructType) and all(
        f in dtype.fieldNames() and isinstance(dtype[f].dataType, TimestampType)
        for f in ("start", "end")
    )
    if not ok:
        raise SideInputConfigError(
            f"{where}: window column {column!r} has type {dtype.simpleString()}; it must be a "
            f"struct<start: timestamp, end: timestamp> as made by F.window or F.session_window"
        )


class SideInput:
    """A view over a side DataFrame, attached to an operation with ``with_side_inputs``.

    Created on the driver. In a Spark task, ``ctx.side_input(view)`` reads it (see the
    subclasses for what it returns). ``keyed`` views are co-partitioned with the main
    input by key (each task holds only its keys); the others are broadcast (every task
    sees all of it). A streaming side DataFrame makes the view evolve: each non-empty
    micro-batch makes a new version.
    """

    kind: ClassVar[str] = ""

    def __init__(
        self,
        df: DataFrame,
        *,
        key: str | Sequence[str] | None,
        value: str | Sequence[str] | None,
        keyed: bool,
        window: str | None,
        default: Any,
        name: str | None,
        output_mode: str,
    ) -> None:
        cls = type(self).__name__
        if df is None or not _is_dataframe(df):
            raise SideInputConfigError(
                f"{cls} needs a pyspark.sql.DataFrame as its first argument, got "
                f"{type(df).__name__}"
            )
        if name is None:
            name = f"{self.kind}_{next(_counter)}"
        if not isinstance(name, str) or not name:
            raise SideInputConfigError(f"{cls}: name= must be a non-empty string, got {name!r}")
        where = f"{cls} {name!r}"
        if not isinstance(keyed, bool):
            raise SideInputConfigError(f"{where}: keyed= must be True or False, got {keyed!r}")
        if output_mode not in _OUTPUT_MODES:
            raise SideInputConfigError(
                f"{where}: output_mode={output_mode!r}; use one of {list(_OUTPUT_MODES)} (the "
                f"side query's output mode: 'complete' replaces the view on every micro-batch)"
            )
        keys = _columns("key", key, df, where)
        if window is not None:
            check_window_column(df, window, where)
        values = _columns("value", value, df, where)
        if not values:
            values = tuple(c for c in df.columns if c not in keys and c != window)
            if not values:
                raise SideInputConfigError(
                    f"{where}: the side DataFrame has no column besides the key and window; "
                    f"name the value with value=..."
                )
        scalar = isinstance(value, str) or (value is None and len(values) == 1)
        self._df: DataFrame | None = df
        self._spec = _ViewSpec(
            view_id=uuid.uuid4().hex,
            name=name,
            kind=self.kind,
            keyed=keyed,
            key=keys,
            value=values,
            scalar=scalar,
            window=window,
            default=default,
            output_mode=output_mode,
        )

    # -- what the driver asks ----------------------------------------------------------

    @property
    def df(self) -> DataFrame:
        if self._df is None:
            raise SideInputConfigError(
                f"{self!r} was unpickled in a task and has no DataFrame; declare views and "
                f"call with_side_inputs on the driver"
            )
        return self._df

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def keyed(self) -> bool:
        return self._spec.keyed

    @property
    def key(self) -> tuple[str, ...]:
        return self._spec.key

    @property
    def value(self) -> tuple[str, ...]:
        return self._spec.value

    @property
    def window(self) -> str | None:
        return self._spec.window

    @property
    def is_streaming(self) -> bool:
        return bool(self.df.isStreaming)

    # -- pickling: the spec travels, the DataFrame stays on the driver ---------------------

    def __getstate__(self) -> dict[str, Any]:
        return {"_df": None, "_spec": self._spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SideInput) and other._spec.view_id == self._spec.view_id

    def __hash__(self) -> int:
        return hash(self._spec.view_id)

    def __repr__(self) -> str:
        s = self._spec
        parts = [repr(s.name)]
        if s.key:
            parts.append(f"key={list(s.key)}")
        if s.kind in ("map", "multimap"):
            parts.append(f"keyed={s.keyed}")
        if s.window:
            parts.append(f"window={s.window!r}")
        return f"{type(self).__name__}({', '.join(parts)})"


class SingletonSideInput(SideInput):
    """One value (per window). ``ctx.side_input(view)`` returns it, or ``default``.

    With ``key=`` the view is keyed: one value per key, and the function sees the value
    of the current main record's key (``default`` when the side has none). More than one
    value at once (in a bounded side input, or in one micro-batch of a streaming one) is a
    ``SideInputValueError``; a later micro-batch replaces the value.
    """

    kind = "singleton"

    def __init__(
        self,
        df: DataFrame,
        value: str | Sequence[str] | None = None,
        *,
        key: str | Sequence[str] | None = None,
        window: str | None = None,
        default: Any = None,
        name: str | None = None,
        output_mode: str = "append",
    ) -> None:
        super().__init__(
            df,
            key=key,
            value=value,
            keyed=key is not None,
            window=window,
            default=default,
            name=name,
            output_mode=output_mode,
        )


class ListSideInput(SideInput):
    """All values (per window), as a tuple; new micro-batches append to it.

    With ``key=`` the view is keyed and the function sees the values of the current main
    record's key (an empty tuple when there are none). ``output_mode='complete'``
    replaces the list with each micro-batch instead.
    """

    kind = "list"

    def __init__(
        self,
        df: DataFrame,
        value: str | Sequence[str] | None = None,
        *,
        key: str | Sequence[str] | None = None,
        window: str | None = None,
        name: str | None = None,
        output_mode: str = "append",
    ) -> None:
        super().__init__(
            df,
            key=key,
            value=value,
            keyed=key is not None,
            window=window,
            default=None,
            name=name,
            output_mode=output_mode,
        )


class MapSideInput(SideInput):
    """A read-only mapping key -> value (per window); a later micro-batch upserts keys.

    Broadcast (default): every task sees the whole mapping. ``keyed=True``: the key must
    match the main input's key, main and side are co-partitioned, and a record sees only
    its own key's entry, as keyed state in FLIP-17: ``mapping.get(row.key)`` finds it;
    iterating, ``len``, ``keys()``, ``items()`` show only that entry; another key raises
    ``SideInputScopeError`` (use a broadcast view to look up any key). Results never
    depend on the partition count. A key twice in one version is a
    ``SideInputValueError``.
    """

    kind = "map"

    def __init__(
        self,
        df: DataFrame,
        key: str | Sequence[str],
        value: str | Sequence[str] | None = None,
        *,
        keyed: bool = False,
        window: str | None = None,
        name: str | None = None,
        output_mode: str = "append",
    ) -> None:
        if key is None:
            raise SideInputConfigError("MapSideInput needs key= (the column(s) of the map's key)")
        super().__init__(
            df,
            key=key,
            value=value,
            keyed=keyed,
            window=window,
            default=None,
            name=name,
            output_mode=output_mode,
        )


class MultimapSideInput(SideInput):
    """A read-only mapping key -> tuple of values (per window); micro-batches append.

    ``keyed=True`` co-partitions it with the main input as for ``MapSideInput``.
    """

    kind = "multimap"

    def __init__(
        self,
        df: DataFrame,
        key: str | Sequence[str],
        value: str | Sequence[str] | None = None,
        *,
        keyed: bool = False,
        window: str | None = None,
        name: str | None = None,
        output_mode: str = "append",
    ) -> None:
        if key is None:
            raise SideInputConfigError(
                "MultimapSideInput needs key= (the column(s) of the map's key)"
            )
        super().__init__(
            df,
            key=key,
            value=value,
            keyed=keyed,
            window=window,
            default=None,
            name=name,
            output_mode=output_mode,
        )
