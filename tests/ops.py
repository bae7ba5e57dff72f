"""Operators shared by the tests (importable in Spark workers and the Ray actor)."""

from __future__ import annotations

import time

import numpy as np

import hybrid_iter as hi


def make_regression(
    spark, rows: int, dims: int, partitions: int, seed: int = 7, noise: float = 0.1
):
    """A DataFrame x0..x{d-1}, y = x . (1..d) + 0.5 + noise, and the same as numpy."""
    from pyspark.sql import functions as F

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, dims))
    y = X @ np.arange(1, dims + 1, dtype=float) + 0.5 + noise * rng.standard_normal(rows)
    data = [(i, *map(float, X[i]), float(y[i])) for i in range(rows)]
    cols = ["id", *[f"x{j}" for j in range(dims)], "y"]
    df = spark.createDataFrame(data, cols).repartition(partitions, "id").sortWithinPartitions("id")
    # Make the numpy reference see rows in the same order the subtasks will.
    df = df.select(*[F.col(c) for c in cols]).cache()
    df.count()
    return df, X, y


def numpy_linreg(X, y, lr, epochs, intercept=False):
    """Full-batch gradient descent; the same arithmetic as LinReg* below."""
    w = np.zeros(X.shape[1])
    b = 0.0
    n = len(y)
    losses = []
    for _ in range(epochs):
        r = X @ w + b - y
        losses.append(float(r @ r) / n)
        w = w - lr * (X.T @ r) / n
        if intercept:
            b = b - lr * r.sum() / n
    return w, b, losses


class LinRegPartition(hi.PartitionOperator):
    """Least-squares gradient of the subtask's rows (stream 0) at the current variables."""

    def __init__(self, features, label="y", delay_partition=None, delay_s=0.0):
        self.features = list(features)
        self.label = label
        self.delay_partition = delay_partition
        self.delay_s = delay_s

    def open(self, ctx):
        self.cache = hi.NumpyCache(self.features, extra=[self.label])

    def process_data(self, stream, batch, ctx, out):
        if stream == 0:
            self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = variables["w"]
        self.b = float(variables["b"]) if "b" in variables else 0.0

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if ctx.partition_id == self.delay_partition:
            time.sleep(self.delay_s)  # a simulated straggler, not synchronisation
        X = self.cache.matrix()
        y = self.cache.column(self.label)
        r = X @ self.w + self.b - y
        out.feedback({"g": X.T @ r, "gb": float(r.sum()), "sq": float(r @ r), "n": len(y)})


class GradientDescent(hi.CoordinatorOperator):
    """Sync: sum an epoch's gradients in partition order, then step. Async: step on each."""

    def __init__(self, lr, total_rows, intercept=False):
        self.lr = lr
        self.total_rows = total_rows
        self.intercept = intercept

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"], dtype=float)
        self.b = float(init_variables.get("b", 0.0))
        self.acc = None

    def _step(self, g, gb):
        self.w = self.w - self.lr * g / self.total_rows
        if self.intercept:
            self.b = self.b - self.lr * gb / self.total_rows

    def _publish(self, out):
        if self.intercept:
            out.publish_variables(w=self.w, b=self.b)
        else:
            out.publish_variables(w=self.w)

    def process_feedback(self, value, ctx, out):
        if ctx.is_sync:
            if self.acc is None:
                self.acc = dict(value)
            else:
                for k in ("g", "gb", "sq", "n"):
                    self.acc[k] = self.acc[k] + value[k]
        else:
            # Async: each partition's gradient is a step of its own, scaled to its share.
            share = value["n"] / self.total_rows if value["n"] else 0.0
            if value["n"]:
                self.w = self.w - self.lr * share * value["g"] / value["n"]
                self.last_loss = value["sq"] / value["n"]
            out.output("partition_loss", (ctx.source_partition, value["sq"] / max(value["n"], 1)))
            self._publish(out)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if ctx.is_sync:
            acc, self.acc = self.acc, None
            out.output("loss", acc["sq"] / self.total_rows)
            self._step(acc["g"], acc["gb"])
            self._publish(out)
        else:
            out.output("loss", getattr(self, "last_loss", float("nan")))


class Recorder(hi.PartitionOperator):
    """Records every callback as an output ("event", (pid, kind, epoch)); feeds back a
    token while ``epoch < feedback_until``."""

    def __init__(self, feedback_until=10**9, criteria_until=None):
        self.feedback_until = feedback_until
        self.criteria_until = criteria_until

    def open(self, ctx):
        self.pid = ctx.partition_id
        self.rows = 0

    def _event(self, out, kind, epoch):
        out.output("event", (self.pid, kind, epoch))

    def process_data(self, stream, batch, ctx, out):
        self.rows += batch.num_rows

    def process_variables(self, variables, ctx, out):
        self._event(out, "variables", int(variables["version"]))

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self._event(out, "watermark", epoch)
        if epoch < self.feedback_until:
            out.feedback(self.rows)
        if self.criteria_until is not None and epoch < self.criteria_until:
            out.criteria()

    def on_iteration_terminated(self, ctx, out):
        self._event(out, "terminated", ctx.epoch)


class RecordingCoordinator(hi.CoordinatorOperator):
    """Records its callbacks as ("coord", (kind, epoch)) and publishes a version number."""

    def __init__(self, publish=True, criteria_until=None, publish_until=None):
        self.publish = publish
        self.criteria_until = criteria_until
        self.publish_until = publish_until

    def open(self, init_variables, ctx):
        self.version = int(init_variables["version"])
        self.feedback_epochs = []

    def process_feedback(self, value, ctx, out):
        self.feedback_epochs.append(ctx.epoch)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("coord", ("watermark", epoch, sorted(set(self.feedback_epochs))))
        self.feedback_epochs = []
        if self.publish and (self.publish_until is None or epoch < self.publish_until):
            self.version += 1
            out.publish_variables(version=self.version)
        if self.criteria_until is not None and epoch < self.criteria_until:
            out.criteria()

    def on_iteration_terminated(self, ctx, out):
        out.output("coord", ("terminated", ctx.epoch, []))


class PidCoordinator(RecordingCoordinator):
    """A ``RecordingCoordinator`` that outputs its process id ("coordinator_pid") when it
    opens, and fails at ``fail_at`` (an epoch) when given."""

    def __init__(self, fail_at=None, **kwargs):
        super().__init__(**kwargs)
        self.fail_at = fail_at

    def open(self, init_variables, ctx):
        super().open(init_variables, ctx)
        self.seen = sorted(init_variables)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        import os

        if epoch == 0:
            out.output("coordinator_pid", os.getpid())
            out.output("init_names", self.seen)
        if epoch == self.fail_at:
            raise RuntimeError(f"coordinator fails at epoch {epoch}")
        super().on_epoch_watermark_incremented(epoch, ctx, out)
