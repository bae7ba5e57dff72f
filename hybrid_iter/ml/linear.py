"""Logistic and linear regression trained by (mini-batch) gradient descent on Spark + Ray.

Runs where the core runs them: the estimators (``fit``) and models (``transform``,
``save``) on the driver; ``_LinearTask`` in each Spark task of the iteration's barrier
stage (it reads its partition once into a numpy matrix and sends one packed gradient
per epoch); ``_LinearServer`` in the Ray coordinator actor (it holds the weights and
applies the gradients: in partition order at each epoch's alignment in sync mode, on
arrival in async and SSP modes).

The objective is MLlib's: the mean loss over the rows (log loss, or half the squared
error) plus ``reg * (elastic_net * ||w||_1 + (1 - elastic_net) / 2 * ||w||_2^2)``, the
intercept not regularised. A step is ``w -= learning_rate * (gradient + L2 term)``
followed by the L1 proximal step (soft thresholding), which makes coefficients exactly
zero under elastic-net regularisation.

``tol`` is Flink ML's: training stops once the loss is <= ``tol`` (or after
``max_iter`` epochs). ``global_batch_size=None`` is full-batch gradient descent (one
pass per epoch); a number is the mini-batch of each epoch, split evenly over the
subtasks, each taking its rows cyclically in a seeded random order (Flink ML's
``globalBatchSize``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._body import IterationBody
from .._errors import DataValidationError, IterationConfigError
from .._operators import CoordinatorOperator, PartitionOperator
from ._base import (
    Model,
    check_bool,
    check_column,
    check_dataframe,
    check_features_col,
    check_int,
    check_mode,
    check_number,
    check_optional_column,
    check_progress,
    run_iteration,
)
from ._features import ARRAY, COLUMNS, VECTOR, FeatureCache, FeaturePlan, resolve_features

__all__ = [
    "LinearRegression",
    "LinearRegressionModel",
    "LogisticRegression",
    "LogisticRegressionModel",
    "linear_gradient",
    "logistic_terms",
]

#: Above this many features ``transform`` computes the margin in a vectorised pandas UDF
#: instead of one Spark SQL expression with a literal per coefficient.
SQL_MAX_FEATURES = 1024


def logistic_terms(z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(p - y, log loss per row)`` for margins ``z``, computed stably (one exp, one log)."""
    e = np.exp(-np.abs(z))
    inv = 1.0 / (1.0 + e)
    p = np.where(z >= 0, inv, e * inv)
    loss = np.maximum(z, 0.0) - y * z + np.log1p(e)
    return p - y, loss


def _block_rows(d: int) -> int:
    # ~4 MiB of rows: a block read from memory for X @ w is still in cache for X.T @ r
    return int(min(65536, max(1024, (4 << 20) // (8 * max(d, 1)))))


def linear_gradient(
    X: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    b: float,
    sw: np.ndarray | None,
    *,
    logistic: bool,
) -> np.ndarray:
    """``[X^T r (d), sum r, loss sum, rows]`` over the rows of ``X``, block by block.

    ``r`` is the residual (``p - y`` or ``X w + b - y``, times the row weight); the loss
    is the log loss or half the squared error. One pass over ``X`` from memory: each
    block's ``X_b @ w`` and ``X_b.T @ r_b`` share the block while it is in cache (a
    memory-bound epoch costs about half of ``X @ w`` then ``X.T @ r``).
    """
    n, d = X.shape
    out = np.zeros(d + 3)
    g = out[:d]
    block = _block_rows(d)
    gb = loss_sum = 0.0
    for s in range(0, n, block):
        e = min(n, s + block)
        Xb = X[s:e]
        z = Xb @ w
        z += b
        if logistic:
            r, loss = logistic_terms(z, y[s:e])
        else:
            r = z - y[s:e]
            loss = 0.5 * r * r
        if sw is not None:
            r *= sw[s:e]
            loss_sum += float(loss @ sw[s:e])
        else:
            loss_sum += float(loss.sum())
        g += Xb.T @ r
        gb += float(r.sum())
    out[d] = gb
    out[d + 1] = loss_sum
    out[d + 2] = float(sw.sum()) if sw is not None else float(n)
    return out


# -- Spark task ---------------------------------------------------------------------------


class _LinearTask(PartitionOperator):
    """Runs in a Spark task: caches its rows once, sends one packed gradient per epoch.

    The feedback is one float64 array: ``[X^T r (d), sum r, loss sum, rows (weighted),
    wall time the epoch started]``, ``r`` the per-row residual (times the row weight).
    """

    def __init__(
        self,
        plan: FeaturePlan,
        logistic: bool,
        global_batch_size: int | None,
        seed: int,
        straggler: tuple[int, float] | None = None,
    ) -> None:
        self.plan = plan
        self.logistic = logistic
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.straggler = straggler

    def open(self, ctx: Any) -> None:
        self.cache = FeatureCache(self.plan)
        self.order: np.ndarray | None = None
        self.pos = 0
        n, p = ctx.num_partitions, ctx.partition_id
        gb = self.global_batch_size
        self.batch = None if gb is None else gb // n + (1 if p < gb % n else 0)

    def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
        self.cache.add(batch)

    def process_variables(self, variables: Any, ctx: Any, out: Any) -> None:
        self.w = variables["coef"]
        self.b = float(variables["intercept"])

    def _sealed(self, ctx: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        first = self.order is None
        X, y, sw = self.cache.matrix(), self.cache.label(), self.cache.weight()
        if first:
            if self.logistic and len(y) and not np.isin(y, (0.0, 1.0)).all():
                bad = y[~np.isin(y, (0.0, 1.0))][0]
                raise DataValidationError(
                    f"label column {self.plan.label!r} holds {bad!r}; binary logistic "
                    f"regression needs labels 0 or 1"
                )
            if not np.isfinite(X).all():
                raise DataValidationError(
                    f"the features {list(self.plan.columns)} hold NaN or infinite values in "
                    f"partition {ctx.partition_id}; clean them first"
                )
            rng = np.random.default_rng([self.seed, ctx.partition_id])
            self.order = rng.permutation(len(y)) if self.batch is not None else np.zeros(0)
        return X, y, sw

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        started = time.time()
        X, y, sw = self._sealed(ctx)
        t0 = time.perf_counter()  # the straggler's slowdown scales the gradient, not loading
        if self.batch is not None and len(y):
            assert self.order is not None
            take = self.order[(self.pos + np.arange(self.batch)) % len(y)]
            self.pos = (self.pos + self.batch) % len(y)
            X, y = X[take], y[take]
            sw = sw[take] if sw is not None else None
        elif self.batch == 0:
            X, y, sw = X[:0], y[:0], (sw[:0] if sw is not None else None)
        d = len(self.w)
        packed = np.empty(d + 4)
        packed[: d + 3] = linear_gradient(X, y, self.w, self.b, sw, logistic=self.logistic)
        packed[d + 3] = started
        out.feedback(packed)
        if self.straggler is not None and self.straggler[0] == ctx.partition_id:
            # a simulated straggler (benchmarks): this subtask computes `factor` x slower
            time.sleep((self.straggler[1] - 1.0) * (time.perf_counter() - t0))


# -- Ray coordinator actor ----------------------------------------------------------------


class _LinearServer(CoordinatorOperator):
    """Runs in the Ray coordinator actor: the weights and the gradient steps."""

    def __init__(
        self,
        *,
        learning_rate: float,
        reg: float,
        elastic_net: float,
        fit_intercept: bool,
        max_iter: int,
        tol: float,
        trace_weights: bool = False,
    ) -> None:
        self.trace_weights = trace_weights
        self.lr = learning_rate
        self.l1 = reg * elastic_net
        self.l2 = reg * (1.0 - elastic_net)
        self.fit_intercept = fit_intercept
        self.max_iter = max_iter
        self.tol = tol

    def open(self, init_variables: Any, ctx: Any) -> None:
        self.w = np.array(init_variables["coef"], dtype=np.float64)
        self.b = float(init_variables["intercept"])
        self.acc: np.ndarray | None = None
        self.recent: dict[int, tuple[float, float]] = {}
        self.t0 = math.inf
        self.loss = math.inf

    def _penalty(self) -> float:
        if not (self.l1 or self.l2):
            return 0.0
        return self.l1 * float(np.abs(self.w).sum()) + 0.5 * self.l2 * float(self.w @ self.w)

    def _step(self, g: np.ndarray, gb: float, rows: float) -> None:
        if rows <= 0:
            return
        lr = self.lr
        grad = g / rows
        if self.l2:
            grad = grad + self.l2 * self.w
        w = self.w - lr * grad
        if self.l1:
            w = np.sign(w) * np.maximum(np.abs(w) - lr * self.l1, 0.0)
        self.w = w
        if self.fit_intercept:
            self.b -= lr * gb / rows

    def _report(self, loss: float, ctx: Any, out: Any) -> None:
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"the loss diverged ({loss}) at epoch {ctx.epoch}; lower learning_rate "
                f"(now {self.lr:g}) or scale the features"
            )
        self.loss = loss
        out.output("loss", loss)
        out.output("loss_trace", (time.time() - self.t0, loss))

    def _publish(self, out: Any) -> None:
        out.publish_variables(coef=self.w, intercept=self.b)
        if self.trace_weights:  # benchmarks: every version with its time, to score exactly
            out.output("weights_trace", (time.time() - self.t0, self.w.copy(), self.b))

    def process_feedback(self, value: np.ndarray, ctx: Any, out: Any) -> None:
        self.t0 = min(self.t0, float(value[-1]))
        if ctx.is_sync:  # applied at the epoch's alignment, summed in partition order
            if self.acc is None:
                self.acc = value.copy()
            else:
                self.acc += value
            return
        d = len(self.w)
        # async / SSP: this partition's (mini-batch) gradient, applied now
        self.recent[ctx.source_partition] = (float(value[d + 1]), float(value[d + 2]))
        seen = sum(n for _, n in self.recent.values())
        penalty = self._penalty()
        self._step(value[:d], float(value[d]), float(value[d + 2]))
        if seen > 0:
            self._report(sum(s for s, _ in self.recent.values()) / seen + penalty, ctx, out)
        self._publish(out)

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        if ctx.is_sync and self.acc is not None:
            d = len(self.w)
            acc, self.acc = self.acc, None
            rows = float(acc[d + 2])
            if rows > 0:
                self._report(float(acc[d + 1]) / rows + self._penalty(), ctx, out)
            self._step(acc[:d], float(acc[d]), rows)
            self._publish(out)
        if epoch + 1 < self.max_iter and self.loss > self.tol:
            out.criteria()


# -- estimators ---------------------------------------------------------------------------


def _validate_common(owner: str, est: Any) -> int | None:
    features = check_features_col(owner, est.features_col)
    object.__setattr__(est, "features_col", features)
    check_column(owner, "label_col", est.label_col)
    check_optional_column(owner, "weight_col", est.weight_col)
    check_column(owner, "prediction_col", est.prediction_col)
    check_int(owner, "max_iter", est.max_iter, minimum=1)
    check_number(owner, "tol", est.tol, low=-math.inf)
    check_number(owner, "learning_rate", est.learning_rate, low=0.0, low_open=True)
    check_int(owner, "global_batch_size", est.global_batch_size, minimum=1, optional=True)
    check_number(owner, "reg", est.reg, low=0.0)
    check_number(owner, "elastic_net", est.elastic_net, low=0.0, high=1.0)
    check_bool(owner, "fit_intercept", est.fit_intercept)
    check_int(owner, "seed", est.seed, minimum=0)
    check_int(owner, "parallelism", est.parallelism, minimum=1, optional=True)
    check_progress(owner, est.progress)
    return check_mode(owner, est.mode, est.staleness)


def _fit_linear(
    est: Any,
    df: Any,
    *,
    logistic: bool,
    straggler: tuple[int, float] | None,
    trace_weights: bool = False,
) -> tuple[np.ndarray, float, FeaturePlan, Any]:
    owner = type(est).__name__
    check_dataframe(owner, df)
    outputs = [c for c in est._output_columns() if c is not None]
    if len(set(outputs)) != len(outputs):
        raise IterationConfigError(f"{owner}: the output columns {outputs} must differ")
    plan = resolve_features(
        df, est.features_col, label_col=est.label_col, weight_col=est.weight_col
    )
    staleness = check_mode(owner, est.mode, est.staleness)
    init = {"coef": np.zeros(plan.dim), "intercept": 0.0}
    body = IterationBody(
        partition=_LinearTask(plan, logistic, est.global_batch_size, est.seed, straggler),
        coordinator=_LinearServer(
            learning_rate=float(est.learning_rate),
            reg=float(est.reg),
            elastic_net=float(est.elastic_net),
            fit_intercept=est.fit_intercept,
            max_iter=est.max_iter,
            tol=float(est.tol),
            trace_weights=trace_weights,
        ),
        criteria=True,
    )
    result = run_iteration(
        df,
        plan,
        init,
        body,
        staleness=staleness,
        parallelism=est.parallelism,
        progress=est.progress,
        name=f"{owner}[{est.mode}]",
    )
    return (
        np.array(result.variables["coef"], dtype=np.float64),
        float(result.variables["intercept"]),
        plan,
        result,
    )


@dataclass(frozen=True, kw_only=True)
class LogisticRegression:
    """Binary logistic regression by gradient descent (sync, async or SSP).

    ``features_col``: a vector column (``pyspark.ml.linalg`` dense or sparse), an array
    column, or a list of numeric columns; ``label_col`` holds 0 or 1. ``fit(df)`` returns
    a ``LogisticRegressionModel``. See the module docstring for the objective, ``tol``
    and ``global_batch_size``.
    """

    features_col: str | Sequence[str] = "features"
    label_col: str = "label"
    weight_col: str | None = None
    prediction_col: str = "prediction"
    probability_col: str | None = "probability"
    raw_prediction_col: str | None = "raw_prediction"
    max_iter: int = 100
    tol: float = 1e-6
    learning_rate: float = 0.1
    global_batch_size: int | None = None
    reg: float = 0.0
    elastic_net: float = 0.0
    fit_intercept: bool = True
    threshold: float = 0.5
    mode: str = "sync"
    staleness: int | None = None
    seed: int = 0
    parallelism: int | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        _validate_common("LogisticRegression", self)
        check_optional_column("LogisticRegression", "probability_col", self.probability_col)
        check_optional_column("LogisticRegression", "raw_prediction_col", self.raw_prediction_col)
        check_number("LogisticRegression", "threshold", self.threshold, low=0.0, high=1.0)

    def _output_columns(self) -> list[str | None]:
        return [self.prediction_col, self.probability_col, self.raw_prediction_col]

    def fit(self, df: Any) -> LogisticRegressionModel:
        """Train on ``df`` (one iteration; the data is read once into the subtasks)."""
        return self._fit(df)

    def _fit(
        self,
        df: Any,
        straggler: tuple[int, float] | None = None,
        trace_weights: bool = False,
    ) -> LogisticRegressionModel:
        """``fit`` with benchmark hooks: ``straggler=(partition, factor)`` makes that
        subtask ``factor`` x slower; ``trace_weights`` outputs every version with its time."""
        w, b, plan, result = _fit_linear(
            self, df, logistic=True, straggler=straggler, trace_weights=trace_weights
        )
        return LogisticRegressionModel(
            _model_params(self, plan), {"coefficients": w, "intercept": np.array(b)}, result
        )


@dataclass(frozen=True, kw_only=True)
class LinearRegression:
    """Least-squares linear regression by gradient descent (sync, async or SSP).

    Same parameters as ``LogisticRegression`` without the classification ones; the loss
    is half the mean squared error. ``fit(df)`` returns a ``LinearRegressionModel``.
    """

    features_col: str | Sequence[str] = "features"
    label_col: str = "label"
    weight_col: str | None = None
    prediction_col: str = "prediction"
    max_iter: int = 100
    tol: float = 1e-6
    learning_rate: float = 0.1
    global_batch_size: int | None = None
    reg: float = 0.0
    elastic_net: float = 0.0
    fit_intercept: bool = True
    mode: str = "sync"
    staleness: int | None = None
    seed: int = 0
    parallelism: int | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        _validate_common("LinearRegression", self)

    def _output_columns(self) -> list[str | None]:
        return [self.prediction_col]

    def fit(self, df: Any) -> LinearRegressionModel:
        """Train on ``df`` (one iteration; the data is read once into the subtasks)."""
        return self._fit(df)

    def _fit(
        self,
        df: Any,
        straggler: tuple[int, float] | None = None,
        trace_weights: bool = False,
    ) -> LinearRegressionModel:
        w, b, plan, result = _fit_linear(
            self, df, logistic=False, straggler=straggler, trace_weights=trace_weights
        )
        return LinearRegressionModel(
            _model_params(self, plan), {"coefficients": w, "intercept": np.array(b)}, result
        )


def _model_params(est: Any, plan: FeaturePlan) -> dict[str, Any]:
    params = {
        f.name: getattr(est, f.name)
        for f in dataclasses.fields(est)
        if f.name not in ("progress", "parallelism")
    }
    fc = params["features_col"]
    params["features_col"] = fc if isinstance(fc, str) else list(fc)
    params["num_features"] = plan.dim
    return params


# -- transform: Spark SQL expressions (the input schema, vector columns included, is kept)


def _feature_array(df: Any, features_col: Any, dim: int, owner: str) -> tuple[str, Any]:
    """``(kind, column)``: the features as a Spark array column (or the list of columns)."""
    from pyspark.sql import functions as F

    plan = resolve_features(df, features_col, param=f"{owner}.transform features_col", probe=False)
    if plan.kind == COLUMNS:
        if plan.dim != dim:
            raise IterationConfigError(
                f"{owner}.transform: {plan.dim} feature columns given, the model has {dim}"
            )
        return COLUMNS, [F.col(c) for c in plan.columns]
    if plan.kind == VECTOR:
        from pyspark.ml.functions import vector_to_array

        return VECTOR, vector_to_array(F.col(plan.columns[0]))
    assert plan.kind == ARRAY
    return ARRAY, F.col(plan.columns[0]).cast("array<double>")


def _literal_array(values: np.ndarray) -> Any:
    from pyspark.sql import functions as F

    return F.array(*[F.lit(float(v)) for v in values])


def dot_expression(df: Any, features_col: Any, w: np.ndarray, b: float, owner: str) -> Any:
    """A Spark column ``features . w + b`` (SQL; a pandas UDF for very wide models)."""
    from pyspark.sql import functions as F

    kind, col = _feature_array(df, features_col, len(w), owner)
    if kind == COLUMNS:
        terms = [c.cast("double") * F.lit(float(wi)) for c, wi in zip(col, w)]
        return functools.reduce(lambda a, t: a + t, terms, F.lit(float(b)))
    if len(w) <= SQL_MAX_FEATURES:
        products = F.zip_with(col, _literal_array(w), lambda x, y: x * y)
        return F.aggregate(products, F.lit(float(b)), lambda acc, v: acc + v)
    return _margin_udf(w, b)(col)


def _margin_udf(w: np.ndarray, b: float) -> Any:
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    weights = np.array(w, dtype=np.float64)
    dim = len(weights)

    def margin(arrays):  # type: ignore[no-untyped-def]
        X = np.stack(arrays.to_numpy()).reshape(len(arrays), dim) if len(arrays) else None
        return pd.Series(X @ weights + b if X is not None else np.zeros(0))

    # explicit hints: this module's postponed annotations are strings pandas_udf cannot read
    margin.__annotations__ = {"arrays": pd.Series, "return": pd.Series}
    return pandas_udf(margin, "double")  # type: ignore[call-overload]


class _LinearModel(Model):
    @property
    def coefficients(self) -> np.ndarray:
        return self._arrays["coefficients"]

    @property
    def intercept(self) -> float:
        return float(self._arrays["intercept"])

    @property
    def loss_history(self) -> list[float]:
        """The loss of each epoch (sync) or update (async) of the training run."""
        return [float(v) for v in self.result.outputs.get("loss", [])] if self.result else []

    def _margin(self, df: Any, features_col: Any = None) -> Any:
        fc = features_col if features_col is not None else self.params["features_col"]
        return dot_expression(df, fc, self.coefficients, self.intercept, type(self).__name__)


class LogisticRegressionModel(_LinearModel):
    """Coefficients and intercept of a binary logistic regression.

    ``transform(df)`` adds ``prediction_col`` (0.0 or 1.0), ``probability_col`` and
    ``raw_prediction_col`` (``pyspark.ml.linalg`` vectors ``[1 - p, p]`` and
    ``[-margin, margin]``, as MLlib's) as Spark SQL expressions, keeping every input
    column.
    """

    def transform(self, df: Any, *, features_col: Any = None) -> Any:
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        p = self.params
        margin = self._margin(df, features_col)
        prob = F.lit(1.0) / (F.lit(1.0) + F.exp(-margin))
        out = df
        if p.get("raw_prediction_col"):
            out = out.withColumn(p["raw_prediction_col"], array_to_vector(F.array(-margin, margin)))
        if p.get("probability_col"):
            out = out.withColumn(
                p["probability_col"], array_to_vector(F.array(F.lit(1.0) - prob, prob))
            )
        return out.withColumn(
            p["prediction_col"], (prob > F.lit(float(p.get("threshold", 0.5)))).cast("double")
        )

    def predict_numpy(self, X: np.ndarray) -> np.ndarray:
        """Probabilities of class 1 for the rows of ``X`` (on the driver)."""
        z = np.asarray(X, dtype=np.float64) @ self.coefficients + self.intercept
        return 1.0 / (1.0 + np.exp(-z))


class LinearRegressionModel(_LinearModel):
    """Coefficients and intercept of a linear regression; ``transform`` adds
    ``prediction_col`` (a Spark SQL expression, every input column kept)."""

    def transform(self, df: Any, *, features_col: Any = None) -> Any:
        return df.withColumn(self.params["prediction_col"], self._margin(df, features_col))

    def predict_numpy(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(X, dtype=np.float64) @ self.coefficients + self.intercept
