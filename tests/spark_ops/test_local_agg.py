"""local_key_by: two-phase aggregation equals the one-phase result (a Python reference and
Spark's own aggregates), on random and skewed keys, for any partitioning; the local phase
is vectorized when it can be; metrics show the skew win; streaming queries merge
per-micro-batch partials into state; bad arguments and non-mergeable aggregates fail
before any Spark job."""

from __future__ import annotations

import math
import sys
import uuid
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle
from pyspark.sql import functions as F

from spark_ops import (
    AggregateFunction,
    LocalAggMetrics,
    NonMergeableAggregateError,
    SparkOpsError,
    UserFunctionError,
    local_key_by,
)
from spark_ops.local_agg import _kernels as K

N = 3000
SCHEMA = "k long, s string, v long, x double"


@pytest.fixture(scope="module", autouse=True)
def ship_this_module_by_value():
    """The aggregates below reach Spark's Python workers pickled by value, as a user's
    own script would ship them (this module is not importable there; see conftest)."""
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # PySpark's own copy of cloudpickle
    yield
    cloudpickle.unregister_pickle_by_value(module)


# -- aggregates ----------------------------------------------------------------------------


class VecMean(AggregateFunction):
    """Vectorized mean of a column without nulls: ``add`` must never run."""

    def create_accumulator(self):
        return (0.0, 0)

    def add(self, value, acc):
        raise AssertionError("the vectorized path called add() per row")

    def add_batch(self, values, acc):
        return (acc[0] + float(values.sum()), acc[1] + len(values))

    def merge(self, a, b):
        return (a[0] + b[0], a[1] + b[1])

    def get_result(self, acc):
        return acc[0] / acc[1]


class RowMean(AggregateFunction):
    """The same mean, one ``add`` per row (nulls arrive as None and are skipped)."""

    def create_accumulator(self):
        return [0, 0]

    def add(self, value, acc):
        if value is not None:
            acc[0] += value
            acc[1] += 1
        return acc

    def merge(self, a, b):
        return [a[0] + b[0], a[1] + b[1]]

    def get_result(self, acc):
        return acc[0] / acc[1] if acc[1] else None


class Distinct(AggregateFunction):
    """The distinct values of a column: mergeable (set union), pickled accumulators."""

    def create_accumulator(self):
        return frozenset()

    def add(self, value, acc):
        return acc | {value}

    def merge(self, a, b):
        return a | b

    def get_result(self, acc):
        return sorted(v for v in acc if v is not None)


class BigSum(AggregateFunction):
    """Sums that outgrow int64: the accumulators must not wrap in the shuffle."""

    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        return acc + (value or 0) * 10**20

    def merge(self, a, b):
        return a + b

    def get_result(self, acc):
        return str(acc)


class WeightedSum(AggregateFunction):
    """Two value columns: ``add`` gets (v, x) tuples."""

    def create_accumulator(self):
        return 0.0

    def add(self, value, acc):
        v, x = value
        return acc + (v or 0) * x

    def merge(self, a, b):
        return a + b

    def get_result(self, acc):
        return acc


class CountDistinct(AggregateFunction):
    """Exact distinct count without a mergeable sketch: no merge()."""

    def create_accumulator(self):
        return set()

    def add(self, value, acc):
        acc.add(value)
        return acc

    def get_result(self, acc):
        return len(acc)


class Boom(VecMean):
    def add_batch(self, values, acc):
        raise ValueError("boom in user code")


# -- data ----------------------------------------------------------------------------------


def make_rows(n: int = N, seed: int = 7) -> list[tuple]:
    """Skewed keys: key 0 holds ~20% of the rows, the rest Zipf(1.2), a few null keys."""
    rng = np.random.default_rng(seed)
    hot = rng.random(n) < 0.2
    k = np.where(hot, 0, rng.zipf(1.2, n) % 80 + 1)
    rows = []
    for i in range(n):
        key = None if i % 53 == 0 else int(k[i])
        v = None if i % 17 == 0 else int(rng.integers(-50, 50))
        rows.append((key, f"s{int(k[i]) % 5}", v, float(rng.random())))
    return rows


@pytest.fixture(scope="module")
def rows():
    return make_rows()


@pytest.fixture(scope="module")
def df(spark, rows):
    # three input partitions, built without a shuffle: three local tasks
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, 3), SCHEMA)


def group(rows, key=lambda r: r[0]):
    out = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return out


def native(df, keys, expr) -> dict:
    res = df.groupBy(*keys).agg(expr.alias("r")).collect()
    if len(keys) == 1:
        return {r[0]: r["r"] for r in res}
    return {tuple(r[: len(keys)]): r["r"] for r in res}


def assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        if w is None or g is None:
            assert g is w, k
        else:
            assert g == pytest.approx(w, rel=1e-9, abs=1e-9), k


# -- built-ins -----------------------------------------------------------------------------


def test_builtins_equal_python_and_native_spark_on_skewed_keys(df, rows):
    view = local_key_by(df, "k")
    by_key = group(rows)

    def vals(rs, i):
        return [r[i] for r in rs if r[i] is not None]

    ref = {
        "sum": {k: (sum(vals(rs, 2)) if vals(rs, 2) else None) for k, rs in by_key.items()},
        "count": {k: len(rs) for k, rs in by_key.items()},
        "min": {k: (min(vals(rs, 2)) if vals(rs, 2) else None) for k, rs in by_key.items()},
        "max": {k: max(vals(rs, 3)) for k, rs in by_key.items()},
        "mean": {
            k: (sum(vals(rs, 2)) / len(vals(rs, 2)) if vals(rs, 2) else None)
            for k, rs in by_key.items()
        },
    }
    got = {
        "sum": view.sum("v"),
        "count": view.count(),
        "min": view.min("v"),
        "max": view.max("x"),
        "mean": view.mean("v"),
    }
    spark_exprs = {
        "sum": F.sum("v"),
        "count": F.count(F.lit(1)),
        "min": F.min("v"),
        "max": F.max("x"),
        "mean": F.avg("v"),
    }
    for op, agg in got.items():
        result = agg.to_dict()
        assert_close(result, ref[op])
        assert_close(result, native(df, ["k"], spark_exprs[op]))
    assert None in got["count"].to_dict()  # null keys are a group, as in Spark
    # names and types follow Spark's groupBy().sum() / avg()
    assert got["sum"].df.columns == ["k", "sum(v)"]
    assert got["mean"].df.columns == ["k", "avg(v)"]
    assert dict(got["sum"].df.dtypes)["sum(v)"] == "bigint"
    assert dict(got["min"].df.dtypes)["min(v)"] == "bigint"


def test_hot_key_costs_one_partial_per_task_and_metrics_show_it(df, rows):
    agg = local_key_by(df, "k", num_reducers=4).count()
    assert agg.metrics is None  # nothing ran yet
    counts = agg.to_dict()
    hot_rows = counts[0]
    assert hot_rows == max(counts.values()) >= 0.18 * N  # the hot key: ~20% of the rows
    m = agg.metrics
    distinct = len(counts)
    assert m.rows_in == N and m.local_tasks == 3 and m.reducers == 4 and m.keys == distinct
    assert m.partials_shuffled <= m.local_tasks * distinct
    assert m.max_partials_per_key <= m.local_tasks  # the hot key: one partial per task
    assert m.max_rows_per_key == hot_rows
    # without local aggregation the hot key's reducer would get all of its rows
    assert m.one_phase_max_rows_per_reducer >= hot_rows
    assert m.max_rows_per_reducer <= m.partials_shuffled < N / 5
    assert m.skew_reduction > 5
    assert "partials shuffled" in str(m)
    # a second execution replaces the figures instead of adding to them
    agg.df.write.format("noop").mode("overwrite").save()
    assert agg.metrics == m


# -- user aggregates -----------------------------------------------------------------------


def test_vectorized_aggregate_never_calls_add_per_row(df, rows):
    got = local_key_by(df, "k").aggregate(VecMean(), "x", result_type="double").to_dict()
    want = {k: sum(r[3] for r in rs) / len(rs) for k, rs in group(rows).items()}
    assert_close(got, want)
    assert_close(got, native(df, ["k"], F.avg("x")))


def test_row_wise_aggregate_sees_python_values_and_none_for_nulls(df, rows):
    agg = local_key_by(df, "k").aggregate(RowMean(), "v", result_type="double")
    assert_close(agg.to_dict(), native(df, ["k"], F.avg("v")))


def test_accumulators_that_are_not_plain_numbers_survive_the_shuffle(df, rows):
    view = local_key_by(df, "k")
    distinct = view.aggregate(Distinct(), "s", result_type="array<string>").to_dict()
    assert distinct == {k: sorted({r[1] for r in rs}) for k, rs in group(rows).items()}
    big = view.aggregate(BigSum(), "v", result_type="string").to_dict()
    want = {k: str(sum((r[2] or 0) * 10**20 for r in rs)) for k, rs in group(rows).items()}
    assert big == want


def test_several_key_and_value_columns(df, rows):
    view = local_key_by(df, ["s", "k"])
    got = view.aggregate(WeightedSum(), ["v", "x"], result_type="double").to_dict()
    want = {
        k: sum((r[2] or 0) * r[3] for r in rs)
        for k, rs in group(rows, key=lambda r: (r[1], r[0])).items()
    }
    assert_close(got, want)
    assert_close(view.sum("x").to_dict(), native(df, ["s", "k"], F.sum("x")))


def test_reduce_with_a_numpy_ufunc_and_with_a_python_function(df, rows):
    view = local_key_by(df, "s")
    assert_close(view.reduce(np.add, "v").to_dict(), native(df, ["s"], F.sum("v")))
    assert_close(view.reduce(np.maximum, "x").to_dict(), native(df, ["s"], F.max("x")))
    longest = view.reduce(lambda a, b: a if a >= b else b, "k").to_dict()
    assert longest == native(df, ["s"], F.max("k"))
    assert dict(view.reduce(np.add, "v").df.dtypes)["reduce(v)"] == "bigint"


def test_top_n_keeps_the_largest_rows_per_key(df, rows):
    agg = local_key_by(df, "k").top_n(3, "x", columns=["x", "s"])
    got = agg.to_dict()
    for k, rs in group(rows).items():
        best = sorted(rs, key=lambda r: -r[3])[:3]
        assert [e["x"] for e in got[k]] == [r[3] for r in best]
        assert [e["s"] for e in got[k]] == [r[1] for r in best]
    assert agg.df.schema[agg.result_column].dataType.simpleString() == (
        "array<struct<x:double,s:string>>"
    )
    default = local_key_by(df, "k").top_n(1, "v").df
    assert default.schema["top_1(v)"].dataType.elementType.names == ["s", "v", "x"]


# -- partitioning does not matter ----------------------------------------------------------


class Sum(AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        return acc + value

    def add_batch(self, values, acc):
        return acc + int(values.sum())

    def merge(self, a, b):
        return a + b

    def get_result(self, acc):
        return acc


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    data=st.lists(
        st.tuples(st.one_of(st.integers(0, 6), st.sampled_from([0, 0, 0])), st.integers(-9, 9)),
        min_size=1,
        max_size=120,
    ),
    partitions=st.integers(1, 4),
    reducers=st.one_of(st.none(), st.integers(1, 3)),
    buffer_bytes=st.sampled_from([1, 1 << 20]),
    max_local_keys=st.sampled_from([1, 3, 1 << 20]),
)
def test_results_do_not_depend_on_partitioning_buffering_or_flushes(
    spark, data, partitions, reducers, buffer_bytes, max_local_keys
):
    df = spark.createDataFrame(spark.sparkContext.parallelize(data, partitions), "k long, v long")
    view = local_key_by(
        df, "k", num_reducers=reducers, buffer_bytes=buffer_bytes, max_local_keys=max_local_keys
    )
    want: dict = defaultdict(int)
    for k, v in data:
        want[k] += v
    agg = view.aggregate(Sum(), "v", result_type="bigint")
    assert agg.to_dict() == dict(want)
    assert agg.metrics.rows_in == len(data)
    assert view.sum("v").to_dict() == dict(want)


def test_small_buffers_and_flushes_trade_partials_for_memory(df, rows):
    base = local_key_by(df, "k").count()
    flushing = local_key_by(df, "k", buffer_bytes=1, max_local_keys=2).count()
    assert base.to_dict() == flushing.to_dict()
    assert flushing.metrics.partials_shuffled > base.metrics.partials_shuffled
    assert base.metrics.partials_shuffled <= 3 * len(base.to_dict())


def test_empty_input_gives_an_empty_result(df):
    agg = local_key_by(df.limit(0), "k").aggregate(VecMean(), "x", result_type="double")
    assert agg.to_dict() == {}
    assert agg.metrics.rows_in == 0 and agg.metrics.partials_shuffled == 0


class TooBig(ArithmeticError):
    """A user's own exception class."""


def refuse_big(a, b):
    if a + b > 50:
        raise TooBig(f"{a} + {b} is too big")
    return a + b


def test_a_failing_user_aggregate_names_the_operation(df):
    with pytest.raises(UserFunctionError) as info:
        local_key_by(df, "k").aggregate(Boom(), "x", result_type="double").to_dict()
    text = str(info.value)
    assert "local_key_by('k').aggregate(Boom())" in text and "boom in user code" in text
    err = info.value
    assert err.operation == "local_key_by('k').aggregate(Boom())" and err.function == "Boom"
    assert err.raised(ValueError) and isinstance(err.partition, int)
    assert "raise ValueError" in err.traceback_text  # the user's line


def test_a_failing_reduce_function_is_a_spark_ops_error_in_the_users_own_action(df):
    from pyspark.errors import PythonException

    out = local_key_by(df, "k").reduce(refuse_big, "v")
    with pytest.raises(SparkOpsError) as info:
        out.df.collect()  # the user's own action, not one spark_ops runs
    err = info.value
    assert isinstance(err, UserFunctionError) and isinstance(err, PythonException)
    assert err.function == "refuse_big" and "reduce(refuse_big)" in err.operation
    assert (
        err.raised(TooBig) and err.raised(ArithmeticError) and err.exception_type.endswith("TooBig")
    )
    assert "is too big" in str(err) and "failed in the" in str(err)


# -- the kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "accs, numeric",
    [
        ([1.5, np.float64(2.0), 3.0], True),
        ([1, np.int64(2)], True),
        ([True, False], True),
        ([(1.0, 2), (np.float64(3.5), np.int64(4))], True),
        ([(1, True, 2.5)], True),
        ([], True),
        ([2**70, 1], False),  # beyond int64: pickled, not wrapped
        ([(1, 2.0), (1.0, 2.0)], False),  # an int and a float in one position: pickled
        ([{"a": 1}, [1, 2]], False),
    ],
)
def test_accumulator_encoding_round_trips(accs, numeric):
    cols = K.encode_accumulators(accs)
    back = K.decode_accumulators(pa.table(cols))
    assert back == [a.item() if isinstance(a, np.generic) else a for a in accs]
    assert [type(b) for b in back] == [
        type(a.item()) if isinstance(a, np.generic) else type(a) for a in accs
    ]
    assert ("p" not in cols[K.FMT].to_pylist()) == numeric


def test_grouping_keeps_arrival_order_within_a_key():
    keys = np.array([3, 1, 3, 2, 1, 3] * 20000)  # more than 2^16 rows: radix passes
    table = pa.table({"k": keys, "i": np.arange(len(keys))})
    g = K.group_rows(table, ["k"])
    for c in range(g.num_groups):
        rows = g.order[g.starts[c] : g.starts[c + 1]]
        assert np.all(np.diff(rows) > 0)
        assert len(set(keys[rows].tolist())) == 1
    # the fallback for keys Arrow cannot hash (nested types): encode + radix sort
    sorted_g = K._group_rows_sorted(table, ["k"])
    assert sorted(map(tuple, np.split(sorted_g.order, sorted_g.starts[1:-1]))) == sorted(
        map(tuple, np.split(g.order, g.starts[1:-1]))
    )
    assert np.array_equal(g.codes[g.order], np.repeat(np.arange(g.num_groups), g.counts))
    nested = pa.table({"k": pa.array([{"a": 1}, {"a": 2}, {"a": 1}])})
    g2 = K.group_rows(nested, ["k"])
    assert g2.keys.column("k").to_pylist() == [{"a": 1}, {"a": 2}]
    assert g2.order.tolist() == [0, 2, 1]
    codes = np.random.default_rng(0).integers(0, 200_000, 300_000)
    assert np.array_equal(K.stable_argsort(codes, 200_000), np.argsort(codes, kind="stable"))


# -- streaming -----------------------------------------------------------------------------


def write_file(root, i: int, rows: list[tuple]) -> None:
    k, v, x = zip(*rows)
    table = pa.table({"k": pa.array(k, pa.int64()), "v": pa.array(v, pa.int64()), "x": x})
    pq.write_table(table, str(root / f"part-{i:03d}.parquet"))


def stream_rows(i: int, n: int = 300) -> list[tuple]:
    rng = np.random.default_rng(100 + i)
    hot = rng.random(n) < 0.2
    k = np.where(hot, 0, rng.integers(1, 30, n))
    return [(int(a), int(b), float(c)) for a, b, c in zip(k, rng.integers(0, 9, n), rng.random(n))]


class Latest:
    """A foreachBatch sink keeping the newest value per key (update output mode)."""

    def __init__(self):
        self.values: dict = {}
        self.batches = 0

    def __call__(self, batch_df, batch_id):
        self.batches += 1
        for r in batch_df.collect():
            self.values[r[0]] = r[1]


def start(agg, sink, checkpoint):
    return (
        agg.df.writeStream.outputMode("update")
        .foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )


def test_streaming_sum_merges_micro_batch_partials_into_state_across_restarts(spark, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    batches = [stream_rows(i) for i in range(3)]
    for i, b in enumerate(batches):
        write_file(src, i, b)
    stream = spark.readStream.schema("k long, v long, x double")
    sdf = stream.option("maxFilesPerTrigger", 1).parquet(str(src))
    agg = local_key_by(sdf, "k").sum("v")
    assert agg.is_streaming and agg.df.isStreaming
    sink = Latest()
    query = start(agg, sink, tmp_path / "ckpt")
    try:
        query.processAllAvailable()
        m = agg.metrics_from(query)
    finally:
        query.stop()
    assert sink.batches == 3  # one micro-batch per file, each merged into the state
    want: dict = defaultdict(int)
    for b in batches:
        for k, v, _ in b:
            want[k] += v
    assert sink.values == dict(want)
    last = batches[-1]
    assert m.rows_in == len(last) and m.partials_shuffled <= len({r[0] for r in last})

    # a restart from the checkpoint continues from the state
    extra = stream_rows(3)
    write_file(src, 3, extra)
    sink2 = Latest()
    query = start(agg, sink2, tmp_path / "ckpt")
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    for k, v, _ in extra:
        want[k] += v
    assert sink2.batches == 1
    assert sink2.values == {k: want[k] for k in {r[0] for r in extra}}


def test_streaming_user_aggregate_top_n_and_complete_mode(spark, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    batches = [stream_rows(i) for i in range(2)]
    for i, b in enumerate(batches):
        write_file(src, i, b)
    sdf = (
        spark.readStream.schema("k long, v long, x double")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(src))
    )
    view = local_key_by(sdf, "k")
    all_rows = [r for b in batches for r in b]
    by_key = group(all_rows)

    mean_sink, top_sink = Latest(), Latest()
    q1 = start(view.aggregate(VecMean(), "x", result_type="double"), mean_sink, tmp_path / "c1")
    q2 = start(view.top_n(2, "x", columns=["x"]), top_sink, tmp_path / "c2")
    name = f"local_agg_counts_{uuid.uuid4().hex[:8]}"
    q3 = (
        view.count()
        .df.writeStream.outputMode("complete")
        .format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "c3"))
        .start()
    )
    try:
        for q in (q1, q2, q3):
            q.processAllAvailable()
        counts = {r[0]: r[1] for r in spark.table(name).collect()}
    finally:
        for q in (q1, q2, q3):
            q.stop()
    assert mean_sink.batches == 2
    assert_close(mean_sink.values, {k: sum(r[2] for r in rs) / len(rs) for k, rs in by_key.items()})
    for k, rs in by_key.items():
        assert [e["x"] for e in top_sink.values[k]] == sorted((r[2] for r in rs), reverse=True)[:2]
    assert counts == {k: len(rs) for k, rs in by_key.items()}


# -- bad arguments: clear errors before any job --------------------------------------------


@pytest.fixture
def no_jobs(spark):
    """Fails the test if anything it does starts a Spark job."""
    sc = spark.sparkContext
    group_id = f"local-agg-validation-{uuid.uuid4().hex}"
    sc.setJobGroup(group_id, "argument checks must not run jobs")
    try:
        yield
    finally:
        jobs = list(sc.statusTracker().getJobIdsForGroup(group_id))
        sc.setLocalProperty("spark.jobGroup.id", None)
        assert jobs == [], f"argument checks started Spark jobs {jobs}"


def test_non_mergeable_aggregates_are_rejected_with_the_reason_and_the_alternatives(df, no_jobs):
    with pytest.raises(NonMergeableAggregateError) as info:
        local_key_by(df, "k").aggregate(CountDistinct(), "v", result_type="bigint")
    text = str(info.value)
    for word in ("CountDistinct", "merge()", "approx_count_distinct", "applyInPandas"):
        assert word in text
    assert isinstance(info.value, TypeError)


@pytest.fixture(scope="module")
def sdf(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_stream")
    write_file(root, 0, stream_rows(0, 10))
    return spark.readStream.schema("k long, v long, x double").parquet(str(root))


def test_bad_arguments_fail_clearly_before_any_job(df, sdf, no_jobs):
    view = local_key_by(df, "k")
    streaming = local_key_by(sdf, "k").sum("v")
    cases = [
        (lambda: local_key_by(None, "k"), TypeError, ["DataFrame"]),
        (lambda: local_key_by(df, "nope"), ValueError, ["nope", "'k'"]),
        (lambda: local_key_by(df, []), ValueError, ["empty"]),
        (lambda: local_key_by(df, 3), TypeError, ["column name"]),
        (lambda: local_key_by(df, ["k", "k"]), ValueError, ["twice"]),
        (lambda: local_key_by(df, "k", num_reducers=0), ValueError, ["num_reducers"]),
        (lambda: local_key_by(df, "k", buffer_bytes=0), ValueError, ["buffer_bytes"]),
        (lambda: local_key_by(df, "k", max_local_keys=True), ValueError, ["max_local_keys"]),
        (lambda: view.aggregate(None, "v"), TypeError, ["None"]),
        (lambda: view.aggregate(VecMean, "v"), TypeError, ["VecMean()"]),
        (lambda: view.aggregate(object(), "v"), TypeError, ["AggregateFunction"]),
        (lambda: view.aggregate(VecMean(), "nope", result_type="double"), ValueError, ["nope"]),
        (lambda: view.aggregate(VecMean(), "x"), TypeError, ["result_type", "double"]),
        (
            lambda: view.aggregate(VecMean(), "x", result_type="no such type"),
            ValueError,
            ["result_type"],
        ),
        (lambda: view.sum("s"), TypeError, ["'s'", "cast"]),
        (lambda: view.mean("nope"), ValueError, ["nope"]),
        (lambda: view.sum("v", alias="k"), ValueError, ["clash"]),
        (lambda: view.reduce(None, "v"), TypeError, ["callable"]),
        (lambda: view.reduce(np.add, "s"), TypeError, ["ufunc"]),
        (lambda: view.top_n(0, "x"), ValueError, ["top_n(n)"]),
        (lambda: view.top_n(2, "nope"), ValueError, ["nope"]),
        (lambda: view.top_n(2, "x", columns=[]), ValueError, ["empty"]),
        (lambda: local_key_by(sdf, "k", num_reducers=2), ValueError, ["streaming"]),
        (lambda: streaming.to_dict(), TypeError, ["streaming", "writeStream"]),
        (lambda: streaming.metrics, TypeError, ["metrics_from"]),
    ]
    for call, exc, words in cases:
        with pytest.raises(exc) as info:
            call()
        for w in words:
            assert w in str(info.value), (w, str(info.value))
    assert math.isinf(LocalAggMetrics(rows_in=0, partials_shuffled=0).reduction)
