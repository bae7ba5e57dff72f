"""A sync iteration with checkpoints, run in a subprocess by test_checkpoint.py so the
test can SIGKILL its driver and resume it (``python checkpoint_job.py DIR``)."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import hybrid_iter as hi

ROWS, DIMS, EPOCHS = 600, 3, 40


def data(spark):
    rng = np.random.default_rng(21)
    X = rng.standard_normal((ROWS, DIMS))
    y = X @ np.arange(1.0, DIMS + 1) + 0.1 * rng.standard_normal(ROWS)
    rows = [(i, *map(float, X[i]), float(y[i])) for i in range(ROWS)]
    cols = ["id", *[f"x{j}" for j in range(DIMS)], "y"]
    return spark.createDataFrame(rows, cols).repartition(2, "id").sortWithinPartitions("id")


class Grad(hi.PartitionOperator):
    """Full-batch least-squares gradient; ``pace`` seconds of simulated work per epoch."""

    def __init__(self, pace: float = 0.0):
        self.pace = pace

    def open(self, ctx):
        self.cache = hi.NumpyCache([f"x{j}" for j in range(DIMS)], extra=["y"])

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = variables["w"]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if self.pace:
            time.sleep(self.pace)  # simulated work, so the driver can be killed mid-run
        X, y = self.cache.matrix(), self.cache.column("y")
        out.feedback(X.T @ (X @ self.w - y))


class Step(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])
        self.g = None

    def process_feedback(self, value, ctx, out):
        self.g = value if self.g is None else self.g + value

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.w = self.w - 0.2 * self.g / ROWS
        self.g = None
        out.output("w0", float(self.w[0]))
        out.publish_variables(w=self.w)


def iterate(df, *, pace=0.0, **config):
    config = {"max_epochs": EPOCHS, "parallelism": 2, **config}
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(DIMS)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(**config),
        hi.IterationBody(Grad(pace), Step()),
    )


def main(directory: str) -> int:
    # warm_up=False: the warm-up's processes are not what this job tests, and on 2 cores
    # their start is the killed run's time
    with hi.Session.local(2, warm_up=False) as session:
        # the test resumes it with the same body (a resume with other operator parameters
        # is refused: the checkpoint's fingerprint covers them)
        result = iterate(
            data(session.spark),
            pace=0.05,
            checkpoint=hi.CheckpointConfig(directory, every_epochs=2),
        )
    print(
        "RESULT "
        + json.dumps(
            {
                "w": result.variables["w"].tolist(),
                "w_hex": result.variables["w"].tobytes().hex(),
                "epochs": result.epochs,
                "w0": result.outputs["w0"],
                "checkpoint": result.checkpoint,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
