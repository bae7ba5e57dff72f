"""spark_ops semantics, on a real SparkSession: the keyed aggregate with an
atomic result type, keyed side-input views scoped to the record's key, rich functions
(open/close once per partition) and one exception root."""

from __future__ import annotations

import os
import sys
import uuid

import pytest
from pyspark import cloudpickle

import hybrid_iter as hi
import spark_ops as so
from spark_ops import (
    AggregateFunction,
    MapSideInput,
    MultimapSideInput,
    full_window_partition,
    key_by,
    local_key_by,
    with_side_inputs,
)


@pytest.fixture(scope="module", autouse=True)
def ship_this_module_by_value():
    """The functions below reach Spark's Python workers pickled by value, as a user's
    own script would ship them (this module is not importable there; see conftest)."""
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # PySpark's own copy of cloudpickle
    yield
    cloudpickle.unregister_pickle_by_value(module)


# -- 5. keyed aggregate with a one-type result schema --------------------------------------


class Concat(AggregateFunction):
    def create_accumulator(self):
        return []

    def add(self, value, accumulator):
        accumulator.append(value.v)
        return accumulator

    def get_result(self, accumulator):
        return ",".join(sorted(accumulator))


def test_keyed_aggregate_with_an_atomic_result_type(spark):
    df = spark.createDataFrame([("Key1", "97"), ("Key1", "3"), ("Key2", "5")], "k string, v string")
    out = key_by(df, "k").full_window_partition().aggregate(Concat(), "string")
    assert out.columns == ["k", "value"]
    assert sorted(map(tuple, out.collect())) == [("Key1", "3,97"), ("Key2", "5")]


# -- 6. keyed side-input views show a record only its own key ------------------------------


def _seen(row, ctx):
    seg = ctx.side_input("seg")
    tags = ctx.side_input("tags")
    return (
        row.user_id,
        row.n,
        repr((len(seg), sorted(seg), sorted(seg.items()), list(seg.values()))),
        repr((len(tags), sorted(tags.keys()), sorted(tags.items()))),
    )


def test_keyed_views_are_scoped_to_the_record_key_whatever_the_partitions(spark):
    side = spark.createDataFrame([(k, f"s{k}") for k in range(12)], "user_id long, segment string")
    tag_rows = [(k, f"t{k}{j}") for k in range(12) for j in range(k % 3)]
    tags = spark.createDataFrame(tag_rows, "user_id long, tag string")
    main = spark.createDataFrame([(i % 15, i) for i in range(60)], "user_id long, n long")
    seg = MapSideInput(side, key="user_id", value="segment", keyed=True, name="seg")
    multi = MultimapSideInput(tags, key="user_id", value="tag", keyed=True, name="tags")
    schema = "user_id long, n long, seg string, tags string"
    results = {}
    for n in (1, 2, 7):
        op = with_side_inputs(main, seg, multi, key="user_id", num_partitions=n)
        results[n] = sorted(map(tuple, op.map(_seen, schema).collect()))
    assert results[1] == results[2] == results[7]
    for uid, _, seen_seg, seen_tags in results[1]:
        if uid < 12:
            assert seen_seg == repr((1, [uid], [(uid, f"s{uid}")], [f"s{uid}"]))
            own = tuple(sorted(f"t{uid}{j}" for j in range(uid % 3)))
            expected = (1, [uid], [(uid, own)]) if own else (0, [], [])
            assert seen_tags == repr(expected)
        else:  # no side entry for this key: an empty view, not another key's entries
            assert seen_seg == repr((0, [], [], []))

    def other_key(row, ctx):
        return (row.user_id, ctx.side_input("seg").get(row.user_id + 1))

    with pytest.raises(so.UserFunctionError, match=r"SideInputScopeError.*broadcast view") as info:
        with_side_inputs(main, seg, key="user_id", num_partitions=2).map(
            other_key, "user_id long, seg string"
        ).collect()
    assert info.value.raised(so.SideInputScopeError) and info.value.raised(LookupError)


# -- 7. rich functions: open(ctx) / close() once per partition ------------------------------


class _Rich:
    """Logs every open/close to a file (closes happen after the last record, so the
    test reads them from disk, not from the output)."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.ctx = None

    def _log(self, what):
        name = f"{what}-{self.ctx.partition_id}-{uuid.uuid4().hex}"
        with open(os.path.join(self.log_dir, name), "w") as f:
            f.write(f"{self.ctx.num_partitions}")

    def open(self, ctx):
        assert self.ctx is None, "open() called twice on one copy"
        self.ctx = ctx
        self.calls = 0
        self._log("open")

    def close(self):
        self._log("close")


class RichMap(_Rich):
    def __call__(self, rows):
        self.calls += 1
        yield (self.ctx.partition_id, self.ctx.num_partitions, self.calls, sum(1 for _ in rows))


class RichAgg(_Rich, AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, value, accumulator):
        return accumulator + 1

    def get_result(self, accumulator):
        return accumulator


class RichReduce(_Rich):
    def __call__(self, a, b):
        return a if a.id >= b.id else b


class RichKey(_Rich):
    def __call__(self, row):
        return -row.id


def _log(log_dir):
    events = {}
    for name in os.listdir(log_dir):
        what, pid, _ = name.split("-")
        events.setdefault(what, []).append(int(pid))
        with open(os.path.join(log_dir, name)) as f:
            events.setdefault(f"{what}_n", set()).add(f.read())
    return events


@pytest.mark.parametrize("op", ["map_partition", "aggregate", "reduce", "sort_partition"])
@pytest.mark.parametrize("keyed", [False, True], ids=["partitions", "keyed"])
def test_rich_functions_open_and_close_once_per_partition(spark, tmp_path, op, keyed):
    df = spark.range(0, 40, numPartitions=3).selectExpr("id", "id % 5 as k")
    stream = (
        key_by(df, "k", num_partitions=3).full_window_partition()
        if keyed
        else full_window_partition(df)
    )
    log_dir = str(tmp_path)
    if op == "map_partition":
        out = stream.map_partition(RichMap(log_dir), "pid int, n int, calls int, rows long")
    elif op == "aggregate":
        out = stream.aggregate(RichAgg(log_dir), "long")
    elif op == "reduce":
        out = stream.reduce(RichReduce(log_dir))
    else:
        out = stream.sort_partition(RichKey(log_dir))
    rows = out.collect()
    events = _log(log_dir)
    assert sorted(events["open"]) == [0, 1, 2]  # once per partition, keyed or not
    assert sorted(events["close"]) == [0, 1, 2]
    assert events["open_n"] == events["close_n"] == {"3"}  # ctx.num_partitions
    if op == "map_partition" and keyed:  # called once per key, opened once per partition
        assert sum(r.calls for r in rows if r.calls == 1) <= 3
        assert len(rows) == 5 and max(r.calls for r in rows) > 1
    if op == "sort_partition" and not keyed:
        assert len(rows) == 40


def test_rich_function_partition_count_is_unknown_rather_than_wrong(spark, tmp_path):
    """A keyed shuffle Spark sizes itself may be coalesced by adaptive execution, so
    its planned count is no answer: ctx.num_partitions is None there."""
    df = spark.range(0, 20, numPartitions=2).selectExpr("id", "id % 4 as k")
    out = (
        key_by(df, "k")
        .full_window_partition()
        .map_partition(RichMap(str(tmp_path)), "pid int, n int, calls int, rows long")
    )
    rows = out.collect()
    assert sum(r.rows for r in rows) == 20 and {r.n for r in rows} == {None}


# -- 8. one root exception --------------------------------------------------------------------


def test_spark_ops_errors_share_one_root_and_keep_their_builtin_bases(spark):
    df = spark.range(10).selectExpr("id", "id % 2 as k")
    with pytest.raises(so.SparkOpsError, match="not in the DataFrame") as missing:
        key_by(df, "nope")
    assert isinstance(missing.value, ValueError)
    with pytest.raises(so.SparkOpsError, match="order must be"):
        full_window_partition(df).sort_partition("id", "sideways")
    with pytest.raises(so.SparkOpsError, match="must be an int >= 1") as top:
        local_key_by(df, "k").top_n("id", 0)
    assert isinstance(top.value, ValueError)
    with pytest.raises(so.SparkOpsError, match="out of range") as idx:
        full_window_partition(df).sort_partition(7)
    assert isinstance(idx.value, IndexError)
    for cls in (
        so.PartitionFunctionError,
        so.NonMergeableAggregateError,
        so.SideInputError,
        so.SideInputValueError,
        so.SideInputConfigError,
        so.SideInputScopeError,
        so.SideInputNotReadyError,
    ):
        assert issubclass(cls, so.SparkOpsError), cls
    assert issubclass(so.NonMergeableAggregateError, TypeError)
    assert issubclass(so.SideInputValueError, ValueError)
    assert hi.SparkOpsError is so.SparkOpsError  # re-exported by hybrid_iter
    # broadcast and keyed duplicates: the same type name and message shape
    dup = spark.createDataFrame([(1, "a"), (1, "b")], "user_id long, segment string")
    main = spark.createDataFrame([(1, 0)], "user_id long, n long")
    with pytest.raises(so.SideInputValueError, match="more than once"):
        with_side_inputs(main, MapSideInput(dup, key="user_id", value="segment")).map(
            lambda row, ctx: (row.n,), "n long"
        ).collect()
    keyed = MapSideInput(dup, key="user_id", value="segment", keyed=True)
    with pytest.raises(so.SideInputValueError, match="key 1 more than once"):
        with_side_inputs(main, keyed, key="user_id").map(lambda row, ctx: (row.n,), "n long")


def test_a_keyed_windowed_duplicate_is_named_with_its_window_before_the_main_job(spark):
    """One value per (window, key): the same key in two windows is fine, twice in one
    window is a SideInputValueError on the driver naming the window."""
    import datetime as dt

    from pyspark.sql import functions as F

    t0 = dt.datetime(2026, 1, 1, 12, 0, 5)
    t1 = dt.datetime(2026, 1, 1, 12, 1, 5)
    side = spark.createDataFrame(
        [(1, t0, 0.5), (1, t1, 0.7), (2, t0, 0.1)], "user_id long, ts timestamp, rate double"
    ).withColumn("w", F.window("ts", "1 minute"))
    main = spark.createDataFrame([(1, t0)], "user_id long, ts timestamp").withColumn(
        "w", F.window("ts", "1 minute")
    )
    ok = MapSideInput(side, key="user_id", value="rate", window="w", keyed=True)
    rows = (
        with_side_inputs(main, ok, key="user_id", window="w")
        .map(lambda row, ctx: (ctx.side_input(ok)[row.user_id],), "rate double")
        .collect()
    )
    assert [r.rate for r in rows] == [0.5]
    twice = side.union(side.filter("rate = 0.7"))
    bad = MapSideInput(twice, key="user_id", value="rate", window="w", keyed=True)
    with pytest.raises(
        so.SideInputValueError, match=r"key 1 more than once.*window \[2026-01-01T12:01"
    ):
        with_side_inputs(main, bad, key="user_id", window="w").map(
            lambda row, ctx: (0.0,), "rate double"
        )
