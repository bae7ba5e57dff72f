"""Operators of ``connect_attach_job.py``, importable by a Spark Connect server's Python
workers (which have no Ray: each subtask says whether Ray got imported in its process)."""

from __future__ import annotations

import sys

import numpy as np
from checkpoint_job import Grad
from ops import LinRegPartition

import hybrid_iter as hi


def _say_where(ctx, out) -> None:
    out.output("where", (ctx.partition_id, "ray" in sys.modules))


class WhereLinReg(LinRegPartition):
    def on_iteration_terminated(self, ctx, out):
        _say_where(ctx, out)
        super().on_iteration_terminated(ctx, out)


class WhereGrad(Grad):
    def on_iteration_terminated(self, ctx, out):
        _say_where(ctx, out)
        super().on_iteration_terminated(ctx, out)


class ReadsBig(hi.PartitionOperator):
    """Reports (partition, epoch, the large variable's first value, its length)."""

    def process_data(self, stream, batch, ctx, out):
        pass

    def process_variables(self, variables, ctx, out):
        big = variables["big"]
        out.output("seen", (ctx.partition_id, ctx.epoch, float(big[0]), len(big)))

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(1)

    def on_iteration_terminated(self, ctx, out):
        _say_where(ctx, out)


class PublishesBig(hi.CoordinatorOperator):
    """Publishes a large array whose values are the epoch after it."""

    def open(self, init_variables, ctx):
        self.size = len(init_variables["big"])

    def process_feedback(self, value, ctx, out):
        pass

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.publish_variables(big=np.full(self.size, float(epoch + 1)))


def with_class(df):
    """``df`` with a 0/1 label ``c`` (y above zero) for the logistic fit."""
    from pyspark.sql import functions as F

    return df.withColumn("c", (F.col("y") > 0).cast("double"))


def ps_linreg(params, batch):
    """``ps.train``'s gradient of the squared error of y ~ X w + b over the ``x*``
    columns."""
    names = [f"x{j}" for j in range(len(params["w"]))]
    X = np.column_stack([batch[n] for n in names])
    r = X @ params["w"] + params["b"] - batch["y"]
    return float(r @ r) / (2 * len(r)), {"w": X.T @ r / len(r), "b": r.mean()}


def ps_run(df, names, **kw):
    """The ``ps.train`` run both sides make: its parameters and loss."""
    from hybrid_iter import ps

    out = ps.train(
        df,
        ps_linreg,
        {"w": np.zeros(len(names)), "b": 0.0},
        optimizer=ps.SGD(0.1),
        epochs=2,
        batch_size=40,
        columns=[*names, "y"],
        num_shards=2,
        parallelism=2,
        progress=False,
        **kw,
    )
    try:
        return {
            "w": out.params["w"].tolist(),
            "b": float(out.params["b"]),
            "endpoint_calls": [s.get("endpoint_calls", 0) for s in out.shards],
        }
    finally:
        out.close()
