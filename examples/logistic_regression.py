"""Logistic regression on 1,000,000 x 50 generated points, trained sync and async.

    python examples/logistic_regression.py            # embedded: local Ray + Spark local[2]
    python examples/logistic_regression.py --rows 200000 --features 20 --partitions 2

The data is generated inside Spark (no driver-side arrays), each Spark task of the
barrier stage reads its partition once into a numpy matrix, and every epoch is one
actor call per task:

* sync (staleness=0): each epoch every partition sends its full-batch gradient; the
  coordinator sums them in partition order, steps, and publishes the new weights. Stops
  when the gradient norm falls below --tol (TerminateOnMaxIterOrTol) or at --max-epochs.
* async (staleness=None): each partition sends the gradient of its next mini-batch and
  reads the newest weights without waiting for the others; the coordinator (the
  parameter server) applies every gradient on arrival.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

import hybrid_iter as hi


class LogisticGradient(hi.PartitionOperator):
    """Runs in a Spark task: caches its rows as numpy, returns gradients per epoch."""

    def __init__(self, features: list[str], label: str, batch_rows: int | None = None) -> None:
        self.features = features
        self.label = label
        self.batch_rows = batch_rows

    def open(self, ctx):
        self.cache = hi.NumpyCache(self.features, extra=[self.label])
        self.offset = 0

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = variables["w"]
        self.b = float(variables["b"])

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        X, y = self.cache.matrix(), self.cache.column(self.label)
        if self.batch_rows is not None and len(y):
            # the next mini-batch, cyclically over the cached partition
            start = self.offset % len(y)
            idx = slice(start, min(start + self.batch_rows, len(y)))
            self.offset = idx.stop
            X, y = X[idx], y[idx]
        z = X @ self.w + self.b
        p = 1.0 / (1.0 + np.exp(-z))
        # log loss, computed stably: log(1 + e^z) - y z
        loss = float(np.sum(np.logaddexp(0.0, z) - y * z))
        r = p - y
        out.feedback((X.T @ r, float(r.sum()), loss, len(y)))


class ParameterServer(hi.CoordinatorOperator):
    """Runs in the Ray coordinator actor: holds the weights and applies gradients."""

    def __init__(self, learning_rate: float, total_rows: int) -> None:
        self.lr = learning_rate
        self.total_rows = total_rows

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"], dtype=float)
        self.b = float(init_variables["b"])
        self.acc = None
        self.recent: dict[int, tuple[float, int]] = {}

    def process_feedback(self, value, ctx, out):
        g, gb, loss, n = value
        if ctx.is_sync:  # accumulate; the step happens at the epoch's watermark
            if self.acc is None:
                self.acc = [np.array(g), gb, loss, n]
            else:
                self.acc[0] += g
                self.acc[1] += gb
                self.acc[2] += loss
                self.acc[3] += n
        elif n:  # async: apply this partition's mini-batch gradient now
            self.w -= self.lr * g / n
            self.b -= self.lr * gb / n
            self.recent[ctx.source_partition] = (loss, n)
            out.publish_variables(w=self.w, b=self.b)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if ctx.is_sync:
            g, gb, loss, n = self.acc
            self.acc = None
            g, gb = g / n, gb / n
            self.w -= self.lr * g
            self.b -= self.lr * gb
            out.output("loss", loss / n)
            out.output("grad_norm", math.sqrt(float(g @ g) + gb * gb))
            out.publish_variables(w=self.w, b=self.b)
        else:
            seen = sum(n for _, n in self.recent.values())
            if seen:
                out.output("loss", sum(loss for loss, _ in self.recent.values()) / seen)


def generate(spark, rows: int, features: int, partitions: int, seed: int):
    """Points x ~ N(0, I) with labels drawn from a known logistic model, built in Spark."""
    from pyspark.sql import functions as F

    rng = np.random.default_rng(seed)
    w_true = rng.normal(0.0, 3.0 / math.sqrt(features), features)
    b_true = 0.5
    cols = [F.randn(seed + j).alias(f"x{j}") for j in range(features)]
    df = spark.range(rows, numPartitions=partitions).select(*cols)
    logit = sum(F.col(f"x{j}") * float(w_true[j]) for j in range(features)) + b_true
    label = (F.rand(seed + features) < 1.0 / (1.0 + F.exp(-logit))).cast("double")
    return df.withColumn("label", label), w_true, b_true


def accuracy(df, features: list[str], w: np.ndarray, b: float) -> float:
    """Fraction of rows the model classifies right, computed by Spark."""
    from pyspark.sql import functions as F

    logit = sum(F.col(c) * float(wi) for c, wi in zip(features, w)) + b
    hit = ((logit > 0).cast("double") == F.col("label")).cast("double")
    return float(df.select(F.avg(hit)).first()[0])


def train(
    df, features, rows, *, mode: str, max_epochs: int, tol: float, batch_rows: int, lr_async: float
):
    init = {"w": np.zeros(len(features)), "b": 0.0}
    data = hi.ReplayableDataStreamList.not_replay(
        hi.DataStream(df, numeric_columns=[*features, "label"])
    )
    if mode == "sync":
        config = hi.IterationConfig(staleness=0, max_epochs=max_epochs, progress=True, name="sync")
        body = hi.IterationBody(
            partition=LogisticGradient(features, "label"),
            coordinator=ParameterServer(learning_rate=2.0, total_rows=rows),
            criteria=hi.TerminateOnMaxIterOrTol(max_epochs, tol, loss_tag="grad_norm"),
            # the coordinator only adds the feedback up: merge it in a tree on the way
            feedback_combine="sum",
        )
    else:
        config = hi.IterationConfig(
            staleness=None, max_epochs=max_epochs, progress=True, name="async"
        )
        body = hi.IterationBody(
            partition=LogisticGradient(features, "label", batch_rows=batch_rows),
            coordinator=ParameterServer(learning_rate=lr_async, total_rows=rows),
        )
    return hi.iterate_bounded_streams_until_termination(init, data, config, body)


def main(
    session: hi.Session,
    *,
    rows: int,
    features: int,
    partitions: int,
    max_epochs: int,
    tol: float = 1e-3,
    batch_rows: int = 20_000,
    seed: int = 42,
) -> dict[str, dict]:
    df, w_true, b_true = generate(session.spark, rows, features, partitions, seed)
    df = df.cache()
    t = time.perf_counter()
    df.count()
    print(
        f"generated {rows:,} x {features} points in {partitions} partitions "
        f"({time.perf_counter() - t:.1f} s)"
    )
    cols = [f"x{j}" for j in range(features)]
    summary: dict[str, dict] = {}
    for mode in ("sync", "async"):
        result = train(
            df,
            cols,
            rows,
            mode=mode,
            max_epochs=max_epochs,
            tol=tol,
            batch_rows=batch_rows,
            lr_async=0.5,
        )
        w, b = result.variables["w"], float(result.variables["b"])
        acc = accuracy(df, cols, w, b)
        oracle = accuracy(df, cols, w_true, b_true)
        loss = result.outputs.get("loss", [float("nan")])[-1]
        summary[mode] = {
            "final_loss": float(loss),
            "accuracy": acc,
            "oracle_accuracy": oracle,
            "epochs": result.epochs,
            "terminated_by": result.terminated_by,
            "seconds_per_epoch": result.seconds_per_epoch,
            "seconds": result.seconds,
            "updates_per_partition": dict(result.feedback_counts),
        }
        print(
            f"{mode:>5}: final loss {float(loss):.5f} | accuracy {acc:.4f} "
            f"(true model {oracle:.4f}) | {result.epochs} epochs, terminated by "
            f"{result.terminated_by} | {result.seconds_per_epoch * 1000:.1f} ms/epoch | "
            f"{result.seconds:.1f} s total | updates per partition "
            f"{dict(result.feedback_counts)}"
        )
    df.unpersist()
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--features", type=int, default=50)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--max-epochs", type=int, default=200)
    ap.add_argument(
        "--tol", type=float, default=1e-3, help="sync: stop when the gradient norm is below"
    )
    ap.add_argument(
        "--batch-rows", type=int, default=20_000, help="async: mini-batch rows per partition"
    )
    args = ap.parse_args()
    with hi.Session.local(parallelism=args.partitions) as session:
        main(
            session,
            rows=args.rows,
            features=args.features,
            partitions=args.partitions,
            max_epochs=args.max_epochs,
            tol=args.tol,
            batch_rows=args.batch_rows,
        )
