"""``hybrid_iter.ml``: ready algorithms as estimators on Spark DataFrames.

    from hybrid_iter.ml import KMeans, LogisticRegression

    model = LogisticRegression(features_col="features", max_iter=50, learning_rate=1.0).fit(df)
    model.transform(df)            # + raw_prediction, probability, prediction (Spark SQL)
    model.save("s3://bucket/lr")   # pyarrow.fs; LogisticRegressionModel.load(path)
    model.result.plot("loss.png")  # loss per epoch and per second

Each ``fit`` is one iteration (one Spark barrier stage; each task reads its partition
once into numpy; the Ray coordinator actor holds the model). Parameter names follow
Spark MLlib and Flink ML in snake case (``features_col``, ``label_col``, ``max_iter``,
``tol``, ``learning_rate``, ``global_batch_size``, ``reg``, ``elastic_net``, ``k``,
``seed``, ...). Features come from a ``pyspark.ml.linalg`` vector column (dense or
sparse), an array column, or a list of numeric columns. Bad parameters raise
``IterationConfigError`` before any Spark job.
"""

from ._base import Model
from .kmeans import KMeans, KMeansModel
from .linear import (
    LinearRegression,
    LinearRegressionModel,
    LogisticRegression,
    LogisticRegressionModel,
)

__all__ = [
    "KMeans",
    "KMeansModel",
    "LinearRegression",
    "LinearRegressionModel",
    "LogisticRegression",
    "LogisticRegressionModel",
    "Model",
]
