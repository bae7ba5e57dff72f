"""The array cache of ``hybrid_iter.ml`` (``hybrid_iter/_runtime/array_store.py``): a fit
of a cached DataFrame keeps the arrays it decoded; the next fit of the same cached data
reads them instead of Spark's rows, and gives bit for bit the same model. Never stale:
unpersisted, re-cached, changed or computed-on data is read from Spark again; lost
arrays cost a rerun from Spark, not the fit. Real Spark, real Ray."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from pyspark.sql import functions as F

import hybrid_iter as hi
from hybrid_iter import ml
from hybrid_iter._runtime.array_store import CONF_BYTES, CONF_ENABLED, store_stats
from hybrid_iter.testing import LoseKeptArrays
from spark_ops import _spark_compat as compat
from spark_ops import cached_view

D = 6
COLS = [f"x{i}" for i in range(D)]
P = 2  # partitions of the cached data and subtasks of every fit here


def _frame(seed: int, rows: int = 4_000) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, D)) * np.logspace(-2, 2, D)
    y = X @ (rng.normal(size=D) / np.logspace(-2, 2, D)) + rng.normal(size=rows)
    pdf = pd.DataFrame(X, columns=COLS)
    pdf["y"] = y
    pdf["c"] = (y > np.median(y)).astype(float)
    return pdf


@pytest.fixture
def cached(spark):
    df = spark.createDataFrame(_frame(0)).repartition(P).cache()
    yield df
    df.unpersist()


@pytest.fixture
def cache_conf(spark):
    yield spark.conf
    spark.conf.unset(CONF_ENABLED)
    spark.conf.unset(CONF_BYTES)


def _lin(df, **kw):
    return ml.LinearRegression(
        features_col=COLS, label_col="y", parallelism=P, progress=False, **kw
    ).fit(df)


def _log(df, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ml.LogisticRegression(
            features_col=COLS, label_col="c", parallelism=P, progress=False, **kw
        ).fit(df)


def _swapped(df):
    """``y`` and ``x5`` swapped: the names a fit reads, other columns behind them."""
    return df.withColumnRenamed("y", "t").withColumnRenamed("x5", "y").withColumnRenamed("t", "x5")


def _same(a, b) -> None:
    assert np.array_equal(a.coefficients, b.coefficients)
    assert float(a.intercept) == float(b.intercept)


def test_the_next_fit_of_the_same_cached_data_reads_the_kept_arrays_bit_for_bit(
    spark, cached, cache_conf
):
    first = _lin(cached)
    assert first.summary.data_source == "spark"
    second = _lin(cached, reg=0.1)  # another parameter, the same data
    again = _lin(cached)
    assert second.summary.data_source == again.summary.data_source == "array cache"
    _same(first, again)
    # a logistic fit of other columns (the label differs) reads from Spark first
    log1, log2 = _log(cached), _log(cached)
    assert (log1.summary.data_source, log2.summary.data_source) == ("spark", "array cache")
    _same(log1, log2)
    assert log1.summary.objective_history == log2.summary.objective_history
    # and equals a fit with the cache turned off
    cache_conf.set(CONF_ENABLED, "false")
    off = _log(cached)
    assert off.summary.data_source == "spark"
    _same(off, log2)
    stats = store_stats()
    assert stats is not None and stats["keys"] == 0  # turned off: everything dropped


def test_unpersisted_recached_or_changed_data_is_never_served_stale(spark, cache_conf, tmp_path):
    path = str(tmp_path / "rows.parquet")
    spark.createDataFrame(_frame(1)).repartition(P).write.parquet(path)
    old = spark.read.parquet(path).cache()
    a, b = _lin(old), _lin(old)
    assert (a.summary.data_source, b.summary.data_source) == ("spark", "array cache")
    old.unpersist()
    assert _lin(old).summary.data_source == "spark"  # not cached any more
    assert store_stats()["keys"] == 0  # its arrays are gone with its RDD
    old.cache()  # the same DataFrame object cached again: a new cached RDD
    again = [_lin(old).summary.data_source for _ in range(2)]
    assert again == ["spark", "array cache"]
    old.unpersist()
    # the same path, new rows, cached again: a new cached RDD, read from Spark
    spark.createDataFrame(_frame(2)).repartition(P).write.mode("overwrite").parquet(path)
    new = spark.read.parquet(path).cache()
    fresh = _lin(new)
    assert fresh.summary.data_source == "spark"
    assert not np.allclose(fresh.coefficients, a.coefficients)
    cache_conf.set(CONF_ENABLED, "false")
    _same(fresh, _lin(new))
    new.unpersist()


def test_data_computed_on_the_cached_rows_is_read_from_spark(spark, cached, cache_conf):
    _lin(cached)
    assert _lin(cached).summary.data_source == "array cache"
    for derived in (
        cached.where(F.col("x0") > 0),  # a filter
        cached.withColumn("x1", F.col("x1") * 2.0),  # a column computed
    ):
        for _ in range(2):
            assert _lin(derived).summary.data_source == "spark"
    # the same names, other columns: Spark 3.5 plans renames as computed columns; Spark 4
    # renames the cached relation's columns, so the fit reads the cached columns in
    # another order, kept apart from the original order's arrays (never served them)
    renamed = _swapped(cached)
    sources = [_lin(renamed).summary.data_source for _ in range(2)]
    spark4 = compat.spark_version() >= (4, 0, 0)
    assert sources == (["spark", "array cache"] if spark4 else ["spark", "spark"])
    kept = _lin(renamed)
    cache_conf.set(CONF_ENABLED, "false")
    _same(_lin(renamed), renamed_fit := _lin(renamed))
    _same(kept, renamed_fit)
    assert not np.array_equal(renamed_fit.coefficients, _lin(cached).coefficients)
    cache_conf.unset(CONF_ENABLED)
    # as many subtasks as cached partitions only (no repartition is cached)
    fits = [
        ml.LinearRegression(features_col=COLS, label_col="y", parallelism=1, progress=False).fit(
            cached
        )
        for _ in range(2)
    ]
    assert [f.summary.data_source for f in fits] == ["spark", "spark"]


def _partitions(df) -> list[list[tuple]]:
    return [[tuple(r) for r in part] for part in df.rdd.glom().collect()]


def test_a_fit_over_cached_data_plans_its_job_on_the_cache_and_reads_what_spark_would(
    spark, cached, cache_conf
):
    """A fit's Spark job over cached data runs on a DataFrame planned on the cache
    relation itself (``cached_view``), not on the plan the cache was made from again: it
    must hold the same rows in the same partitions, in the fit's column order."""
    asked = [cached.select(*COLS, "y"), cached.select("y", *COLS[::-1])]
    if compat.spark_version() >= (4, 0, 0):  # renames stay a scan of the cache (above)
        asked.append(_swapped(cached).select(*COLS, "y"))
    for df in asked:
        view = cached_view(df)
        assert view is not None
        source, frame = view
        assert frame.columns == df.columns
        assert compat.exact_num_partitions(frame) == source.num_partitions == P
        assert _partitions(frame) == _partitions(df)
    # computed on the cached rows: no view (the fit reads what Spark computes)
    assert cached_view(cached.where(F.col("x0") > 0)) is None
    assert cached_view(cached.withColumn("x1", F.col("x1") * 2.0).select(*COLS)) is None
    # Spark computes the rows again once unpersisted (the cache's partitions held them
    # in another order: the same model up to rounding)
    cache_conf.set(CONF_ENABLED, "false")  # every fit below reads from Spark
    on_cache = _lin(cached), _lin(_swapped(cached))
    cached.unpersist()
    assert cached_view(cached.select(*COLS, "y")) is None
    not_cached = _lin(cached), _lin(_swapped(cached))
    for a, b in zip(on_cache, not_cached):
        assert np.allclose(a.coefficients, b.coefficients, rtol=1e-9, atol=0)
        assert np.isclose(a.intercept, b.intercept, rtol=1e-9, atol=0)
    assert not np.allclose(on_cache[0].coefficients, on_cache[1].coefficients)


def test_arrays_lost_from_outside_cost_a_rerun_from_spark_not_the_fit(spark, cached, cache_conf):
    expected = _log(cached)
    assert _log(cached).summary.data_source == "array cache"
    hooks = LoseKeptArrays()
    with pytest.warns(UserWarning, match="array cache kept"):
        got = ml.LogisticRegression(
            features_col=COLS, label_col="c", parallelism=P, progress=False
        )._fit(cached, hooks=hooks)
    assert hooks.killed, "the store actor was not killed"
    assert got.summary.data_source == "spark"
    _same(expected, got)
    # a new store serves the fits after it
    _log(cached)
    assert _log(cached).summary.data_source == "array cache"


def test_a_bound_smaller_than_the_data_keeps_nothing_and_bad_conf_fails_before_a_job(
    spark, cached, cache_conf
):
    cache_conf.set(CONF_BYTES, "1000")
    fits = [_lin(cached) for _ in range(3)]
    assert [f.summary.data_source for f in fits] == ["spark"] * 3
    assert store_stats()["refused"] >= 1
    _same(fits[0], fits[2])
    cache_conf.unset(CONF_BYTES)
    sc = spark.sparkContext
    for key, value, word in (
        (CONF_ENABLED, "maybe", "'true' or 'false'"),
        (CONF_BYTES, "-5", "bytes >= 0"),
        (CONF_BYTES, "lots", "bytes >= 0"),
    ):
        cache_conf.set(key, value)
        jobs_before = set(sc.statusTracker().getJobIdsForGroup(None))
        with pytest.raises(hi.IterationConfigError, match=word) as info:
            _lin(cached)
        assert key in str(info.value)
        assert set(sc.statusTracker().getJobIdsForGroup(None)) == jobs_before
        cache_conf.unset(key)


_KEEPER = """
import sys, numpy as np, ray
from hybrid_iter._runtime import array_store
from hybrid_iter._cluster.ray_util import connect
connect(sys.argv[1])
stored = array_store.StoredArrays(sys.argv[2], ("app", 1, "k"), "write", 1)
x = np.asfortranarray(np.arange(12.0).reshape(4, 3))
array_store.keep_arrays(stored, 0, (x, np.ones(4), None), x.nbytes + 32)
# wait until the store has its copy (the task's object is released then), then end
store = array_store._handle(sys.argv[2])
while array_store._PENDING:
    ray.get(store.ready.remote())
"""


def test_kept_arrays_outlive_the_process_that_decoded_them(session, cached, cache_conf):
    """Spark ends idle Python workers: what the store keeps must not die with the worker
    that put it (an object dies with the process that put it). A process keeps arrays,
    exits, and they are still read back whole."""
    import subprocess
    import sys

    from hybrid_iter._runtime import array_store

    _lin(cached)  # starts this driver's store
    handle, name = array_store._store(create=False)
    subprocess.run(
        [sys.executable, "-c", _KEEPER, session.ray_address, name], check=True, timeout=120
    )
    stored = array_store.StoredArrays(name, ("app", 1, "k"), "read", 1)
    x, label, weight = array_store.read_arrays(stored, 0)
    assert np.array_equal(x, np.arange(12.0).reshape(4, 3)) and x.flags.f_contiguous
    assert not x.flags.writeable  # zero-copy views of the object store
    assert np.array_equal(label, np.ones(4)) and weight is None
    with pytest.raises(hi.StoredArraysLost, match="partition 1"):
        array_store.read_arrays(stored, 1)


def test_a_subtask_given_other_stand_in_rows_fails_rather_than_fit_part_of_the_data():
    """Reading kept arrays, subtask p must be the stage's partition p holding the one
    stand-in row p: a stage of another shape would fit a part of the data, silently."""
    import pyarrow as pa

    from hybrid_iter._runtime.array_store import StoredArrays
    from hybrid_iter.ml._features import FeatureCache, FeaturePlan

    stored = StoredArrays("hybrid_iter.arrays.none", ("app", 1), "read", 2)
    plan = FeaturePlan("columns", tuple(COLS), D, label="y", stored=stored)
    for rows in ([0, 1], [0], []):
        cache = FeatureCache(plan, 1)
        if rows:
            cache.add(pa.record_batch({"id": pa.array(rows, pa.int64())}))
        with pytest.raises(hi.UsageError, match="exactly 2 subtasks"):
            cache.matrix()
    with pytest.raises(hi.UsageError, match="columns"):
        FeatureCache(plan, 1).add(pa.record_batch({"x0": pa.array([1.0])}))


def test_kmeans_reads_the_kept_arrays_too_and_cosine_does_not_change_them(
    spark, cached, cache_conf
):
    """A cosine fit scales its rows; the arrays it keeps (and a Euclidean fit reads
    after it) are the rows as they are."""

    def fit(measure):
        return ml.KMeans(
            features_col=COLS,
            k=3,
            seed=5,
            parallelism=P,
            progress=False,
            distance_measure=measure,
        ).fit(cached)

    cosine = fit("cosine")
    euclid = fit("euclidean")
    again = fit("cosine")
    assert [f.summary.data_source for f in (cosine, euclid, again)] == [
        "spark",
        "array cache",
        "array cache",
    ]
    assert np.array_equal(again.cluster_centers, cosine.cluster_centers)
    cache_conf.set(CONF_ENABLED, "false")
    plain = fit("euclidean")
    assert plain.summary.data_source == "spark"
    assert np.array_equal(plain.cluster_centers, euclid.cluster_centers)
    assert plain.summary.training_cost == euclid.summary.training_cost


def test_the_store_serves_an_entry_only_with_exactly_its_partitions_and_within_its_bound():
    """The store's bookkeeping alone (no Ray: ``add`` takes references it owns)."""
    from hybrid_iter._runtime.array_store import READ, WRITE, ArrayStore

    store = ArrayStore()
    key, other = ("app", 7, (0, 1)), ("app", 8, (0, 1))
    assert store.lookup(key, 2, [7, 8], 1000) == (WRITE, [])
    assert not store.add(key, 2, 2, ["ref"], 100, 10)  # no partition 2 of 2
    assert store.add(key, 1, 2, ["ref"], 100, 10)
    assert store.lookup(key, 2, [7, 8], 1000) == (WRITE, [])  # partition 0 missing
    assert store.add(key, 0, 2, ["ref"], 100, 12)
    assert store.lookup(key, 2, [7, 8], 1000) == (READ, [12, 10])
    assert store.lookup(key, 3, [7, 8], 1000) == (WRITE, [])  # another partition count
    assert store.stats()["keys"] == 0
    # the bound: the least recently used key goes; a key larger than it is refused
    assert store.lookup(other, 2, [7, 8, 9, 10], 1300) == (WRITE, [])
    for k in (key, other):
        for p in (0, 1):
            assert store.add(k, p, 2, ["ref"], 300, 1)
    assert store.stats()["keys"] == 2
    assert store.add(("app", 9, ()), 0, 2, ["ref"], 300, 1)  # needs 600: `key` goes
    assert key not in store.entries and other in store.entries
    assert not store.add(("app", 10, ()), 0, 2, ["ref"], 700, 1)  # 1400 > 1300
    assert store.lookup(("app", 10, ()), 2, [8, 9, 10], 1300) == (None, [])
    store.purge("app", [8])  # RDD 9 and 10 no longer persisted
    assert list(store.entries) == [other] and not store.refused


def test_weights_a_multinomial_rerun_and_the_rows_reported_read_the_same(spark, cache_conf):
    """Weights come back from the kept arrays; a 3-class label without metadata (the fit
    runs twice: a binomial guess, then 3 classes) reads what its first run kept; the
    result counts the rows read, not the stand-in's."""
    pdf = _frame(3)
    pdf["w"] = np.random.default_rng(4).uniform(0.1, 2.0, len(pdf))
    pdf["k"] = pd.qcut(pdf["y"], 3, labels=False).astype(float)
    df = spark.createDataFrame(pdf).repartition(P).cache()

    def fit(label):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ml.LogisticRegression(
                features_col=COLS,
                label_col=label,
                weight_col="w",
                parallelism=P,
                progress=False,
            ).fit(df)

    first, second = fit("c"), fit("c")
    assert (first.summary.data_source, second.summary.data_source) == ("spark", "array cache")
    _same(first, second)
    assert sum(second.result.rows) == sum(first.result.rows) == len(pdf)
    multi = fit("k")  # its second run (3 classes) reads what its first run kept
    assert multi.summary.family == "multinomial" and multi.summary.data_source == "array cache"
    again = fit("k")
    assert np.array_equal(multi.coefficient_matrix, again.coefficient_matrix)
    cache_conf.set(CONF_ENABLED, "false")
    plain = fit("k")
    assert np.array_equal(plain.coefficient_matrix, multi.coefficient_matrix)
    cache_conf.unset(CONF_ENABLED)
    fit("c")
    ml.clear_array_cache()
    assert store_stats()["keys"] == 0
    assert fit("c").summary.data_source == "spark"
    df.unpersist()


def test_crossvalidator_reads_each_cached_fold_from_spark_once(spark, cached, cache_conf):
    """What the cache is for: CrossValidator caches each fold's training set and fits
    every param map on it; the first fit of a fold reads Spark, the others the kept
    arrays. The metrics equal a cross-validation with the cache off."""
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    def cross_validate():
        est = ml.LinearRegression(features_col=COLS, label_col="y", parallelism=P, progress=False)
        grid = ParamGridBuilder().addGrid(est.regParam, [0.3, 0.01, 0.0]).build()
        return CrossValidator(
            estimator=est,
            estimatorParamMaps=grid,
            evaluator=RegressionEvaluator(labelCol="y"),
            numFolds=2,
            seed=7,
        ).fit(cached)

    _lin(cached)  # the store is started
    before = store_stats()
    on = cross_validate()
    after = store_stats()
    assert after["reads"] - before["reads"] >= 2 * (3 - 1)  # folds x (param maps - 1)
    cache_conf.set(CONF_ENABLED, "false")
    off = cross_validate()
    assert on.avgMetrics == off.avgMetrics
    assert on.bestModel.getRegParam() == off.bestModel.getRegParam()
