"""Online logistic regression that trains while files land in a directory.

    python examples/online_logistic_regression.py --files 20 --rows 5000

A background thread drops Parquet files of labelled points into a directory, one every
--interval seconds; a Structured Streaming file source reads them (one file per
micro-batch) and every micro-batch is one sync round: each partition scores its rows
with the current model (prequential accuracy: the model is tested on data it has not
trained on yet), computes its gradient, and the coordinator takes one step and publishes
the new weights. The rolling accuracy is printed per batch; malformed rows (the
generator adds some) go to the dead-letter directory. Stop with Ctrl-C, or it ends after
the last file.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

import hybrid_iter as hi

FEATURES = 10


class Learner(hi.PartitionOperator):
    """Runs in a Spark task, on one micro-batch partition."""

    def open(self, ctx):
        self.cache = hi.NumpyCache([f"x{j}" for j in range(FEATURES)], extra=["label"])

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w, self.b = variables["w"], float(variables["b"])

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        X, y = self.cache.matrix(), self.cache.column("label")
        z = X @ self.w + self.b
        p = 1.0 / (1.0 + np.exp(-z))
        correct = int(((z > 0) == (y > 0.5)).sum())  # scored before the update: prequential
        r = p - y
        out.feedback(
            (X.T @ r, float(r.sum()), float(np.sum(np.logaddexp(0.0, z) - y * z)), correct, len(y))
        )


class Model(hi.CoordinatorOperator):
    """Runs in the Ray actor: one SGD step per micro-batch."""

    def __init__(self, learning_rate: float = 1.0, window: int = 5) -> None:
        self.lr, self.window = learning_rate, window

    def open(self, init_variables, ctx):
        self.w, self.b = np.array(init_variables["w"]), float(init_variables["b"])
        self.acc = None
        self.recent: deque = deque(maxlen=self.window)

    def process_feedback(self, value, ctx, out):
        self.acc = value if self.acc is None else tuple(a + b for a, b in zip(self.acc, value))

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if self.acc is None:
            return
        g, gb, loss, correct, n = self.acc
        self.acc = None
        self.w = self.w - self.lr * g / n
        self.b = self.b - self.lr * gb / n
        self.recent.append((correct, n))
        rolling = sum(c for c, _ in self.recent) / sum(m for _, m in self.recent)
        out.output("loss", loss / n)
        out.output("rolling_accuracy", rolling)
        out.publish_variables(w=self.w, b=self.b)


def drop_files(
    directory: Path, files: int, rows: int, interval: float, seed: int = 7, start: int = 0
) -> None:
    """Write labelled points as Parquet files, one per interval (plus a few bad rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    w_true = rng.normal(0, 2 / math.sqrt(FEATURES), FEATURES)
    for i in range(start, start + files):
        X = rng.standard_normal((rows, FEATURES))
        y = (rng.random(rows) < 1 / (1 + np.exp(-(X @ w_true)))).astype(float)
        cols = {f"x{j}": X[:, j] for j in range(FEATURES)}
        cols["x0"] = np.where(rng.random(rows) < 0.001, np.nan, cols["x0"])  # malformed rows
        table = pa.table({**cols, "label": y})
        tmp = directory / f".f{i:05d}.tmp"
        pq.write_table(table, tmp)
        tmp.rename(directory / f"f{i:05d}.parquet")  # lands whole
        time.sleep(interval)  # files arrive over time


def main(
    session: hi.Session,
    *,
    files: int = 20,
    rows: int = 5000,
    interval: float = 0.5,
    directory: str | None = None,
) -> dict:
    base = Path(directory or tempfile.mkdtemp(prefix="online_lr_"))
    incoming = base / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    drop_files(
        incoming, 1, rows, 0
    )  # the file source needs one file to infer nothing: schema given
    schema = ", ".join(f"x{j} double" for j in range(FEATURES)) + ", label double"
    stream = (
        session.spark.readStream.schema(schema)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(incoming))
    )
    producer = threading.Thread(
        target=drop_files,
        args=(incoming, files - 1, rows, interval),
        kwargs={"seed": 8, "start": 1},
        daemon=True,
    )

    def show(batch_id, records):
        acc = [r.value for r in records if r.tag == "rolling_accuracy"]
        if acc:
            print(f"batch {batch_id:4d}: rolling accuracy {acc[-1]:.4f}", flush=True)

    it = hi.iterate_unbounded_streams(
        {"w": np.zeros(FEATURES), "b": 0.0},
        hi.ReplayableDataStreamList.not_replay(
            hi.DataStream(stream, [*(f"x{j}" for j in range(FEATURES)), "label"])
        ),
        hi.IterationBody(Learner(), Model()),
        hi.OnlineConfig(
            checkpoint_location=str(base / "checkpoint"),
            trigger={"processingTime": "200 milliseconds"},
            on_outputs=show,
            name="online-lr",
        ),
    )
    producer.start()
    try:
        deadline = time.monotonic() + files * (interval + 5) + 60
        while it.progress.batches < files and time.monotonic() < deadline:
            if it.query.awaitTermination(0.5):  # the query runs; we watch its progress
                raise RuntimeError(f"the streaming query stopped: {it.exception()}")
    finally:
        producer.join(timeout=1)
        progress = it.progress
        accuracy = [r.value for r in it.outputs if r.tag == "rolling_accuracy"]
        it.stop()
    print(
        f"{progress.batches} micro-batches, {progress.rows:,} rows trained on, "
        f"{progress.dead_letters} malformed rows and {progress.dead_files} rejected files in "
        f"{base / 'checkpoint' / 'dead_letter'}; final rolling accuracy {accuracy[-1]:.4f}"
        if accuracy
        else "no batch processed"
    )
    print(progress.status_line())  # the line the iteration logs every log_every_seconds
    return {
        "batches": progress.batches,
        "rows": progress.rows,
        "dead_letters": progress.dead_letters,
        "dead_files": progress.dead_files,
        "accuracy": accuracy,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--interval", type=float, default=0.5)
    args = ap.parse_args()
    with hi.Session.local(parallelism=2) as session:
        main(session, files=args.files, rows=args.rows, interval=args.interval)
