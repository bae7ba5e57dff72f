"""Operators and data of the online tests (shared with the subprocess job)."""

from __future__ import annotations

import os

import numpy as np

import hybrid_iter as hi

W_TRUE = np.array([1.0, -2.0, 0.5])
LR = 0.5
SCHEMA = "x0 double, x1 double, x2 double, y double"


def write_file(directory, index, rows=200, seed=0, extra_lines=""):
    """One CSV file of a linear model; files get increasing modification times so a file
    source reads them in order. Returns the arrays of its good rows."""
    rng = np.random.default_rng(seed * 1000 + index)
    X = rng.standard_normal((rows, 3))
    y = X @ W_TRUE + 0.01 * rng.standard_normal(rows)
    path = os.path.join(directory, f"part-{index:04d}.csv")
    tmp = os.path.join(directory, f".part-{index:04d}.tmp")
    with open(tmp, "w") as f:
        for r in range(rows):
            f.write(",".join(repr(float(v)) for v in (*X[r], y[r])) + "\n")
        f.write(extra_lines)
    os.utime(tmp, (1_700_000_000 + index, 1_700_000_000 + index))
    os.rename(tmp, path)  # appears whole, as a file landing
    return X, y


def reference(batches, w=None):
    """The same per-batch sync updates in numpy."""
    w = np.zeros(3) if w is None else w
    for X, y in batches:
        r = X @ w - y
        w = w - LR * (X.T @ r) / len(y)
    return w


class Grad(hi.PartitionOperator):
    def open(self, ctx):
        self.cache = hi.NumpyCache(["x0", "x1", "x2"], extra=["y"])

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = variables["w"]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        X, y = self.cache.matrix(), self.cache.column("y")
        r = X @ self.w - y
        out.feedback((X.T @ r, float(r @ r), len(y)))


class Step(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])
        self.acc = None

    def process_feedback(self, value, ctx, out):
        g, sq, n = value
        if ctx.is_sync:
            self.acc = value if self.acc is None else tuple(a + b for a, b in zip(self.acc, value))
        elif n:
            self.w = self.w - LR * g / n
            out.publish_variables(w=self.w)
            out.output("loss", sq / n)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if ctx.is_sync and self.acc is not None:
            g, sq, n = self.acc
            self.acc = None
            self.w = self.w - LR * g / n
            out.output("loss", sq / n)
            out.publish_variables(w=self.w)


def write_parquet_file(directory, index, rows=200, seed=0, null_rows=0):
    """One Parquet file of the same linear model (``null_rows`` extra rows with a null x1:
    malformed). Returns the arrays of its good rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed * 1000 + index)
    X = rng.standard_normal((rows, 3))
    y = X @ W_TRUE + 0.01 * rng.standard_normal(rows)
    cols = {f"x{j}": list(X[:, j]) + [1.0] * null_rows for j in range(3)}
    cols["x1"] = cols["x1"][:rows] + [None] * null_rows
    cols["y"] = list(y) + [0.0] * null_rows
    _land(
        directory, f"part-{index:04d}.parquet", index, lambda p: pq.write_table(pa.table(cols), p)
    )
    return X, y


def write_bad_file(directory, index, kind):
    """A file that a Parquet source cannot use: ``"text"`` (not Parquet at all) or
    ``"type"`` (Parquet whose x0 column is a string)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = f"part-{index:04d}.parquet"
    if kind == "text":
        _land(directory, name, index, lambda p: open(p, "w").write("x0,x1,x2,y\n1,2,3,4\n"))
    else:
        table = pa.table({"x0": ["a", "b"], "x1": [1.0, 2.0], "x2": [1.0, 2.0], "y": [1.0, 2.0]})
        _land(directory, name, index, lambda p: pq.write_table(table, p))
    return os.path.join(directory, name)


def _land(directory, name, index, write):
    tmp = os.path.join(directory, f".{name}.tmp")
    write(tmp)
    os.utime(tmp, (1_700_000_000 + index, 1_700_000_000 + index))
    os.rename(tmp, os.path.join(directory, name))


class Sums(hi.PartitionOperator):
    """Feeds back the row count and the column sums of its share of a micro-batch: the
    totals tell whether every row was applied exactly once, whatever Spark's batching."""

    def open(self, ctx):
        self.acc = np.zeros(5)

    def process_data(self, stream, batch, ctx, out):
        cols = [np.asarray(batch.column(c), dtype=float) for c in ("x0", "x1", "x2", "y")]
        self.acc += np.array([batch.num_rows, *(c.sum() for c in cols)])

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(self.acc)


class Total(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.total = np.array(init_variables["total"])

    def process_feedback(self, value, ctx, out):
        self.total = self.total + value

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.publish_variables(total=self.total)
        out.output("rows", float(self.total[0]))  # one output per batch: a sign of life


def totals(batches):
    """What ``Total`` must end with after every row of ``batches`` applied once."""
    return np.array(
        [sum(len(y) for _, y in batches)]
        + [sum(X[:, j].sum() for X, _ in batches) for j in range(3)]
        + [sum(y.sum() for _, y in batches)]
    )
