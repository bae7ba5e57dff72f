"""Issues 4/16 benchmark: sustained rows/s of online logistic regression, and file-to-model latency.

    python benchmarks/bench_online.py
    python benchmarks/bench_online.py --batch-rows 10000 100000 --total-rows 400000   # quicker
    python benchmarks/bench_online.py --spark-reader     # also ours with parquet_reader="spark"

50 features, 2 partitions. For each micro-batch size (one Parquet file per micro-batch,
``maxFilesPerTrigger=1``, ``availableNow``):

* ``ours``: ``iterate_unbounded_streams`` in sync mode (every micro-batch: fresh partition
  operators compute the gradient, the coordinator applies it and publishes the weights).
* ``foreachbatch``: the same per-batch update written by hand: ``foreachBatch`` runs a
  ``mapInArrow`` that computes each partition's gradient with the weights shipped in the
  closure, collects the gradients to the driver and steps there.
* ``ours_spark_reader`` (with ``--spark-reader``): ours with ``parquet_reader="spark"``
  (Spark decodes the files, as the hand-written one does), to show what the pyarrow
  reader of a Parquet source is worth on its own.

Rows/s = rows / wall time of the whole query, start-up included (ours starts a Ray actor),
median of alternating repeats after a warm-up of both; "sustained" rows/s = rows of
batches 2..n / time from the end of batch 1 to the end of batch n (start-up excluded:
what a stream running for weeks sees). Then the latency from a file landing in
the directory to the first model version that includes it (ours, processingTime trigger
of 100 ms), p50 and p99 over ``--latency-samples`` files landing one after another. Writes JSON to benchmarks/results/online.json.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _harness import write_report

import hybrid_iter as hi

HERE = Path(__file__).resolve().parent
D = 50
COLS = [f"x{j}" for j in range(D)]
SCHEMA = ", ".join(f"{c} double" for c in COLS) + ", label double"
LR = 1.0


def write_files(directory: Path, rows: int, files: int, seed: int = 0, start: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w_true = rng.normal(0, 2 / math.sqrt(D), D)
    for i in range(start, start + files):
        X = rng.standard_normal((rows, D))
        y = (rng.random(rows) < 1 / (1 + np.exp(-(X @ w_true)))).astype(float)
        tmp = directory / f".f{i:06d}.tmp"
        pq.write_table(pa.table({**{c: X[:, j] for j, c in enumerate(COLS)}, "label": y}), tmp)
        os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))
        tmp.rename(directory / f"f{i:06d}.parquet")


class Grad(hi.PartitionOperator):
    def open(self, ctx):
        self.cache = hi.NumpyCache(COLS, extra=["label"])

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = variables["w"]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        X, y = self.cache.matrix(), self.cache.column("label")
        p = 1 / (1 + np.exp(-(X @ self.w)))
        out.feedback((X.T @ (p - y), len(y)))


class Step(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])
        self.acc = None

    def process_feedback(self, value, ctx, out):
        self.acc = value if self.acc is None else (self.acc[0] + value[0], self.acc[1] + value[1])

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if self.acc is not None:
            g, n = self.acc
            self.acc = None
            self.w = self.w - LR * g / n
            out.publish_variables(w=self.w)


def ours(
    spark, directory: Path, parallelism: int, reader: str = "arrow"
) -> tuple[float, np.ndarray, list[float]]:
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(directory))
    t = time.perf_counter()
    with hi.iterate_unbounded_streams(
        {"w": np.zeros(D)},
        hi.ReplayableDataStreamList.not_replay(stream),
        hi.IterationBody(Grad(), Step()),
        hi.OnlineConfig(
            trigger={"availableNow": True}, parallelism=parallelism, parquet_reader=reader
        ),
    ) as it:
        it.await_termination()
        seconds = time.perf_counter() - t
        import ray

        commits = [c for c, _ in ray.get(it._actor.online_state.remote()).recent_commits]
        return seconds, it.latest_variables()["w"], commits


def by_hand(spark, directory: Path, parallelism: int) -> tuple[float, np.ndarray, list[float]]:
    state = {"w": np.zeros(D)}
    commits: list[float] = []

    def step(batch_df, batch_id):
        w = state["w"]

        def grad(batches):
            g, n = np.zeros(D), 0
            for b in batches:
                X = np.column_stack([b.column(c).to_numpy() for c in COLS])
                y = b.column("label").to_numpy()
                g += X.T @ (1 / (1 + np.exp(-(X @ w))) - y)
                n += len(y)
            yield pa.RecordBatch.from_pydict({"g": [g.tobytes()], "n": [n]})

        rows = batch_df.repartition(parallelism).mapInArrow(grad, "g binary, n long").collect()
        g = sum(np.frombuffer(r.g) for r in rows)
        n = sum(r.n for r in rows)
        if n:
            state["w"] = w - LR * g / n
        commits.append(time.time())

    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(directory))
    t = time.perf_counter()
    query = stream.writeStream.foreachBatch(step).trigger(availableNow=True).start()
    query.awaitTermination()
    return time.perf_counter() - t, state["w"], commits


def sustained(commits: list[float], rows: int) -> float | None:
    """Rows/s between the first and the last batch's end (start-up excluded)."""
    if len(commits) < 2 or commits[-1] <= commits[0]:
        return None
    return (len(commits) - 1) * rows / (commits[-1] - commits[0])


def latency(spark, directory: Path, samples: int) -> list[float]:
    """File landing -> the model version that includes it (ours, processingTime trigger)."""
    write_files(directory, 10_000, 1, seed=5)
    stream = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(directory))
    out = []
    with hi.iterate_unbounded_streams(
        {"w": np.zeros(D)},
        hi.ReplayableDataStreamList.not_replay(stream),
        hi.IterationBody(Grad(), Step()),
        hi.OnlineConfig(trigger={"processingTime": "100 milliseconds"}, log_every_seconds=None),
    ) as it:
        while it.progress.batches < 1:
            time.sleep(0.05)
        for i in range(samples):
            before = it.progress.batches
            landed = time.perf_counter()
            write_files(directory, 10_000, 1, seed=6 + i, start=1 + i)
            # the benchmark's own clock: poll until the batch with this file has committed
            # (its model version published)
            while it.progress.batches == before:
                time.sleep(0.005)
            out.append(time.perf_counter() - landed)
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile by linear interpolation (q in [0, 1])."""
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--total-rows", type=int, default=2_000_000)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--latency-samples", type=int, default=40)
    ap.add_argument("--spark-reader", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "online.json"))
    args = ap.parse_args()
    report: dict = {
        "benchmark": "online logistic regression (issues 4, 16)",
        "note": "shared 2-core machine, other jobs running: figures are noisy",
        "features": D,
        "partitions": args.partitions,
        "batch_sizes": {},
    }
    root = Path(tempfile.mkdtemp(prefix="bench_online_"))
    with hi.Session.local(parallelism=args.partitions, driver_memory="4g") as session:
        warm = root / "warmup"  # JIT, Python workers, query planning: before any timing
        warm.mkdir()
        write_files(warm, 1000, 3)
        ours(session.spark, warm, args.partitions)
        by_hand(session.spark, warm, args.partitions)
        if args.spark_reader:
            ours(session.spark, warm, args.partitions, "spark")
        for rows in args.batch_rows:
            files = max(2, args.total_rows // rows)
            data = root / f"b{rows}"
            data.mkdir()
            write_files(data, rows, files)
            runs_ours, runs_hand, runs_spark = [], [], []
            sus_ours, sus_hand = [], []
            for r in range(args.repeats):  # alternate the order: no side runs warmer
                if r % 2 == 0:
                    t_ours, w_ours, c_ours = ours(session.spark, data, args.partitions)
                    t_hand, w_hand, c_hand = by_hand(session.spark, data, args.partitions)
                else:
                    t_hand, w_hand, c_hand = by_hand(session.spark, data, args.partitions)
                    t_ours, w_ours, c_ours = ours(session.spark, data, args.partitions)
                if args.spark_reader:
                    runs_spark.append(ours(session.spark, data, args.partitions, "spark")[0])
                runs_ours.append(t_ours)
                runs_hand.append(t_hand)
                sus_ours.append(sustained(c_ours, rows))
                sus_hand.append(sustained(c_hand, rows))
            t_ours, t_hand = statistics.median(runs_ours), statistics.median(runs_hand)
            same = float(np.max(np.abs(w_ours - w_hand)))
            total = rows * files
            entry = {
                "files": files,
                "rows": total,
                "ours_rows_per_s": total / t_ours,
                "foreachbatch_rows_per_s": total / t_hand,
                "ratio_ours_over_foreachbatch": t_hand / t_ours,
                "max_abs_diff_w": same,
                "runs": {"ours": runs_ours, "foreachbatch": runs_hand},
            }
            if all(x is not None for x in sus_ours + sus_hand):
                entry["sustained_ours_rows_per_s"] = statistics.median(sus_ours)
                entry["sustained_foreachbatch_rows_per_s"] = statistics.median(sus_hand)
                entry["sustained_ratio"] = statistics.median(sus_ours) / statistics.median(sus_hand)
            if runs_spark:
                entry["ours_spark_reader_rows_per_s"] = total / statistics.median(runs_spark)
                entry["ratio_ours_spark_reader_over_foreachbatch"] = t_hand / statistics.median(
                    runs_spark
                )
                entry["runs"]["ours_spark_reader"] = runs_spark
            report["batch_sizes"][str(rows)] = entry
            print(
                f"{rows:>9,} rows/batch x {files}: ours {entry['ours_rows_per_s']:,.0f} rows/s, "
                f"foreachBatch by hand {entry['foreachbatch_rows_per_s']:,.0f} rows/s "
                f"({entry['ratio_ours_over_foreachbatch']:.2f}x); same model to {same:.1e}"
                + (
                    f"; sustained (start-up excluded) {entry['sustained_ours_rows_per_s']:,.0f} vs "
                    f"{entry['sustained_foreachbatch_rows_per_s']:,.0f} rows/s "
                    f"({entry['sustained_ratio']:.2f}x)"
                    if "sustained_ratio" in entry
                    else ""
                )
                + (
                    f"; ours with Spark's reader "
                    f"{entry['ratio_ours_spark_reader_over_foreachbatch']:.2f}x"
                    if runs_spark
                    else ""
                ),
                flush=True,
            )
            shutil.rmtree(data)
        if args.latency_samples > 0:
            lat_dir = root / "latency"
            lat_dir.mkdir()
            lat = latency(session.spark, lat_dir, args.latency_samples)
            report["latency_s"] = {
                "p50": percentile(lat, 0.5),
                "p99": percentile(lat, 0.99),
                "max": max(lat),
                "samples": lat,
            }
            print(
                f"file landing -> first model version with it ({len(lat)} files): p50 "
                f"{percentile(lat, 0.5):.3f} s, p99 {percentile(lat, 0.99):.3f} s, max {max(lat):.3f} s"
            )
    shutil.rmtree(root, ignore_errors=True)
    out = write_report(report, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
