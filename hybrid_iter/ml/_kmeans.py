"""The KMeans operators (Lloyd's algorithm with k-means|| or random initialisation):
``_KMeansTask`` in each Spark task (its partition read once into a numpy matrix),
``_KMeansServer`` in the Ray coordinator actor. Sync (lock step) only: each epoch is one
pass over the cached data. No ``pyspark.ml`` here: the tasks and the actor import this
module, the stages (``kmeans``) run on the driver.

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
from typing import Any

import numpy as np

from coordinator import RuntimeHooks
from coordinator._finite import all_finite

from .._errors import DataValidationError
from .._operators import CoordinatorOperator, PartitionOperator
from ._features import FeatureCache, FeaturePlan

__all__ = ["nearest_centres"]

PICK, COST, SAMPLE, WEIGHTS, LLOYD = range(5)
#: rows per block of the distance computation (bounds memory at ``block * k`` floats)
_BLOCK = 32768


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
        self.cache = FeatureCache(self.plan, ctx.partition_id)
        self.X: np.ndarray | None = None
        self.dmin: np.ndarray | None = None
        self.seen = 0  # candidates already folded into dmin

    def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
        self.cache.add(batch)

    def process_variables(self, variables: Any, ctx: Any, out: Any) -> None:
        self.vars = variables

    def close(self) -> None:
        self.cache.handed_over()  # kept alongside the passes (``_data``)

    def _data(self, ctx: Any) -> np.ndarray:
        if self.X is None:
            X = self.cache.matrix()
            if not all_finite(X):
                raise DataValidationError(
                    f"the features {list(self.plan.columns)} hold NaN or infinite values in "
                    f"partition {ctx.partition_id}; clean them first"
                )
            # validated: the array cache may keep them (before any scaling below, which
            # makes a copy: kept arrays are read-only and other fits read them as read)
            self.cache.keep()
            if self.cosine:
                norms = np.linalg.norm(X, axis=1)
                if (norms == 0).any():
                    raise DataValidationError(
                        "distance_measure='cosine' is not defined for zero-length vectors; "
                        f"partition {ctx.partition_id} holds {int((norms == 0).sum())} of them"
                    )
                X = X / norms[:, None]
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
