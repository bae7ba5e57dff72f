"""Side inputs (FLIP-17) for Spark DataFrames: extra, read-only inputs of an operation.

Declare views over side DataFrames, attach them to an operation on a main DataFrame,
read them in the function (which runs in Spark tasks)::

    dims = MapSideInput(users_df, key="user_id", value="segment", keyed=True)
    limit = SingletonSideInput(threshold_df, "value")

    def enrich(row, ctx):
        return (row.user_id, row.dwell_ms, ctx.side_input(dims).get(row.user_id))

    out = with_side_inputs(clicks_df, dims, limit, key="user_id").map(
        enrich, "user_id long, dwell_ms double, segment string")
    kept = with_side_inputs(clicks_df, limit).filter(lambda row, ctx: row.dwell_ms >= ctx.side_input(limit))

Views (``ctx.side_input(view)`` returns)
    ``SingletonSideInput`` the value (``default`` when empty); ``ListSideInput`` a tuple;
    ``MapSideInput`` a read-only mapping key -> value; ``MultimapSideInput`` a read-only
    mapping key -> tuple. Values are one column's value (``value='col'``) or a Row of
    several; keys and values look exactly as ``df.collect()`` gives them, like the main
    Rows the function gets. A singleton with two values at once, or a map with a key
    twice in one version, is a ``SideInputValueError``. Maps are live: each access
    answers for the record current at that moment (its window, its key), so a
    ``map_partition`` function can read a map once and use it for every row.

Broadcast or keyed (where the side data goes)
    Broadcast views (the default) are read once on the driver (Arrow end to end) and
    shipped as one Spark broadcast variable per view: every task sees all of it, each
    executor's Python worker unpickles it once. Keyed views (``keyed=True`` for maps;
    ``key=`` for singletons and lists, which then answer for the current record's key)
    need ``with_side_inputs(..., key=...)`` with the same arity and Spark types as the
    view's key (checked before any job: Spark hashes different types differently). Main
    and side are co-partitioned, never broadcast: bounded ones are unioned, shuffled
    together by the key and sorted so each partition's side rows precede its main rows;
    the task folds only its partition's share of the side data (1/n of it), then runs
    the main rows. A keyed map or multimap shows a record only its own key's entry (as
    FLIP-17's keyed state): ``get(row.key)`` finds it, iteration and ``len`` see only
    it, and asking for another key raises ``SideInputScopeError`` (use a broadcast view
    to look up any key), so results never depend on the partition count.

Static and evolving
    A bounded main input needs bounded views: the result is a lazy DataFrame, side data
    read once and shipped once. A streaming main input returns a ``SideInputStream``;
    ``.start(foreach_batch=...)`` (or ``format=``/``path=``) runs it as Structured
    Streaming queries driven by ``foreachBatch`` on the driver (``_side_stream``):

    * each streaming view is its own query; every non-empty micro-batch is a new version
      (singletons and maps replace values, lists and multimaps append; the side query's
      ``output_mode='complete'`` replaces the whole view). Broadcast views become a new
      broadcast variable; keyed views are written by Spark tasks to versioned files by
      key group (``pmod(hash(key), key_groups)``, the same for main rows) that main tasks
      fold for their key groups only, cached per Python worker;
    * a main micro-batch runs against one snapshot of all views (swapped under a lock:
      every record of it sees the same version of a view, never a half-applied one, and
      later micro-batches see later versions). ``ctx.side_input_version(view)`` says which
      version a record saw; ``SideInputQuery.history`` records it per output batch;
    * until a view is ready (its first data arrived) main records wait in a
      ``RecordBuffer`` per window namespace: Arrow batches in driver memory up to
      ``buffer_memory``, Parquet files in ``work_dir`` beyond (disk, not an OOM). When
      a version makes a namespace ready, Spark reads its records back and processes
      them before any later main record. ``ready``, ``wait_until_ready()`` and
      ``status()`` show the ready condition; ``ready_timeout`` turns a side input that
      never becomes ready into a ``SideInputNotReadyError``.

Windows
    With ``with_side_inputs(..., window='w')`` (a ``F.window`` struct column of the
    main input) and a windowed view (``window=`` on the view), a record sees the view's
    content for the matching window: the same window, or for different window functions
    the latest-starting side window that contains the main window's end
    (``start < main_end <= end``). Non-windowed views serve every window. Readiness is
    per main window.

Limits
    Side-input state is not recovered when a stopped streaming query is started again
    (checkpoints live in ``work_dir``, temporary by default); views cannot retract values;
    keyed versions are not compacted (a new Python worker folds every version of its key
    groups once); ``foreach_batch`` must consume its DataFrame within the call (buffered
    files are deleted after it). On a cluster ``work_dir`` must be storage every
    executor reads (a path or a URI pyarrow opens, as for a checkpoint location).

Runs on the driver (planning, ``SideInputQuery``) and in Spark tasks (the function,
``SideInputContext``). Never imports ray or hybrid_iter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._buffer import RecordBuffer
from ._content import SideInputContext
from ._errors import (
    SideInputConfigError,
    SideInputError,
    SideInputKeyError,
    SideInputNotReadyError,
    SideInputScopeError,
    SideInputValueError,
)
from ._plan import broadcast_contents, check_keyed_unique, check_main, make_plan, run_on
from ._stream import BatchRecord, SideInputQuery, SideInputStream
from ._views import (
    ListSideInput,
    MapSideInput,
    MultimapSideInput,
    SideInput,
    SingletonSideInput,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = [
    "BatchRecord",
    "ListSideInput",
    "MapSideInput",
    "MultimapSideInput",
    "RecordBuffer",
    "SideInput",
    "SideInputConfigError",
    "SideInputContext",
    "SideInputError",
    "SideInputKeyError",
    "SideInputNotReadyError",
    "SideInputOperation",
    "SideInputQuery",
    "SideInputScopeError",
    "SideInputStream",
    "SideInputValueError",
    "SingletonSideInput",
    "with_side_inputs",
]


class SideInputOperation:
    """A main DataFrame with side-input views attached; pick the operation to run.

    Created on the driver by ``with_side_inputs``. Each method returns a lazy DataFrame
    for a bounded main input, a ``SideInputStream`` (call ``.start(...)``) for a
    streaming one. The function runs in Spark tasks and gets ``(row, ctx)``
    (``map``/``filter``: a ``pyspark.sql.Row`` of the main columns) or ``(rows, ctx)``
    (``map_partition``: an iterator over the partition's Rows); ``ctx`` is a
    ``SideInputContext``.
    """

    def __init__(
        self,
        main: DataFrame,
        views: Sequence[SideInput],
        *,
        key: str | Sequence[str] | None = None,
        window: str | None = None,
        num_partitions: int | None = None,
    ) -> None:
        self._spec = check_main(main, views, key=key, window=window, num_partitions=num_partitions)
        self.main = main
        self.views = tuple(views)

    def map(self, fn: Callable[[Any, SideInputContext], Any], schema: Any) -> Any:
        """One output row per main row: ``fn(row, ctx)`` returns a tuple, Row or dict with
        ``schema``'s fields (a StructType or DDL string)."""
        return self._run("map", fn, schema)

    def filter(self, fn: Callable[[Any, SideInputContext], Any]) -> Any:
        """The main rows for which ``fn(row, ctx)`` is true (same schema as the main input)."""
        return self._run("filter", fn, None)

    def map_partition(self, fn: Callable[[Any, SideInputContext], Any], schema: Any) -> Any:
        """``fn(rows, ctx)`` gets an iterator over a partition's main rows and returns (or
        yields) any number of output rows with ``schema``. ``ctx`` follows the iterator:
        while a row is current, ``ctx.key``/``ctx.window``/keyed views answer for it."""
        return self._run("map_partition", fn, schema)

    def _run(self, op: str, fn: Any, schema: Any) -> Any:
        plan, struct = make_plan(self.main, self._spec, op, fn, schema)
        if self.main.isStreaming:
            return SideInputStream(self.main, self._spec, self.views, plan, struct)
        broadcast_views = [v for v in self.views if not v.keyed]
        contents = broadcast_contents(broadcast_views)  # read once, on the driver
        check_keyed_unique([v for v in self.views if v.keyed])
        sc = self.main.sparkSession.sparkContext
        bcasts = {vid: sc.broadcast(c) for vid, c in contents.items()}  # shipped once
        return run_on(
            self.main,
            plan,
            struct,
            self._spec,
            broadcast=tuple((v._spec, 1) for v in broadcast_views),
            bcast=bcasts,
            keyed_views=[v for v in self.views if v.keyed],
        )


def with_side_inputs(
    main: DataFrame,
    *views: SideInput,
    key: str | Sequence[str] | None = None,
    window: str | None = None,
    num_partitions: int | None = None,
) -> SideInputOperation:
    """Attach side-input views to an operation on ``main``; see the module docstring.

    ``key``: the main input's key column(s), required by keyed views (same arity and
    types as their key). ``window``: the main input's window column (a ``F.window``
    struct), required by windowed views. ``num_partitions``: partitions of the keyed
    co-partitioning shuffle (default: Spark's ``spark.sql.shuffle.partitions``,
    coalesced by AQE). Every argument is checked here, before any Spark job.
    """
    return SideInputOperation(main, views, key=key, window=window, num_partitions=num_partitions)
