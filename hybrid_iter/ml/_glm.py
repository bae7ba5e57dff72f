"""Generalised linear models by second-order or exact solvers: the operators and the math.

Runs where the core runs them: ``_GLMTask`` in each Spark task of the fit's barrier stage
(it reads its partition once into a numpy matrix), ``_GLMServer`` in the Ray coordinator
actor (it holds the optimizer: ``_optim.LBFGS``), ``Problem`` wherever it is built (the
actor during a fit; the driver in tests). Nothing here imports pyspark.

One fit is one iteration:

* epoch 0 -- statistics: each subtask validates its rows (NaN / infinite features or
  labels name the column) and returns its weight sum, the features' mean and centred
  second moments, the class histogram with each class's feature sums (classification),
  or the label's moments and the centred Gram matrix ``X^T W X`` (least squares by the
  normal equations). The coordinator merges them (Chan's parallel formulas: no
  cancellation for features with large means), which gives the standardisation, the
  start point, and the objective and gradient at the start point (all margins are equal
  there), so no pass is spent on it;
* least squares with at most 4,096 features: solved in the coordinator from the
  statistics (Cholesky; OWL-QN on the quadratic when an L1 term is present) -- one pass;
* otherwise epochs 1, 2, ...: the coordinator publishes a point (coefficients on the
  original scale), every subtask returns its loss sum and gradient there, and the
  optimizer (L-BFGS, OWL-QN with L1) decides the next point. Line-search trials are
  epochs too.

The optimizer works in MLlib's scaled space: ``theta[k, j] = beta[k, j] * sigma_j`` with
the features also centred when an intercept is fitted (better conditioned; the intercept
absorbs the shift). The objective is MLlib's, on the original scale:

* logistic (binomial, multinomial): ``sum_i w_i loss_i / sum_i w_i + reg * ((1 - a) / 2 *
  sum (s_j beta_kj)^2 + a * sum |s_j beta_kj|)``;
* least squares: ``sum_i w_i r_i^2 / (2 sum_i w_i) + reg * ((1 - a) / (2 sigma_y) *
  sum (s_j beta_j)^2 + a * sum |s_j beta_j|)`` (MLlib standardises the label too);

with ``a = elastic_net``, ``s_j = sigma_j`` when ``standardization`` else 1 (MLlib:
the penalty on the scaled or on the original coefficients), the intercept not
regularised. ``sigma`` is the weighted sample standard deviation (MLlib's summarizer);
the normal-equation path uses the population one, as MLlib's ``WeightedLeastSquares``.
A feature with ``sigma_j = 0`` gets coefficient 0 (MLlib's rule).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator._finite import all_finite

from .._errors import DataValidationError
from .._operators import CoordinatorOperator, PartitionOperator
from ._features import COLUMNS, FeatureCache, FeaturePlan
from ._optim import LBFGS
from ._sgd import _block_rows, linear_gradient

__all__ = [
    "BINOMIAL",
    "GAUSSIAN",
    "MULTINOMIAL",
    "FitSpec",
    "Problem",
    "merge_stats",
    "multinomial_gradient",
    "partition_stats",
]

BINOMIAL, MULTINOMIAL, GAUSSIAN = "binomial", "multinomial", "gaussian"
#: the most classes a label may have (the coefficient matrix is classes x features)
MAX_CLASSES = 10_000
#: least squares with at most this many features: normal equations (MLlib's limit)
NORMAL_MAX_FEATURES = 4096

STATS, POINT, DONE = 0, 1, 2


@dataclass(frozen=True)
class FitSpec:
    """What the coordinator needs to know about the fit (plain data, pickled to Ray).

    ``family``: ``"auto"``, ``"binomial"``, ``"multinomial"`` (logistic) or
    ``"gaussian"`` (least squares); ``solver``: ``"l-bfgs"`` or ``"normal"``."""

    family: str
    solver: str
    reg: float
    elastic_net: float
    standardization: bool
    fit_intercept: bool
    max_iter: int
    tol: float
    label: str
    memory: int = 10
    #: classes known on the driver (label metadata, or a run that found them), else 0
    classes: int = 0
    #: the coefficient rows the variables are shaped with (1: binomial or least squares)
    rows: int = 1


# -- partition-side math (Spark task) ------------------------------------------------------


def _feature_names(plan: FeaturePlan) -> list[str]:
    if plan.kind == COLUMNS:
        return list(plan.columns)
    return [f"{plan.columns[0]}[{j}]" for j in range(plan.dim)]


def validate_rows(
    plan: FeaturePlan, X: np.ndarray, y: np.ndarray | None, partition: int, *, classes: bool
) -> None:
    """Raise ``DataValidationError`` naming the column of the first NaN / infinite value,
    or of a label a classifier cannot take."""
    if not all_finite(X):
        bad = np.flatnonzero(~np.isfinite(X).all(axis=0))  # which columns, to name them
        names = _feature_names(plan)
        cols = ", ".join(repr(names[j]) for j in bad[:5])
        raise DataValidationError(
            f"feature column(s) {cols} hold NaN or infinite values (partition {partition}); "
            f"drop or impute them first (df.na.drop(), pyspark.ml.feature.Imputer)"
        )
    if y is None or not len(y):
        return
    if not all_finite(y):
        raise DataValidationError(
            f"label column {plan.label!r} holds NaN or infinite values (partition "
            f"{partition}); drop those rows first"
        )
    if classes:
        bad = (y < 0) | (y != np.floor(y)) | (y >= MAX_CLASSES)
        if bad.any():
            raise DataValidationError(
                f"label column {plan.label!r} holds {y[bad][0]!r}; logistic regression needs "
                f"class indices 0, 1, ..., K-1 (K <= {MAX_CLASSES}); index string labels "
                f"with pyspark.ml.feature.StringIndexer"
            )


def _centred_moments(X: np.ndarray, sw: np.ndarray | None) -> tuple[float, np.ndarray, np.ndarray]:
    """``(weight sum, weighted mean, sum_i w_i (x_i - mean)^2)`` per column."""
    W = float(sw.sum()) if sw is not None else float(len(X))
    if W <= 0:
        d = X.shape[1]
        return 0.0, np.zeros(d), np.zeros(d)
    mean = (sw @ X if sw is not None else X.sum(axis=0)) / W
    m2 = np.zeros(X.shape[1])
    if X.flags.f_contiguous:  # a column at a time: contiguous, one temporary column
        for j in range(X.shape[1]):
            c = X[:, j] - mean[j]
            m2[j] = (c * sw) @ c if sw is not None else c @ c
        return W, mean, m2
    block = _block_rows(X.shape[1])
    for s in range(0, len(X), block):
        D = X[s : s + block] - mean
        D *= D
        m2 += sw[s : s + block] @ D if sw is not None else D.sum(axis=0)
    return W, mean, m2


#: up to this many classes the per-class feature sums are one matrix-vector product
#: per class; more, a one-hot matrix-matrix product per block of rows
_FEW_CLASSES = 16


def _class_sums(X: np.ndarray, idx: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """``(k, d)``: row ``c`` is ``sum_i w_i x_i`` over the rows of class ``c``."""
    n, d = X.shape
    cx = np.zeros((k, d))
    if k <= _FEW_CLASSES:
        for c in range(k):
            cx[c] = np.where(idx == c, w, 0.0) @ X
        return cx
    block = _block_rows(max(d, k))
    for s in range(0, n, block):
        e = min(n, s + block)
        onehot = np.zeros((e - s, k))
        onehot[np.arange(e - s), idx[s:e]] = w[s:e]
        cx += onehot.T @ X[s:e]
    return cx


def partition_stats(
    X: np.ndarray, y: np.ndarray, sw: np.ndarray | None, *, family: str, gram: bool
) -> dict[str, Any]:
    """One partition's statistics for epoch 0 (see the module docstring)."""
    n, d = X.shape
    W, mean, m2 = _centred_moments(X, sw)
    out: dict[str, Any] = {
        "n": n,
        "W": W,
        "W2": float(sw @ sw) if sw is not None else float(n),
        "mean": mean,
        "m2": m2,
    }
    w = sw if sw is not None else np.ones(n)
    if family == GAUSSIAN:
        ymean = float(w @ y) / W if W > 0 else 0.0
        yc = y - ymean
        out["ymean"] = ymean
        out["ym2"] = float(w @ (yc * yc))
        xy = np.zeros(d)
        G = np.zeros((d, d)) if gram else None
        block = _block_rows(d)
        for s in range(0, n, block):
            Xc = X[s : s + block] - mean
            wy = w[s : s + block] * yc[s : s + block]
            xy += wy @ Xc
            if G is not None:
                G += Xc.T @ (Xc * w[s : s + block, None] if sw is not None else Xc)
        out["xy"] = xy
        if G is not None:
            out["gram"] = G
    else:
        k = int(y.max()) + 1 if n else 0
        idx = y.astype(np.intp)
        out["class_w"] = np.bincount(idx, weights=w, minlength=k)
        out["class_x"] = _class_sums(X, idx, w, k)
    return out


def multinomial_gradient(
    X: np.ndarray, y: np.ndarray, B: np.ndarray, b: np.ndarray, sw: np.ndarray | None
) -> np.ndarray:
    """``[R^T X (K x D, row-major), sum R (K), loss sum]`` of the softmax loss at ``(B, b)``,
    ``R = w * (softmax(X B^T + b) - onehot(y))``, block by block (stable log-sum-exp).

    The margins of a block are held class-major (``K x rows``): the per-row reductions
    over the classes then run along contiguous rows of length ``rows``, not over ``K``
    elements at a time."""
    n, d = X.shape
    k = len(b)
    G = np.zeros((k, d))
    gb = np.zeros(k)
    loss = 0.0
    block = _block_rows(max(d, k))
    idx = y.astype(np.intp)
    for s in range(0, n, block):
        e = min(n, s + block)
        Xb = X[s:e]
        cols = np.arange(e - s)
        Z = B @ Xb.T  # K x rows
        Z += b[:, None]
        zy = Z[idx[s:e], cols]
        zmax = Z.max(axis=0)
        Z -= zmax
        np.exp(Z, out=Z)
        S = Z.sum(axis=0)
        li = zmax + np.log(S) - zy
        Z /= S
        Z[idx[s:e], cols] -= 1.0
        if sw is not None:
            Z *= sw[s:e]
            loss += float(li @ sw[s:e])
        else:
            loss += float(li.sum())
        G += Z @ Xb
        gb += Z.sum(axis=1)
    return np.concatenate([G.ravel(), gb, [loss]])


# -- the merged statistics and the problem (coordinator; pure) -----------------------------


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the partitions' statistics (Chan et al.: centred sums shifted to the global
    mean). Partitions without rows are skipped."""
    parts = [p for p in parts if p["W"] > 0]
    if not parts:
        raise DataValidationError("the data has no rows (or only rows of weight 0): nothing to fit")
    W = sum(p["W"] for p in parts)
    mean = sum(p["W"] * p["mean"] for p in parts) / W
    out: dict[str, Any] = {
        "n": sum(p["n"] for p in parts),
        "W": W,
        "W2": sum(p["W2"] for p in parts),
        "mean": mean,
        "m2": sum(p["m2"] + p["W"] * (p["mean"] - mean) ** 2 for p in parts),
    }
    if "ymean" in parts[0]:
        ymean = sum(p["W"] * p["ymean"] for p in parts) / W
        out["ymean"] = ymean
        out["ym2"] = sum(p["ym2"] + p["W"] * (p["ymean"] - ymean) ** 2 for p in parts)
        out["xy"] = sum(p["xy"] + p["W"] * (p["mean"] - mean) * (p["ymean"] - ymean) for p in parts)
        if "gram" in parts[0]:
            out["gram"] = sum(
                p["gram"] + p["W"] * np.outer(p["mean"] - mean, p["mean"] - mean) for p in parts
            )
    if "class_w" in parts[0]:
        k = max(len(p["class_w"]) for p in parts)
        d = len(mean)
        cw, cx = np.zeros(k), np.zeros((k, d))
        for p in parts:
            kp = len(p["class_w"])
            cw[:kp] += p["class_w"]
            cx[:kp] += p["class_x"]
        out["class_w"], out["class_x"] = cw, cx
    return out


@dataclass
class Problem:
    """The objective in the optimizer's scaled space, built from the merged statistics.

    ``theta`` holds ``K x D`` scaled coefficients then (logistic with an intercept) ``K``
    intercepts. ``to_original(theta)`` gives ``(B (K x D), b (K))`` on the original
    scale; ``gradient(G, gb)`` turns the original-space gradient of the mean loss into
    the scaled space's and adds the L2 term."""

    spec: FitSpec
    stats: dict[str, Any]
    classes: int = 1
    family: str = BINOMIAL
    mu: np.ndarray = field(default_factory=lambda: np.zeros(0))
    sigma: np.ndarray = field(default_factory=lambda: np.zeros(0))
    l2: np.ndarray = field(default_factory=lambda: np.zeros(0))
    l1: np.ndarray = field(default_factory=lambda: np.zeros(0))
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        st, spec = self.stats, self.spec
        W, d = st["W"], len(st["mean"])
        normal = spec.solver == "normal"
        denom = W if normal else W - st["W2"] / W  # population (WLS) or sample std
        var = st["m2"] / denom if denom > 0 else np.zeros(d)
        sigma = np.sqrt(np.maximum(var, 0.0))
        # a constant column: zero, or rounding noise next to its mean
        sigma[sigma <= 1e-12 * np.maximum(np.abs(st["mean"]), 1.0)] = 0.0
        self.sigma = sigma
        self.mu = st["mean"] if spec.fit_intercept else np.zeros(d)
        if spec.family == GAUSSIAN:
            self.family, self.classes = GAUSSIAN, 1
        else:
            k = max(len(st["class_w"]), spec.classes)
            if spec.family == BINOMIAL and k > 2:
                raise DataValidationError(
                    f"family='binomial' takes 2 classes, but label column {spec.label!r} holds "
                    f"class indices up to {k - 1}; use family='multinomial' (or 'auto')"
                )
            multi = spec.family == MULTINOMIAL or (spec.family == "auto" and k > 2)
            self.family = MULTINOMIAL if multi else BINOMIAL
            self.classes = max(k, 2) if multi else 1
        lam, a = spec.reg, spec.elastic_net
        safe = np.where(sigma > 0, sigma, 1.0)
        c = np.ones(d) if spec.standardization else 1.0 / safe  # s_j / sigma_j
        scale = 1.0
        if self.family == GAUSSIAN:
            ystd = self.label_std()
            scale = 1.0 / ystd if ystd > 0 else 1.0
        l2 = np.tile(lam * (1 - a) * scale * c * c, self.classes)
        l1 = np.tile(lam * a * c, self.classes)
        extra = self.classes if self._has_intercepts else 0
        self.l2 = np.concatenate([l2, np.zeros(extra)])
        self.l1 = np.concatenate([l1, np.zeros(extra)])

    # -- layout ------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return len(self.sigma)

    @property
    def _has_intercepts(self) -> bool:
        return self.spec.fit_intercept and self.family != GAUSSIAN

    @property
    def size(self) -> int:
        return self.classes * self.dim + (self.classes if self._has_intercepts else 0)

    @property
    def fixed(self) -> np.ndarray:
        """Coordinates held at 0: the coefficients of constant features."""
        f = np.tile(self.sigma == 0, self.classes)
        return np.concatenate([f, np.zeros(self.size - len(f), dtype=bool)])

    def label_std(self) -> float:
        st = self.stats
        denom = st["W"] if self.spec.solver == "normal" else st["W"] - st["W2"] / st["W"]
        return math.sqrt(max(st["ym2"] / denom, 0.0)) if denom > 0 else 0.0

    # -- conversions -------------------------------------------------------------------

    def to_original(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k, d = self.classes, self.dim
        inv = np.divide(1.0, self.sigma, out=np.zeros(d), where=self.sigma > 0)
        B = theta[: k * d].reshape(k, d) * inv
        if self.family == GAUSSIAN:
            b = np.array([self.stats["ymean"] - B[0] @ self.mu if self.spec.fit_intercept else 0.0])
        elif self.spec.fit_intercept:
            b = theta[k * d :] - B @ self.mu
        else:
            b = np.zeros(k)
        return B, b

    def gradient(self, theta: np.ndarray, G: np.ndarray, gb: np.ndarray) -> np.ndarray:
        """Scaled-space gradient of the smooth objective from the original-space gradient
        ``(G (K x D), gb (K))`` of the mean loss."""
        inv = np.divide(1.0, self.sigma, out=np.zeros(self.dim), where=self.sigma > 0)
        gt = (G - gb[:, None] * self.mu) * inv
        parts = [gt.ravel()]
        if self._has_intercepts:
            parts.append(gb)
        return np.concatenate(parts) + self.l2 * theta

    def smooth(self, theta: np.ndarray, mean_loss: float) -> float:
        return mean_loss + 0.5 * float(self.l2 @ (theta * theta))

    def objective(self, theta: np.ndarray, mean_loss: float) -> float:
        """The full objective (the L1 term too)."""
        return self.smooth(theta, mean_loss) + float(self.l1 @ np.abs(theta))

    # -- the start point, its loss and gradient from the statistics ------------------------

    def start(self) -> tuple[np.ndarray, float, np.ndarray]:
        """``(theta0, mean loss, original-space gradient (G, gb) flattened)`` at the start
        point: coefficients 0, intercepts at the class log-odds (MLlib's start)."""
        st, k, d = self.stats, self.classes, self.dim
        W = st["W"]
        theta = np.zeros(self.size)
        Sx = W * st["mean"]  # sum_i w_i x_i
        if self.family == GAUSSIAN:
            # centred problem: r_i = -(y_i - ymean), or -y_i without an intercept
            if self.spec.fit_intercept:
                loss = 0.5 * st["ym2"] / W
                G = -st["xy"] / W
            else:
                yy = st["ym2"] + W * st["ymean"] ** 2
                loss = 0.5 * yy / W
                G = -(st["xy"] + W * st["mean"] * st["ymean"]) / W
            return theta, loss, np.concatenate([G, [0.0]])
        cw, cx = st["class_w"], st["class_x"]
        if self.family == BINOMIAL:
            w1 = cw[1] if len(cw) > 1 else 0.0
            w0 = cw[0]
            b0 = math.log(w1 / w0) if (self.spec.fit_intercept and w0 > 0 and w1 > 0) else 0.0
            if self.spec.fit_intercept:
                theta[-1] = b0
            p = 1.0 / (1.0 + math.exp(-b0))
            loss = (w1 * np.logaddexp(0.0, -b0) + w0 * np.logaddexp(0.0, b0)) / W
            x1 = cx[1] if len(cx) > 1 else np.zeros(d)
            G = (p * Sx - x1) / W
            gb = (p * W - w1) / W
            return theta, float(loss), np.concatenate([G, [gb]])
        full_w = np.zeros(k)
        full_w[: len(cw)] = cw
        full_x = np.zeros((k, d))
        full_x[: len(cx)] = cx
        intercepts = np.zeros(k)
        if self.spec.fit_intercept:
            intercepts = np.log1p(full_w)  # MLlib's smoothed class log-counts
            intercepts -= intercepts.mean()
            theta[k * d :] = intercepts
        lse = float(np.logaddexp.reduce(intercepts))
        probs = np.exp(intercepts - lse)
        loss = float(full_w @ (lse - intercepts)) / W
        G = (np.outer(probs, Sx) - full_x) / W
        gb = (probs * W - full_w) / W
        return theta, loss, np.concatenate([G.ravel(), gb])

    def split(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """``(G, gb, mean loss)`` from the summed feedback ``[G, gb, loss sum]``."""
        k, d, W = self.classes, self.dim, self.stats["W"]
        G = packed[: k * d].reshape(k, d) / W
        gb = packed[k * d : k * d + k] / W
        return G, gb, float(packed[-1]) / W

    # -- least squares from the statistics (normal equations) ---------------------------------

    def normal_quadratic(self) -> tuple[np.ndarray, np.ndarray, float]:
        """``(A, c, const)``: the mean half squared error is ``theta^T A theta / 2 - c^T
        theta + const`` in the scaled space."""
        st, W = self.stats, self.stats["W"]
        G, xy = st["gram"], st["xy"]
        if self.spec.fit_intercept:
            A, c, const = G / W, xy / W, 0.5 * st["ym2"] / W
        else:
            m = st["mean"]
            A = (G + W * np.outer(m, m)) / W
            c = (xy + W * m * st["ymean"]) / W
            const = 0.5 * (st["ym2"] + W * st["ymean"] ** 2) / W
        inv = np.divide(1.0, self.sigma, out=np.zeros(self.dim), where=self.sigma > 0)
        return A * np.outer(inv, inv), c * inv, const

    def solve_normal(
        self, *, tol: float, max_iter: int
    ) -> tuple[np.ndarray, list[float], bool, int]:
        """``(theta, objective history, converged, iterations)`` of least squares, exactly
        (L2 only) or by OWL-QN on the quadratic (an L1 term), in this process."""
        A, c, const = self.normal_quadratic()
        free = self.sigma > 0
        theta = np.zeros(self.dim)

        def value(t: np.ndarray) -> tuple[float, np.ndarray]:
            At = A @ t
            return 0.5 * float(t @ At) - float(c @ t) + const, At - c

        f0, _ = value(theta)
        history = [self.objective(theta, f0)]
        if not free.any():
            return theta, history, True, 0
        if not self.l1.any():
            H = A[np.ix_(free, free)] + np.diag(self.l2[free])
            try:
                L = np.linalg.cholesky(H)
                theta[free] = np.linalg.solve(L.T, np.linalg.solve(L, c[free]))
            except np.linalg.LinAlgError:
                self.warnings.append(
                    "the normal equations are singular (collinear features); the minimum-norm "
                    "least-squares solution is returned. Add reg > 0 for a unique one"
                )
                theta[free] = np.linalg.lstsq(H, c[free], rcond=None)[0]
            f, _ = value(theta)
            history.append(self.objective(theta, f))
            return theta, history, True, 1
        opt = LBFGS(theta, l1=self.l1, fixed=~free, max_iter=max_iter, tol=tol)
        while not opt.done:
            t = opt.point
            f, g = value(t)
            opt.tell(self.smooth(t, f), g + self.l2 * t)
        return opt.x, opt.history, opt.converged, opt.iterations

    def finish(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Original-scale ``(B, b)``, centred as MLlib centres an over-parameterised
        multinomial model (the intercepts always, the coefficients without L1/L2)."""
        B, b = self.to_original(theta)
        if self.family == MULTINOMIAL:
            if self.spec.reg == 0:
                B = B - B.mean(axis=0)
            if self.spec.fit_intercept:
                b = b - b.mean()
        return B, b


# -- Spark task ---------------------------------------------------------------------------


class _GLMTask(PartitionOperator):
    """Runs in a Spark task: caches its rows once; epoch 0 sends statistics, every later
    epoch the loss sum and gradient at the published point."""

    def __init__(self, plan: FeaturePlan, family: str, gram: bool) -> None:
        self.plan = plan
        self.family = family
        self.gram = gram

    def open(self, ctx: Any) -> None:
        self.cache = FeatureCache(self.plan, ctx.partition_id)
        self.checked = False

    def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
        self.cache.add(batch)

    def process_variables(self, variables: Any, ctx: Any, out: Any) -> None:
        self.vars = variables

    def close(self) -> None:
        self.cache.handed_over()

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        X, y, sw = self.cache.matrix(), self.cache.label(), self.cache.weight()
        phase = int(self.vars["phase"])
        if phase == DONE:
            return
        if not self.checked:
            validate_rows(self.plan, X, y, ctx.partition_id, classes=self.family != GAUSSIAN)
            self.checked = True
        if phase == STATS:
            out.feedback(partition_stats(X, y, sw, family=self.family, gram=self.gram))
            # the rows passed validation: kept for a refit while the statistics go out
            # and the coordinator solves (a one-pass fit does not wait for it)
            self.cache.keep()
            return
        B = np.asarray(self.vars["coef"], dtype=np.float64)
        b = np.asarray(self.vars["intercept"], dtype=np.float64)
        if self.family == GAUSSIAN or len(b) == 1:
            g = linear_gradient(X, y, B[0], float(b[0]), sw, logistic=self.family != GAUSSIAN)
            out.feedback(np.concatenate([g[: len(B[0]) + 1], g[-2:-1]]))  # [G, gb, loss]
        else:
            out.feedback(multinomial_gradient(X, y, B, b, sw))


class GLMCombiner:
    """``feedback_combine`` of the GLM fits: the partitions' statistics (epoch 0) merge
    as ``merge_stats`` merges them, the packed gradients add up; so with many subtasks
    the coordinator receives at most ``fan_in`` values per epoch (``coordinator._tree``)."""

    def merge(self, a: Any, b: Any) -> Any:
        if isinstance(a, dict):
            if a["W"] <= 0:
                return b
            if b["W"] <= 0:
                return a
            return merge_stats([a, b])
        return a + b

    def __repr__(self) -> str:
        return "GLMCombiner()"


# -- Ray coordinator actor ----------------------------------------------------------------


class _GLMServer(CoordinatorOperator):
    """Runs in the Ray coordinator actor: merges the statistics, runs the optimizer,
    publishes each point to evaluate; outputs ``objective`` per iteration and the
    ``summary`` at the end."""

    def __init__(self, spec: FitSpec) -> None:
        self.spec = spec

    def open(self, init_variables: Any, ctx: Any) -> None:
        self.parts: dict[int, Any] = {}
        self.problem: Problem | None = None
        self.opt: LBFGS | None = None
        self.t0 = time.time()
        self.reported = 0

    def process_feedback(self, value: Any, ctx: Any, out: Any) -> None:
        # one value per partition, or (GLMCombiner) their merge (source_partition None)
        source = ctx.source_partition
        self.parts[-1 if source is None else int(source)] = value

    def _report(self, history: list[float], out: Any) -> None:
        for v in history[self.reported :]:
            out.output("objective", v)
            out.output("objective_trace", (time.time() - self.t0, v))
        self.reported = len(history)

    def _finish(
        self,
        theta: np.ndarray,
        history: list[float],
        converged: bool,
        iters: int,
        reason: str,
        out: Any,
    ) -> None:
        assert self.problem is not None
        self._report(history, out)
        B, b = self.problem.finish(theta)
        out.publish_variables(phase=DONE, coef=B, intercept=b)
        out.output(
            "summary",
            {
                "family": self.problem.family,
                "classes": self.problem.classes,
                "solver": self.spec.solver,
                "objective_history": list(history),
                "total_iterations": iters,
                "converged": converged,
                "reason": reason,
                "warnings": list(self.problem.warnings),
                "rows": int(self.problem.stats["n"]),
            },
        )

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        parts = [self.parts[p] for p in sorted(self.parts)]
        self.parts = {}
        if self.problem is None:
            self._start(merge_stats(parts), out)
            return
        assert self.opt is not None
        packed = sum(parts[1:], parts[0].copy())
        G, gb, loss = self.problem.split(packed)
        theta = self.opt.point
        self.opt.tell(self.problem.smooth(theta, loss), self.problem.gradient(theta, G, gb))
        self._step(out)

    def _start(self, stats: dict[str, Any], out: Any) -> None:
        problem = self.problem = Problem(self.spec, stats)
        spec = self.spec
        if (problem.classes if problem.family == MULTINOMIAL else 1) != spec.rows:
            # more classes than the variables have rows for: end now, the driver runs the
            # fit again with the count (``linear._fit_glm``)
            out.output("classes", problem.classes)
            out.publish_variables(phase=DONE)
            return
        if problem.family == GAUSSIAN and problem.label_std() == 0 and spec.fit_intercept:
            problem.warnings.append(
                f"label column {spec.label!r} is constant: coefficients 0, intercept its value"
            )
            theta = np.zeros(problem.size)
            self._finish(theta, [0.0], True, 0, "constant label", out)
            return
        if problem.family == BINOMIAL and spec.fit_intercept:
            cw = stats["class_w"]
            if len(cw) < 2 or cw[0] == 0 or cw[1] == 0:
                # MLlib's answer: the intercept is +-inf, no coefficient is needed
                cls = 0 if len(cw) < 2 or cw[1] == 0 else 1
                problem.warnings.append(
                    f"every label is {cls}: coefficients 0, intercept {'-' if cls == 0 else '+'}inf"
                )
                theta = np.zeros(problem.size)
                theta[-1] = -math.inf if cls == 0 else math.inf
                self._finish(theta, [0.0], True, 0, "a single class", out)
                return
        if spec.solver == "normal":
            theta, history, conv, iters = problem.solve_normal(
                tol=min(spec.tol, 1e-12), max_iter=max(spec.max_iter, 1000)
            )
            self._finish(theta, history, conv, iters, "normal equations", out)
            return
        theta0, loss0, grad0 = problem.start()
        k, d = problem.classes, problem.dim
        self.opt = LBFGS(
            theta0,
            l1=problem.l1,
            fixed=problem.fixed,
            memory=spec.memory,
            max_iter=spec.max_iter,
            tol=spec.tol,
        )
        self.opt.tell(
            problem.smooth(theta0, loss0),
            problem.gradient(theta0, grad0[: k * d].reshape(k, d), grad0[k * d :]),
        )
        self._step(out)

    def _step(self, out: Any) -> None:
        opt = self.opt
        assert opt is not None and self.problem is not None
        if opt.done:
            self._finish(opt.x, opt.history, opt.converged, opt.iterations, opt.reason, out)
            return
        self._report(opt.history, out)
        B, b = self.problem.to_original(opt.point)
        out.publish_variables(phase=POINT, coef=B, intercept=b)
        out.criteria()
