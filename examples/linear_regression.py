"""Sync linear regression: the FLIP-176 example, on Spark + Ray.

    python examples/linear_regression.py --rows 500000 --features 20

The seed's body has a "Train" vertex (data-parallel: one subtask per partition) and a
"Parameters" vertex (parallelism 1). Here Train is a PartitionOperator running in the
Spark tasks, Parameters a CoordinatorOperator running in the Ray actor. Each epoch:
every Train subtask computes the gradient of its cached rows at the current weights and
feeds it back; Parameters sums the gradients of the epoch in partition order, takes a
step and publishes the new weights, which every subtask reads before the next epoch.
Mini-batches: with --batch-rows the subtasks use the next batch of their rows per epoch
(the seed's mini-batch variant); without, the full batch.
"""

from __future__ import annotations

import argparse

import numpy as np

import hybrid_iter as hi


class Train(hi.PartitionOperator):
    """Runs in a Spark task."""

    def __init__(self, features: list[str], label: str, batch_rows: int | None) -> None:
        self.features, self.label, self.batch_rows = features, label, batch_rows

    def open(self, ctx):
        self.cache = hi.NumpyCache(self.features, extra=[self.label])
        self.offset = 0

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w, self.b = variables["w"], float(variables["b"])

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        X, y = self.cache.matrix(), self.cache.column(self.label)
        if self.batch_rows and len(y):
            start = self.offset % len(y)
            X, y = X[start : start + self.batch_rows], y[start : start + self.batch_rows]
            self.offset = start + len(y)
        r = X @ self.w + self.b - y
        out.feedback((X.T @ r, float(r.sum()), float(r @ r), len(y)))


class Parameters(hi.CoordinatorOperator):
    """Runs in the Ray coordinator actor."""

    def __init__(self, learning_rate: float) -> None:
        self.lr = learning_rate

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])
        self.b = float(init_variables["b"])
        self.sum = None

    def process_feedback(self, value, ctx, out):
        self.sum = list(value) if self.sum is None else [a + b for a, b in zip(self.sum, value)]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        g, gb, sq, n = self.sum
        self.sum = None
        self.w = self.w - self.lr * g / n
        self.b = self.b - self.lr * gb / n
        out.output("loss", sq / n)
        out.publish_variables(w=self.w, b=self.b)


def generate(spark, rows: int, features: int, partitions: int, seed: int):
    from pyspark.sql import functions as F

    w_true = np.linspace(-2.0, 2.0, features)
    df = spark.range(rows, numPartitions=partitions).select(
        *[F.randn(seed + j).alias(f"x{j}") for j in range(features)]
    )
    y = sum(F.col(f"x{j}") * float(w_true[j]) for j in range(features)) + 1.5
    return df.withColumn("y", y + 0.1 * F.randn(seed + features)), w_true, 1.5


def main(
    session: hi.Session,
    *,
    rows: int = 200_000,
    features: int = 20,
    partitions: int = 2,
    epochs: int = 100,
    learning_rate: float = 0.5,
    batch_rows: int | None = None,
    tol: float = 0.0101,
    progress: bool = True,
) -> hi.IterationResult:
    df, w_true, b_true = generate(session.spark, rows, features, partitions, seed=11)
    cols = [f"x{j}" for j in range(features)]
    result = hi.iterate_bounded_streams_until_termination(
        init_variables={"w": np.zeros(features), "b": 0.0},
        data_streams=hi.ReplayableDataStreamList.not_replay(hi.DataStream(df, [*cols, "y"])),
        config=hi.IterationConfig(staleness=0, progress=progress, name="linreg"),
        body=hi.IterationBody(
            partition=Train(cols, "y", batch_rows),
            coordinator=Parameters(learning_rate),
            criteria=hi.TerminateOnMaxIterOrTol(epochs, tol),  # stops when the MSE <= tol
            # the coordinator only adds the feedback up: merge it in a tree on the way
            feedback_combine="sum",
        ),
    )
    err = float(np.max(np.abs(result.variables["w"] - w_true)))
    print(result.summary())
    print(f"max |w - w_true| = {err:.4f}, b = {float(result.variables['b']):.4f} (true {b_true})")
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--features", type=int, default=20)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-rows", type=int, default=None)
    args = ap.parse_args()
    with hi.Session.local(parallelism=args.partitions) as session:
        main(
            session,
            rows=args.rows,
            features=args.features,
            partitions=args.partitions,
            epochs=args.epochs,
            batch_rows=args.batch_rows,
        )
