"""Full-partition processing (FLIP-380) against Spark's own operators.

    python benchmarks/bench_full_partition.py                    # 10,000,000 rows, 2 cores
    python benchmarks/bench_full_partition.py --rows 2000000     # quicker
    python benchmarks/bench_full_partition.py --only sort_column,map_batches --repeats 6

One local SparkSession (``local[cores]``), one cached DataFrame of ``rows`` rows in
``partitions`` partitions (``id``, ``k = id % keys``, ``x`` uniform random), every
variant written to Spark's ``noop`` sink (or collected, for the few-row aggregates), the
pairs interleaved in each repeat so machine noise hits both sides alike:

* ``sort_column``: ``sort_partition("x")`` vs ``df.sortWithinPartitions("x")`` (target
  <= 1.1x); ``sort_key_fn``: ``sort_partition(lambda r: r.x)``, keys computed in Python
  into an order-preserving binary column that Spark sorts (reported).
* ``map_batches``: ``map_partition(fn, batches=True)`` vs the same ``fn`` in a plain
  ``mapInArrow`` (target <= 1.2x); ``map_rows``: ``map_partition(fn)`` over pyspark Rows
  vs a hand-written ``mapInArrow`` that does the same per-row work on ``to_pylist()``
  dicts (reported). Peak RSS of any one Python worker during each (the harness's watch:
  its high-water mark, restarted when the variant starts, read every 20 ms; workers are
  reused, as by default, so a worker's RSS carries what earlier variants left allocated:
  a floor, not a per-variant delta).
* ``aggregate_rows`` / ``aggregate_batches``: a Python ``AggregateFunction`` (count, sum)
  per partition, over Rows and over Arrow batches, vs the native
  ``groupBy(spark_partition_id()).agg(count, sum)``; ``aggregate_keyed``:
  ``key_by(df, "k").full_window_partition().aggregate`` (Arrow batches) vs
  ``groupBy("k").agg``.

Prints medians and ratios (of the medians, the median of each repeat's pair, and of the
best times); writes JSON to benchmarks/results/full_partition.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from _harness import Watch, local_spark, write_report  # noqa: E402

from spark_ops import AggregateFunction, full_window_partition, key_by  # noqa: E402

# -- what the workers run (this module is __main__: cloudpickle ships it by value) ------------


def double_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for b in batches:
        yield pa.record_batch({"id": b.column("id"), "y": pc.multiply(b.column("x"), 2.0)})


def double_rows(rows: Iterator) -> Iterator[tuple]:
    for r in rows:
        yield r.id, r.x * 2.0


def double_dicts_in_arrow(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The per-row work of ``double_rows`` written by hand against plain mapInArrow."""
    schema = pa.schema([("id", pa.int64()), ("y", pa.float64())])
    for b in batches:
        out = [(d["id"], d["x"] * 2.0) for d in b.to_pylist()]
        ids, ys = zip(*out) if out else ((), ())
        yield pa.record_batch(
            [pa.array(ids, pa.int64()), pa.array(ys, pa.float64())], schema=schema
        )


class CountSumRows(AggregateFunction):
    def create_accumulator(self):
        return [0, 0.0]

    def add(self, value, accumulator):
        accumulator[0] += 1
        accumulator[1] += value.x
        return accumulator

    def get_result(self, accumulator):
        return accumulator[0], accumulator[1]

    def merge(self, a, b):
        return [a[0] + b[0], a[1] + b[1]]


class CountSumBatches(CountSumRows):
    def add(self, value, accumulator):
        accumulator[0] += value.num_rows
        accumulator[1] += pc.sum(value.column("x")).as_py() or 0.0
        return accumulator


# -- measuring ------------------------------------------------------------------------------


def timed(action: Callable[[], object]) -> tuple[float, int]:
    """Seconds of ``action`` and the largest peak RSS of one Spark Python worker during it
    (read every 20 ms: a worker that starts and ends between two reads is not seen)."""
    with Watch(roles={"spark_python"}, interval=0.02) as watch:
        t = time.perf_counter()
        action()
        seconds = time.perf_counter() - t
    return seconds, watch.peak_one()


def noop(make: Callable) -> Callable[[], None]:
    """Build the DataFrame anew and write it to the noop sink: a fresh query each run, so
    no run reuses the shuffle files of an earlier one."""
    return lambda: make().write.format("noop").mode("overwrite").save()


def collect(make: Callable) -> Callable[[], object]:
    return lambda: make().collect()


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--driver-memory", default="6g")
    ap.add_argument(
        "--only", default=None, help="comma-separated variants, e.g. sort_column,map_batches"
    )
    ap.add_argument("--out", default=str(HERE / "results" / "full_partition.json"))
    args = ap.parse_args()

    from pyspark.sql import functions as F

    shuffle = {"spark.sql.shuffle.partitions": str(args.partitions)}
    spark = local_spark("bench_full_partition", args.cores, args.driver_memory, shuffle)
    try:
        df = (
            spark.range(args.rows, numPartitions=args.partitions)
            .select("id", (F.col("id") % args.keys).alias("k"), F.rand(7).alias("x"))
            .cache()
        )
        assert df.count() == args.rows
        window = full_window_partition(df)
        keyed = key_by(df, "k").full_window_partition()
        pid = F.spark_partition_id().alias("pid")

        # name -> (ours, baseline or None, target ratio or None)
        pairs: dict[str, tuple[Callable, Callable | None, float | None]] = {
            "sort_column": (
                noop(lambda: window.sort_partition("x")),
                noop(lambda: df.sortWithinPartitions("x")),
                1.1,
            ),
            "sort_key_fn": (
                noop(lambda: window.sort_partition(lambda r: r.x)),
                noop(lambda: df.sortWithinPartitions("x")),
                None,
            ),
            "map_batches": (
                noop(
                    lambda: window.map_partition(double_batches, "id long, y double", batches=True)
                ),
                noop(lambda: df.mapInArrow(double_batches, "id long, y double")),
                1.2,
            ),
            "map_rows": (
                noop(lambda: window.map_partition(double_rows, "id long, y double")),
                noop(lambda: df.mapInArrow(double_dicts_in_arrow, "id long, y double")),
                None,
            ),
            "aggregate_rows": (
                collect(lambda: window.aggregate(CountSumRows(), "n long, total double")),
                collect(lambda: df.groupBy(pid).agg(F.count("*"), F.sum("x"))),
                None,
            ),
            "aggregate_batches": (
                collect(
                    lambda: window.aggregate(
                        CountSumBatches(), "n long, total double", batches=True
                    )
                ),
                collect(lambda: df.groupBy(pid).agg(F.count("*"), F.sum("x"))),
                None,
            ),
            "aggregate_keyed": (
                collect(
                    lambda: keyed.aggregate(CountSumBatches(), "n long, total double", batches=True)
                ),
                collect(lambda: df.groupBy("k").agg(F.count("*"), F.sum("x"))),
                None,
            ),
        }
        if args.only:
            wanted = [v.strip() for v in args.only.split(",") if v.strip()]
            unknown = sorted(set(wanted) - set(pairs))
            if unknown:
                raise SystemExit(f"--only: unknown variants {unknown}; known: {sorted(pairs)}")
            pairs = {name: pairs[name] for name in wanted}
        # correctness first
        ours_agg = sorted(
            tuple(r) for r in window.aggregate(CountSumRows(), "n long, t double").collect()
        )
        native = df.groupBy(pid).agg(F.count("*"), F.sum("x")).orderBy("pid").collect()
        for (n, total), ref in zip(ours_agg, sorted((r[1], r[2]) for r in native)):
            assert n == ref[0] and abs(total - ref[1]) < 1e-6 * max(1.0, abs(ref[1]))
        # A small warm-up of each kind of job (JIT, worker imports) before anything is timed.
        small = full_window_partition(df.limit(50_000))
        small.sort_partition(lambda r: r.x).write.format("noop").mode("overwrite").save()
        small.map_partition(double_rows, "id long, y double").write.format("noop").mode(
            "overwrite"
        ).save()

        samples: dict[str, dict[str, list]] = {
            name: {"ours_s": [], "base_s": [], "ours_rss": [], "base_rss": []} for name in pairs
        }
        for rep in range(args.repeats):
            for name, (ours, base, _) in pairs.items():
                order = (
                    [("ours", ours), ("base", base)]
                    if rep % 2 == 0
                    else [("base", base), ("ours", ours)]
                )
                for side, action in order:
                    if action is None:
                        continue
                    seconds, rss = timed(action)
                    samples[name][f"{side}_s"].append(seconds)
                    samples[name][f"{side}_rss"].append(rss)
                    print(
                        f"  {name:18s} {side}: {seconds:7.2f} s  worker peak {rss / 2**20:7.1f} MiB",
                        flush=True,
                    )

        results = {}
        print(
            f"\n{args.rows:,} rows, {args.partitions} partitions, local[{args.cores}], median of {args.repeats}"
        )
        print(
            f"{'':18s} {'ours s':>8s} {'spark s':>8s} {'ratio':>6s} {'paired':>6s} {'best':>6s} "
            f"{'target':>6s}  {'ours MiB':>8s} {'spark MiB':>9s}"
        )
        for name, (_, _, target) in pairs.items():
            s = samples[name]
            ours_s, base_s = statistics.median(s["ours_s"]), statistics.median(s["base_s"])
            ratio = ours_s / base_s
            # On a shared machine the median ratio moves with the load; the median of the
            # ratios of each repeat's back-to-back pair and the ratio of the best times
            # move less.
            paired = statistics.median(o / b for o, b in zip(s["ours_s"], s["base_s"]))
            best = min(s["ours_s"]) / min(s["base_s"])
            results[name] = {
                "ours_s": ours_s,
                "spark_s": base_s,
                "ratio": ratio,
                "paired_ratio_median": paired,
                "best_ratio": best,
                "target_ratio": target,
                "meets_target": None if target is None else ratio <= target,
                "ours_rows_per_s": args.rows / ours_s,
                "ours_worker_peak_rss_mib": max(s["ours_rss"]) / 2**20,
                "spark_worker_peak_rss_mib": max(s["base_rss"]) / 2**20,
                "ours_all_s": s["ours_s"],
                "spark_all_s": s["base_s"],
            }
            t = f"{target:.1f}" if target else "-"
            print(
                f"{name:18s} {ours_s:8.2f} {base_s:8.2f} {ratio:6.2f} {paired:6.2f} {best:6.2f} "
                f"{t:>6s}  {max(s['ours_rss']) / 2**20:8.1f} {max(s['base_rss']) / 2**20:9.1f}"
            )
        report = {
            "benchmark": "full-partition processing (issue 6)",
            "rows": args.rows,
            "partitions": args.partitions,
            "cores": args.cores,
            "keys": args.keys,
            "repeats": args.repeats,
            "baselines": {
                "sort_column": "df.sortWithinPartitions('x')",
                "sort_key_fn": "df.sortWithinPartitions('x')",
                "map_batches": "df.mapInArrow(same fn)",
                "map_rows": "df.mapInArrow(same per-row work on to_pylist() dicts)",
                "aggregate_rows": "df.groupBy(spark_partition_id()).agg(count, sum)",
                "aggregate_batches": "df.groupBy(spark_partition_id()).agg(count, sum)",
                "aggregate_keyed": "df.groupBy('k').agg(count, sum)",
            },
            "results": results,
        }
        out = write_report(report, args.out)
        print(f"\nwrote {out}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
