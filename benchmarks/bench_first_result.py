"""Session start-up to a first Spark action, each in a fresh process (a process keeps one
JVM and one Ray), interleaved, ``--repeats`` times per contender:

    python benchmarks/bench_first_result.py [--repeats 3] [--parallelism 2]

* ``spark``: ``SparkSession.builder...getOrCreate()`` (``local[N]``, loopback, UI off)
  then ``spark.range(N).count()``;
* ``ray``: ``ray.init(address="local", _node_ip_address="127.0.0.1")`` then one task;
* ``sequential``: a script doing both by hand, Ray first then Spark, then both actions;
* ``session``: ``hybrid_iter.Session.local(N)`` (Spark's JVM in a thread while Ray
  starts), then both actions.

Each process times itself from before its first import of pyspark / ray to the end of
its actions (interpreter start-up is not counted, the same for all). Reported: the
medians, ``session / max(spark, ray)`` (the target is 1.25: the session costs little
more than its slower side) and ``session / sequential``; written to
``benchmarks/results/first_result.json``. Noisy on a shared machine: the contenders
alternate so that noise falls on all alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from _harness import machine, ratio, write_report  # noqa: E402

KINDS = ("spark", "ray", "sequential", "session")


def _spark(n: int) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    for k, v in {
        "spark.master": f"local[{n}]",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }.items():
        builder = builder.config(k, v)
    return builder.getOrCreate()


def _ray() -> None:
    import ray

    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace="hybrid_iter",
        logging_level="WARNING",
    )


def _ray_action() -> None:
    import ray

    @ray.remote(num_cpus=0)
    def one() -> int:
        return 1

    assert ray.get(one.remote()) == 1


def worker(kind: str, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    if kind == "spark":
        spark = _spark(n)
        spark.range(n, numPartitions=n).count()
        took = time.perf_counter() - t0
        spark.stop()
    elif kind == "ray":
        _ray()
        _ray_action()
        took = time.perf_counter() - t0
    elif kind == "sequential":
        _ray()
        spark = _spark(n)
        spark.range(n, numPartitions=n).count()
        _ray_action()
        took = time.perf_counter() - t0
        spark.stop()
    else:
        import hybrid_iter as hi

        with hi.Session.local(n) as session:
            session.spark.range(n, numPartitions=n).count()
            _ray_action()
            took = time.perf_counter() - t0
    return {"kind": kind, "seconds": took}


def _run_fresh(kind: str, n: int) -> float:
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    code = (
        f"import sys, json; sys.path.insert(0, {str(HERE)!r}); sys.path.insert(0, {str(ROOT)!r});"
        f"import bench_first_result as b; print('RESULT ' + json.dumps(b.worker({kind!r}, {n})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-4000:]}")
    return float(json.loads(lines[0][len("RESULT ") :])["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "first_result.json"))
    args = ap.parse_args()
    runs: dict[str, list[float]] = {k: [] for k in KINDS}
    _run_fresh("session", args.parallelism)  # warm-up: the OS's file caches, the same for all
    for r in range(args.repeats):
        for kind in KINDS:
            runs[kind].append(_run_fresh(kind, args.parallelism))
            print(f"repeat {r}: {kind:<10} {runs[kind][-1]:6.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    slower = max(med["spark"], med["ray"])
    report = {
        "benchmark": "session start-up to a first Spark action (fresh processes)",
        "machine": machine(),
        "parallelism": args.parallelism,
        "repeats": args.repeats,
        "runs_s": runs,
        "median_s": med,
        "ratios": {
            "session_over_slower_side": ratio(med["session"], slower),
            "session_over_sequential": ratio(med["session"], med["sequential"]),
            "sequential_over_slower_side": ratio(med["sequential"], slower),
        },
        "target": {"session_over_slower_side": 1.25},
    }
    print(f"\n{'':<12}{'median s':>10}")
    for k in KINDS:
        print(f"{k:<12}{med[k]:>10.2f}")
    for k, v in report["ratios"].items():
        print(f"{k:<30} {v:.2f}" if v is not None else f"{k:<30} -")
    write_report(report, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
