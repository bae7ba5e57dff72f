"""Logistic regression (binomial, multinomial) and linear regression: the estimators and
models, ``pyspark.ml`` stages. Runs on the driver (``fit`` starts one iteration; the
operators are in ``_glm`` and ``_sgd``, which run in Spark tasks and the Ray actor).

Solvers (``solver=``):

* ``"auto"`` (default): ``LogisticRegression`` -> L-BFGS, OWL-QN when ``reg *
  elastic_net > 0`` adds an L1 term; ``LinearRegression`` -> the normal equations (one
  pass: ``X^T W X`` and ``X^T W y`` summed in the coordinator and solved there) when
  there are at most 4,096 features, else L-BFGS / OWL-QN. Both with MLlib's internal
  standardisation, objective and relative ``tol`` (``_glm``'s docstring), so the same
  ``reg`` / ``elastic_net`` / ``standardization`` give MLlib's coefficients. Lock step
  only (``mode="sync"``).
* ``"l-bfgs"``, ``"normal"`` (``LinearRegression``): that solver.
* ``"sgd"``: (mini-batch) gradient descent with ``learning_rate``,
  ``global_batch_size``, ``mode`` sync / async / SSP -- the parameter-server path
  (``_sgd``): no standardisation, Flink ML's absolute ``tol`` on the loss.

``tol`` changed meaning with the default solver: it is MLlib's relative change of the
objective between iterations (it was, and under ``solver="sgd"`` still is, Flink ML's
absolute loss threshold). A fit that ends at ``max_iter`` without meeting ``tol`` warns
(``ConvergenceWarning``) and reports ``model.summary.converged = False``.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator import RuntimeHooks

from .._body import IterationBody
from .._errors import ConvergenceWarning, IterationConfigError
from .._runtime.controller import relaunch_if_worker_died
from ._base import (
    check_bool,
    check_column,
    check_dataframe,
    check_features_col,
    check_mode,
    check_optional_column,
    run_iteration,
    run_with_array_cache,
)
from ._features import ARRAY, COLUMNS, VECTOR, FeaturePlan, resolve_features
from ._glm import (
    BINOMIAL,
    GAUSSIAN,
    MULTINOMIAL,
    NORMAL_MAX_FEATURES,
    FitSpec,
    GLMCombiner,
    _GLMServer,
    _GLMTask,
)
from ._sgd import SGDCombiner, _LinearServer, _LinearTask, linear_gradient, logistic_terms
from ._stages import (
    ParamSpec,
    StageEstimator,
    StageModel,
    StageParams,
    choice_check,
    features_check,
    int_check,
    number_check,
    progress_check,
)

__all__ = [
    "ConvergenceWarning",
    "LinearRegression",
    "LinearRegressionModel",
    "LogisticRegression",
    "LogisticRegressionModel",
    "TrainingSummary",
    "linear_gradient",
    "logistic_terms",
]

#: Above this many features ``transform`` computes the margin in a vectorised pandas UDF
#: instead of one Spark SQL expression with a literal per coefficient.
SQL_MAX_FEATURES = 1024


@dataclass
class TrainingSummary:
    """What a fit did: the objective at the start and after every iteration
    (``objective_history``; ``solver="sgd"``: the loss of every epoch or update),
    ``total_iterations``, ``solver``, ``converged``, why it stopped, wall ``seconds``,
    ``epochs`` (passes over the data, line-search trials included), ``data_source``
    (``"spark"``, or ``"array cache"`` when the arrays an earlier fit of the same cached
    DataFrame decoded were read instead, ``docs/ml.md``). MLlib's names
    ``objectiveHistory`` and ``totalIterations`` work too."""

    objective_history: list[float]
    total_iterations: int
    solver: str
    converged: bool
    reason: str
    seconds: float
    epochs: int
    family: str = ""
    warnings: list[str] = field(default_factory=list)
    data_source: str = "spark"

    @property
    def objectiveHistory(self) -> list[float]:
        return self.objective_history

    @property
    def totalIterations(self) -> int:
        return self.total_iterations


# -- parameters -------------------------------------------------------------------------------


def _c_mode(owner: str, name: str, value: Any) -> None:
    if value not in ("sync", "async", "ssp"):
        check_mode(owner, value, None)


_COMMON = (
    ParamSpec("features_col", "featuresCol", "features", "features: a vector column, an array column or a list of numeric columns", features_check),
    ParamSpec("label_col", "labelCol", "label", "label column name", check_column),
    ParamSpec("weight_col", "weightCol", None, "row weight column name (None: weight 1)", check_optional_column),
    ParamSpec("prediction_col", "predictionCol", "prediction", "prediction column name", check_column),
    ParamSpec("max_iter", "maxIter", 100, "maximum number of iterations (sgd: epochs)", int_check(1)),
    ParamSpec("tol", "tol", 1e-6, "convergence tolerance: relative change of the objective (sgd: absolute loss)", number_check(low=-math.inf)),
    ParamSpec("reg", "regParam", 0.0, "regularization parameter (>= 0)", number_check(low=0.0)),
    ParamSpec("elastic_net", "elasticNetParam", 0.0, "ElasticNet mixing: 0 is L2, 1 is L1", number_check(low=0.0, high=1.0)),
    ParamSpec("fit_intercept", "fitIntercept", True, "whether to fit an intercept", check_bool),
    ParamSpec("standardization", "standardization", True, "standardize the features internally (MLlib's meaning)", check_bool),
    ParamSpec("learning_rate", "learningRate", 0.1, "solver='sgd': step size", number_check(low=0.0, low_open=True)),
    ParamSpec("global_batch_size", "globalBatchSize", None, "solver='sgd': rows per epoch (None: full batch)", int_check(1, optional=True)),
    ParamSpec("mode", "mode", "sync", "solver='sgd': 'sync', 'async' or 'ssp'", _c_mode),
    ParamSpec("staleness", "staleness", None, "mode='ssp': bound on staleness", int_check(0, optional=True)),
    ParamSpec("seed", "seed", 0, "random seed (sgd mini-batches)", int_check(0)),
    ParamSpec("parallelism", "parallelism", None, "subtasks (None: the data's partitions)", int_check(1, optional=True)),
    ParamSpec("progress", "progress", None, "progress line (None: on a terminal)", progress_check),
)  # fmt: skip

_CLASSIFIER = (
    ParamSpec("probability_col", "probabilityCol", "probability", "class probabilities column (None: none)", check_optional_column),
    ParamSpec("raw_prediction_col", "rawPredictionCol", "rawPrediction", "margins column (None: none)", check_optional_column),
    ParamSpec("threshold", "threshold", 0.5, "binomial: predict 1 when P(1) > threshold", number_check(low=0.0, high=1.0)),
    ParamSpec("family", "family", "auto", "'auto', 'binomial' or 'multinomial'", choice_check("auto", "binomial", "multinomial")),
    ParamSpec("solver", "solver", "auto", "'auto' (L-BFGS / OWL-QN), 'l-bfgs' or 'sgd'", choice_check("auto", "l-bfgs", "sgd")),
)  # fmt: skip

_REGRESSOR = (
    ParamSpec("solver", "solver", "auto", "'auto', 'normal', 'l-bfgs' or 'sgd'", choice_check("auto", "normal", "l-bfgs", "sgd")),
)  # fmt: skip

_SGD_ONLY = ("learning_rate", "global_batch_size")


def _check_cross(est: StageParams) -> None:
    """Checks across parameters (on creation and before each fit)."""
    owner = type(est).__name__
    check_mode(owner, est.value("mode"), est.value("staleness"))
    solver = est.value("solver")
    if solver != "sgd":
        if est.value("mode") != "sync":
            raise IterationConfigError(
                f"{owner}(mode={est.value('mode')!r}) needs solver='sgd': solver={solver!r} "
                f"(L-BFGS / normal equations) runs in lock step over full-batch gradients. "
                f"Use mode='sync', or solver='sgd' for asynchronous training"
            )
        for name in _SGD_ONLY:
            if est.is_set(name) and est.value(name) is not None:
                raise IterationConfigError(
                    f"{owner}({name}=...) applies to solver='sgd' only (solver={solver!r} "
                    f"needs no step size and reads every row each iteration); drop it, or "
                    f"pass solver='sgd'"
                )
        tol = est.value("tol")
        if not tol >= 0:
            raise IterationConfigError(
                f"{owner}(tol=...) must be >= 0 with solver={solver!r} (the relative change "
                f"of the objective), got {tol!r}"
            )
    elif est.is_set("standardization") and est.value("standardization"):
        raise IterationConfigError(
            f"{owner}(standardization=True) is not available with solver='sgd', which "
            f"trains on the features as given; scale them first "
            f"(pyspark.ml.feature.StandardScaler) or use solver='auto'"
        )


# -- fitting --------------------------------------------------------------------------------


def _prepare(est: Any, df: Any) -> FeaturePlan:
    owner = type(est).__name__
    est.check_params()
    _check_cross(est)
    check_dataframe(owner, df)
    outputs = [c for c in est._output_columns() if c is not None]
    if len(set(outputs)) != len(outputs):
        raise IterationConfigError(f"{owner}: the output columns {outputs} must differ")
    return resolve_features(
        df,
        check_features_col(owner, est.value("features_col")),
        label_col=est.value("label_col"),
        weight_col=est.value("weight_col"),
    )


def _fit_sgd(
    est: Any,
    df: Any,
    plan: FeaturePlan,
    *,
    logistic: bool,
    hooks: RuntimeHooks | None,
) -> tuple[np.ndarray, np.ndarray, Any, TrainingSummary]:
    owner = type(est).__name__
    v = est.value
    staleness = check_mode(owner, v("mode"), v("staleness"))
    init = {"coef": np.zeros(plan.dim), "intercept": 0.0}
    gbs = v("global_batch_size")
    body = IterationBody(
        partition=_LinearTask(plan, logistic, gbs, v("seed"), hooks),
        coordinator=_LinearServer(
            learning_rate=float(v("learning_rate")),
            reg=float(v("reg")),
            elastic_net=float(v("elastic_net")),
            fit_intercept=v("fit_intercept"),
            max_iter=v("max_iter"),
            tol=float(v("tol")),
            full_batch=gbs is None,
        ),
        criteria=True,
        # sync: the subtasks' gradients merge in a tree (at most fan_in values reach the
        # coordinator per epoch); async / SSP apply each partition's gradient as it comes
        feedback_combine=SGDCombiner() if staleness == 0 else None,
    )
    t = time.perf_counter()
    result = relaunch_if_worker_died(
        owner,
        functools.partial(
            run_iteration,
            df,
            plan,
            init,
            body,
            staleness=staleness,
            parallelism=v("parallelism"),
            progress=v("progress"),
            name=f"{owner}[{v('mode')}]",
            hooks=hooks,
        ),
    )
    losses = [float(x) for x in result.outputs.get("loss", [])]
    summary = TrainingSummary(
        objective_history=losses,
        total_iterations=result.epochs,
        solver="sgd",
        converged=bool(losses) and losses[-1] <= float(v("tol")),
        reason="loss <= tol" if losses and losses[-1] <= float(v("tol")) else "max_iter",
        seconds=time.perf_counter() - t,
        epochs=result.epochs,
        family=("binomial" if logistic else GAUSSIAN),
    )
    w = np.array(result.variables["coef"], dtype=np.float64)
    b = float(result.variables["intercept"])
    return w[None, :], np.array([b]), result, summary


def _num_classes(df: Any, label: str) -> int:
    """The label's class count when its ML metadata gives one (``StringIndexer``: classes
    that are absent from the data count too), else 0: the epoch-0 statistics count the
    classes (the largest index + 1) and the coordinator shapes the coefficients from
    them, so no Spark job is spent on the label here."""
    attrs = (df.schema[label].metadata or {}).get("ml_attr", {})
    if isinstance(attrs, dict):
        if isinstance(attrs.get("num_vals"), int):
            return int(attrs["num_vals"])
        if isinstance(attrs.get("vals"), list):
            return len(attrs["vals"])
    return 0


def _fit_glm(
    est: Any, df: Any, plan: FeaturePlan, *, family: str, hooks: RuntimeHooks | None = None
) -> tuple[np.ndarray, np.ndarray, Any, TrainingSummary]:
    owner = type(est).__name__
    v = est.value
    solver = v("solver")
    if family == GAUSSIAN:
        if solver == "normal" and plan.dim > NORMAL_MAX_FEATURES:
            raise IterationConfigError(
                f"{owner}(solver='normal') takes at most {NORMAL_MAX_FEATURES} features "
                f"(the Gram matrix is features x features), the data has {plan.dim}; use "
                f"solver='auto' or 'l-bfgs'"
            )
        solver = (
            "normal"
            if solver == "normal" or (solver == "auto" and plan.dim <= NORMAL_MAX_FEATURES)
            else "l-bfgs"
        )
    else:
        solver = "l-bfgs"
    classes = 0 if family in (GAUSSIAN, BINOMIAL) else _num_classes(df, v("label_col"))
    t = time.perf_counter()
    while True:
        multinomial = family == MULTINOMIAL or (family == "auto" and classes > 2)
        # the coefficient rows the variables are shaped with: the coordinator learns the
        # class count from epoch 0's statistics and, when it needs more rows (a label
        # with more classes than its metadata or a binomial guess says), ends the run
        # at once and says how many: then it runs again (no Spark job reads the label
        # before the fit)
        rows = max(classes, 2) if multinomial else 1
        spec = FitSpec(
            classes=classes,
            rows=rows,
            family=family,
            solver=solver,
            reg=float(v("reg")),
            elastic_net=float(v("elastic_net")),
            standardization=bool(v("standardization")),
            fit_intercept=bool(v("fit_intercept")),
            max_iter=int(v("max_iter")),
            tol=float(v("tol")),
            label=str(v("label_col")),
        )

        def build(
            run_plan: FeaturePlan, spec: FitSpec = spec, rows: int = rows
        ) -> tuple[dict[str, Any], IterationBody]:
            body = IterationBody(
                partition=_GLMTask(run_plan, family, gram=solver == "normal"),
                coordinator=_GLMServer(spec),
                criteria=True,
                feedback_combine=GLMCombiner(),
            )
            init = {"phase": 0, "coef": np.zeros((rows, plan.dim)), "intercept": np.zeros(rows)}
            return init, body

        result, source = run_with_array_cache(
            owner,
            df,
            plan,
            build,
            staleness=0,
            parallelism=v("parallelism"),
            progress=v("progress"),
            name=f"{owner}[{solver}]",
            progress_tag="objective",
            # a safety net only: the optimizer stops itself (<= 30 trials per iteration)
            max_epochs=2 + 31 * (spec.max_iter + 1),
            hooks=hooks,
        )
        more = result.outputs.get("classes")
        if not more:
            break
        if int(more[-1]) <= classes:  # pragma: no cover - the second run has the count
            raise RuntimeError(f"{owner}: the class count did not settle ({more})")
        classes = int(more[-1])
    info = result.outputs["summary"][-1]
    summary = TrainingSummary(
        objective_history=[float(x) for x in info["objective_history"]],
        total_iterations=int(info["total_iterations"]),
        solver=solver,
        converged=bool(info["converged"]),
        reason=str(info["reason"]),
        seconds=time.perf_counter() - t,
        epochs=result.epochs,
        family=str(info["family"]),
        warnings=list(info["warnings"]),
        data_source=source,
    )
    for w in summary.warnings:
        warnings.warn(f"{owner}: {w}", UserWarning, stacklevel=4)
    if not summary.converged:
        warnings.warn(
            f"{owner} did not converge: stopped after {summary.total_iterations} iterations "
            f"({summary.reason}) with the relative change of the objective still above "
            f"tol={spec.tol:g}; raise max_iter (now {spec.max_iter})",
            ConvergenceWarning,
            stacklevel=4,
        )
    B = np.array(result.variables["coef"], dtype=np.float64)
    b = np.array(result.variables["intercept"], dtype=np.float64)
    return B, b, result, summary


class _LinearEstimator(StageEstimator):
    """Shared by both estimators: the solvers."""

    def _check_cross(self) -> None:
        _check_cross(self)

    def _output_columns(self) -> list[str | None]:
        return [self.value("prediction_col")]

    def _solve(
        self,
        dataset: Any,
        *,
        family: str,
        hooks: RuntimeHooks | None,
    ) -> tuple[np.ndarray, np.ndarray, Any, Any]:
        """``(coefficient matrix, intercepts, IterationResult, summary)`` by the chosen
        solver: SGD on the iteration runtime, or the GLM operators (L-BFGS / OWL-QN /
        normal equations). ``hooks`` serve tests and benchmarks: the runtime's hook
        points (``hybrid_iter.testing``): ``Straggler`` slows one subtask (SGD),
        ``TraceVersions`` records every published version with its time."""
        plan = _prepare(self, dataset)
        if self.value("solver") == "sgd":
            if family == "multinomial":
                raise IterationConfigError(
                    "LogisticRegression(solver='sgd') is binomial only; use solver='auto' "
                    "for family='multinomial'"
                )
            return _fit_sgd(
                self,
                dataset,
                plan,
                logistic=family != GAUSSIAN,
                hooks=hooks,
            )
        return _fit_glm(self, dataset, plan, family=family, hooks=hooks)


class LogisticRegression(_LinearEstimator):
    """Logistic regression, binomial or multinomial (``family``), on Spark + Ray.

    ``features_col``: a vector column (``pyspark.ml.linalg`` dense or sparse), an array
    column, or a list of numeric columns; ``label_col`` holds class indices 0..K-1.
    ``fit(df)`` returns a ``LogisticRegressionModel``. Parameters by Python keyword
    (``max_iter``, ``reg``, ``elastic_net``, ...) or MLlib's name (``maxIter``,
    ``regParam``, ``elasticNetParam``, ...); see the module docstring for solvers.
    """

    _SPECS = (*_COMMON, *_CLASSIFIER)

    def _output_columns(self) -> list[str | None]:
        return [
            self.value("prediction_col"),
            self.value("probability_col"),
            self.value("raw_prediction_col"),
        ]

    def _fit(
        self,
        dataset: Any,
        *,
        hooks: RuntimeHooks | None = None,
    ) -> LogisticRegressionModel:
        B, b, result, summary = self._solve(dataset, family=self.value("family"), hooks=hooks)
        arrays = (
            {"coefficient_matrix": B, "intercept_vector": b}
            if summary.family == "multinomial"
            else {"coefficients": B[0], "intercept": np.array(b[0])}
        )
        return self._model(LogisticRegressionModel, arrays, result, summary)


class LinearRegression(_LinearEstimator):
    """Least-squares linear regression on Spark + Ray (MLlib's objective; the normal
    equations by default). ``fit(df)`` returns a ``LinearRegressionModel``."""

    _SPECS = (*_COMMON, *_REGRESSOR)

    def _fit(
        self,
        dataset: Any,
        *,
        hooks: RuntimeHooks | None = None,
    ) -> LinearRegressionModel:
        B, b, result, summary = self._solve(dataset, family=GAUSSIAN, hooks=hooks)
        arrays = {"coefficients": B[0], "intercept": np.array(b[0])}
        return self._model(LinearRegressionModel, arrays, result, summary)


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


def _dot(kind: str, col: Any, w: np.ndarray, b: float) -> Any:
    from pyspark.sql import functions as F

    if kind == COLUMNS:
        terms = [c.cast("double") * F.lit(float(wi)) for c, wi in zip(col, w)]
        return functools.reduce(lambda a, t: a + t, terms, F.lit(float(b)))
    products = F.zip_with(col, _literal_array(w), lambda x, y: x * y)
    return F.aggregate(products, F.lit(float(b)), lambda acc, v: acc + v)


def dot_expression(df: Any, features_col: Any, w: np.ndarray, b: float, owner: str) -> Any:
    """A Spark column ``features . w + b`` (SQL; a pandas UDF for very wide models)."""
    kind, col = _feature_array(df, features_col, len(w), owner)
    if kind == COLUMNS or len(w) <= SQL_MAX_FEATURES:
        return _dot(kind, col, w, b)
    return _margins_udf(np.asarray(w)[None, :], np.array([b]), single=True)(col)


def margins_expression(df: Any, features_col: Any, B: np.ndarray, b: np.ndarray, owner: str) -> Any:
    """A Spark ``array<double>`` column of the ``K`` margins ``X B^T + b``."""
    from pyspark.sql import functions as F

    kind, col = _feature_array(df, features_col, B.shape[1], owner)
    if kind == COLUMNS or B.size <= SQL_MAX_FEATURES:
        return F.array(*[_dot(kind, col, B[k], float(b[k])) for k in range(len(B))])
    return _margins_udf(B, b, single=False)(col)


def _margins_udf(B: np.ndarray, b: np.ndarray, *, single: bool) -> Any:
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    weights = np.array(B, dtype=np.float64)
    bias = np.array(b, dtype=np.float64)
    dim = weights.shape[1]

    def margin(arrays: Any) -> Any:  # pd.Series -> pd.Series (set below)
        if not len(arrays):
            return pd.Series([], dtype=float if single else object)
        Z = np.stack(arrays.to_numpy()).reshape(len(arrays), dim) @ weights.T + bias
        return pd.Series(Z[:, 0]) if single else pd.Series(list(Z))

    # explicit hints: this module's postponed annotations are strings pandas_udf cannot read
    margin.__annotations__ = {"arrays": pd.Series, "return": pd.Series}
    return pandas_udf(margin, "double" if single else "array<double>")  # type: ignore[call-overload]


class _LinearModel(StageModel):
    """Shared by the models: coefficients, intercepts, the summary's loss history."""

    @property
    def loss_history(self) -> list[float]:
        """The objective of every iteration (``solver="sgd"``: the loss of every epoch or
        update)."""
        return list(self._summary.objective_history) if self._summary else []

    @property
    def num_features(self) -> int:
        return int(self._matrix().shape[1])

    def _matrix(self) -> np.ndarray:
        if "coefficient_matrix" in self._arrays:
            return self._arrays["coefficient_matrix"]
        return self._arrays["coefficients"][None, :]

    def _vector(self) -> np.ndarray:
        if "intercept_vector" in self._arrays:
            return self._arrays["intercept_vector"]
        return np.atleast_1d(self._arrays["intercept"])


class LogisticRegressionModel(_LinearModel):
    """A fitted logistic regression. Binomial: ``coefficients`` (D) and ``intercept``;
    multinomial: ``coefficient_matrix`` (K x D) and ``intercept_vector`` (K), MLlib's
    parameterisation (intercepts centred; coefficients centred when unregularised).

    ``transform(df)`` adds, as MLlib does, ``rawPrediction`` (margins: ``[-m, m]``, or the
    K margins), ``probability`` (``pyspark.ml.linalg`` vectors) and ``prediction``
    (binomial: ``P(1) > threshold``; multinomial: the most probable class)."""

    _SPECS = (*_COMMON, *_CLASSIFIER)

    @property
    def is_multinomial(self) -> bool:
        return "coefficient_matrix" in self._arrays

    @property
    def num_classes(self) -> int:
        return len(self._vector()) if self.is_multinomial else 2

    numClasses = num_classes

    @property
    def coefficients(self) -> np.ndarray:
        if self.is_multinomial:
            raise IterationConfigError(
                "a multinomial model has a matrix of coefficients: use coefficient_matrix"
            )
        return self._arrays["coefficients"]

    @property
    def intercept(self) -> float:
        if self.is_multinomial:
            raise IterationConfigError(
                "a multinomial model has a vector of intercepts: use intercept_vector"
            )
        return float(self._arrays["intercept"])

    @property
    def coefficient_matrix(self) -> np.ndarray:
        return self._matrix()

    @property
    def intercept_vector(self) -> np.ndarray:
        return self._vector()

    def _transform(self, dataset: Any, features_col: Any = None) -> Any:
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F

        v = self.value
        fc = self._features(features_col)
        owner = type(self).__name__
        out = dataset
        if not self.is_multinomial:
            margin = dot_expression(dataset, fc, self.coefficients, self.intercept, owner)
            prob = F.lit(1.0) / (F.lit(1.0) + F.exp(-margin))
            if v("raw_prediction_col"):
                out = out.withColumn(
                    v("raw_prediction_col"), array_to_vector(F.array(-margin, margin))
                )
            if v("probability_col"):
                out = out.withColumn(
                    v("probability_col"), array_to_vector(F.array(F.lit(1.0) - prob, prob))
                )
            return out.withColumn(
                v("prediction_col"), (prob > F.lit(float(v("threshold")))).cast("double")
            )
        raw = margins_expression(dataset, fc, self.coefficient_matrix, self.intercept_vector, owner)
        tmp = f"__hybrid_iter_margins_{self.uid}"
        out = out.withColumn(tmp, raw)
        z = F.col(tmp)
        top = F.array_max(z)
        if v("raw_prediction_col"):
            out = out.withColumn(v("raw_prediction_col"), array_to_vector(z))
        if v("probability_col"):
            e = F.transform(z, lambda m: F.exp(m - top))
            total = F.aggregate(e, F.lit(0.0), lambda a, x: a + x)
            out = out.withColumn(
                v("probability_col"), array_to_vector(F.transform(e, lambda x: x / total))
            )
        # the largest margin, ties to the lowest class (numpy's argmax)
        pairs = F.array(
            *[
                F.struct((-z.getItem(k)).alias("s"), F.lit(k).alias("i"))
                for k in range(self.num_classes)
            ]
        )
        pred = F.array_min(pairs).getField("i").cast("double")
        return out.withColumn(v("prediction_col"), pred).drop(tmp)

    def predict_numpy(self, X: np.ndarray) -> np.ndarray:
        """Binomial: ``P(1)`` per row of ``X``; multinomial: the ``(rows, K)``
        probabilities (on the driver)."""
        Z = np.asarray(X, dtype=np.float64) @ self.coefficient_matrix.T + self.intercept_vector
        if not self.is_multinomial:
            return 1.0 / (1.0 + np.exp(-Z[:, 0]))
        Z -= Z.max(axis=1, keepdims=True)
        E = np.exp(Z)
        return E / E.sum(axis=1, keepdims=True)


class LinearRegressionModel(_LinearModel):
    """Coefficients and intercept of a linear regression; ``transform`` adds
    ``prediction_col`` (a Spark SQL expression, every input column kept)."""

    _SPECS = (*_COMMON, *_REGRESSOR)

    @property
    def coefficients(self) -> np.ndarray:
        return self._arrays["coefficients"]

    @property
    def intercept(self) -> float:
        return float(self._arrays["intercept"])

    def _transform(self, dataset: Any, features_col: Any = None) -> Any:
        margin = dot_expression(
            dataset,
            self._features(features_col),
            self.coefficients,
            self.intercept,
            type(self).__name__,
        )
        return dataset.withColumn(self.value("prediction_col"), margin)

    def predict_numpy(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(X, dtype=np.float64) @ self.coefficients + self.intercept
