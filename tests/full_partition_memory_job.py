"""map_partition and sort_partition over one partition much larger than the memory the
Python worker may use, run in a process of its own.

Spark allows one SparkContext per process and the suite shares a ``Session.local``, so
``test_full_partition.py`` runs this module in a subprocess::

    PYTHONPATH=tests:. python -c "import full_partition_memory_job as j, sys; sys.exit(j.main())"

``main()`` starts a local SparkSession with a small Python worker memory limit
(``spark.executor.pyspark.memory``: an RLIMIT_AS that Spark sets in every worker, so
holding the partition would raise MemoryError) and a small JVM heap (so Spark's sort
must spill), pushes one partition of generated wide rows through ``map_partition``
(Rows, then Arrow batches) and ``sort_partition`` by a key function, checks the results
in Python as they stream back, and prints one JSON line prefixed with ``RESULT ``: rows,
bytes, each step's seconds, the workers' peak RSS and limit, and the bytes Spark spilled.
The functions live in this module (not ``__main__``) so Spark's workers import them by name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator

RESULT_PREFIX = "RESULT "


def _peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def _as_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_AS)[0]


def count_rows(rows: Iterator) -> Iterator[tuple]:
    """Rows mode: touch every value, hold none."""
    n = 0
    chars = 0
    for row in rows:
        n += 1
        chars += len(row.payload)
    yield n, chars, _peak_rss_bytes(), _as_limit()


def count_batches(batches: Iterator) -> Iterator[tuple]:
    import pyarrow.compute as pc

    n = 0
    chars = 0
    for b in batches:
        n += b.num_rows
        chars += pc.sum(pc.utf8_length(b.column("payload"))).as_py() or 0
    yield n, chars, _peak_rss_bytes(), _as_limit()


def sort_key(row) -> tuple:
    # A key no column holds: descending k, then ascending id.
    return (-row.k, row.id)


def check_sorted(batches: Iterator) -> Iterator[tuple]:
    """Streams the sorted partition back: is (-k, id) non-decreasing row after row?"""
    import numpy as np

    n = 0
    ok = True
    last = None
    for b in batches:
        k = b.column("k").to_numpy()
        ids = b.column("id").to_numpy()
        n += len(k)
        if len(k) == 0:
            continue
        keys = list(zip((-k).tolist(), ids.tolist()))
        if last is not None and keys[0] < last:
            ok = False
        if len(k) > 1:
            step_k = np.diff(-k)
            same = step_k == 0
            if (step_k < 0).any() or (np.diff(ids)[same] < 0).any():
                ok = False
        last = keys[-1]
    yield n, ok, _peak_rss_bytes(), _as_limit()


def _spilled_bytes(spark) -> int:
    """Disk bytes spilled by every stage so far, from Spark's status store (no UI needed)."""
    store = spark.sparkContext._jsc.sc().statusStore()
    sc = spark.sparkContext
    no_quantiles = sc._gateway.new_array(sc._jvm.double, 0)
    stages = store.stageList(None, False, False, no_quantiles, None)
    return sum(int(stages.apply(i).diskBytesSpilled()) for i in range(stages.size()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=700_000)
    p.add_argument("--width", type=int, default=1200, help="characters of payload per row")
    p.add_argument("--worker-memory", default="600m", help="spark.executor.pyspark.memory")
    p.add_argument("--jvm-memory", default="512m")
    p.add_argument("--batch-rows", type=int, default=2000)
    args = p.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from spark_ops import full_window_partition

    spark = (
        SparkSession.builder.master("local[1]")
        .appName("full_partition_memory_job")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.memory", args.jvm_memory)
        .config("spark.executor.pyspark.memory", args.worker_memory)
        .config("spark.python.worker.reuse", "false")  # a fresh worker (and peak) per task
        # The bounded buffer is one Arrow batch of this many rows: a few MB of wide rows.
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(args.batch_rows))
        .config("spark.task.maxFailures", "1")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    out: dict = {"rows": args.rows, "width": args.width, "worker_memory": args.worker_memory}
    try:
        # One partition; the JVM makes every row (nothing is materialised up front).
        df = spark.range(args.rows, numPartitions=1).select(
            "id",
            (F.col("id") * 7919 % 1000).alias("k"),
            F.expr(f"repeat(cast(id % 10 as string), {args.width})").alias("payload"),
        )
        out["bytes"] = args.rows * args.width
        window = full_window_partition(df)
        schema = "n long, chars long, peak_rss long, as_limit long"

        t = time.perf_counter()
        (row,) = window.map_partition(count_rows, schema).collect()
        out["map_rows"] = {**row.asDict(), "seconds": time.perf_counter() - t}

        t = time.perf_counter()
        (row,) = window.map_partition(count_batches, schema, batches=True).collect()
        out["map_batches"] = {**row.asDict(), "seconds": time.perf_counter() - t}

        t = time.perf_counter()
        spilled_before = _spilled_bytes(spark)
        ordered = window.sort_partition(sort_key)
        (row,) = (
            full_window_partition(ordered)
            .map_partition(
                check_sorted, "n long, ok boolean, peak_rss long, as_limit long", batches=True
            )
            .collect()
        )
        out["sort_key_fn"] = {
            **row.asDict(),
            "seconds": time.perf_counter() - t,
            "spilled_bytes": _spilled_bytes(spark) - spilled_before,
        }
    finally:
        spark.stop()
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
