"""The barrier stage's two ways of bringing several streams to their subtasks: DataFrame
operations (Spark >= 4.1: ``repartitionById``, ``sortWithinPartitions``, a barrier
``mapInArrow``, ``DataFrame.persist`` for replay) and RDD operations (every line). Each
subtask must see the same batches in the same order either way: partition ``j`` of
every stream at subtask ``j % n``, ordered by stream, source partition, batch."""

from __future__ import annotations

import pickle
import sys

import pytest
from pyspark.sql import functions as F

from spark_ops import BarrierStage, ReplayPlan
from spark_ops import _spark_compat as compat

DATAFRAME_PATHS = compat.dataframe_barrier_paths(None)
N = 2

pytestmark = pytest.mark.spark_lines  # the compatibility set every CI environment runs


@pytest.fixture(scope="module", autouse=True)
def ship_this_module_by_value():
    """The task functions below reach Spark's Python workers pickled by value, as a
    user's own script would ship them (this module is not importable there)."""
    from pyspark import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # PySpark's own copy of cloudpickle
    yield
    cloudpickle.unregister_pickle_by_value(module)


def record(pid, inputs):
    """A subtask's view: (stream, first id, rows, source partition) of each batch, in order."""
    seen = []
    for stream, batch in inputs:
        ids = batch.column("id").to_pylist()
        seen.append((stream, ids[0], len(ids), batch.column("part")[0].as_py()))
    return pickle.dumps((pid, seen))


def record_round(round_, pid, inputs):
    return pickle.dumps((round_, pickle.loads(record(pid, inputs))))


def _streams(spark):
    # partition counts 3, 5 and (after a shuffle adaptive execution may coalesce) <= 4;
    # each row carries its own partition index to check where it went
    a = spark.range(0, 30, numPartitions=3)
    b = spark.range(100, 150, numPartitions=5)
    c = spark.range(200, 240, numPartitions=4).repartition(4, "id")
    return [df.withColumn("part", F.spark_partition_id()) for df in (a, b, c)]


def _expected(spark, streams):
    """Each stream's partition j, batch by batch, at subtask j % N, in order."""
    views = {p: [] for p in range(N)}
    for s, df in enumerate(streams):
        rows = df.select("id", "part").collect()
        by_part: dict[int, list[int]] = {}
        for r in rows:
            by_part.setdefault(r["part"], []).append(r["id"])
        for j in sorted(by_part):
            views[j % N].append((s, j, sorted(by_part[j])))
    return views


def _decoded(results):
    return dict(pickle.loads(r) for r in results)


def _check_against_expected(views, expected):
    for p in range(N):
        got = [(s, part) for s, _, _, part in views[p]]
        want = [(s, j) for s, j, _ in expected[p]]
        # batches of one source partition stay consecutive, in stream then partition order
        assert list(dict.fromkeys(got)) == want, (p, got, want)
        rows = {}
        for s, _first, count, part in views[p]:
            rows.setdefault((s, part), 0)
            rows[(s, part)] += count
        assert rows == {(s, j): len(ids) for s, j, ids in expected[p]}


def test_the_rdd_path_routes_each_streams_partitions_in_order(spark):
    streams = _streams(spark)
    stage = BarrierStage(streams, N, record, paths="rdd")
    views = _decoded(stage.run())
    _check_against_expected(views, _expected(spark, streams))


@pytest.mark.skipif(not DATAFRAME_PATHS, reason="DataFrame.repartitionById needs Spark >= 4.1")
def test_the_dataframe_path_is_the_default_and_equals_the_rdd_path(spark):
    streams = _streams(spark)
    stage = BarrierStage(streams, N, record)
    assert stage.paths == "dataframe"
    views = _decoded(stage.run())
    _check_against_expected(views, _expected(spark, streams))
    assert views == _decoded(BarrierStage(streams, N, record, paths="rdd").run())


@pytest.mark.skipif(DATAFRAME_PATHS, reason="this Spark has DataFrame.repartitionById")
def test_before_spark_4_1_the_rdd_path_is_the_default(spark):
    assert BarrierStage(_streams(spark), N, record).paths == "rdd"
    with pytest.raises(ValueError, match="repartitionById"):
        BarrierStage(_streams(spark), N, record, paths="dataframe")


@pytest.mark.parametrize("paths", ["rdd", "dataframe"])
def test_replay_rounds_read_the_cache_and_round_zero_also_the_streams_read_once(spark, paths):
    if paths == "dataframe" and not DATAFRAME_PATHS:
        pytest.skip("DataFrame.repartitionById needs Spark >= 4.1")
    streams = _streams(spark)
    replayed = [True, False, True]
    plan = ReplayPlan(streams, replayed, N, paths=paths)
    assert plan.paths == paths
    try:
        batches = plan.prepare()
        assert batches > 0
        assert plan.memory_bytes + plan.disk_bytes > 0  # Spark's storage info was read
        assert plan.storage_level.useDisk and plan.storage_level.useMemory
        expected_all = _expected(spark, streams)
        expected_replayed = {
            p: [v for v in views if replayed[v[0]]] for p, views in expected_all.items()
        }
        # round 0: the cache's batches, then those of the streams read once
        expected_first = {
            p: expected_replayed[p] + [v for v in views if not replayed[v[0]]]
            for p, views in expected_all.items()
        }
        for round_ in range(3):
            results = [pickle.loads(r) for r in plan.run_round(round_, record_round)]
            assert {r for r, _ in results} == {round_}
            views = dict(view for _, view in results)
            _check_against_expected(views, expected_first if round_ == 0 else expected_replayed)
    finally:
        plan.close()
    assert plan.storage_level is None
