"""The start of each session kind to its first epoch: Session.local and Session.on_spark.

    python benchmarks/bench_session_start.py [--repeats 3]

Each start runs in a fresh process (a process keeps one JVM and one SparkContext), one
after the other, ``--repeats`` times per kind:

* ``local``: ``Session.local(2)`` (Ray on 127.0.0.1 and Spark ``local[2]``, both started
  here), then a one-epoch sync iteration (the linear regression of
  tests/on_spark_job.py over 2,000 rows in 2 partitions);
* ``on_spark``: a SparkSession on a ``local-cluster[2, 2, 1024]`` master (the user's
  cluster: two executor JVMs of two cores; its start and the executors' registration
  are reported apart, as "spark"), then ``Session.on_spark(spark)`` (Ray on Spark: its
  head here, two Ray worker nodes as Spark tasks; the probe job; token and loopback
  handling), then the same one-epoch iteration on the two slots the worker nodes leave.

"To first epoch" is from the session call to the end of that iteration (data read,
coordinator started, one epoch, results back). Reported: the medians of each part and
the ratio on_spark / local, written to ``benchmarks/results/session_start.json``. Ray
on Spark waits about 20 s by itself (its head's start-up sleep, its worker-node launch
intervals), as its documentation says; the environment sets its two waits that can be
shortened as Ray's own tests do (``RAY_ON_SPARK_BACKGROUND_JOB_STARTUP_WAIT=1``,
``RAY_ON_SPARK_RAY_WORKER_NODE_STARTUP_INTERVAL=2``). Noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "tests"
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from _harness import ratio, run_worker, write_report  # noqa: E402

MiB = 1 << 20
ROWS = 2000


def _first_epoch(spark: Any) -> tuple[float, list[float]]:
    """A one-epoch sync iteration of tests/on_spark_job.py's linear regression."""
    import numpy as np
    from pyspark.sql.types import DoubleType, StructField, StructType

    import hybrid_iter as hi

    sys.path.insert(0, str(TESTS))
    import on_spark_job as job

    X, y = job.make_data(ROWS)
    schema = StructType(
        [StructField(c, DoubleType(), False) for c in job.FEATURES]
        + [StructField("y", DoubleType(), False)]
    )
    rows = [(*map(float, X[i]), float(y[i])) for i in range(ROWS)]
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), schema)
    t = time.perf_counter()
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(len(job.FEATURES))},
        hi.ReplayableDataStreamList.not_replay(
            hi.DataStream(df, numeric_columns=[*job.FEATURES, "y"])
        ),
        hi.IterationConfig(staleness=0, max_epochs=1, progress=False, parallelism=2),
        hi.IterationBody(partition=job.LinRegGradient(), coordinator=job.GradientStep(job.LR)),
    )
    return time.perf_counter() - t, [float(v) for v in result.variables["w"]]


def worker(kind: str) -> dict[str, Any]:
    """In a fresh process: one start of ``kind`` to its first epoch."""
    import hybrid_iter as hi

    out: dict[str, Any] = {"kind": kind}
    root: str | None = None
    if kind == "local":
        t0 = time.perf_counter()
        session = hi.Session.local(2, driver_memory="1g")
        out["spark_seconds"] = 0.0  # started by the session, inside session_seconds
    else:
        from pyspark.sql import SparkSession

        t = time.perf_counter()
        spark = (
            SparkSession.builder.master("local-cluster[2, 2, 1024]")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.executor.memory", "512m")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        from hybrid_iter._session.on_spark_plan import wait_for_executors as _wait_for_executors

        _wait_for_executors(spark, 300)  # the user's cluster is up before the session
        out["spark_seconds"] = time.perf_counter() - t
        root = tempfile.mkdtemp(prefix="hi-bench-", dir="/tmp")  # short socket paths
        t0 = time.perf_counter()
        session = hi.Session.on_spark(
            spark,
            ray_temp_root_dir=root,
            setup_options={
                "memory_worker_node": 512 * MiB,
                "object_store_memory_worker_node": 128 * MiB,
                "memory_head_node": 512 * MiB,
                "object_store_memory_head_node": 128 * MiB,
            },
        )
    with session:
        out["session_seconds"] = time.perf_counter() - t0
        out["first_epoch_seconds"], out["w"] = _first_epoch(session.spark)
        out["to_first_epoch_seconds"] = time.perf_counter() - t0
        out["task_slots"] = session.describe()["task_slots"]
        t = time.perf_counter()
    out["stop_seconds"] = time.perf_counter() - t
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "PYSPARK_", "SPARK_", "HYBRID_ITER_"))
    }
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ON_SPARK_BACKGROUND_JOB_STARTUP_WAIT": "1",
            "RAY_ON_SPARK_RAY_WORKER_NODE_STARTUP_INTERVAL": "2",
            "RAY_ON_SPARK_WORKER_CPU_CORES": "2",
            "RAY_ON_SPARK_WORKER_PHYSICAL_MEMORY_BYTES": str(4 << 30),
            "RAY_ON_SPARK_WORKER_SHARED_MEMORY_BYTES": str(2 << 30),
        }
    )
    return env


def _run_worker(kind: str) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind]
    out: dict[str, Any] = run_worker(cmd, "WORKER", what=kind, env=_env(), cwd=ROOT, timeout=1800)
    return out


PARTS = ("spark_seconds", "session_seconds", "first_epoch_seconds", "to_first_epoch_seconds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["local", "on_spark"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("WORKER " + json.dumps(worker(args.worker)), flush=True)
        return 0

    runs: dict[str, list[dict[str, Any]]] = {"local": [], "on_spark": []}
    for _ in range(args.repeats):  # interleaved: both kinds see the same machine load
        for kind in runs:
            runs[kind].append(_run_worker(kind))
    medians = {
        kind: {p: statistics.median(r[p] for r in rs) for p in (*PARTS, "stop_seconds")}
        for kind, rs in runs.items()
    }
    report: dict[str, Any] = {
        "benchmark": "session_start",
        "repeats": args.repeats,
        "medians": medians,
        "ratio_on_spark_over_local_to_first_epoch": ratio(
            medians["on_spark"]["to_first_epoch_seconds"],
            medians["local"]["to_first_epoch_seconds"],
        ),
        "runs": runs,
        "note": (
            "each start in a fresh process; on_spark's 'spark' part is the user's "
            "local-cluster start (before the session), not in to_first_epoch"
        ),
    }
    path = write_report(report, RESULTS / "session_start.json")
    for kind, m in medians.items():
        print(
            f"{kind:9s} to first epoch {m['to_first_epoch_seconds']:6.1f} s (session "
            f"{m['session_seconds']:.1f} s + first epoch {m['first_epoch_seconds']:.1f} s; "
            f"Spark before it {m['spark_seconds']:.1f} s; stop {m['stop_seconds']:.1f} s)"
        )
    print(
        f"on_spark / local to first epoch: "
        f"{report['ratio_on_spark_over_local_to_first_epoch']:.2f}  ({path})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
