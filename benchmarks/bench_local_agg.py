"""A Python AggregateFunction through local_key_by vs Spark's own paths.

    python benchmarks/bench_local_agg.py                       # 10,000,000 rows, Zipf(1.2) over 100,000 keys
    python benchmarks/bench_local_agg.py --rows 2000000        # quicker
    python benchmarks/bench_local_agg.py --pandas-rows 1000000 # applyInPandas at 1M rows, extrapolated

Measured side by side in one run, on one cached DataFrame (``k`` bigint, ``v`` double;
keys drawn from Zipf(s) truncated to ``--keys`` keys, so key 1 holds ~20% of the rows at
s = 1.2), each aggregation executed with the ``noop`` sink (the whole plan runs, nothing
is collected), Spark ``local[--cores]``:

* ``native``: ``groupBy("k").agg(sum("v"))`` (JVM two-phase hash aggregation).
* ``local_agg_python``: ``local_key_by(df, "k").aggregate(PySum(), "v")`` where ``PySum``
  is a plain Python ``AggregateFunction`` with the vectorized ``add_batch`` hook.
* ``local_agg_builtin``: ``local_key_by(df, "k").sum("v")``.
* ``numpy_two_phase``: hand-written ``mapInArrow`` (numpy grouping per partition) then
  ``groupBy().agg(sum)`` on the partials: what a careful user writes by hand.
* ``local_agg_rowwise``: ``PySum`` without ``add_batch`` (one Python ``add`` per row).
* ``applyInPandas``: ``groupBy("k").applyInPandas`` summing each group (every row shuffled,
  one pandas call per key). ``--pandas-rows`` runs it on fewer rows; its time is then
  extrapolated linearly to ``--rows`` and labelled ``extrapolated`` (per-key overhead
  dominates it, so linear extrapolation overestimates it: the ratio is conservative only
  if you run it at full size).
* ``rdd_reduce_by_key`` (``--rdd``): ``df.rdd.map(...).reduceByKey(add)``.

Every contender gets the same accounting: one warm-up run, then ``--repeats`` timed runs
(median reported). Prints medians and ratios and the local aggregation's metrics (rows in, partials
shuffled, busiest reducer) and checks ``partials <= local tasks x distinct keys``;
writes JSON to benchmarks/results/local_agg.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _harness as harness
import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from spark_ops import AggregateFunction, local_key_by  # noqa: E402


class PySum(AggregateFunction):
    """A user's Python sum, with the vectorized hook."""

    def create_accumulator(self):
        return 0.0

    def add(self, value, accumulator):
        return accumulator + value

    def add_batch(self, values, accumulator):
        return accumulator + float(values.sum())

    def merge(self, a, b):
        return a + b

    def get_result(self, accumulator):
        return accumulator


class PySumRowwise(PySum):
    """The same aggregate without ``add_batch``: one ``add`` per row."""

    add_batch = AggregateFunction.add_batch


def zipf_generator(keys: int, s: float, seed: int):
    """A mapInArrow function drawing (k, v) rows; k ~ Zipf(s) over 1..keys (inverse CDF)."""

    def gen(batches):
        from pyspark import TaskContext

        weights = np.arange(1, keys + 1, dtype=np.float64) ** -s
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        rng = np.random.default_rng([seed, TaskContext.get().partitionId()])
        for b in batches:
            n = b.num_rows
            k = np.searchsorted(cdf, rng.random(n), side="right").astype(np.int64) + 1
            yield pa.RecordBatch.from_arrays(
                [pa.array(k), pa.array(rng.random(n))], names=["k", "v"]
            )

    return gen


def numpy_two_phase(df):
    from pyspark.sql import functions as F

    def partial(batches):
        ks, vs = [], []
        for b in batches:
            ks.append(b.column(0).to_numpy())
            vs.append(b.column(1).to_numpy())
        if not ks:
            return
        k, v = np.concatenate(ks), np.concatenate(vs)
        uniq, inv = np.unique(k, return_inverse=True)
        yield pa.RecordBatch.from_arrays(
            [pa.array(uniq), pa.array(np.bincount(inv, weights=v))], names=["k", "s"]
        )

    return df.mapInArrow(partial, "k long, s double").groupBy("k").agg(F.sum("s").alias("s"))


def apply_in_pandas(df):
    import pandas as pd

    def per_key(pdf):
        return pd.DataFrame({"k": [pdf["k"].iloc[0]], "s": [pdf["v"].sum()]})

    return df.groupBy("k").applyInPandas(per_key, "k long, s double")


def run_noop(df) -> float:
    t = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t


def measure(make, repeats: int) -> list[float]:
    """The same accounting for every contender: one warm-up run, then ``repeats`` runs."""
    return harness.measure(lambda: run_noop(make()), repeats, warmup=1).values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--partitions", type=int, default=None, help="input partitions (default: cores)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pandas-rows", type=int, default=None, help="rows for applyInPandas")
    p.add_argument("--skip-pandas", action="store_true")
    p.add_argument("--skip-rowwise", action="store_true")
    p.add_argument("--rdd", action="store_true", help="also time rdd.reduceByKey")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(HERE / "results" / "local_agg.json"))
    args = p.parse_args()
    partitions = args.partitions or args.cores

    from pyspark.sql import functions as F

    spark = harness.local_spark(
        "bench_local_agg",
        args.cores,
        "6g",
        {
            "spark.sql.shuffle.partitions": str(args.cores),
            "spark.default.parallelism": str(args.cores),
        },
    )
    try:
        results = run(spark, F, args, partitions)
    finally:
        spark.stop()
    print(f"\nwrote {harness.write_report(results, args.out)}")


def make_data(spark, rows: int, args, partitions: int):
    df = spark.range(rows, numPartitions=partitions).mapInArrow(
        zipf_generator(args.keys, args.zipf, args.seed), "k long, v double"
    )
    df = df.cache()
    df.count()
    return df


def run(spark, F, args, partitions: int) -> dict:
    t0 = time.perf_counter()
    data = make_data(spark, args.rows, args, partitions)
    print(
        f"data: {args.rows:,} rows, Zipf({args.zipf}) over {args.keys:,} keys, "
        f"{partitions} partitions, local[{args.cores}] (generated and cached in "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    hot = data.filter("k = 1").count() / args.rows
    distinct = data.select("k").distinct().count()
    print(f"hot key share {hot:.1%}, distinct keys {distinct:,}")

    view = local_key_by(data, "k")
    timings: dict[str, dict] = {}

    def record(name: str, times: list[float], **extra) -> None:
        timings[name] = {"median_s": statistics.median(times), "runs_s": times, **extra}
        print(
            f"  {name:<22} median {statistics.median(times):7.3f} s  runs {[round(t, 2) for t in times]}"
        )

    record("native", measure(lambda: data.groupBy("k").agg(F.sum("v").alias("s")), args.repeats))
    python_agg = view.aggregate(PySum(), "v", result_type="double")
    record("local_agg_python", measure(lambda: python_agg.df, args.repeats))
    metrics = python_agg.metrics
    record("local_agg_builtin", measure(lambda: view.sum("v").df, args.repeats))
    record("numpy_two_phase", measure(lambda: numpy_two_phase(data), args.repeats))
    if not args.skip_rowwise:
        rowwise = view.aggregate(PySumRowwise(), "v", result_type="double")
        record("local_agg_rowwise", measure(lambda: rowwise.df, args.repeats))
    if args.rdd:
        import operator

        def rdd_job():
            data.rdd.map(lambda r: (r[0], r[1])).reduceByKey(operator.add).count()

        record("rdd_reduce_by_key", harness.measure(rdd_job, args.repeats).seconds)
    if not args.skip_pandas:
        prow = args.pandas_rows or args.rows
        pdata = data if prow == args.rows else make_data(spark, prow, args, partitions)
        times = measure(lambda: apply_in_pandas(pdata), args.repeats)
        scale = args.rows / prow
        label = "measured" if prow == args.rows else f"extrapolated x{scale:g} from {prow:,} rows"
        record(
            "applyInPandas",
            [t * scale for t in times],
            measured_rows=prow,
            measured_s=times,
            how=label,
        )
        if pdata is not data:
            pdata.unpersist()

    # correctness: the Python aggregate equals the native sum per key
    native = {r[0]: r[1] for r in data.groupBy("k").agg(F.sum("v")).collect()}
    ours = python_agg.to_dict()
    worst = max(abs(ours[k] - v) / max(1.0, abs(v)) for k, v in native.items())
    assert set(ours) == set(native), "local_agg returned other keys than native"
    print(f"  results equal native (max relative difference {worst:.2e})")

    med = {k: v["median_s"] for k, v in timings.items()}
    ratios = {
        "local_agg_python_vs_native": med["local_agg_python"] / med["native"],
        "local_agg_builtin_vs_native": med["local_agg_builtin"] / med["native"],
        "numpy_two_phase_vs_native": med["numpy_two_phase"] / med["native"],
    }
    if "applyInPandas" in med:
        ratios["applyInPandas_vs_local_agg_python"] = med["applyInPandas"] / med["local_agg_python"]
    if "local_agg_rowwise" in med:
        ratios["local_agg_rowwise_vs_native"] = med["local_agg_rowwise"] / med["native"]
    bound = (metrics.local_tasks or 0) * distinct
    checks = {
        "python_within_3x_native": ratios["local_agg_python_vs_native"] <= 3.0,
        "partials_le_tasks_x_keys": metrics.partials_shuffled <= bound,
    }
    if "applyInPandas_vs_local_agg_python" in ratios:
        checks["python_20x_faster_than_applyInPandas"] = (
            ratios["applyInPandas_vs_local_agg_python"] >= 20.0
        )
    print("ratios:")
    for k, v in ratios.items():
        print(f"  {k:<36} {v:8.2f}x")
    print(f"metrics of local_agg_python: {metrics}")
    print(
        f"  partials {metrics.partials_shuffled:,} <= local tasks {metrics.local_tasks} x "
        f"distinct keys {distinct:,} = {bound:,}: {checks['partials_le_tasks_x_keys']}"
    )
    for k, v in checks.items():
        print(f"  {k}: {'PASS' if v else 'FAIL'}")
    return {
        "benchmark": "local_agg",
        "config": {
            "rows": args.rows,
            "keys": args.keys,
            "zipf": args.zipf,
            "cores": args.cores,
            "partitions": partitions,
            "repeats": args.repeats,
            "pandas_rows": args.pandas_rows or args.rows,
            "hot_key_share": hot,
            "distinct_keys": distinct,
        },
        "timings": timings,
        "ratios": ratios,
        "checks": checks,
        "metrics": metrics.__dict__,
        "accounting": "every contender: one warm-up run, then --repeats runs (noop sink)",
    }


if __name__ == "__main__":
    main()
