"""Logistic and linear regression by (mini-batch) gradient descent: ``solver="sgd"``.

Runs where the core runs them: ``_LinearTask`` in each Spark task of the iteration's
barrier stage (it reads its partition once into a numpy matrix and sends one packed
gradient per epoch); ``_LinearServer`` in the Ray coordinator actor (it holds the
weights and applies the gradients: in partition order at each epoch's alignment in sync
mode, on arrival in async and SSP modes). Nothing here imports pyspark.

The objective is MLlib's on the features as given (no standardisation): the mean loss
over the rows (log loss, or half the squared error) plus ``reg * (elastic_net * ||w||_1
+ (1 - elastic_net) / 2 * ||w||_2^2)``, the intercept not regularised. A step is ``w -=
learning_rate * (gradient + L2 term)`` followed by the L1 proximal step (soft
thresholding), which makes coefficients exactly zero under elastic-net regularisation.

Stopping: after ``max_iter`` epochs, or once the loss is <= ``tol`` (Flink ML's
absolute rule, kept for this solver). A loss that is not finite, or that stays above
its best value for ``DIVERGENCE_PATIENCE`` epochs in a row (full batch, sync; 4x as many
reports and 2x the best for mini-batches and async updates, whose losses are noisy),
stops the fit with an error naming ``learning_rate`` and ``standardization``: gradient
descent diverges or oscillates on unscaled features.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from coordinator import RuntimeHooks
from coordinator._finite import all_finite

from .._errors import DataValidationError
from .._operators import CoordinatorOperator, PartitionOperator
from ._features import FeatureCache, FeaturePlan

__all__ = ["DIVERGENCE_PATIENCE", "LossWatch", "linear_gradient", "logistic_terms"]

#: epochs in a row whose loss is above the best one before the fit is stopped
DIVERGENCE_PATIENCE = 5


class LossWatch:
    """The rule that stops gradient descent whose loss rises or oscillates, shared by
    this solver and ``hybrid_iter.ps.train``: a report counts as *worse* when its loss is
    above ``margin`` times the best loss reported so far (and, with ``above_first``, also
    above the first report's loss); ``rising`` says when ``patience`` reports in a row
    were worse. A new best, or any report that is not worse, restarts the count."""

    def __init__(self, *, above_first: bool = False) -> None:
        self.above_first = above_first
        self.first = math.nan
        self.best = math.inf
        self.worse = 0  # reports in a row that were worse

    def rising(self, loss: float, *, patience: int, margin: float) -> bool:
        if math.isnan(self.first):
            self.first = loss
        if loss < self.best:
            self.best, self.worse = loss, 0
        elif loss > self.best * margin + 1e-300 and (not self.above_first or loss > self.first):
            self.worse += 1
            return self.worse >= patience
        else:
            self.worse = 0
        return False


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
        hooks: RuntimeHooks | None = None,
    ) -> None:
        self.plan = plan
        self.logistic = logistic
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.hooks = hooks

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
            if not all_finite(X):
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
        t0 = time.perf_counter()  # the gradient, not loading
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
        if self.hooks is not None:  # e.g. a simulated straggler (hybrid_iter.testing)
            self.hooks.after_epoch_compute(ctx.partition_id, time.perf_counter() - t0)


# -- Ray coordinator actor ----------------------------------------------------------------


class SGDCombiner:
    """``feedback_combine`` of sync gradient descent: the packed gradients, losses and
    row counts add up; the last slot (when the epoch started) is the earliest."""

    def merge(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = a + b
        out[-1] = min(a[-1], b[-1])
        return out

    def __repr__(self) -> str:
        return "SGDCombiner()"


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
        full_batch: bool = True,
    ) -> None:
        self.full_batch = full_batch
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
        self.watch = LossWatch()

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
        fix = (
            f"lower learning_rate (now {self.lr:g}), or standardize the features "
            f"(pyspark.ml.feature.StandardScaler), or use solver='auto' (L-BFGS with "
            f"standardization=True, which needs no learning rate)"
        )
        if not math.isfinite(loss):
            raise FloatingPointError(f"the loss diverged ({loss}) at epoch {ctx.epoch}; {fix}")
        # full-batch sync GD with a small enough step lowers the loss every epoch; noisy
        # (mini-batch, async) losses get more patience and a wider margin
        noisy = not (ctx.is_sync and self.full_batch)
        patience = DIVERGENCE_PATIENCE * (4 if noisy else 1)
        margin = 2.0 if noisy else 1.0 + 1e-12
        if self.watch.rising(loss, patience=patience, margin=margin):
            raise FloatingPointError(
                f"gradient descent is not converging: the loss ({loss:.6g}) has stayed "
                f"above its best ({self.watch.best:.6g}) for {self.watch.worse} "
                f"{'updates' if noisy else 'epochs'} in a row (it rises or oscillates) "
                f"at epoch {ctx.epoch}; {fix}"
            )
        self.loss = loss
        out.output("loss", loss)
        out.output("loss_trace", (time.time() - self.t0, loss))

    def _publish(self, out: Any) -> None:
        out.publish_variables(coef=self.w, intercept=self.b)

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
