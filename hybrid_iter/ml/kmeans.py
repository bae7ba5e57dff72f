"""KMeans (Lloyd's algorithm) with k-means|| or random initialisation, on Spark + Ray.

Runs where the core runs them: ``KMeans.fit`` and ``KMeansModel.transform`` on the
driver; ``_KMeansTask`` in each Spark task (its partition read once into a numpy
matrix); ``_KMeansServer`` in the Ray coordinator actor. Sync (lock step) only: each
epoch is one pass over the cached data.

The initialisation runs inside the same iteration, as epochs before Lloyd's:

* ``"random"``: epoch 0 picks ``k`` distinct rows uniformly (every subtask draws a
  seeded random key per row and sends its ``k`` smallest; the coordinator keeps the
  global ``k`` smallest: a uniform sample without replacement).
* ``"k-means||"`` (Bahmani et al., MLlib's default): the first centre is one uniform
  row (the same way); then ``init_steps`` times a cost pass (each row's squared
  distance to the nearest candidate) and a sampling pass (each row kept with
  probability ``2k * d^2 / cost``); a weights pass counts the rows nearest to each
  candidate, and the coordinator reduces the weighted candidates to ``k`` centres by
  greedy k-means++ and 30 Lloyd iterations locally (MLlib reduces them with plain
  k-means++; see ``_local_kmeans`` for why greedy).

Random draws are seeded by ``(seed, partition, step)``: the same data in the same
partitions with the same seed gives the same model. A centre that loses all its points
keeps its position (MLlib's rule) instead of becoming 0/0 = NaN. ``distance_measure=
"cosine"`` normalises the points (a zero vector is an error, as in MLlib), keeps the
centres normalised, and reports the cost as the sum of ``1 - cos``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator import RuntimeHooks

from .._body import IterationBody
from .._errors import DataValidationError
from .._operators import CoordinatorOperator, PartitionOperator
from ._base import (
    Model,
    check_column,
    check_dataframe,
    check_features_col,
    check_int,
    check_number,
    check_progress,
    run_iteration,
)
from ._features import COLUMNS, FeatureCache, FeaturePlan, resolve_features

__all__ = ["KMeans", "KMeansModel", "nearest_centres"]

PICK, COST, SAMPLE, WEIGHTS, LLOYD = range(5)
_INIT_MODES = ("k-means||", "random")
_MEASURES = ("euclidean", "cosine")
#: rows per block of the distance computation (bounds memory at ``block * k`` floats)
_BLOCK = 32768
#: above this many ``k * d`` literals ``transform`` uses a pandas UDF instead of SQL
SQL_MAX_LITERALS = 20000


def nearest_centres(
    X: np.ndarray,
    sq: np.ndarray,
    C: np.ndarray,
    *,
    sums: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(index, squared distance)`` of each row's nearest centre, block by block.

    With ``sums`` (``(k, d)``, zeroed) also adds each row to its centre's sum (a one-hot
    matrix product per block: one BLAS call instead of a pass per feature).
    """
    n, k = len(X), len(C)
    csq = np.einsum("ij,ij->i", C, C)
    idx = np.empty(n, dtype=np.intp)
    dmin = np.empty(n)
    rows = np.arange(min(n, _BLOCK))
    for s in range(0, n, _BLOCK):
        e = min(n, s + _BLOCK)
        m = e - s
        D = X[s:e] @ C.T
        D *= -2.0
        D += csq
        j = D.argmin(axis=1)
        idx[s:e] = j
        dmin[s:e] = D[rows[:m], j] + sq[s:e]
        if sums is not None:
            onehot = np.zeros((m, k))
            onehot[rows[:m], j] = 1.0
            sums += onehot.T @ X[s:e]
    np.maximum(dmin, 0.0, out=dmin)
    return idx, dmin


def _normalise_rows(C: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(C, axis=1, keepdims=True)
    return np.divide(C, norms, out=C.copy(), where=norms > 0)


def _local_kmeans(
    points: np.ndarray, weights: np.ndarray, k: int, rng: np.random.Generator, cosine: bool
) -> np.ndarray:
    """Weighted greedy k-means++ then 30 Lloyd iterations on the candidates (in the actor).

    Greedy: each pick draws ``2 + log k`` points by the k-means++ distribution and keeps
    the one that lowers the weighted cost most. Plain k-means++ (MLlib's) often spends a
    pick on a covered cluster once the covered ones together outweigh a missing one, and
    Lloyd never splits the two clusters one centre then sits between.
    """
    n = len(points)
    if n <= k:  # fewer candidates than centres: use them all (repeats stay empty)
        return np.array([points[i % n] for i in range(k)])
    sq = np.einsum("ij,ij->i", points, points)
    total = weights.sum()
    centres = np.empty((k, points.shape[1]))
    first = rng.choice(n, p=weights / total) if total > 0 else rng.integers(n)
    centres[0] = points[first]
    cost = np.maximum(sq - 2 * points @ centres[0] + centres[0] @ centres[0], 0.0)
    trials = 2 + int(math.log(k))
    for i in range(1, k):
        p = cost * weights
        s = p.sum()
        if s > 0:
            picks = rng.choice(n, size=trials, p=p / s)
        else:  # every candidate is a centre already
            picks = rng.integers(n, size=1)
        d = np.maximum(sq[None, :] - 2 * points[picks] @ points.T + sq[picks][:, None], 0.0)
        np.minimum(d, cost[None, :], out=d)
        best = int(np.argmin(d @ weights))  # first of equals: deterministic
        centres[i] = points[picks[best]]
        cost = d[best]
    for _ in range(30):
        idx, _ = nearest_centres(points, sq, centres)
        moved = False
        for c in range(k):
            mask = idx == c
            wsum = weights[mask].sum()
            if wsum > 0:
                new = weights[mask] @ points[mask] / wsum
                if cosine:
                    new = _normalise_rows(new[None, :])[0]
            else:
                new = points[rng.integers(n)]  # MLlib: an empty cluster takes a random point
            moved |= not np.array_equal(new, centres[c])
            centres[c] = new
        if not moved:
            break
    return centres


# -- Spark task ---------------------------------------------------------------------------


class _KMeansTask(PartitionOperator):
    """Runs in a Spark task: what each phase needs from the cached rows."""

    def __init__(
        self,
        plan: FeaturePlan,
        k: int,
        random_init: bool,
        seed: int,
        cosine: bool,
        hooks: RuntimeHooks | None = None,
    ) -> None:
        self.plan = plan
        self.k = k
        self.random_init = random_init
        self.seed = seed
        self.cosine = cosine
        self.hooks = hooks

    def open(self, ctx: Any) -> None:
        self.cache = FeatureCache(self.plan)
        self.X: np.ndarray | None = None
        self.dmin: np.ndarray | None = None
        self.seen = 0  # candidates already folded into dmin

    def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
        self.cache.add(batch)

    def process_variables(self, variables: Any, ctx: Any, out: Any) -> None:
        self.vars = variables

    def _data(self, ctx: Any) -> np.ndarray:
        if self.X is None:
            X = self.cache.matrix()
            if not np.isfinite(X).all():
                raise DataValidationError(
                    f"the features {list(self.plan.columns)} hold NaN or infinite values in "
                    f"partition {ctx.partition_id}; clean them first"
                )
            if self.cosine:
                norms = np.linalg.norm(X, axis=1)
                if (norms == 0).any():
                    raise DataValidationError(
                        "distance_measure='cosine' is not defined for zero-length vectors; "
                        f"partition {ctx.partition_id} holds {int((norms == 0).sum())} of them"
                    )
                X /= norms[:, None]
            self.X = X
            self.sq = np.einsum("ij,ij->i", X, X)
        return self.X

    def _fold_candidates(self, cand: np.ndarray, n_cand: int) -> None:
        """Update each row's squared distance to its nearest candidate with the new ones."""
        X = self._data_cached
        if n_cand > self.seen:
            _, d = nearest_centres(X, self.sq, cand[self.seen : n_cand])
            self.dmin = d if self.dmin is None else np.minimum(self.dmin, d)
            self.seen = n_cand

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        started = time.time()
        X = self._data_cached = self._data(ctx)
        t0 = time.perf_counter()  # the pass, not loading
        phase, n_cand, step = (int(v) for v in self.vars["state"])
        pid = ctx.partition_id
        if phase == PICK:
            m = self.k if self.random_init else 1
            keys = np.random.default_rng([self.seed, pid, 0]).random(len(X))
            take = np.argsort(keys, kind="stable")[:m]
            out.feedback((phase, started, keys[take], X[take]))
        elif phase == COST:
            self._fold_candidates(self.vars["cand"], n_cand)
            assert self.dmin is not None
            out.feedback((phase, started, float(self.dmin.sum())))
        elif phase == SAMPLE:
            assert self.dmin is not None
            total = float(self.vars["cost"])
            rng = np.random.default_rng([self.seed, pid, step + 1])
            keep = rng.random(len(X)) < 2.0 * self.k * self.dmin / total
            out.feedback((phase, started, X[keep]))
        elif phase == WEIGHTS:
            cand = self.vars["cand"][:n_cand]
            idx, _ = nearest_centres(X, self.sq, cand)
            out.feedback((phase, started, np.bincount(idx, minlength=n_cand).astype(float)))
        else:
            C = self.vars["centres"]
            sums = np.zeros(C.shape)
            idx, dmin = nearest_centres(X, self.sq, C, sums=sums)
            counts = np.bincount(idx, minlength=len(C)).astype(float)
            out.feedback((phase, started, sums, counts, float(dmin.sum())))
            self.dmin = None  # the init's distances are no longer needed
        if self.hooks is not None:
            self.hooks.after_epoch_compute(pid, time.perf_counter() - t0)


# -- Ray coordinator actor ----------------------------------------------------------------


class _KMeansServer(CoordinatorOperator):
    """Runs in the Ray coordinator actor: candidates, centres, phases, termination."""

    def __init__(
        self,
        *,
        k: int,
        random_init: bool,
        init_steps: int,
        max_iter: int,
        tol: float,
        seed: int,
        cosine: bool,
    ) -> None:
        self.k = k
        self.random_init = random_init
        self.init_steps = init_steps
        self.max_iter = max_iter
        self.tol = tol
        self.seed = seed
        self.cosine = cosine

    def open(self, init_variables: Any, ctx: Any) -> None:
        self.centres = np.array(init_variables["centres"])
        self.cand = np.array(init_variables["cand"])
        self.n_cand = 0
        self.phase = PICK
        self.step = 0
        self.cost = 0.0
        self.acc: list[Any] = []
        self.iterations = 0
        self.shift = math.inf
        self.t0 = math.inf

    def process_feedback(self, value: Any, ctx: Any, out: Any) -> None:
        self.t0 = min(self.t0, float(value[1]))
        self.acc.append(value)  # sync: in partition order

    def _publish(self, out: Any, **extra: Any) -> None:
        state = np.array([self.phase, self.n_cand, self.step], dtype=np.int64)
        out.publish_variables(state=state, **extra)

    def on_epoch_watermark_incremented(self, epoch: int, ctx: Any, out: Any) -> None:
        acc, self.acc = self.acc, []
        phase = self.phase
        if phase == PICK:
            keys = np.concatenate([a[2] for a in acc])
            rows = np.concatenate([a[3] for a in acc])
            order = np.argsort(keys, kind="stable")
            if self.random_init:
                if len(rows) < self.k:
                    raise DataValidationError(
                        f"k={self.k} but the data has only {len(rows)} rows; lower k"
                    )
                self.centres = rows[order[: self.k]].copy()
                self.phase = LLOYD
                self._publish(out, centres=self.centres)
            else:
                self.cand[0] = rows[order[0]]
                self.n_cand = 1
                self.phase = COST
                self._publish(out, cand=self.cand)
        elif phase == COST:
            self.cost = float(sum(a[2] for a in acc))
            # every row sits on a candidate: nothing left to sample
            self.phase = SAMPLE if self.cost > 0 else WEIGHTS
            out.publish_variables(cost=self.cost)
            self._publish(out)
        elif phase == SAMPLE:
            new = np.concatenate([a[2] for a in acc])
            room = len(self.cand) - self.n_cand
            if len(new) > room:  # rare (the expected sample is 2k per step): keep a random part
                rng = np.random.default_rng([self.seed, 1 << 20, self.step])
                new = new[np.sort(rng.choice(len(new), room, replace=False))]
            self.cand[self.n_cand : self.n_cand + len(new)] = new
            self.n_cand += len(new)
            self.step += 1
            self.phase = COST if self.step < self.init_steps else WEIGHTS
            self._publish(out, cand=self.cand)
        elif phase == WEIGHTS:
            weights = np.sum([a[2] for a in acc], axis=0)
            if weights.sum() < self.k:  # every row counts towards one candidate
                raise DataValidationError(
                    f"k={self.k} but the data has only {int(weights.sum())} rows; lower k"
                )
            rng = np.random.default_rng([self.seed, 1 << 21])
            self.centres = _local_kmeans(
                self.cand[: self.n_cand], weights, self.k, rng, self.cosine
            )
            self.phase = LLOYD
            self._publish(out, centres=self.centres)
        else:
            sums = np.sum([a[2] for a in acc], axis=0)
            counts = np.sum([a[3] for a in acc], axis=0)
            cost = float(sum(a[4] for a in acc))
            new = self.centres.copy()
            filled = counts > 0
            new[filled] = sums[filled] / counts[filled, None]  # empty clusters keep their centre
            if self.cosine:
                new = _normalise_rows(new)
                cost = cost / 2.0  # |x - c|^2 = 2 (1 - cos) for unit vectors
            self.shift = float(np.max(np.linalg.norm(new - self.centres, axis=1)))
            self.centres = new
            self.iterations += 1
            out.output("cost", cost)
            out.output("cost_trace", (time.time() - self.t0, cost))
            out.output("shift", self.shift)
            out.output("empty_clusters", int((~filled).sum()))
            out.publish_variables(centres=new)
        if self.phase != LLOYD or (self.iterations < self.max_iter and self.shift > self.tol):
            out.criteria()


# -- estimator and model --------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class KMeans:
    """KMeans clustering; ``fit(df)`` returns a ``KMeansModel``.

    ``k`` centres, ``init_mode`` ``"k-means||"`` (``init_steps`` rounds) or
    ``"random"``, ``max_iter`` Lloyd iterations at most, stopping earlier when no centre
    moved more than ``tol``; ``distance_measure`` ``"euclidean"`` or ``"cosine"``;
    deterministic for a ``seed`` (same data, same partitions).
    """

    features_col: str | Sequence[str] = "features"
    prediction_col: str = "prediction"
    k: int = 2
    max_iter: int = 20
    tol: float = 1e-4
    init_mode: str = "k-means||"
    init_steps: int = 2
    distance_measure: str = "euclidean"
    seed: int = 0
    parallelism: int | None = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        owner = "KMeans"
        object.__setattr__(self, "features_col", check_features_col(owner, self.features_col))
        check_column(owner, "prediction_col", self.prediction_col)
        check_int(owner, "k", self.k, minimum=2)
        check_int(owner, "max_iter", self.max_iter, minimum=1)
        check_number(owner, "tol", self.tol, low=0.0)
        check_int(owner, "init_steps", self.init_steps, minimum=1)
        check_int(owner, "seed", self.seed, minimum=0)
        check_int(owner, "parallelism", self.parallelism, minimum=1, optional=True)
        check_progress(owner, self.progress)
        from .._errors import IterationConfigError

        if self.init_mode not in _INIT_MODES:
            raise IterationConfigError(
                f"KMeans(init_mode=...) must be 'k-means||' or 'random', got {self.init_mode!r}"
            )
        if self.distance_measure not in _MEASURES:
            raise IterationConfigError(
                f"KMeans(distance_measure=...) must be 'euclidean' or 'cosine', got "
                f"{self.distance_measure!r}"
            )

    def fit(self, df: Any) -> KMeansModel:
        """Cluster ``df`` (one iteration; the data is read once into the subtasks)."""
        return self._fit(df)

    def _fit(self, df: Any, *, hooks: RuntimeHooks | None = None) -> KMeansModel:
        """``fit`` with test hooks (``hybrid_iter.testing.Straggler``) in every subtask."""
        check_dataframe("KMeans", df)
        plan = resolve_features(df, self.features_col)
        random_init = self.init_mode == "random"
        cosine = self.distance_measure == "cosine"
        # room for the k-means|| candidates: 1 + about 2k per step, with a margin
        cap = 1 if random_init else 1 + self.init_steps * 4 * self.k
        init = {
            "centres": np.zeros((self.k, plan.dim)),
            "cand": np.zeros((cap, plan.dim)),
            "state": np.array([PICK, 0, 0], dtype=np.int64),
            "cost": 0.0,
        }
        body = IterationBody(
            partition=_KMeansTask(plan, self.k, random_init, self.seed, cosine, hooks),
            coordinator=_KMeansServer(
                k=self.k,
                random_init=random_init,
                init_steps=self.init_steps,
                max_iter=self.max_iter,
                tol=float(self.tol),
                seed=self.seed,
                cosine=cosine,
            ),
            criteria=True,
        )
        result = run_iteration(
            df,
            plan,
            init,
            body,
            staleness=0,
            parallelism=self.parallelism,
            progress=self.progress,
            name="KMeans",
            progress_tag="cost",
        )
        fc = self.features_col
        params: dict[str, Any] = {
            "features_col": fc if isinstance(fc, str) else list(fc),
            "prediction_col": self.prediction_col,
            "k": self.k,
            "max_iter": self.max_iter,
            "tol": self.tol,
            "init_mode": self.init_mode,
            "init_steps": self.init_steps,
            "distance_measure": self.distance_measure,
            "seed": self.seed,
            "num_features": plan.dim,
        }
        costs = result.outputs.get("cost", [])
        params["training_cost"] = float(costs[-1]) if costs else None
        params["iterations"] = len(costs)
        centres = np.array(result.variables["centres"], dtype=np.float64)
        return KMeansModel(params, {"centres": centres}, result)


class KMeansModel(Model):
    """The centres of a KMeans clustering.

    ``transform(df)`` adds ``prediction_col``, the index of each row's nearest centre
    (an int; null for a zero vector under the cosine measure), as a Spark SQL expression
    that keeps every input column.
    """

    @property
    def cluster_centers(self) -> np.ndarray:
        return self._arrays["centres"]

    @property
    def training_cost(self) -> float | None:
        """The cost of the last Lloyd iteration (sum of squared distances, or of 1 - cos)."""
        return self.params.get("training_cost")

    def predict_numpy(self, X: np.ndarray) -> np.ndarray:
        """Nearest centre of each row of ``X`` (on the driver)."""
        X = np.asarray(X, dtype=np.float64)
        C = self.cluster_centers
        if self.params.get("distance_measure") == "cosine":
            X = _normalise_rows(X)
        return nearest_centres(X, np.einsum("ij,ij->i", X, X), C)[0]

    def cost_numpy(self, X: np.ndarray) -> float:
        """The clustering cost of the rows of ``X`` at these centres."""
        X = np.asarray(X, dtype=np.float64)
        if self.params.get("distance_measure") == "cosine":
            X = _normalise_rows(X)
            return float(
                nearest_centres(X, np.einsum("ij,ij->i", X, X), self.cluster_centers)[1].sum() / 2
            )
        return float(nearest_centres(X, np.einsum("ij,ij->i", X, X), self.cluster_centers)[1].sum())

    def transform(self, df: Any, *, features_col: Any = None) -> Any:
        from pyspark.sql import functions as F

        from .linear import _feature_array, _literal_array

        fc = features_col if features_col is not None else self.params["features_col"]
        C = self.cluster_centers
        k, d = C.shape
        cosine = self.params.get("distance_measure") == "cosine"
        kind, col = _feature_array(df, fc, d, "KMeansModel")
        if kind != COLUMNS and k * d > SQL_MAX_LITERALS:
            return df.withColumn(self.params["prediction_col"], _predict_udf(C, cosine)(col))

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
        return df.withColumn(self.params["prediction_col"], pred)


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
