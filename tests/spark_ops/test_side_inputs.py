"""Side inputs (FLIP-17) on bounded DataFrames, the pure pieces (folding versions, window
matching, the record buffer), and every argument error (raised before any Spark job).

Streaming (evolving) side inputs are in test_side_inputs_streaming.py.
"""

from __future__ import annotations

import datetime as dt
import pickle
import shutil
import uuid

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import Row
from pyspark.sql import functions as F

from spark_ops import (
    ListSideInput,
    MapSideInput,
    MultimapSideInput,
    RecordBuffer,
    SideInputConfigError,
    SideInputKeyError,
    SideInputValueError,
    SingletonSideInput,
    SparkOpsError,
    UserFunctionError,
    with_side_inputs,
)
from spark_ops.side_inputs._content import VersionApplier, match_window
from spark_ops.side_inputs._task import OpPlan, broadcast_task
from spark_ops.side_inputs._views import _ViewSpec

N_MAIN = 400


@pytest.fixture(scope="module")
def main(spark):
    return spark.range(N_MAIN, numPartitions=3).select(
        F.col("id").alias("user_id"), (F.col("id") * 0.5).alias("amount")
    )


@pytest.fixture(scope="module")
def dims(spark):
    # every even user has a segment; odd users have none
    return spark.range(0, N_MAIN, 2, numPartitions=2).select(
        F.col("id").alias("user_id"),
        F.concat(F.lit("seg"), F.col("id").cast("string")).alias("segment"),
    )


@pytest.fixture(scope="module")
def tags(spark):
    # users divisible by 3 have two tags, in a fixed order
    rows = [(u, t) for u in range(0, N_MAIN, 3) for t in (f"a{u}", f"b{u}")]
    return spark.createDataFrame(rows, "user_id long, tag string").coalesce(1)


def no_jobs(spark, call):
    """Run ``call`` and return (exception, number of Spark jobs it started)."""
    sc = spark.sparkContext
    group = f"side-inputs-check-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "argument checks must not start jobs")
    try:
        with pytest.raises(Exception) as info:
            call()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return info.value, len(sc.statusTracker().getJobIdsForGroup(group))


# -- views of every kind, broadcast ------------------------------------------------------------


def test_broadcast_views_of_every_kind(spark, main, dims, tags):
    limit = SingletonSideInput(spark.createDataFrame([(42.0,)], "value double"), "value")
    blocked = ListSideInput(spark.createDataFrame([(3,), (5,), (7,)], "user_id long"))
    segments = MapSideInput(dims, key="user_id", value="segment")
    labels = MultimapSideInput(tags, key="user_id", value="tag")

    def fn(row, ctx):
        return (
            row.user_id,
            ctx.side_input(limit),
            row.user_id in ctx.side_input(blocked),
            ctx.side_input(segments).get(row.user_id),
            list(ctx.side_input(labels).get(row.user_id, ())),
            len(ctx.side_input(segments)),
            ctx.side_input_version(segments),
        )

    schema = (
        "user_id long, lim double, blocked boolean, seg string, tags array<string>, n long, v long"
    )
    out = with_side_inputs(main, limit, blocked, segments, labels).map(fn, schema).collect()
    assert len(out) == N_MAIN
    for r in out:
        u = r.user_id
        assert r.lim == 42.0
        assert r.blocked == (u in (3, 5, 7))
        assert r.seg == (f"seg{u}" if u % 2 == 0 else None)
        assert sorted(r.tags) == ([f"a{u}", f"b{u}"] if u % 3 == 0 else [])
        assert r.n == N_MAIN // 2  # broadcast: every task sees the whole map
        assert r.v == 1


def test_row_values_and_names(spark, main):
    people = spark.createDataFrame(
        [(1, "ann", 30), (2, "bob", 40)], "user_id long, name string, age int"
    )
    whole = MapSideInput(people, key="user_id")  # value: the other columns, as a Row
    by_name = SingletonSideInput(people.filter("user_id = 2"), ["name", "age"], name="bob")
    out = (
        with_side_inputs(main.filter("user_id < 3"), whole, by_name)
        .map(
            lambda r, ctx: (
                r.user_id,
                ctx.side_input(whole).get(r.user_id),
                ctx.side_input("bob").age,
            ),
            "user_id long, person struct<name: string, age: int>, bob_age int",
        )
        .orderBy("user_id")
        .collect()
    )
    assert out[1].person == Row(name="ann", age=30) and out[2].person.name == "bob"
    assert out[0].person is None and {r.bob_age for r in out} == {40}


def test_empty_singleton_gives_the_default(spark, main):
    empty = spark.createDataFrame([], "value double")
    v = SingletonSideInput(empty, "value", default=-1.0)
    none = SingletonSideInput(empty, "value")
    out = with_side_inputs(main.limit(3), v, none).map(
        lambda r, ctx: (ctx.side_input(v), ctx.side_input(none)), "a double, b double"
    )
    assert set(out.collect()) == {Row(a=-1.0, b=None)}


def test_filter_and_map_partition(spark, main):
    limit = SingletonSideInput(spark.createDataFrame([(100.0,)], "value double"), "value")
    kept = with_side_inputs(main, limit).filter(lambda r, ctx: r.amount >= ctx.side_input(limit))
    assert kept.schema == main.schema
    assert sorted(r.user_id for r in kept.collect()) == list(range(200, N_MAIN))

    def per_partition(rows, ctx):
        n = 0
        for r in rows:
            n += r.amount >= ctx.side_input(limit)
        yield (ctx.partition_id, n)

    out = with_side_inputs(main, limit).map_partition(per_partition, "pid int, n long").collect()
    assert len(out) == 3 and sum(r.n for r in out) == N_MAIN - 200


def test_bounded_side_input_is_read_once_and_shipped_once(spark, main, tmp_path):
    path = str(tmp_path / "limit")
    spark.createDataFrame([(7.0,)], "value double").write.parquet(path)
    limit = SingletonSideInput(spark.read.parquet(path), "value")
    out = with_side_inputs(main, limit).map(lambda r, ctx: (ctx.side_input(limit),), "v double")
    # the side data was read when the operation was declared: the plan does not scan it,
    # and the result runs (twice) after its files are gone
    shutil.rmtree(path)
    assert "limit" not in out._jdf.queryExecution().optimizedPlan().toString()
    assert {r.v for r in out.collect()} == {7.0}
    assert out.count() == N_MAIN


# -- keyed views: co-partitioned, not broadcast ---------------------------------------------------


def test_keyed_views_of_every_kind_show_a_record_only_its_key(spark, main, dims, tags):
    seg = MapSideInput(dims, key="user_id", value="segment", keyed=True)
    one = SingletonSideInput(dims, "segment", key="user_id", name="one")
    many = ListSideInput(tags, "tag", key="user_id")
    multi = MultimapSideInput(tags, key="user_id", value="tag", keyed=True)

    def fn(rows, ctx):
        for r in rows:
            shard = ctx.side_input(seg)
            yield (
                r.user_id,
                ctx.partition_id,
                shard.get(r.user_id),
                ctx.side_input(one),
                sorted(ctx.side_input(many)),
                sorted(ctx.side_input(multi).get(r.user_id, ())),
                len(shard),
                ctx.key,
            )

    op = with_side_inputs(main, seg, one, many, multi, key="user_id", num_partitions=4)
    out = op.map_partition(
        fn,
        "user_id long, pid int, seg string, one string, many array<string>, multi array<string>, "
        "shard long, key long",
    ).collect()
    assert sorted(r.user_id for r in out) == list(range(N_MAIN))
    for r in out:
        u = r.user_id
        want = f"seg{u}" if u % 2 == 0 else None
        assert (r.seg, r.one, r.key) == (want, want, u)
        tags_u = [f"a{u}", f"b{u}"] if u % 3 == 0 else []
        assert r.many == tags_u and r.multi == tags_u
        # each task holds one shard of the map, but a record sees only its own key's
        # entry (FLIP-17 keyed state): never the rest of its task's shard
        assert r.shard == (1 if u % 2 == 0 else 0)
    assert len({r.pid for r in out}) == 4


def test_keyed_plan_shuffles_both_sides_and_broadcasts_nothing(spark, main, dims):
    seg = MapSideInput(dims, key="user_id", value="segment", keyed=True)
    out = with_side_inputs(main, seg, key="user_id", num_partitions=4).filter(
        lambda r, ctx: r.user_id in ctx.side_input(seg)
    )
    plan = out._jdf.queryExecution().executedPlan().toString()
    assert "hashpartitioning(__k0" in plan and "Broadcast" not in plan
    assert out.count() == N_MAIN // 2


def test_compound_keys(spark):
    main = spark.createDataFrame(
        [(1, "x", 1.0), (1, "y", 2.0), (2, "x", 3.0)], "a long, b string, v double"
    )
    side = spark.createDataFrame([(1, "x", "p"), (2, "x", "q")], "a long, b string, label string")
    view = SingletonSideInput(side, "label", key=["a", "b"])
    bview = MapSideInput(side, key=["a", "b"], value="label")
    out = with_side_inputs(main, view, bview, key=["a", "b"]).map(
        lambda r, ctx: (r.a, r.b, ctx.side_input(view), ctx.side_input(bview).get((r.a, r.b))),
        "a long, b string, label string, blabel string",
    )
    got = {(r.a, r.b): (r.label, r.blabel) for r in out.collect()}
    assert got == {(1, "x"): ("p", "p"), (1, "y"): (None, None), (2, "x"): ("q", "q")}


# -- windowed side inputs ----------------------------------------------------------------------------


def _windowed(spark, rows, schema, width):
    return spark.createDataFrame(rows, schema).withColumn("w", F.window("ts", width))


def test_windowed_main_sees_the_matching_window(spark):
    t0 = dt.datetime(2024, 1, 1, 10, 0, 0)
    main_rows = [(u, t0 + dt.timedelta(seconds=s)) for u in (1, 2) for s in (10, 70, 130)]
    main = _windowed(spark, main_rows, "user_id long, ts timestamp", "1 minute")
    per_minute = _windowed(
        spark,
        [(1, t0 + dt.timedelta(seconds=5), 0.1), (1, t0 + dt.timedelta(seconds=65), 0.2)],
        "user_id long, ts timestamp, rate double",
        "1 minute",
    )
    hourly = _windowed(
        spark,
        [(t0, "morning"), (t0 + dt.timedelta(hours=1), "noon")],
        "ts timestamp, label string",
        "1 hour",
    )
    rate = SingletonSideInput(per_minute, "rate", key="user_id", window="w")  # keyed, same windows
    label = SingletonSideInput(hourly, "label", window="w")  # broadcast, containing window
    rates = ListSideInput(per_minute, "rate", window="w", name="rates")  # broadcast, same windows

    def fn(r, ctx):
        return (
            r.user_id,
            r.ts,
            ctx.side_input(rate),
            ctx.side_input(label),
            list(ctx.side_input(rates)),
        )

    out = with_side_inputs(main, rate, label, rates, key="user_id", window="w").map(
        fn, "user_id long, ts timestamp, rate double, label string, rates array<double>"
    )
    got = {(r.user_id, (r.ts - t0).seconds): (r.rate, r.label, r.rates) for r in out.collect()}
    assert got == {
        (1, 10): (0.1, "morning", [0.1]),
        (1, 70): (0.2, "morning", [0.2]),
        (1, 130): (None, "morning", []),
        (2, 10): (None, "morning", [0.1]),
        (2, 70): (None, "morning", [0.2]),
        (2, 130): (None, "morning", []),
    }


def test_match_window_picks_the_same_or_the_containing_window():
    minute, hour = 60_000_000, 3_600_000_000
    hours = [(0, hour), (hour, 2 * hour)]
    assert match_window(hours, (0, minute)) == (0, hour)
    assert match_window(hours, (hour - minute, hour)) == (0, hour)  # ends at the hour's end
    assert match_window(hours, (hour, hour + minute)) == (hour, 2 * hour)
    assert match_window(hours, (2 * hour, 2 * hour + minute)) is None
    same = [(0, minute), (minute, 2 * minute)]
    assert match_window(same, (minute, 2 * minute)) == (minute, 2 * minute)
    # sliding side windows: the latest-starting one containing the main window's end
    sliding = [(0, 2 * minute), (minute, 3 * minute)]
    assert match_window(sliding, (minute, 2 * minute)) == (minute, 3 * minute)


# -- folding versions (pure) --------------------------------------------------------------------------


def _spec(kind, *, keyed=False, key=("k",), mode="append"):
    return _ViewSpec(
        view_id="v",
        name=f"{kind}_view",
        kind=kind,
        keyed=keyed,
        key=key,
        value=("x",),
        scalar=True,
        window=None,
        default=None,
        output_mode=mode,
    )


def test_versions_upsert_maps_append_lists_and_replace_on_complete():
    content = {}
    m = _spec("map")
    a = VersionApplier(m, content, replace=False)
    a.add(None, [1, 2], ["a", "b"])
    a.finish()
    a = VersionApplier(m, content, replace=False)
    a.add(None, [2, 3], ["B", "c"])  # a later version replaces key 2
    a.finish()
    assert content == {None: {1: "a", 2: "B", 3: "c"}}
    lists = {}
    lst = _spec("list", key=())
    for vals in (["x"], ["y", "z"]):
        a = VersionApplier(lst, lists, replace=False)
        a.add(None, None, vals)
        a.finish()
    assert lists == {None: ("x", "y", "z")}
    a = VersionApplier(lst, lists, replace=True)
    a.add(None, None, ["only"])
    a.finish()
    assert lists == {None: ("only",)}


@pytest.mark.parametrize("kind", ["map", "singleton"])
def test_a_unique_key_twice_in_one_version_is_an_error_across_batches(kind):
    content = {}
    a = VersionApplier(_spec(kind, keyed=True), content, replace=False)
    a.add(None, [1, 2], ["a", "b"])
    with pytest.raises(SideInputValueError, match=r"key 2"):
        a.add(None, [2], ["again"])
    single = VersionApplier(_spec("singleton", key=()), {}, replace=False)
    single.add(None, None, [1.0])
    with pytest.raises(SideInputValueError, match=r"more than one value .*1\.0 and 2\.0"):
        single.add(None, None, [2.0])


_versions = st.lists(
    st.lists(st.tuples(st.integers(0, 20), st.integers()), max_size=15), min_size=1, max_size=6
)


@settings(max_examples=60, deadline=None)
@given(_versions)
def test_folding_versions_matches_upsert_and_append_models(versions):
    maps, multis = {}, {}
    model_map: dict[int, int] = {}
    model_multi: dict[int, list[int]] = {}
    for rows in versions:
        unique = list(dict(rows).items())  # a map version has each key once
        a = VersionApplier(_spec("map"), maps, replace=False)
        a.add(None, [k for k, _ in unique], [v for _, v in unique])
        a.finish()
        model_map.update(unique)
        b = VersionApplier(_spec("multimap"), multis, replace=False)
        b.add(None, [k for k, _ in rows], [v for _, v in rows])
        b.finish()
        for k, v in rows:
            model_multi.setdefault(k, []).append(v)
    assert maps.get(None, {}) == model_map
    assert {k: list(v) for k, v in multis.get(None, {}).items()} == model_multi


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 30)), min_size=1, max_size=12),
    st.integers(0, 60),
    st.integers(1, 10),
)
def test_match_window_returns_the_latest_window_containing_the_main_end(sides, start, width):
    windows = sorted({(s, s + w) for s, w in sides})
    main = (start, start + width)
    hit = match_window(windows, main)
    containing = [w for w in windows if w[0] < main[1] <= w[1]]
    if not containing:
        assert hit is None
    else:
        assert hit in containing and hit[0] == max(w[0] for w in containing)


# -- the record buffer (pure) ---------------------------------------------------------------------------


def _batch(lo, hi):
    return pa.RecordBatch.from_pydict(
        {"id": list(range(lo, hi)), "s": [str(i) for i in range(lo, hi)]}
    )


def test_record_buffer_spills_beyond_its_memory_budget_and_keeps_every_record(tmp_path):
    buf = RecordBuffer(str(tmp_path / "buf"), memory_budget=_batch(0, 100).nbytes + 1)
    buf.add("w1", _batch(0, 100))
    assert buf.stats()["spills"] == 0 and buf.bytes_in_memory > 0
    buf.add("w2", _batch(100, 150))
    buf.add("w1", _batch(150, 250))  # over budget: the biggest namespace goes to disk
    st = buf.stats()
    assert st["spills"] >= 1 and st["bytes_spilled"] > 0
    assert st["bytes_in_memory"] <= buf.memory_budget
    assert st["records"] == 250 and buf.num_records("w1") == 200
    got = sorted(i for b in buf.records("w1") for i in b.column("id").to_pylist())
    assert got == list(range(100)) + list(range(150, 250))
    files = buf.files("w2")  # spills what w2 holds in memory, for Spark to read
    assert files and buf.bytes_in_memory == 0
    assert sum(pa.parquet.read_table(f).num_rows for f in files) == 50
    buf.clear("w1")
    buf.clear("w2")
    assert buf.namespaces() == [] and not list((tmp_path / "buf").iterdir())


def test_record_buffer_with_no_memory_writes_everything_to_disk(tmp_path):
    buf = RecordBuffer(str(tmp_path / "b"), memory_budget=0)
    buf.add(None, _batch(0, 10))
    assert buf.bytes_in_memory == 0 and buf.bytes_spilled > 0
    assert [b.num_rows for b in buf.records(None)] == [10]


# -- errors ---------------------------------------------------------------------------------------------


def test_a_singleton_with_more_than_one_value_is_an_error(spark, main, dims):
    two = SingletonSideInput(spark.createDataFrame([(1.0,), (2.0,)], "value double"), "value")
    with pytest.raises(SideInputValueError, match=r"SingletonSideInput .* more than one value"):
        with_side_inputs(main, two).map(lambda r, ctx: (ctx.side_input(two),), "v double")
    dup = MapSideInput(dims.union(dims.limit(1)), key="user_id", value="segment")
    with pytest.raises(SideInputValueError, match="key 0 more than once"):
        with_side_inputs(main, dup).filter(lambda r, ctx: True)


def test_a_keyed_singleton_with_two_values_for_a_key_is_an_error_on_the_driver(spark, main, dims):
    twice = SingletonSideInput(dims.union(dims.filter("user_id = 10")), "segment", key="user_id")
    with pytest.raises(SideInputValueError, match=r"more than one value for key 10"):
        with_side_inputs(main, twice, key="user_id").map(
            lambda r, ctx: (ctx.side_input(twice),), "s string"
        )


def test_keyed_view_key_type_or_arity_mismatch_is_an_error_before_any_job(spark, main, dims):
    as_string = dims.select(F.col("user_id").cast("string").alias("user_id"), "segment")
    seg = MapSideInput(as_string, key="user_id", value="segment", keyed=True)
    err, jobs = no_jobs(spark, lambda: with_side_inputs(main, seg, key="user_id"))
    assert isinstance(err, SideInputKeyError) and jobs == 0
    assert "string" in str(err) and "bigint" in str(err) and "cast" in str(err)
    ok = MapSideInput(dims, key="user_id", value="segment", keyed=True)
    err, jobs = no_jobs(spark, lambda: with_side_inputs(main, ok, key=["user_id", "amount"]))
    assert isinstance(err, SideInputKeyError) and "1 key column" in str(err) and jobs == 0
    err, jobs = no_jobs(spark, lambda: with_side_inputs(main, ok))
    assert isinstance(err, SideInputKeyError) and "key=" in str(err) and jobs == 0


def _bad_calls(spark, main, dims):
    seg = MapSideInput(dims, key="user_id", value="segment")
    win = spark.createDataFrame([(dt.datetime(2024, 1, 1), 1.0)], "ts timestamp, v double")
    windowed = SingletonSideInput(win.withColumn("w", F.window("ts", "1 minute")), "v", window="w")
    streaming = spark.readStream.format("rate").load()
    op = with_side_inputs(main, seg)
    return [
        (lambda: with_side_inputs(None, seg), "main"),
        (lambda: with_side_inputs(main.rdd, seg), "DataFrame"),
        (lambda: with_side_inputs(main), "at least one view"),
        (lambda: with_side_inputs(main, MapSideInput), "MapSideInput(side_df"),
        (lambda: with_side_inputs(main, dims), "views after the main"),
        (lambda: with_side_inputs(main, seg, seg), "distinct names"),
        (lambda: with_side_inputs(main, seg, key="nope"), "nope"),
        (lambda: with_side_inputs(main, seg, num_partitions=0), "num_partitions"),
        (lambda: with_side_inputs(main, windowed), "window="),
        (lambda: with_side_inputs(main, seg, window="amount"), "struct<start"),
        (lambda: with_side_inputs(main, SingletonSideInput(streaming, "value")), "bounded"),
        (lambda: op.map(None, "a long"), "None"),
        (lambda: op.map(42, "a long"), "callable"),
        (lambda: op.map(seg, "a long"), "function"),
        (lambda: op.filter(None), "None"),
        (lambda: op.map_partition(lambda rows, ctx: rows, None), "schema"),
        (lambda: op.map(lambda r, c: r, "not a schema ((("), "DDL"),
        (lambda: op.map(lambda r, c: r, "long"), "not a struct"),
        (lambda: SingletonSideInput(None, "v"), "DataFrame"),
        (lambda: SingletonSideInput(dims, "nope"), "nope"),
        (lambda: MapSideInput(dims, key=None), "key="),
        (lambda: MapSideInput(dims, key="user_id", keyed="yes"), "keyed="),
        (lambda: ListSideInput(dims, "segment", output_mode="sometimes"), "output_mode"),
        (lambda: ListSideInput(dims, "segment", window="segment"), "struct<start"),
        (lambda: ListSideInput(dims, "segment", name=""), "name="),
        (lambda: MapSideInput(dims.select("user_id"), key="user_id"), "value="),
    ]


def test_bad_arguments_are_clear_errors_before_any_job(spark, main, dims):
    for call, words in _bad_calls(spark, main, dims):
        err, jobs = no_jobs(spark, call)
        assert isinstance(err, SideInputConfigError), (words, err)
        assert isinstance(err, TypeError) and isinstance(err, ValueError)
        assert words in str(err), (words, str(err))
        assert jobs == 0, (words, jobs)


def test_reading_a_view_the_operation_does_not_have_fails_in_the_task(spark, main, dims):
    attached = MapSideInput(dims, key="user_id", value="segment")
    other = SingletonSideInput(spark.createDataFrame([(1.0,)], "v double"), "v", name="other")
    out = with_side_inputs(main, attached).map(lambda r, ctx: (ctx.side_input(other),), "v double")
    with pytest.raises(Exception, match=r"'other'\) is not attached"):
        out.collect()


def test_a_function_failure_names_the_function_and_partition(spark, main, dims):
    seg = MapSideInput(dims, key="user_id", value="segment")

    def explode(r, ctx):
        raise KeyError("boom")

    out = with_side_inputs(main, seg).map(explode, "v long")
    with pytest.raises(UserFunctionError, match=r"map function .*explode failed in partition \d"):
        out.collect()
    with pytest.raises(SparkOpsError) as info:  # a spark_ops error, in any action
        out.count()
    assert info.value.raised(KeyError) and info.value.function.endswith("explode")
    assert isinstance(info.value.partition, int) and "raise KeyError" in info.value.traceback_text


def test_records_that_do_not_fit_the_schema_name_the_function():
    # the task body runs in-process here (no Spark task: partition 0)
    batch = pa.RecordBatch.from_pydict({"a": [1, 2]})
    schema = pa.schema([("v", pa.int64())])

    def two_fields(r, ctx):
        return (r.a, 2)

    plan = OpPlan("map", two_fields, "two_fields", ("a",), (), None, schema)
    with pytest.raises(RuntimeError, match=r"two_fields .*2 value\(s\) but the schema has 1"):
        list(broadcast_task(plan, (), {})(iter([batch])))
    ok = OpPlan("map", lambda r, ctx: {"v": r.a * 10}, "by_name", ("a",), (), None, schema)
    (out,) = broadcast_task(ok, (), {})(iter([batch]))
    assert out.column(0).to_pylist() == [10, 20]


def test_views_pickle_without_their_dataframe(dims):
    view = MapSideInput(dims, key="user_id", value="segment", keyed=True, name="seg")
    back = pickle.loads(pickle.dumps(view))
    assert back == view and back.name == "seg" and back.keyed and back.key == ("user_id",)
    with pytest.raises(SideInputConfigError, match="unpickled"):
        back.df  # noqa: B018
    assert "keyed=True" in repr(view)
