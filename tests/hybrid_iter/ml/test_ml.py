"""hybrid_iter.ml on real Spark + Ray: LogisticRegression, LinearRegression and KMeans
against numpy references and Spark MLlib, inputs of every kind, transform/save/load, and
every bad parameter (refused before any Spark job)."""

from __future__ import annotations

import contextlib
import math
import uuid

import numpy as np
import pytest

import hybrid_iter as hi
from hybrid_iter import ml

D = 4
FEATURES = [f"x{j}" for j in range(D)]


# -- data ---------------------------------------------------------------------------------


def _make(spark, n=1000, seed=5, partitions=2):
    """Columns x0..x3, a 0/1 label, a regression target y, a weight, and the same features
    as a vector column (dense and sparse rows mixed), a sparse-only vector column and an
    array column; plus the numpy arrays in the same row order."""
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, D))
    X[rng.random((n, D)) < 0.3] = 0.0  # zeros, so sparse vectors are really sparse
    w_true = np.array([1.5, -2.0, 0.7, 0.0])
    label = (rng.random(n) < 1 / (1 + np.exp(-(X @ w_true + 0.4)))).astype(float)
    y = X @ w_true + 0.5 + 0.1 * rng.standard_normal(n)
    weight = rng.uniform(0.5, 2.0, n)

    def vec(i, sparse):
        nz = np.flatnonzero(X[i])
        return Vectors.sparse(D, nz.tolist(), X[i, nz].tolist()) if sparse else Vectors.dense(X[i])

    rows = [
        (
            *map(float, X[i]),
            float(label[i]),
            float(y[i]),
            float(weight[i]),
            vec(i, i % 3 == 0),
            vec(i, True),
            [float(v) for v in X[i]],
        )
        for i in range(n)
    ]
    schema = T.StructType(
        [T.StructField(c, T.DoubleType()) for c in [*FEATURES, "label", "y", "w"]]
        + [
            T.StructField("features", VectorUDT()),
            T.StructField("sparse", VectorUDT()),
            T.StructField("arr", T.ArrayType(T.DoubleType())),
        ]
    )
    rdd = spark.sparkContext.parallelize(rows, partitions)
    df = spark.createDataFrame(rdd, schema).cache()
    df.count()
    return df, X, label, y, weight


@pytest.fixture(scope="module")
def data(spark):
    df, X, label, y, weight = _make(spark)
    yield df, X, label, y, weight
    df.unpersist()


@pytest.fixture(scope="module")
def blobs(spark):
    """Four well separated blobs in 3 dimensions, 2 partitions."""
    rng = np.random.default_rng(11)
    means = np.array([[0, 0, 0], [8, 0, 0], [0, 8, 0], [0, 0, 8]], dtype=float)
    X = means[rng.integers(0, 4, 800)] + rng.standard_normal((800, 3))
    rows = [tuple(map(float, r)) for r in X]
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), ["a", "b", "c"]).cache()
    df.count()
    yield df, X
    df.unpersist()


@contextlib.contextmanager
def no_spark_job(spark):
    """Fails when a Spark job ran inside the block."""
    sc = spark.sparkContext
    group = f"must-not-run-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "no job may run here")
    try:
        yield
    finally:
        jobs = list(sc.statusTracker().getJobIdsForGroup(group))
        sc.setLocalProperty("spark.jobGroup.id", None)
        assert not jobs, f"a Spark job ran before the error: {jobs}"


def numpy_gd(X, y, *, logistic, lr, iters, reg=0.0, en=0.0, intercept=True, sw=None):
    """Full-batch proximal gradient descent on MLlib's objective (the reference)."""
    w, b = np.zeros(X.shape[1]), 0.0
    sw = np.ones(len(y)) if sw is None else sw
    n = sw.sum()
    losses = []
    for _ in range(iters):
        z = X @ w + b
        if logistic:
            r = 1 / (1 + np.exp(-z)) - y
            loss = np.logaddexp(0, z) - y * z
        else:
            r = z - y
            loss = 0.5 * r * r
        losses.append(loss @ sw / n + reg * (en * np.abs(w).sum() + (1 - en) / 2 * w @ w))
        r = r * sw
        w = w - lr * (X.T @ r / n + reg * (1 - en) * w)
        w = np.sign(w) * np.maximum(np.abs(w) - lr * reg * en, 0.0)
        if intercept:
            b -= lr * r.sum() / n
    return w, b, losses


# -- equality with numpy, and with MLlib --------------------------------------------------


@pytest.mark.spark_lines  # the compatibility set every CI environment runs
def test_logistic_sync_full_batch_equals_the_numpy_loop(data):
    df, X, label, *_ = data
    model = ml.LogisticRegression(
        features_col=FEATURES,
        max_iter=25,
        learning_rate=0.8,
        reg=0.05,
        elastic_net=0.3,
        solver="sgd",
    ).fit(df)
    w, b, losses = numpy_gd(X, label, logistic=True, lr=0.8, iters=25, reg=0.05, en=0.3)
    np.testing.assert_allclose(model.coefficients, w, rtol=1e-9, atol=1e-12)
    assert model.intercept == pytest.approx(b, rel=1e-9)
    np.testing.assert_allclose(model.loss_history, losses, rtol=1e-9)
    r = model.result
    assert (r.mode, r.terminated_by, r.epochs) == ("sync", "criteria", 25)
    assert len(r.outputs["loss_trace"]) == 25


def test_trace_versions_records_every_published_version_with_its_time(data, tmp_path):
    # what benchmarks/bench_async.py scores exactly: every version the SGD server published
    from hybrid_iter.testing import CombinedHooks, Straggler, TraceVersions

    df, *_ = data
    hooks = CombinedHooks((Straggler(partition=1, factor=1.0), TraceVersions(str(tmp_path))))
    model = ml.LogisticRegression(
        features_col=FEATURES, max_iter=6, learning_rate=0.8, tol=-1.0, solver="sgd"
    )._fit(df, hooks=hooks)
    versions = TraceVersions.read(str(tmp_path))
    assert len(versions) == model.result.publishes >= 5
    seconds = [s for s, _, _ in versions]
    epochs = [e for _, e, _ in versions]
    assert seconds == sorted(seconds) and seconds[0] >= 0.0
    assert epochs == sorted(epochs)
    last = versions[-1][2]
    np.testing.assert_array_equal(last["coef"], model.coefficients)
    assert float(last["intercept"]) == model.intercept


def test_weighted_linear_regression_equals_the_numpy_loop_for_every_input_kind(data):
    df, X, _, y, weight = data
    w, b, _ = numpy_gd(X, y, logistic=False, lr=0.3, iters=15, sw=weight)
    for features in (FEATURES, "features", "sparse", "arr"):
        model = ml.LinearRegression(
            features_col=features,
            label_col="y",
            weight_col="w",
            max_iter=15,
            learning_rate=0.3,
            solver="sgd",
        ).fit(df)
        np.testing.assert_allclose(model.coefficients, w, rtol=1e-9, err_msg=str(features))
        assert model.intercept == pytest.approx(b, rel=1e-9)


def test_accuracy_and_coefficients_close_to_mllib(spark, data):
    from pyspark.ml.classification import LogisticRegression as MLlibLR

    df, X, label, *_ = data
    ours = ml.LogisticRegression(max_iter=300, learning_rate=2.0, tol=0.0, solver="sgd").fit(df)
    ref = MLlibLR(featuresCol="features", labelCol="label", regParam=0.0, maxIter=100).fit(df)
    np.testing.assert_allclose(ours.coefficients, ref.coefficients.toArray(), atol=0.02)
    assert ours.intercept == pytest.approx(ref.intercept, abs=0.02)

    def accuracy(w, b):
        return float(np.mean(((X @ w + b) > 0) == (label == 1)))

    assert (
        abs(
            accuracy(ours.coefficients, ours.intercept)
            - accuracy(ref.coefficients.toArray(), ref.intercept)
        )
        <= 0.005
    )


def test_elastic_net_zeros_coefficients_exactly_and_matches_mllib(spark):
    from pyspark.ml.regression import LinearRegression as MLlibLinReg

    rng = np.random.default_rng(3)
    X = rng.standard_normal((600, 8))
    y = X[:, :3] @ np.array([2.0, -1.0, 0.5]) + 0.05 * rng.standard_normal(600)
    cols = [f"f{j}" for j in range(8)]
    rows = [(*map(float, X[i]), float(y[i])) for i in range(600)]
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), [*cols, "y"]).cache()
    lasso = ml.LinearRegression(
        features_col=cols,
        label_col="y",
        reg=0.2,
        elastic_net=1.0,
        max_iter=300,
        learning_rate=0.5,
        solver="sgd",
    ).fit(df)
    ridge = ml.LinearRegression(
        features_col=cols,
        label_col="y",
        reg=0.2,
        elastic_net=0.0,
        max_iter=50,
        learning_rate=0.5,
        solver="sgd",
    ).fit(df)
    assert (lasso.coefficients[3:] == 0.0).all() and (lasso.coefficients[:3] != 0).all()
    assert (ridge.coefficients != 0).all()
    from pyspark.ml.feature import VectorAssembler

    vec = VectorAssembler(inputCols=cols, outputCol="v").transform(df)
    ref = MLlibLinReg(
        featuresCol="v", labelCol="y", regParam=0.2, elasticNetParam=1.0, standardization=False
    ).fit(vec)
    np.testing.assert_allclose(lasso.coefficients, ref.coefficients.toArray(), atol=1e-3)
    df.unpersist()


# -- modes ---------------------------------------------------------------------------------


def test_mini_batch_sync_is_deterministic_and_async_ssp_converge(data):
    df, X, label, *_ = data
    kw = {"max_iter": 60, "learning_rate": 1.0, "global_batch_size": 64, "seed": 3, "solver": "sgd"}
    a = ml.LogisticRegression(**kw).fit(df)
    b = ml.LogisticRegression(**kw).fit(df)
    assert np.array_equal(a.coefficients, b.coefficients)
    assert a.result.epochs == 60
    full = ml.LogisticRegression(max_iter=150, learning_rate=2.0, solver="sgd").fit(df)
    for mode, staleness in (("async", None), ("ssp", 1)):
        m = ml.LogisticRegression(
            max_iter=150, learning_rate=1.0, mode=mode, staleness=staleness, solver="sgd"
        ).fit(df)
        assert m.result.mode == mode
        assert sum(m.result.feedback_counts.values()) >= 300  # every update was applied
        np.testing.assert_allclose(m.coefficients, full.coefficients, atol=0.1)
        assert m.loss_history[-1] < m.loss_history[0]


# -- transform, save, load ------------------------------------------------------------------


@pytest.mark.spark_lines  # the compatibility set every CI environment runs
def test_transform_keeps_the_schema_and_save_load_round_trips(spark, data, tmp_path):
    from pyspark.ml.linalg import VectorUDT

    df, X, label, *_ = data
    model = ml.LogisticRegression().fit(df)
    out = model.transform(df)
    assert out.columns == [*df.columns, "rawPrediction", "probability", "prediction"]
    for name in ("features", "sparse", "rawPrediction", "probability"):
        assert isinstance(out.schema[name].dataType, VectorUDT)
    rows = out.select("probability", "prediction", "rawPrediction").collect()
    p = np.array([r.probability[1] for r in rows])
    np.testing.assert_allclose(p, model.predict_numpy(X), rtol=1e-9)
    assert np.array_equal([r.prediction for r in rows], (p > 0.5).astype(float))
    # columns and arrays give the same predictions; a wide model goes through a pandas UDF
    by_cols = model.transform(df, features_col=FEATURES).select("prediction").collect()
    assert [r.prediction for r in by_cols] == [r.prediction for r in rows]

    path = str(tmp_path / "lr")
    model.save(path)
    with pytest.raises(hi.ModelExistsError, match="overwrite=True"):
        model.save(path)
    model.save(f"file://{path}", overwrite=True)
    loaded = ml.LogisticRegressionModel.load(path)
    assert isinstance(ml.Model.load(path), ml.LogisticRegressionModel)
    assert np.array_equal(loaded.coefficients, model.coefficients)
    assert loaded.intercept == model.intercept and loaded.result is None
    again = loaded.transform(df).select("prediction").collect()
    assert [r.prediction for r in again] == [r.prediction for r in rows]
    with pytest.raises(ValueError, match="not a KMeansModel"):
        ml.KMeansModel.load(path)
    with pytest.raises(hi.ModelNotFoundError, match="no saved model"):
        ml.Model.load(str(tmp_path / "nothing"))


def test_wide_models_transform_through_a_pandas_udf(data, monkeypatch):
    from hybrid_iter.ml import linear

    df, X, _, y, _ = data
    model = ml.LinearRegression(features_col="arr", label_col="y", solver="l-bfgs").fit(df)
    sql = [r.prediction for r in model.transform(df).select("prediction").collect()]
    monkeypatch.setattr(linear, "SQL_MAX_FEATURES", 2)
    udf = [r.prediction for r in model.transform(df).select("prediction").collect()]
    np.testing.assert_allclose(udf, sql, rtol=1e-12)
    np.testing.assert_allclose(sql, model.predict_numpy(X), rtol=1e-9)


# -- KMeans --------------------------------------------------------------------------------


def _cost(X, C):
    return float(((X[:, None, :] - C[None]) ** 2).sum(-1).min(1).sum())


def test_kmeans_is_deterministic_for_a_seed_and_costs_what_mllib_costs(spark, blobs, tmp_path):
    from pyspark.ml.clustering import KMeans as MLlibKMeans
    from pyspark.ml.feature import VectorAssembler

    df, X = blobs
    a = ml.KMeans(features_col=["a", "b", "c"], k=4, seed=7).fit(df)
    b = ml.KMeans(features_col=["a", "b", "c"], k=4, seed=7).fit(df)
    assert np.array_equal(a.cluster_centers, b.cluster_centers)
    r = ml.KMeans(features_col=["a", "b", "c"], k=4, seed=7, init_mode="random").fit(df)
    assert np.array_equal(
        r.cluster_centers,
        ml.KMeans(features_col=["a", "b", "c"], k=4, seed=7, init_mode="random")
        .fit(df)
        .cluster_centers,
    )
    vec = VectorAssembler(inputCols=["a", "b", "c"], outputCol="v").transform(df)
    ref = MLlibKMeans(featuresCol="v", k=4, seed=7).fit(vec)
    mllib_cost = _cost(X, np.array([c for c in ref.clusterCenters()]))
    assert _cost(X, a.cluster_centers) <= mllib_cost * 1.01
    assert a.training_cost == pytest.approx(_cost(X, a.cluster_centers), rel=0.01)
    assert a.cost_numpy(X) == pytest.approx(_cost(X, a.cluster_centers), rel=1e-9)
    # transform (SQL) agrees with numpy, keeps the input columns; save/load round trip
    out = a.transform(df)
    assert out.columns == [*df.columns, "prediction"]
    pred = [row.prediction for row in out.collect()]
    assert pred == a.predict_numpy(X).tolist()
    a.save(str(tmp_path / "km"))
    loaded = ml.KMeansModel.load(str(tmp_path / "km"))
    assert [row.prediction for row in loaded.transform(vec, features_col="v").collect()] == pred
    assert loaded.training_cost == a.training_cost and loaded.iterations == a.summary.iterations
    assert loaded.getK() == 4 and loaded.value("features_col") == ["a", "b", "c"]
    assert isinstance(ml.Model.load(str(tmp_path / "km")), ml.KMeansModel)


def test_kmeans_in_a_pipeline_and_pipeline_model_save_load(spark, blobs, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    df, X = blobs
    km = ml.KMeans(k=4, seed=3)
    pipe = Pipeline(stages=[VectorAssembler(inputCols=["a", "b", "c"], outputCol="features"), km])
    model = pipe.fit(df)
    fitted = model.stages[-1]
    assert isinstance(fitted, ml.KMeansModel) and fitted.uid == km.uid
    assert fitted.getK() == 4 and fitted.getSeed() == 3 and fitted.summary.k == 4
    assert (
        fitted.summary.trainingCost
        == fitted.training_cost
        == pytest.approx(_cost(X, fitted.cluster_centers), rel=0.01)
    )
    assert fitted.summary.numIter == fitted.iterations == len(fitted.result.outputs["cost"])
    assert np.array_equal(np.array(fitted.clusterCenters()), fitted.cluster_centers)
    out = model.transform(df)
    assert out.columns == [*df.columns, "features", "prediction"]
    pred = [r.prediction for r in out.select("prediction").collect()]
    assert pred == fitted.predict_numpy(X).tolist() and len(set(pred)) == 4

    path = str(tmp_path / "pipeline")
    model.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    stage = loaded.stages[-1]
    assert isinstance(stage, ml.KMeansModel) and stage.uid == fitted.uid
    assert np.array_equal(stage.cluster_centers, fitted.cluster_centers)
    assert (
        stage.getK() == 4
        and stage.getMaxIter() == 20
        and stage.training_cost == fitted.training_cost
    )
    assert not stage.has_summary and stage.result is None
    again = loaded.transform(df)
    assert again.columns == out.columns
    assert [r.prediction for r in again.select("prediction").collect()] == pred
    # one model in Spark's layout: KMeansModel.load and ml.Model.load read it too
    fitted.write().save(str(tmp_path / "spark_km"))
    for reader in (ml.KMeansModel, ml.Model):
        m = reader.load(str(tmp_path / "spark_km"))
        assert isinstance(m, ml.KMeansModel) and m.getSeed() == 3
        assert np.array_equal(m.cluster_centers, fitted.cluster_centers)
    with pytest.raises(ValueError, match="not a LogisticRegressionModel"):
        ml.LogisticRegressionModel.load(str(tmp_path / "spark_km"))
    # the unfitted pipeline round-trips too
    pipe.write().overwrite().save(str(tmp_path / "estimator"))
    est = Pipeline.load(str(tmp_path / "estimator")).getStages()[-1]
    assert isinstance(est, ml.KMeans) and est.getK() == 4 and est.getSeed() == 3


def test_kmeans_k_tuned_by_train_validation_split_as_mllib(spark, blobs):
    """ParamGridBuilder over k, TrainValidationSplit, ClusteringEvaluator (silhouette):
    on four separated blobs ours and MLlib's both pick k=4, with the same score."""
    from pyspark.ml.clustering import KMeans as MLlibKMeans
    from pyspark.ml.evaluation import ClusteringEvaluator
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    df, _ = blobs
    vec = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(df)

    def tune(est):
        grid = ParamGridBuilder().addGrid(est.k, [2, 4]).build()
        tvs = TrainValidationSplit(
            estimator=est,
            estimatorParamMaps=grid,
            evaluator=ClusteringEvaluator(),
            trainRatio=0.75,
            seed=5,
        )
        fit = tvs.fit(vec)
        return fit.bestModel, fit.validationMetrics

    ours, ours_metrics = tune(ml.KMeans(seed=1))
    ref, ref_metrics = tune(MLlibKMeans(seed=1))
    assert isinstance(ours, ml.KMeansModel)
    assert ours.getK() == ref.getK() == 4
    assert ours_metrics[1] > ours_metrics[0]
    assert ours_metrics[1] == pytest.approx(ref_metrics[1], rel=1e-6)


def test_kmeans_keywords_in_both_spellings_copy_and_param_maps(spark, blobs):
    df, X = blobs
    cols = ["a", "b", "c"]
    a = ml.KMeans(features_col=cols, max_iter=5, k=3, init_mode="random", seed=2)
    b = ml.KMeans(featuresCol=cols, maxIter=5, k=3, initMode="random", seed=2)
    assert a.max_iter == b.getMaxIter() == 5 and a.getK() == b.getOrDefault("k") == 3
    assert a.init_mode == b.getInitMode() == "random"
    ma, mb = a.fit(df), b.fit(df)
    assert np.array_equal(ma.cluster_centers, mb.cluster_centers)
    assert ma.training_cost == mb.training_cost and ma.value("max_iter") == mb.getMaxIter() == 5
    assert ma.summary.iterations <= 5
    with pytest.raises(hi.IterationConfigError, match="unknown parameter 'max_iters'"):
        ml.KMeans(max_iters=3)
    with pytest.raises(hi.IterationConfigError, match=r"KMeans\(init_mode=\.\.\.\)"):
        a.setInitMode("kmeans++")
    c = a.copy({a.k: 4})
    assert c.getK() == 4 and a.getK() == 3 and c.uid == a.uid
    # a param map skips the setters: fit checks the values again before any Spark job
    with no_spark_job(spark), pytest.raises(hi.IterationConfigError, match=r"KMeans\(k=\.\.\.\)"):
        a.fit(df, {a.k: 1})
    m4 = a.fit(df, {a.k: 4})
    assert m4.getK() == 4 and m4.cluster_centers.shape == (4, 3) and a.getK() == 3
    assert m4.transform(df, {m4.predictionCol: "cluster"}).columns == [*df.columns, "cluster"]


def test_kmeans_model_saved_before_it_was_a_stage_still_loads(tmp_path):
    """The older KMeansModel.save kept training_cost and iterations among its params."""
    from hybrid_iter.ml._persist import write_model

    old = {
        "features_col": ["a", "b"],
        "prediction_col": "p",
        "k": 2,
        "max_iter": 20,
        "tol": 1e-4,
        "init_mode": "random",
        "init_steps": 2,
        "distance_measure": "euclidean",
        "seed": 3,
        "num_features": 2,
        "training_cost": 1.5,
        "iterations": 4,
    }
    C = np.array([[0.0, 0.0], [1.0, 1.0]])
    write_model(str(tmp_path / "old"), "KMeansModel", old, {"centres": C})
    for reader in (ml.Model, ml.KMeansModel):
        m = reader.load(str(tmp_path / "old"))
        assert isinstance(m, ml.KMeansModel) and np.array_equal(m.cluster_centers, C)
        assert m.training_cost == 1.5 and m.iterations == 4 and not m.has_summary
        assert m.getInitMode() == "random" and m.value("prediction_col") == "p"
        assert m.predict_numpy(np.array([[0.9, 0.8], [0.1, 0.0]])).tolist() == [1, 0]


def test_saving_over_a_model_or_loading_none_are_project_errors_naming_path_and_fix(
    spark, tmp_path
):
    from hybrid_iter.ml._persist import write_model

    params = {"features_col": ["a", "b"], "k": 2, "seed": 3, "num_features": 2}
    first, second = np.array([[0.0, 0.0], [1.0, 1.0]]), np.array([[5.0, 5.0], [6.0, 6.0]])
    write_model(str(tmp_path / "a"), "KMeansModel", params, {"centres": first})
    write_model(str(tmp_path / "b"), "KMeansModel", params, {"centres": second})
    old, new = ml.KMeansModel.load(str(tmp_path / "a")), ml.KMeansModel.load(str(tmp_path / "b"))
    ours, sparks = str(tmp_path / "ours"), str(tmp_path / "spark")
    old.save(ours)  # our format
    old.write().save(sparks)  # Spark's (what a PipelineModel writes)
    refused = [
        (lambda: new.save(ours), ours, r"model\.save\(.*overwrite=True\)"),
        (lambda: new.write().save(sparks), sparks, r"model\.write\(\)\.overwrite\(\)\.save"),
        # across formats too: else Model.load would read the older model of the two
        (lambda: new.write().save(ours), ours, r"model\.write\(\)\.overwrite\(\)\.save"),
        (lambda: new.save(sparks), sparks, r"model\.save\(.*overwrite=True\)"),
    ]
    for save, path, fix in refused:
        with pytest.raises(hi.ModelExistsError, match=fix) as info:
            save()
        assert isinstance(info.value, FileExistsError) and isinstance(
            info.value, hi.HybridIterError
        )
        assert repr(path) in str(info.value)
    for path in (ours, sparks):  # nothing was written over
        np.testing.assert_array_equal(ml.Model.load(path).cluster_centers, first)
    new.save(sparks, overwrite=True)
    new.write().overwrite().save(ours)
    for path in (ours, sparks):
        np.testing.assert_array_equal(ml.Model.load(path).cluster_centers, second)

    (tmp_path / "empty").mkdir()
    for load, path in [
        (lambda: ml.Model.load(str(tmp_path / "empty")), str(tmp_path / "empty")),
        (lambda: ml.KMeansModel.load(str(tmp_path / "none")), str(tmp_path / "none")),
        (lambda: ml.KMeansModel.read().load(str(tmp_path / "none")), str(tmp_path / "none")),
    ]:
        with pytest.raises(hi.ModelNotFoundError, match="holds no") as info:
            load()
        assert isinstance(info.value, FileNotFoundError) and repr(path) in str(info.value)


def test_kmeans_init_gives_every_separated_cluster_a_centre():
    """The k-means|| candidates reduced to k centres (in the actor, pure numpy): plain
    weighted k-means++ spends a pick on a covered cluster in 8 of these 20 seeds; the
    greedy variant must cover all ten for every seed."""
    from hybrid_iter.ml._kmeans import _local_kmeans, nearest_centres

    rng = np.random.default_rng(3)
    k, d = 10, 20
    means = rng.uniform(-10, 10, (k, d))
    per = rng.integers(2, 8, k)  # uneven candidate counts per cluster
    points = np.concatenate([means[b] + rng.normal(size=(per[b], d)) for b in range(k)])
    weights = np.concatenate([np.full(per[b], 20000.0 / per[b]) for b in range(k)])
    for seed in range(20):
        C = _local_kmeans(points, weights, k, np.random.default_rng(seed), False)
        nearest, _ = nearest_centres(C, np.einsum("ij,ij->i", C, C), means)
        assert sorted(nearest.tolist()) == list(range(k)), seed


def test_kmeans_empty_clusters_keep_their_centre_without_nan(spark):
    points = [(0.0, 0.0), (5.0, 5.0), (-5.0, 5.0)] * 40  # 3 distinct points, k = 5
    df = spark.createDataFrame(spark.sparkContext.parallelize(points, 2), ["a", "b"])
    for init in ("random", "k-means||"):
        model = ml.KMeans(features_col=["a", "b"], k=5, seed=1, init_mode=init).fit(df)
        C = model.cluster_centers
        assert np.isfinite(C).all(), init
        assert max(model.result.outputs["empty_clusters"]) >= 2
        assert model.training_cost == pytest.approx(0.0, abs=1e-9)
        pred = {row.prediction for row in model.transform(df).collect()}
        assert len(pred) == 3 and pred <= set(range(5))


def test_kmeans_cosine_normalises_and_refuses_zero_vectors(spark):
    rng = np.random.default_rng(2)
    dirs = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    X = dirs[rng.integers(0, 3, 300)] * rng.uniform(1, 10, (300, 1)) + 0.05 * rng.standard_normal(
        (300, 2)
    )
    df = spark.createDataFrame(
        spark.sparkContext.parallelize([tuple(map(float, r)) for r in X], 2), ["a", "b"]
    )
    model = ml.KMeans(features_col=["a", "b"], k=3, seed=4, distance_measure="cosine").fit(df)
    np.testing.assert_allclose(np.linalg.norm(model.cluster_centers, axis=1), 1.0)
    pred = [row.prediction for row in model.transform(df).collect()]
    assert pred == model.predict_numpy(X).tolist() and len(set(pred)) == 3
    zero = df.union(spark.createDataFrame([(0.0, 0.0)], ["a", "b"]))
    with pytest.raises(hi.DataValidationError, match="zero-length"):
        ml.KMeans(features_col=["a", "b"], k=3, distance_measure="cosine").fit(zero)


# -- bad parameters and bad data --------------------------------------------------------------


BAD_LINEAR = [
    ({"max_iter": 0}, "max_iter"),
    ({"max_iter": 2.5}, "max_iter"),
    ({"learning_rate": 0}, "learning_rate"),
    ({"learning_rate": "fast"}, "learning_rate"),
    ({"reg": -0.1}, "reg"),
    ({"elastic_net": 1.5}, "elastic_net"),
    ({"global_batch_size": 0}, "global_batch_size"),
    ({"tol": math.nan}, "tol"),
    ({"mode": "fast"}, "mode"),
    ({"mode": "sync", "staleness": 2}, "staleness"),
    ({"mode": "ssp"}, "staleness"),
    ({"mode": "ssp", "staleness": 0}, "staleness"),
    ({"fit_intercept": "yes"}, "fit_intercept"),
    ({"features_col": ""}, "features_col"),
    ({"features_col": []}, "features_col"),
    ({"features_col": ["x0", 1]}, "features_col"),
    ({"label_col": ""}, "label_col"),
    ({"weight_col": 3}, "weight_col"),
    ({"seed": -1}, "seed"),
    ({"parallelism": 0}, "parallelism"),
    ({"progress": "y"}, "progress"),
]


@pytest.mark.parametrize("kwargs, word", BAD_LINEAR)
def test_bad_linear_parameters_are_refused_on_creation(kwargs, word):
    for klass in (ml.LogisticRegression, ml.LinearRegression):
        with pytest.raises(hi.IterationConfigError, match=f"{klass.__name__}\\({word}="):
            klass(**kwargs)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"threshold": 2.0}, "threshold"),
        ({"probability_col": ""}, "probability_col"),
        ({"raw_prediction_col": 5}, "raw_prediction_col"),
    ],
)
def test_bad_classification_parameters(kwargs, word):
    with pytest.raises(hi.IterationConfigError, match=word):
        ml.LogisticRegression(**kwargs)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"k": 1}, "k"),
        ({"max_iter": 0}, "max_iter"),
        ({"tol": -1.0}, "tol"),
        ({"init_mode": "kmeans++"}, "init_mode"),
        ({"init_steps": 0}, "init_steps"),
        ({"distance_measure": "manhattan"}, "distance_measure"),
        ({"features_col": None}, "features_col"),
        ({"prediction_col": ""}, "prediction_col"),
    ],
)
def test_bad_kmeans_parameters(kwargs, word):
    with pytest.raises(hi.IterationConfigError, match=f"KMeans\\({word}="):
        ml.KMeans(**kwargs)


def test_bad_inputs_fail_before_any_spark_job(spark, data):
    df, *_ = data
    cases = [
        (ml.LogisticRegression(), [1, 2], "needs a pyspark.sql.DataFrame"),
        (ml.LogisticRegression(features_col="nope"), df, "column 'nope' is not in the DataFrame"),
        (ml.LogisticRegression(features_col=["x0", "zz"]), df, "'zz' is not in"),
        (ml.LogisticRegression(label_col="nope"), df, "label_col='nope' is not in"),
        (ml.LinearRegression(weight_col="nope"), df, "weight_col='nope'"),
        (ml.LogisticRegression(features_col=["x0", "features"]), df, "give one vector"),
        (ml.LogisticRegression(features_col="name"), df, "not numeric"),
        (ml.LogisticRegression(label_col="name"), df, "cast it"),
        (ml.LogisticRegression(features_col=["x0"], label_col="x0"), df, "also a feature"),
        (ml.LogisticRegression(probability_col="prediction"), df, "must differ"),
        (ml.KMeans(features_col="nope"), df, "'nope' is not in"),
    ]
    from pyspark.sql import functions as F

    named = df.withColumn("name", F.lit("a"))
    for est, frame, message in cases:
        frame = named if frame is df else frame
        with no_spark_job(spark), pytest.raises(hi.IterationConfigError, match=message):
            est.fit(frame)
    stream = spark.readStream.format("rate").load()
    with pytest.raises(hi.IterationConfigError, match="streaming"):
        ml.KMeans(features_col=["value"]).fit(stream)


def test_bad_data_is_reported_clearly(spark, data):
    df, *_ = data
    from pyspark.sql import functions as F

    with pytest.raises(hi.DataValidationError, match="needs class indices"):
        ml.LogisticRegression(features_col=FEATURES, label_col="y", max_iter=2).fit(df)
    nulls = df.withColumn("label", F.when(F.col("x0") > 1, None).otherwise(F.col("label")))
    with pytest.raises(hi.DataValidationError, match=r"'label' has .* null"):
        ml.LogisticRegression(features_col=FEATURES, max_iter=2).fit(nulls)
    with pytest.raises(hi.IterationFailedError, match="lower learning_rate") as info:
        ml.LinearRegression(
            features_col=FEATURES, label_col="y", learning_rate=50.0, max_iter=200, solver="sgd"
        ).fit(df)
    assert isinstance(info.value.failures["coordinator"].cause, FloatingPointError)


def test_kmeans_with_more_centres_than_rows_says_so(spark):
    df = spark.range(30, numPartitions=2).selectExpr("cast(id as double) as a", "rand(1) as b")
    for init in ("random", "k-means||"):
        with pytest.raises(hi.DataValidationError, match="k=50 but the data has only 30 rows"):
            ml.KMeans(features_col=["a", "b"], k=50, init_mode=init).fit(df)
