"""``hybrid_iter.ml``: ready algorithms as estimators on Spark DataFrames, and
``pyspark.ml`` stages.

    from hybrid_iter.ml import KMeans, LogisticRegression

    model = LogisticRegression(features_col="features").fit(df)   # defaults reach the optimum
    model.transform(df)            # + rawPrediction, probability, prediction (Spark SQL)
    model.summary                  # objective history, iterations, solver, converged
    model.save("s3://bucket/lr")   # pyarrow.fs; LogisticRegressionModel.load(path)
    Pipeline(stages=[VectorAssembler(...), LogisticRegression()])   # a pyspark.ml stage

Each ``fit`` is one iteration (one Spark barrier stage; each task reads its partition
once into numpy; the Ray coordinator actor holds the model and, for the default
solvers, the L-BFGS / OWL-QN optimizer or the normal equations). Parameter names follow
Spark MLlib in snake case (``features_col``, ``label_col``, ``max_iter``, ``tol``,
``reg``, ``elastic_net``, ``standardization``, ``family``, ``solver``, ``k``, ``seed``,
...); the linear models also take MLlib's own names (``maxIter``, ``regParam``, ...).
Features come from a ``pyspark.ml.linalg`` vector column (dense or sparse), an array
column, or a list of numeric columns. Bad parameters raise ``IterationConfigError``
before any Spark job; bad data ``DataValidationError`` naming the column.
"""

from typing import Any

from ._base import Model
from .kmeans import KMeans, KMeansModel

#: imported on first use: ``linear`` loads ``pyspark.ml``, which the Spark tasks and the
#: Ray coordinator actor (which import ``hybrid_iter.ml._glm`` to run a fit) never need
_LINEAR = (
    "ConvergenceWarning",
    "LinearRegression",
    "LinearRegressionModel",
    "LogisticRegression",
    "LogisticRegressionModel",
    "TrainingSummary",
)


def __getattr__(name: str) -> Any:
    if name in _LINEAR:
        from . import linear

        return getattr(linear, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConvergenceWarning",
    "KMeans",
    "KMeansModel",
    "LinearRegression",
    "LinearRegressionModel",
    "LogisticRegression",
    "LogisticRegressionModel",
    "Model",
    "TrainingSummary",
]
