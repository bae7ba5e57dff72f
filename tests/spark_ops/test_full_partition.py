"""Full-partition processing (FLIP-380): map_partition, sort_partition, aggregate, reduce,
per partition and per key, on real Spark.

The known layout: ``spark.range(10, numPartitions=2)`` puts ids 0-4 in partition 0 and
5-9 in partition 1. Bad arguments fail before any Spark job (checked with a job group);
failures of user code name the partition (and key) and carry the user's traceback. A
partition far larger than the Python worker's memory streams through ``map_partition``
and ``sort_partition`` in a subprocess with its own memory-limited SparkSession.
"""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import ROOT, TESTS
from pyspark.sql import Row
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StructField, StructType

from spark_ops import (
    AggregateFunction,
    KeyedPartitionWindowedStream,
    Order,
    PartitionWindowedStream,
    SparkOpsError,
    UserFunctionError,
    full_window_partition,
    key_by,
)
from spark_ops import _spark_compat as compat
from spark_ops.full_partition._keys import encode_key, encode_keys

PART0, PART1 = list(range(5)), list(range(5, 10))


@pytest.fixture(scope="module")
def df(spark):
    """ids 0-4 in partition 0, 5-9 in partition 1; k = id % 3; st.a = (7 * id) % 10."""
    return spark.range(10, numPartitions=2).select(
        "id",
        (F.col("id") % 3).alias("k"),
        (F.col("id") * 1.5).alias("x"),
        F.concat(F.lit("s"), (F.col("id") % 3).cast("string")).alias("s"),
        F.struct(((F.col("id") * 7) % 10).alias("a"), F.lit("z").alias("b")).alias("st"),
    )


def by_partition(out) -> dict[int, list]:
    """Collected rows grouped by the partition they were in, in partition order."""
    rows = out.withColumn("_pid", F.spark_partition_id()).collect()
    parts: dict[int, list] = {}
    for r in rows:
        parts.setdefault(r["_pid"], []).append(r)
    return parts


def _worker_side():
    """Functions and classes the Spark workers run. Defined in a function so cloudpickle
    ships them by value: this test module is not importable in the workers (as a user's
    script would not be; see conftest)."""

    def partition_id() -> int:
        from pyspark import TaskContext

        return TaskContext.get().partitionId()

    class CountSum(AggregateFunction):
        """(records, sum of x) of a window: Rows in, a tuple out."""

        def create_accumulator(self):
            return [0, 0.0]

        def add(self, value, accumulator):
            accumulator[0] += 1
            accumulator[1] += value.x
            return accumulator

        def get_result(self, accumulator):
            return (accumulator[0], accumulator[1])

        def merge(self, a, b):
            return [a[0] + b[0], a[1] + b[1]]

    class BatchCountSum(CountSum):
        """The same aggregate over Arrow batches (``batches=True``)."""

        def add(self, value, accumulator):
            import pyarrow.compute as pc

            accumulator[0] += value.num_rows
            accumulator[1] += pc.sum(value.column("x")).as_py() or 0.0
            return accumulator

    def boom_on_seven(rows):
        for r in rows:
            if r.id == 7:
                raise ZeroDivisionError(f"no seven please ({r.id})")
            yield r.id

    return partition_id, CountSum, BatchCountSum, boom_on_seven


partition_id, CountSum, BatchCountSum, boom_on_seven = _worker_side()


# -- map_partition ------------------------------------------------------------------------------


def test_map_partition_sees_every_record_of_its_partition_as_rows(df):
    def summarize(rows):
        from pyspark.sql import Row

        ids, fields, all_rows = [], set(), True
        for r in rows:
            ids.append(r.id)
            fields.add(tuple(r.__fields__))
            all_rows &= isinstance(r, Row) and r["s"] == r.s == r[3]
        yield partition_id(), ids, [list(f) for f in fields], all_rows

    out = full_window_partition(df).map_partition(
        summarize, "pid int, ids array<long>, fields array<array<string>>, rows boolean"
    )
    got = {r.pid: r for r in out.collect()}
    assert got[0].ids == PART0 and got[1].ids == PART1
    assert got[0].fields == [["id", "k", "x", "s", "st"]] and got[0].rows and got[1].rows


def test_map_partition_rows_look_like_collect(spark):
    """Nested structs, maps, arrays, timestamps, decimals and nulls reach the function
    as df.collect() shows them, and what it yields comes back unchanged."""
    schema = (
        "i int, d decimal(10,2), ts timestamp, day date, "
        "arr array<struct<t:timestamp, v:double>>, m map<string, array<long>>, "
        "st struct<a:long, b:struct<c:string>>, bin binary"
    )
    data = [
        (
            1,
            decimal.Decimal("12.34"),
            dt.datetime(2024, 3, 1, 12, 30, 15, 250),
            dt.date(2024, 2, 29),
            [(dt.datetime(2020, 1, 1, 0, 0, 1), 0.5), None],
            {"x": [1, 2], "y": None},
            (7, ("c",)),
            bytearray(b"\x00\x01"),
        ),
        (None, None, None, None, None, None, None, None),
        (
            3,
            decimal.Decimal("-1.00"),
            dt.datetime(1969, 12, 31, 23, 59, 59),
            None,
            [],
            {},
            (None, None),
            bytearray(),
        ),
    ]
    src = spark.createDataFrame(data, schema).coalesce(1)
    expected = src.collect()

    def reprs(rows):
        for r in rows:
            yield (repr(r),)

    seen = [r[0] for r in full_window_partition(src).map_partition(reprs, "r string").collect()]
    assert seen == [repr(r) for r in expected]
    echoed = full_window_partition(src).map_partition(lambda rows: rows, src.schema).collect()
    assert echoed == expected


def test_map_partition_output_forms_and_schemas(df):
    def forms(rows):
        n = sum(1 for _ in rows)
        yield (n, "tuple")
        yield [n, "list"]
        yield {"kind": "dict", "n": n}
        yield Row(kind="row", n=n)

    out = full_window_partition(df).map_partition(forms, "n long, kind string").collect()
    assert sorted((r.n, r.kind) for r in out) == sorted(
        (5, kind) for kind in ("tuple", "list", "dict", "row") for _ in range(2)
    )
    # An atomic type is one column named value, yielded bare; a StructType works like DDL.
    ids = full_window_partition(df).map_partition(lambda rows: (r.id * 2 for r in rows), "bigint")
    assert ids.columns == ["value"]
    assert sorted(r.value for r in ids.collect()) == [2 * i for i in range(10)]
    struct = StructType([StructField("n", LongType())])
    counts = full_window_partition(df).map_partition(lambda rows: [sum(1 for _ in rows)], struct)
    assert sorted(r.n for r in counts.collect()) == [5, 5]


def test_map_partition_with_arrow_batches(df):
    def per_batch(batches):
        import pyarrow.compute as pc

        for b in batches:
            assert isinstance(b, pa.RecordBatch)
            # columns by name in another order
            yield pa.record_batch({"doubled": pc.multiply(b.column("x"), 2), "id": b.column("id")})
        yield (-1, 0.0)  # plain records may be mixed in

    out = full_window_partition(df).map_partition(
        per_batch, "id long, doubled double", batches=True
    )
    parts = by_partition(out)
    assert [r.id for r in parts[0]] == [*PART0, -1]
    assert [r.doubled for r in parts[1]] == [3.0 * i for i in PART1] + [0.0]


def test_map_partition_refuses_values_that_do_not_fit(df):
    bad_float = full_window_partition(df).map_partition(lambda rows: [(1.5,)], "n long")
    with pytest.raises(
        Exception, match=r"column 'n' has type int64 and cannot hold the value 1\.5"
    ):
        bad_float.collect()
    bad_arity = full_window_partition(df).map_partition(lambda rows: [(1, 2)], "n long")
    with pytest.raises(Exception, match=r"has 2 value\(s\) but the schema has 1 column"):
        bad_arity.collect()


# -- sort_partition -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        (lambda: 0, lambda r: r.id),
        (lambda: "id", lambda r: r.id),
        (lambda: "st.a", lambda r: r.st.a),
        (lambda: F.col("x") * -1, lambda r: -r.x),  # made once Spark runs
    ],
    ids=["index", "name", "nested", "column"],
)
@pytest.mark.parametrize("order", [Order.ASCENDING, Order.DESCENDING])
def test_sort_partition_by_field_sorts_each_partition(df, field, value, order):
    parts = by_partition(full_window_partition(df).sort_partition(field(), order))
    for pid, ids in ((0, PART0), (1, PART1)):
        got = [value(r) for r in parts[pid]]
        assert sorted(r.id for r in parts[pid]) == ids  # records stay in their partition
        assert got == sorted(got, reverse=order is Order.DESCENDING)


def test_sort_partition_by_key_function(df):
    def key(r):  # tuple keys, None and a string
        return (None if r.k == 0 else r.s, -r.id)

    asc = by_partition(full_window_partition(df).sort_partition(key))
    desc = by_partition(full_window_partition(df).sort_partition(key, "descending"))
    for pid in (0, 1):
        rows = asc[pid]
        expected = sorted(rows, key=lambda r: (r.k != 0, r.s if r.k else "", -r.id))
        assert [r.id for r in rows] == [r.id for r in expected]
        assert [r.id for r in desc[pid]] == [r.id for r in reversed(expected)]
        assert rows[0].asDict().keys() == {"id", "k", "x", "s", "st", "_pid"}  # key dropped


def test_sort_partition_nulls_follow_spark(spark):
    src = spark.createDataFrame([(3,), (None,), (1,)], "v int").coalesce(1)
    w = full_window_partition(src)
    assert [r.v for r in w.sort_partition("v").collect()] == [None, 1, 3]
    assert [r.v for r in w.sort_partition("v", Order.DESCENDING).collect()] == [3, 1, None]
    assert [r.v for r in w.sort_partition(lambda r: r.v).collect()] == [None, 1, 3]


# -- aggregate / reduce ---------------------------------------------------------------------------


def test_aggregate_gives_one_result_per_partition(df):
    for agg, batches in ((CountSum(), False), (BatchCountSum(), True)):
        out = full_window_partition(df).aggregate(agg, "n long, total double", batches=batches)
        parts = by_partition(out)
        assert [(r.n, r.total) for r in parts[0]] == [(5, 1.5 * sum(PART0))]
        assert [(r.n, r.total) for r in parts[1]] == [(5, 1.5 * sum(PART1))]


def test_reduce_gives_one_record_per_partition(df):
    out = full_window_partition(df).reduce(lambda a, b: a if a.st.a >= b.st.a else b)
    parts = by_partition(out)
    assert [r.id for r in parts[0]] == [4]  # st.a = 8
    assert [r.id for r in parts[1]] == [7]  # st.a = 9
    assert out.columns == df.columns


def test_empty_partitions(spark):
    """Every partition Spark runs gives an aggregate (of nothing) and no reduce result."""
    # three empty partitions, no shuffle; and two empty ones among the four of range(2)
    none = spark.createDataFrame(spark.sparkContext.parallelize([], 3), "x double")
    sparse = spark.range(2, numPartitions=4).select((F.col("id") * 1.0).alias("x"))
    cases = ((none, [(0, 0.0)] * 3), (sparse, [(0, 0.0), (0, 0.0), (1, 0.0), (1, 1.0)]))
    for src, results in cases:
        w = full_window_partition(src)
        agg = w.aggregate(CountSum(), "n long, total double").collect()
        assert sorted((r.n, r.total) for r in agg) == results
        non_empty = sum(1 for n, _ in results if n)
        assert len(w.reduce(lambda a, b: a).collect()) == non_empty
        calls = w.map_partition(
            lambda rows: [(partition_id(), sum(1 for _ in rows))], "p int, n long"
        )
        assert sorted(r.p for r in calls.collect()) == list(range(len(results)))


def test_empty_shuffle_output(spark):
    """Empty partitions after a shuffle get results too; under Spark 3.5's adaptive
    execution an entirely empty shuffle has no partitions left, so nothing runs, while
    Spark 4's keeps them (documented)."""
    empty = (
        spark.range(10, numPartitions=2).where("id > 100").select((F.col("id") * 1.0).alias("x"))
    )
    w = full_window_partition(empty.repartition(3))
    before = spark.conf.get("spark.sql.adaptive.enabled")
    try:
        spark.conf.set("spark.sql.adaptive.enabled", "false")
        assert len(w.aggregate(CountSum(), "n long, total double").collect()) == 3
        spark.conf.set("spark.sql.adaptive.enabled", "true")
        results = w.aggregate(CountSum(), "n long, total double").collect()
        if compat.spark_version() >= (4, 0, 0):
            assert [tuple(r) for r in results] == [(0, 0.0)] * 3
        else:
            assert results == []
    finally:
        spark.conf.set("spark.sql.adaptive.enabled", before)


# -- keyed ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many(spark):
    """1000 rows, keys k in {0, 1, 2} over 3 partitions: every key spans several Arrow
    batches (256 rows each in the test session) and several input partitions."""
    return spark.range(1000, numPartitions=3).select(
        "id",
        (F.col("id") % 3).alias("k"),
        (F.col("id") % 2).alias("j"),
        (F.col("id") * 1.0).alias("x"),
    )


def test_keyed_aggregate_and_reduce_give_one_result_per_key(many):
    keyed = key_by(many, "k").full_window_partition()
    assert isinstance(keyed, KeyedPartitionWindowedStream)
    agg = keyed.aggregate(CountSum(), "n long, total double")
    assert agg.columns == ["k", "n", "total"]
    expected = {k: (len(range(k, 1000, 3)), float(sum(range(k, 1000, 3)))) for k in range(3)}
    assert {r.k: (r.n, r.total) for r in agg.collect()} == expected
    two_keys = key_by(many, ["k", "j"], num_partitions=2).full_window_partition()
    got = two_keys.aggregate(BatchCountSum(), "n long, total double", batches=True).collect()
    assert {(r.k, r.j): r.n for r in got} == {
        (k, j): sum(1 for i in range(1000) if i % 3 == k and i % 2 == j)
        for k in range(3)
        for j in range(2)
    }
    top = keyed.reduce(lambda a, b: a if a.id > b.id else b).collect()
    assert sorted((r.k, r.id) for r in top) == [(0, 999), (1, 997), (2, 998)]
    assert top[0].asDict().keys() == {"id", "k", "j", "x"}


def test_keyed_map_partition_streams_each_key_separately(many):
    def first_three(rows):
        rows = list(itertools.islice(rows, 3))  # leaves the rest of the key unread
        yield rows[0].k, [r.id for r in rows], len({r.k for r in rows})

    keyed = key_by(many, "k", num_partitions=2).full_window_partition()
    out = keyed.map_partition(first_three, "k long, ids array<long>, distinct_keys int").collect()
    assert sorted(r.k for r in out) == [0, 1, 2]
    assert all(r.distinct_keys == 1 and len(r.ids) == 3 for r in out)

    def count(batches):
        yield sum(b.num_rows for b in batches)

    counts = keyed.map_partition(count, "long", batches=True).collect()
    assert sorted(r.value for r in counts) == [333, 333, 334]


def test_keyed_sort_partition_sorts_within_each_key(many):
    keyed = key_by(many, "k").full_window_partition()
    for out in (
        keyed.sort_partition("id", Order.DESCENDING),
        keyed.sort_partition(lambda r: -r.id),
    ):
        parts = by_partition(out)
        for rows in parts.values():
            runs = [list(g) for _, g in itertools.groupby(rows, key=lambda r: r.k)]
            assert len(runs) == len({r.k for r in rows})  # each key's records are together
            for run in runs:
                assert [r.id for r in run] == sorted((r.id for r in run), reverse=True)
        assert sum(len(v) for v in parts.values()) == 1000


def test_keys_group_like_spark(spark):
    """null is a key, NaN is one key, and -0.0 and 0.0 are the same key."""
    rows = [(None, 1), (None, 2), (math.nan, 3), (float("nan"), 4), (-0.0, 5), (0.0, 6), (1.0, 7)]
    src = spark.createDataFrame(rows, "f double, v long").repartition(3)

    def label(f):
        return "nan" if f is not None and math.isnan(f) else f

    out = key_by(src, "f").full_window_partition().reduce(lambda a, b: Row(f=a.f, v=a.v + b.v))
    got = {label(r.f): r.v for r in out.collect()}
    assert got == {None: 3, "nan": 7, 0.0: 11, 1.0: 7}
    native = src.groupBy("f").agg(F.sum("v").alias("v")).collect()
    assert got == {label(r.f): r.v for r in native}
    # a struct key (compared in Python, not by Arrow kernels), over several Arrow batches
    structs = spark.range(600, numPartitions=2).select(
        F.struct((F.col("id") % 2).alias("a"), F.lit("b").alias("b")).alias("st"),
        (F.col("id") * 1.0).alias("x"),
    )
    sums = key_by(structs, "st").full_window_partition().aggregate(CountSum(), "n long, t double")
    assert sorted((r.st.a, r.n) for r in sums.collect()) == [(0, 300), (1, 300)]


# -- failures of user code -----------------------------------------------------------------------


def _failing_functions():
    """A user's own exception class and one failing function per kind of operation, all
    raising it for id 7 (partition 1, key 1). Shipped by value (see ``_worker_side``)."""

    class NotSeven(ValueError):
        pass

    def map_fn(rows):
        for r in rows:
            if r.id == 7:
                raise NotSeven(f"no seven ({r.id})")
            yield (r.id,)

    def sort_key(row):
        if row.id == 7:
            raise NotSeven("no seven as a key")
        return row.id

    def pick(a, b):
        if 7 in (a.id, b.id):
            raise NotSeven("no seven to reduce")
        return a

    class Summing(AggregateFunction):
        def create_accumulator(self):
            return [0]

        def add(self, value, accumulator):
            if value.id == 7:
                raise NotSeven("no seven to add")
            accumulator[0] += 1
            return accumulator

        def get_result(self, accumulator):
            return (accumulator[0],)

        def merge(self, a, b):
            return [a[0] + b[0]]

    class OpensBadly:
        def open(self, ctx):
            if ctx.partition_id == 1:
                raise NotSeven("cannot open partition 1")

        def __call__(self, rows):
            for r in rows:
                yield (r.id,)

    return NotSeven, map_fn, sort_key, pick, Summing, OpensBadly


NotSeven, map_fn, sort_key, pick, Summing, OpensBadly = _failing_functions()

#: (operation, (partition, key) named, the failing DataFrame); id 7 is in partition 1,
#: key 1 (in whichever partition the key's shuffle puts it; a sort key function runs
#: before the sort, on no key)
EVERY_USER_FUNCTION = [
    (
        "map_partition",
        (1, None),
        lambda df: full_window_partition(df).map_partition(map_fn, "id long"),
    ),
    (
        "map_partition",
        (None, "1"),
        lambda df: key_by(df, "k").full_window_partition().map_partition(map_fn, "id long"),
    ),
    ("sort_partition", (1, None), lambda df: full_window_partition(df).sort_partition(sort_key)),
    (
        "sort_partition",
        (None, None),
        lambda df: key_by(df, "k").full_window_partition().sort_partition(sort_key),
    ),
    ("aggregate", (1, None), lambda df: full_window_partition(df).aggregate(Summing(), "n long")),
    (
        "aggregate",
        (None, "1"),
        lambda df: key_by(df, "k").full_window_partition().aggregate(Summing(), "n long"),
    ),
    ("reduce", (1, None), lambda df: full_window_partition(df).reduce(pick)),
    ("reduce", (None, "1"), lambda df: key_by(df, "k").full_window_partition().reduce(pick)),
    (
        "map_partition",
        (1, None),
        lambda df: full_window_partition(df).map_partition(OpensBadly(), "id long"),
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "op, where, build",
    EVERY_USER_FUNCTION,
    ids=[
        "map_partition",
        "keyed-map_partition",
        "sort_partition-key",
        "keyed-sort_partition-key",
        "aggregate",
        "keyed-aggregate",
        "reduce",
        "keyed-reduce",
        "open",
    ],
)
def test_every_user_function_that_raises_is_a_spark_ops_error_naming_its_exception(
    df, op, where, build
):
    from pyspark.errors import PythonException

    with pytest.raises(SparkOpsError) as info:
        build(df).collect()
    err = info.value
    assert isinstance(err, UserFunctionError) and isinstance(err, PythonException)
    assert err.operation.endswith(op), err.operation
    partition, key = where
    assert err.partition == partition or (partition is None and isinstance(err.partition, int))
    assert err.key == key, err.key
    assert err.raised(NotSeven) and err.raised(ValueError) and not err.raised(KeyError)
    assert err.exception_type.endswith("NotSeven")
    assert err.exception_message.startswith(("no seven", "cannot open"))
    assert f"{op} function" in str(err) and "NotSeven" in str(err)
    assert "Traceback" in err.traceback_text and "raise NotSeven" in str(err)  # the user's line
    assert "spark_ops-user-function-failure" not in str(err)  # the line is read, not shown
    assert "PythonException" not in str(err) and "\tat org.apache" not in str(err)
    assert "Traceback (most recent call last)" in err.spark_message  # pyspark's whole text


@pytest.mark.timeout(180)
def test_a_failing_function_names_the_partition_and_keeps_the_traceback(df, many):
    with pytest.raises(UserFunctionError) as info:
        full_window_partition(df).map_partition(boom_on_seven, "long").collect()
    text = str(info.value)
    assert "map_partition function 'boom_on_seven' failed in partition 1" in text
    assert "ZeroDivisionError: no seven please (7)" in text
    assert 'raise ZeroDivisionError(f"no seven please ({r.id})")' in text  # the user's line

    class Broken(CountSum):
        def add(self, value, accumulator):
            if value.id == 500:
                raise KeyError("broken")
            return accumulator

    with pytest.raises(UserFunctionError) as info:
        key_by(many, "k").full_window_partition().aggregate(Broken(), "n long, t double").collect()
    assert "aggregate function 'Broken' failed in partition" in str(info.value)
    assert "key 2:" in str(info.value)  # 500 % 3 == 2
    assert info.value.key == "2" and info.value.raised(KeyError)

    with pytest.raises(Exception, match="returned None; it must return the accumulator"):

        class Forgetful(CountSum):
            def add(self, value, accumulator):
                accumulator[0] += 1

        full_window_partition(df).aggregate(Forgetful(), "n long, t double").collect()


# -- bad arguments: a clear error before any job ---------------------------------------------------


@pytest.fixture
def no_jobs(spark):
    """Fails the test if anything it does starts a Spark job."""
    sc = spark.sparkContext
    group = f"full-partition-validation-{time.monotonic_ns()}"
    sc.setJobGroup(group, "argument checks must not run jobs")
    try:
        yield
    finally:
        jobs = list(sc.statusTracker().getJobIdsForGroup(group))
        sc.setLocalProperty("spark.jobGroup.id", None)
        assert jobs == [], f"argument checks started Spark jobs {jobs}"


@pytest.fixture(scope="module")
def wide(spark):
    return spark.createDataFrame(
        [(1, {"a": 1}, (1, {"b": 2}), "x")],
        "id long, m map<string,int>, st struct<n:int, inner:map<string,int>>, s string",
    )


def _errors(df, wide, spark) -> list:
    stream = spark.readStream.format("rate").load()
    w = full_window_partition(df)
    kw = key_by(df, "k").full_window_partition()
    return [
        (
            lambda: full_window_partition(stream),
            ValueError,
            ["streaming DataFrame", "foreachBatch"],
        ),
        (lambda: key_by(stream, "value"), ValueError, ["streaming DataFrame"]),
        (lambda: full_window_partition([1, 2]), TypeError, ["pyspark.sql.DataFrame", "list"]),
        (lambda: w.map_partition(None, "long"), TypeError, ["map_partition", "got None"]),
        (lambda: w.map_partition("f", "long"), TypeError, ["map_partition", "str"]),
        (lambda: w.map_partition(lambda r: r, None), TypeError, ["schema", "DDL"]),
        (lambda: w.map_partition(lambda r: r, "not a schema !"), ValueError, ["not a valid DDL"]),
        (lambda: w.map_partition(lambda r: r, "long", batches="yes"), TypeError, ["batches"]),
        (lambda: w.reduce(None), TypeError, ["reduce", "got None"]),
        (lambda: kw.reduce(None), TypeError, ["reduce", "got None"]),
        (lambda: w.aggregate(None, "long"), TypeError, ["aggregate", "got None"]),
        (lambda: w.aggregate(CountSum, "long"), TypeError, ["CountSum()"]),
        (lambda: w.aggregate(lambda a, b: a, "long"), TypeError, ["AggregateFunction"]),
        (lambda: kw.aggregate(CountSum(), "k long, n long"), ValueError, ["['k']", "key columns"]),
        (lambda: w.sort_partition(None), TypeError, ["sort_partition", "got None"]),
        (lambda: w.sort_partition(5), IndexError, ["field index 5", "5 column(s)", "0..4"]),
        (lambda: w.sort_partition(-1), IndexError, ["field index -1"]),
        (lambda: w.sort_partition(True), TypeError, ["field index (int)"]),
        (lambda: w.sort_partition(2.5), TypeError, ["field index (int)", "float"]),
        (lambda: w.sort_partition("nope"), ValueError, ["'nope'", "its columns are"]),
        (lambda: w.sort_partition("st.zz"), ValueError, ["'st' has no field 'zz'", "['a', 'b']"]),
        (lambda: w.sort_partition("id.a"), ValueError, ["'id' has type bigint", "no field 'a'"]),
        (lambda: w.sort_partition(F.col("nope")), ValueError, ["does not resolve"]),
        (lambda: w.sort_partition("id", "sideways"), TypeError, ["Order.ASCENDING"]),
        (lambda: kw.sort_partition(99), IndexError, ["field index 99"]),
        (
            lambda: full_window_partition(wide).sort_partition("m"),
            TypeError,
            ["'m'", "map<string,int>", "cannot sort"],
        ),
        (lambda: full_window_partition(wide).sort_partition(1), TypeError, ["cannot sort"]),
        (
            lambda: full_window_partition(wide).sort_partition("st"),
            TypeError,
            ["'st'", "cannot sort"],
        ),
        (lambda: key_by(df, "nope"), ValueError, ["key column 'nope'", "its columns are"]),
        (lambda: key_by(df, "st.a"), ValueError, ["withColumn"]),
        (lambda: key_by(df, []), ValueError, ["at least one key"]),
        (lambda: key_by(df, 3), TypeError, ["column name"]),
        (lambda: key_by(df, ["k", "k"]), ValueError, ["repeat"]),
        (lambda: key_by(df, "k", num_partitions=0), ValueError, ["num_partitions"]),
        (lambda: key_by(wide, "m"), TypeError, ["'m'", "cannot group and sort"]),
    ]


def test_bad_arguments_fail_clearly_before_any_job(df, wide, spark, no_jobs):
    for i, (call, error, words) in enumerate(_errors(df, wide, spark)):
        with pytest.raises(error) as info:
            call()
        for w in words:
            assert w in str(info.value), f"case {i}: {w!r} not in {info.value}"


def test_windows_are_plain_frozen_values(df):
    w = full_window_partition(df)
    assert isinstance(w, PartitionWindowedStream) and w.df is df
    with pytest.raises(AttributeError):
        w.df = df  # type: ignore[misc]
    assert key_by(df, "k").full_window_partition().keys == ("k",)
    assert Order("DESCENDING") is Order.DESCENDING


# -- the sort-key encoding (pure) ------------------------------------------------------------------

_numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**1100), max_value=2**1100),
    st.floats(allow_nan=False),
    st.decimals(allow_nan=False),
    st.booleans(),
)
_keys = st.one_of(
    st.lists(_numbers, min_size=2, max_size=6),
    st.lists(st.text(), min_size=2, max_size=6),
    st.lists(st.binary(), min_size=2, max_size=6),
    st.lists(st.datetimes(), min_size=2, max_size=6),
    st.lists(
        st.tuples(
            _numbers, st.text(), st.one_of(st.none(), st.dates()).map(lambda d: (d,) if d else ())
        ),
        min_size=2,
        max_size=6,
    ),
)


@settings(max_examples=400, deadline=None)
@given(_keys)
def test_key_encoding_preserves_python_order(keys):
    for a, b in itertools.combinations(keys, 2):
        ea, eb = encode_key(a), encode_key(b)
        assert (a < b) == (ea < eb), (a, b)
        assert (a == b) == (ea == eb), (a, b)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.floats(), st.integers(min_value=-(2**53), max_value=2**53)), max_size=30)
)
def test_vectorised_key_encoding_matches_the_scalar_one(keys):
    assert encode_keys(keys).to_pylist() == [encode_key(k) for k in keys]


def test_key_encoding_orders_special_values():
    order = [
        None,
        -math.inf,
        -(2**70),
        -1.5,
        0,
        1,
        2**60 + 1,
        math.inf,
        math.nan,
        "",
        "a",
        b"",
        dt.date(2020, 1, 1),
    ]
    codes = [encode_key(k) for k in order]
    assert codes == sorted(codes)
    assert encode_key(-0.0) == encode_key(0) == encode_key(decimal.Decimal("0.00"))
    assert encode_key((1, "a")) < encode_key((1, "a", None)) < encode_key((1, "b"))
    with pytest.raises(TypeError, match="no natural order"):
        encode_key({"a": 1})


# -- a partition larger than the Python worker's memory --------------------------------------------

MEMORY_TIMEOUT = 240  # seconds; about 30 s on 2 idle cores


@pytest.mark.integration
def test_a_partition_larger_than_worker_memory_streams():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    args = ["--rows=250000", "--width=3200", "--worker-memory=512m", "--jvm-memory=512m"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, full_partition_memory_job as j; sys.exit(j.main(sys.argv[1:]))",
            *args,
        ],
        cwd=str(TESTS),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout takes its JVM and workers too
    )
    try:
        stdout, stderr = proc.communicate(timeout=MEMORY_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the memory job did not finish in {MEMORY_TIMEOUT}s\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-6000:]}"
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT ") :])
    data = res["bytes"]
    limit = 512 * 1024 * 1024
    assert data > limit  # the partition does not fit in what the worker may allocate
    for step in ("map_rows", "map_batches", "sort_key_fn"):
        r = res[step]
        assert r["n"] == res["rows"], step
        assert r["as_limit"] == limit, step  # the limit was in force in the worker
        assert 0 < r["peak_rss"] < 300 * 1024 * 1024, (step, r["peak_rss"])  # bounded, << data
    assert res["map_rows"]["chars"] == res["map_batches"]["chars"] == data
    assert res["sort_key_fn"]["ok"], "the partition did not come back sorted"
    assert res["sort_key_fn"]["spilled_bytes"] > 0, "Spark's sort did not spill to disk"
