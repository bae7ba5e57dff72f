"""``hybrid_iter.ml``: ready algorithms as estimators on Spark DataFrames, and
``pyspark.ml`` stages.

    from hybrid_iter.ml import KMeans, LogisticRegression

    model = LogisticRegression(features_col="features").fit(df)   # defaults reach the optimum
    model.transform(df)            # + rawPrediction, probability, prediction (Spark SQL)
    model.summary                  # objective history, iterations, solver, converged
    model.save("s3://bucket/lr")   # pyarrow.fs; LogisticRegressionModel.load(path)
    Pipeline(stages=[VectorAssembler(...), LogisticRegression()])   # a pyspark.ml stage
    KMeans(k=4, seed=1).fit(df).cluster_centers   # also a stage: Pipeline, ParamGridBuilder

Each ``fit`` is one iteration (one Spark barrier stage; each task reads its partition
once into numpy; the Ray coordinator actor holds the model and, for the default
solvers, the L-BFGS / OWL-QN optimizer or the normal equations). Every estimator and
model (``LogisticRegression``, ``LinearRegression``, ``KMeans`` and their models) is a
``pyspark.ml`` stage: ``Pipeline``, ``CrossValidator`` / ``TrainValidationSplit`` with
``ParamGridBuilder``, ``copy(extra)``, ``fit(df, paramMap)``, ``PipelineModel.save`` /
``load``. Parameters take a Python keyword, Spark MLlib's name in snake case
(``features_col``, ``label_col``, ``max_iter``, ``tol``, ``reg``, ``elastic_net``,
``standardization``, ``family``, ``solver``, ``k``, ``init_mode``, ``seed``, ...), or
MLlib's own name (``featuresCol``, ``maxIter``, ``regParam``, ``initMode``, ...).
Features come from a ``pyspark.ml.linalg`` vector column (dense or sparse), an array
column, or a list of numeric columns. Bad parameters raise ``IterationConfigError``
before any Spark job; bad data ``DataValidationError`` naming the column.
"""

from typing import Any


def clear_array_cache() -> None:
    """Drop every array the array cache keeps for later fits of cached DataFrames
    (``docs/ml.md``, "The array cache"): the next fit of each reads it from Spark again.
    Unpersisting a DataFrame drops its arrays at the next fit anyway; this frees the
    memory now."""
    from .._runtime.array_store import clear

    clear()


#: imported on first use: the stages (``linear``, ``kmeans``) load ``pyspark.ml``, which
#: the Spark tasks and the Ray coordinator actor (which import the operators,
#: ``hybrid_iter.ml._glm`` / ``_sgd`` / ``_kmeans``, to run a fit) never need
_LAZY = {
    "ConvergenceWarning": "linear",
    "KMeans": "kmeans",
    "KMeansModel": "kmeans",
    "KMeansSummary": "kmeans",
    "LinearRegression": "linear",
    "LinearRegressionModel": "linear",
    "LogisticRegression": "linear",
    "LogisticRegressionModel": "linear",
    "TrainingSummary": "linear",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name == "Model":
        # the base of every model: ``Model.load(path)`` reads any of them by its class
        # name, so every model module is imported (and its classes registered) first
        for module in sorted(set(_LAZY.values())):
            importlib.import_module(f".{module}", __name__)
        return importlib.import_module("._stages", __name__).StageModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConvergenceWarning",
    "KMeans",
    "KMeansModel",
    "KMeansSummary",
    "LinearRegression",
    "LinearRegressionModel",
    "LogisticRegression",
    "LogisticRegressionModel",
    "Model",
    "TrainingSummary",
    "clear_array_cache",
]
