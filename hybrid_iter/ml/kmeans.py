"""KMeans clustering: the estimator and the model, ``pyspark.ml`` stages. Runs on the
driver: ``fit`` starts one iteration whose operators (``_kmeans``: the algorithm, its
initialisation and seeding are described there) run in the Spark tasks and the Ray
coordinator actor; ``transform`` is a Spark SQL expression.

Parameters by Python keyword or by MLlib's name: ``features_col`` / ``featuresCol``,
``prediction_col`` / ``predictionCol``, ``k``, ``max_iter`` / ``maxIter``, ``tol``,
``init_mode`` / ``initMode`` (``"k-means||"`` or ``"random"``), ``init_steps`` /
``initSteps``, ``distance_measure`` / ``distanceMeasure`` (``"euclidean"`` or
``"cosine"``), ``seed``; and ours, ``parallelism`` and ``progress``. So ``KMeans`` goes
in a ``Pipeline`` after a ``VectorAssembler``, ``ParamGridBuilder().addGrid(km.k, ...)``
with ``CrossValidator`` / ``TrainValidationSplit`` and ``ClusteringEvaluator`` tunes it,
and ``PipelineModel.save`` / ``load`` round-trip the fitted ``KMeansModel``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator import RuntimeHooks

from .._body import IterationBody
from .._errors import IterationConfigError
from ._base import check_column, check_dataframe, check_features_col, run_with_array_cache
from ._features import COLUMNS, FeaturePlan, resolve_features
from ._kmeans import PICK, _KMeansServer, _KMeansTask, _normalise_rows, nearest_centres
from ._stages import (
    ParamSpec,
    StageEstimator,
    StageModel,
    features_check,
    int_check,
    number_check,
    progress_check,
)

__all__ = ["KMeans", "KMeansModel", "KMeansSummary", "nearest_centres"]

_INIT_MODES = ("k-means||", "random")
_MEASURES = ("euclidean", "cosine")
#: above this many ``k * d`` literals ``transform`` uses a pandas UDF instead of SQL
SQL_MAX_LITERALS = 20000


def _c_init_mode(owner: str, name: str, value: Any) -> None:
    if value not in _INIT_MODES:
        raise IterationConfigError(
            f"{owner}({name}=...) must be 'k-means||' or 'random', got {value!r}"
        )


def _c_measure(owner: str, name: str, value: Any) -> None:
    if value not in _MEASURES:
        raise IterationConfigError(
            f"{owner}({name}=...) must be 'euclidean' or 'cosine', got {value!r}"
        )


_SPECS = (
    ParamSpec("features_col", "featuresCol", "features", "features: a vector column, an array column or a list of numeric columns", features_check),
    ParamSpec("prediction_col", "predictionCol", "prediction", "prediction column name (the nearest centre's index)", check_column),
    ParamSpec("k", "k", 2, "number of clusters (>= 2)", int_check(2)),
    ParamSpec("max_iter", "maxIter", 20, "maximum number of Lloyd iterations", int_check(1)),
    ParamSpec("tol", "tol", 1e-4, "stop once no centre moved more than tol (>= 0)", number_check(low=0.0)),
    ParamSpec("init_mode", "initMode", "k-means||", "initialisation: 'k-means||' or 'random'", _c_init_mode),
    ParamSpec("init_steps", "initSteps", 2, "k-means|| rounds (>= 1)", int_check(1)),
    ParamSpec("distance_measure", "distanceMeasure", "euclidean", "'euclidean' or 'cosine'", _c_measure),
    ParamSpec("seed", "seed", 0, "random seed (>= 0)", int_check(0)),
    ParamSpec("parallelism", "parallelism", None, "subtasks (None: the data's partitions)", int_check(1, optional=True)),
    ParamSpec("progress", "progress", None, "progress line (None: on a terminal)", progress_check),
)  # fmt: skip


@dataclass
class KMeansSummary:
    """What a fit did: the cost after every Lloyd iteration (``cost_history``; the sum of
    squared distances, or of ``1 - cos``), ``training_cost`` (the last), ``iterations``
    (Lloyd's), ``converged`` (no centre moved more than ``tol`` in the last one),
    ``empty_clusters`` (in the last one), wall ``seconds``, ``epochs`` (passes over the
    data, the initialisation's included), ``data_source`` (``"spark"``, or ``"array
    cache"``: arrays an earlier fit of the same cached DataFrame kept). MLlib's names ``trainingCost``, ``numIter``
    and ``k`` work too."""

    k: int
    training_cost: float
    iterations: int
    cost_history: list[float]
    converged: bool
    empty_clusters: int
    seconds: float
    epochs: int
    data_source: str = "spark"

    @property
    def trainingCost(self) -> float:
        return self.training_cost

    @property
    def numIter(self) -> int:
        return self.iterations


class KMeans(StageEstimator):
    """KMeans clustering, a ``pyspark.ml`` estimator; ``fit(df)`` returns a ``KMeansModel``.

    ``k`` centres, ``init_mode`` ``"k-means||"`` (``init_steps`` rounds) or
    ``"random"``, ``max_iter`` Lloyd iterations at most, stopping earlier when no centre
    moved more than ``tol``; ``distance_measure`` ``"euclidean"`` or ``"cosine"``;
    deterministic for a ``seed`` (same data, same partitions). Keywords in either
    spelling (``max_iter=`` or ``maxIter=``); ``fit(df, paramMap)`` and ``copy(extra)``
    as for any ``pyspark.ml`` estimator.
    """

    _SPECS = _SPECS

    def _fit(self, dataset: Any, *, hooks: RuntimeHooks | None = None) -> KMeansModel:
        """Cluster ``dataset`` (one iteration; the data is read once into the subtasks).
        ``hooks``: test hooks (``hybrid_iter.testing.Straggler``) in every subtask."""
        owner = type(self).__name__
        self.check_params()  # a param map given to fit(df, params) skipped the setters
        check_dataframe(owner, dataset)
        v = self.value
        plan = resolve_features(dataset, check_features_col(owner, v("features_col")))
        k, init_steps, seed = int(v("k")), int(v("init_steps")), int(v("seed"))
        max_iter, tol = int(v("max_iter")), float(v("tol"))
        random_init = v("init_mode") == "random"
        cosine = v("distance_measure") == "cosine"
        # room for the k-means|| candidates: 1 + about 2k per step, with a margin
        cap = 1 if random_init else 1 + init_steps * 4 * k
        init = {
            "centres": np.zeros((k, plan.dim)),
            "cand": np.zeros((cap, plan.dim)),
            "state": np.array([PICK, 0, 0], dtype=np.int64),
            "cost": 0.0,
        }
        server = _KMeansServer(
            k=k,
            random_init=random_init,
            init_steps=init_steps,
            max_iter=max_iter,
            tol=tol,
            seed=seed,
            cosine=cosine,
        )

        def build(run_plan: FeaturePlan) -> tuple[dict[str, Any], IterationBody]:
            task = _KMeansTask(run_plan, k, random_init, seed, cosine, hooks)
            return init, IterationBody(partition=task, coordinator=server, criteria=True)

        t = time.perf_counter()
        result, source = run_with_array_cache(
            owner,
            dataset,
            plan,
            build,
            staleness=0,
            parallelism=v("parallelism"),
            progress=v("progress"),
            name=owner,
            progress_tag="cost",
            hooks=hooks,
        )
        costs = [float(c) for c in result.outputs.get("cost", [])]
        shifts = result.outputs.get("shift", [])
        empty = result.outputs.get("empty_clusters", [])
        summary = KMeansSummary(
            k=k,
            training_cost=costs[-1],
            iterations=len(costs),
            cost_history=costs,
            converged=bool(shifts) and float(shifts[-1]) <= tol,
            empty_clusters=int(empty[-1]) if empty else 0,
            seconds=time.perf_counter() - t,
            epochs=result.epochs,
            data_source=source,
        )
        arrays = {
            "centres": np.array(result.variables["centres"], dtype=np.float64),
            "training_cost": np.array(summary.training_cost),
            "iterations": np.array(float(summary.iterations)),
        }
        model: KMeansModel = self._model(KMeansModel, arrays, result, summary)
        return model


class KMeansModel(StageModel):
    """The centres of a KMeans clustering, a ``pyspark.ml`` model.

    ``transform(df)`` adds ``prediction_col``, the index of each row's nearest centre
    (an int; null for a zero vector under the cosine measure), as a Spark SQL expression
    that keeps every input column. ``cluster_centers`` (``k x d``; MLlib's
    ``clusterCenters()`` gives the list of rows), ``training_cost`` and ``iterations``
    (kept by ``save`` / ``load``), ``summary`` and ``result`` (the training's; a loaded
    model has none). ``save(path)`` writes our format, ``write().save(path)`` Spark's
    (what a ``PipelineModel`` does); ``KMeansModel.load`` and ``ml.Model.load`` read both.
    """

    _SPECS = _SPECS

    @classmethod
    def _from_saved(cls, params: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any:
        arrays = dict(arrays)
        # a model saved before KMeansModel was a stage kept these among its parameters
        for name in ("training_cost", "iterations"):
            if name not in arrays and params.get(name) is not None:
                arrays[name] = np.array(float(params[name]))
        return super()._from_saved(params, arrays)

    @property
    def cluster_centers(self) -> np.ndarray:
        return self._arrays["centres"]

    def clusterCenters(self) -> list[np.ndarray]:
        """MLlib's: the centres as a list of numpy arrays."""
        return [np.array(c) for c in self.cluster_centers]

    @property
    def num_features(self) -> int:
        return int(self.cluster_centers.shape[1])

    numFeatures = num_features

    @property
    def training_cost(self) -> float | None:
        """The cost of the last Lloyd iteration (sum of squared distances, or of 1 - cos)."""
        cost = self._arrays.get("training_cost")
        return None if cost is None else float(cost)

    @property
    def iterations(self) -> int | None:
        """The number of Lloyd iterations of the training."""
        n = self._arrays.get("iterations")
        return None if n is None else int(n)

    def _cosine(self) -> bool:
        return bool(self.value("distance_measure") == "cosine")

    def predict_numpy(self, X: np.ndarray) -> np.ndarray:
        """Nearest centre of each row of ``X`` (on the driver)."""
        X = np.asarray(X, dtype=np.float64)
        if self._cosine():
            X = _normalise_rows(X)
        return nearest_centres(X, np.einsum("ij,ij->i", X, X), self.cluster_centers)[0]

    def cost_numpy(self, X: np.ndarray) -> float:
        """The clustering cost of the rows of ``X`` at these centres."""
        X = np.asarray(X, dtype=np.float64)
        if self._cosine():
            X = _normalise_rows(X)
            return float(
                nearest_centres(X, np.einsum("ij,ij->i", X, X), self.cluster_centers)[1].sum() / 2
            )
        return float(nearest_centres(X, np.einsum("ij,ij->i", X, X), self.cluster_centers)[1].sum())

    def __repr__(self) -> str:
        k, d = self.cluster_centers.shape
        return f"KMeansModel(k={k}, features={d}, training_cost={self.training_cost!r})"

    def _transform(self, df: Any, features_col: Any = None) -> Any:
        from pyspark.sql import functions as F

        from .linear import _feature_array, _literal_array

        fc = self._features(features_col)
        C = self.cluster_centers
        k, d = C.shape
        cosine = self._cosine()
        kind, col = _feature_array(df, fc, d, "KMeansModel")
        if kind != COLUMNS and k * d > SQL_MAX_LITERALS:
            return df.withColumn(self.value("prediction_col"), _predict_udf(C, cosine)(col))

        def dot(c: np.ndarray) -> Any:
            if kind == COLUMNS:
                terms = [x.cast("double") * F.lit(float(v)) for x, v in zip(col, c)]
                return sum(terms[1:], terms[0])
            products = F.zip_with(col, _literal_array(c), lambda x, y: x * y)
            return F.aggregate(products, F.lit(0.0), lambda acc, v: acc + v)

        if cosine:
            # nearest by cosine = largest x . c for unit centres
            scores = [-dot(c) for c in C]
        else:
            # |x - c|^2 = |x|^2 - 2 x . c + |c|^2; |x|^2 is the same for every centre
            scores = [F.lit(float(c @ c)) - 2.0 * dot(c) for c in C]
        # the smallest (score, index) pair: ties go to the lowest index, as in numpy
        pairs = F.array(
            *[F.struct(sc.alias("s"), F.lit(j).alias("i")) for j, sc in enumerate(scores)]
        )
        pred = F.array_min(pairs).getField("i")
        if cosine:
            if kind == COLUMNS:
                sq = sum(
                    (x.cast("double") * x.cast("double") for x in col[1:]),
                    col[0].cast("double") ** 2,
                )
            else:
                sq = F.aggregate(col, F.lit(0.0), lambda acc, v: acc + v * v)
            pred = F.when(sq > 0, pred)
        return df.withColumn(self.value("prediction_col"), pred)


def _predict_udf(C: np.ndarray, cosine: bool) -> Any:
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    centres = np.array(C, dtype=np.float64)
    d = centres.shape[1]

    def predict(arrays: Any) -> Any:  # pd.Series -> pd.Series (set below)
        if not len(arrays):
            return pd.Series(np.zeros(0, dtype=np.int32))
        X = np.stack(arrays.to_numpy()).reshape(len(arrays), d)
        norms = np.linalg.norm(X, axis=1)
        if cosine:
            X = _normalise_rows(X)
        idx, _ = nearest_centres(X, np.einsum("ij,ij->i", X, X), centres)
        s = pd.Series(idx.astype(np.int32))
        if cosine:
            s = s.where(norms > 0)  # becomes nulls, as in the SQL path
            return s.astype("Int32")
        return s

    # explicit hints: this module's postponed annotations are strings pandas_udf cannot read
    predict.__annotations__ = {"arrays": pd.Series, "return": pd.Series}
    return pandas_udf(predict, "int")  # type: ignore[call-overload]
