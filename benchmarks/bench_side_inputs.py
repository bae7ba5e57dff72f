"""A keyed map side input vs a broadcast of the same view vs a join.

    python benchmarks/bench_side_inputs.py                              # 10,000,000 x 10,000,000
    python benchmarks/bench_side_inputs.py --rows 1000000 --entries 1000000   # quicker

Data (fixed seed, written once as Parquet and read by every run): a main input of
``--rows`` rows (``user_id`` bigint drawn over twice the side's key range, ``amount``
double: half the rows find their key) and a side input of ``--entries`` rows
(``user_id`` = the even ids, ``segment`` int). Measured side by side in one run, each
executed with the ``noop`` sink, Spark ``local[--cores]``, ``--repeats`` times (medians):

* ``keyed``: ``with_side_inputs(main, MapSideInput(side, ..., keyed=True), key="user_id")
  .map_partition(enrich)``: main and side shuffled together by key; each task folds only
  its share of the side input, then enriches its rows (one Python lookup per row).
* ``broadcast``: the same view with ``keyed=False``: collected on the driver, shipped as
  a broadcast variable, every task's Python worker holds the whole map.
* ``join``: ``main.join(side, "user_id", "left")`` (JVM sort-merge join, no Python).
* ``join_python``: the join followed by the same per-row Python function through
  ``mapInArrow`` (separates the cost of Python rows from the cost of side inputs).

Memory per task, two sources:

* Python: a second pass in a subprocess, one run per approach with
  ``spark.python.worker.reuse=false`` (each task in a fresh worker, so nothing a previous
  task or approach loaded is counted): each task reports its worker's peak RSS
  (``VmHWM``) and how many side entries it held; ``baseline`` is a task that only reads
  its main rows. The timed runs keep Spark's default worker reuse (a broadcast is then
  unpickled once per worker, not per task).
* JVM: each task's ``peakExecutionMemory`` (sort, shuffle and join buffers) in the timed
  runs, from Spark's REST API (the UI is bound to 127.0.0.1).

``--worker-memory`` caps each Python worker (``spark.executor.pyspark.memory``), as a
cluster would; a run that fails under it is reported as failed.

Prints medians and ratios; writes JSON to benchmarks/results/side_inputs.json.
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
import urllib.request
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _harness import WorkerFailed, local_spark, run_worker, write_report  # noqa: E402

from spark_ops import MapSideInput, with_side_inputs  # noqa: E402

OUT_SCHEMA = "user_id long, amount double, segment int"


def _task_memory(mem_dir: str, held: int) -> None:
    """In a Spark task: record this worker's peak RSS since the last task, then reset it
    (the workers import the harness from this folder: see ``start_spark``)."""
    from _harness import peak_rss, reset_peak, rss

    record = {"peak_rss": peak_rss(), "rss": rss(), "held": held}
    with open(os.path.join(mem_dir, f"{uuid.uuid4().hex}.json"), "w") as fh:
        json.dump(record, fh)
    reset_peak()  # the next task measures its own


def enrich_with(view, mem_dir: str):
    def enrich(rows, ctx):
        segments = ctx.side_input(view)
        for r in rows:
            yield (r.user_id, r.amount, segments.get(r.user_id))
        _task_memory(mem_dir, len(segments))

    return enrich


def baseline(mem_dir: str):
    """Only read the main rows: the Python worker's own footprint."""

    def run(batches):
        n = 0
        for b in batches:
            n += b.num_rows
        _task_memory(mem_dir, 0)
        yield from ()

    return run


def python_after_join(mem_dir: str):
    """The same per-row work on joined rows, through plain mapInArrow."""
    import pyarrow as pa

    def run(batches):
        for b in batches:
            ids, amounts, segs = (b.column(i).to_pylist() for i in range(3))
            out = [(u, a, s) for u, a, s in zip(ids, amounts, segs)]
            yield pa.RecordBatch.from_arrays(
                [pa.array(c) for c in zip(*out)] if out else [pa.array([], pa.int64())] * 3,
                names=["user_id", "amount", "segment"],
            ).cast(
                pa.schema(
                    [("user_id", pa.int64()), ("amount", pa.float64()), ("segment", pa.int32())]
                )
            )
        _task_memory(mem_dir, 0)

    return run


def jvm_task_memory(spark, group: str) -> dict[str, Any]:
    """Peak execution memory per task of the job group's stages, from the REST API."""
    sc = spark.sparkContext
    url = sc.uiWebUrl
    if not url:
        return {}
    app = sc.applicationId
    tracker = sc.statusTracker()
    peaks = []
    for jid in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(jid)
        for sid in info.stageIds if info else ():
            try:
                with urllib.request.urlopen(
                    f"{url}/api/v1/applications/{app}/stages/{sid}?details=true&taskStatus=SUCCESS",
                    timeout=30,
                ) as resp:
                    attempts = json.load(resp)
            except Exception:
                continue
            for attempt in attempts:
                for task in (attempt.get("tasks") or {}).values():
                    m = task.get("taskMetrics") or {}
                    peaks.append(int(m.get("peakExecutionMemory", 0)))
    if not peaks:
        return {}
    return {"tasks": len(peaks), "max_bytes": max(peaks), "median_bytes": statistics.median(peaks)}


def read_python_memory(mem_dir: str) -> dict[str, Any]:
    recs = []
    for p in Path(mem_dir).glob("*.json"):
        recs.append(json.loads(p.read_text()))
        p.unlink()
    if not recs:
        return {}
    peaks = [r["peak_rss"] for r in recs]
    held = [r["held"] for r in recs]
    return {
        "tasks": len(recs),
        "peak_rss_max_bytes": max(peaks),
        "peak_rss_median_bytes": statistics.median(peaks),
        "side_entries_held_max": max(held),
        "side_entries_held_median": statistics.median(held),
    }


def generate(spark, rows: int, entries: int, partitions: int, root: str) -> tuple[str, str]:
    from pyspark.sql import functions as F

    main_path, side_path = os.path.join(root, "main"), os.path.join(root, "side")
    (
        spark.range(rows, numPartitions=partitions)
        .select(
            F.pmod(F.xxhash64("id", F.lit(7)), F.lit(2 * entries)).alias("user_id"),
            F.rand(1).alias("amount"),
        )
        .write.parquet(main_path)
    )
    (
        spark.range(entries, numPartitions=partitions)
        .select((F.col("id") * 2).alias("user_id"), (F.col("id") % 16).cast("int").alias("segment"))
        .write.parquet(side_path)
    )
    return main_path, side_path


def run_once(spark, name: str, main, side, mem_dir: str, partitions: int) -> dict[str, Any]:
    sc = spark.sparkContext
    group = f"bench-{name}-{uuid.uuid4().hex[:8]}"
    sc.setJobGroup(group, name)
    t = time.perf_counter()
    try:
        if name in ("keyed", "broadcast"):
            view = MapSideInput(side, key="user_id", value="segment", keyed=name == "keyed")
            op = with_side_inputs(main, view, key="user_id", num_partitions=partitions)
            out = op.map_partition(enrich_with(view, mem_dir), OUT_SCHEMA)
        elif name == "baseline":
            out = main.mapInArrow(baseline(mem_dir), OUT_SCHEMA)
        elif name == "join":
            out = main.join(side, "user_id", "left").select("user_id", "amount", "segment")
        else:
            joined = main.join(side, "user_id", "left").select("user_id", "amount", "segment")
            out = joined.mapInArrow(python_after_join(mem_dir), OUT_SCHEMA)
        out.write.format("noop").mode("overwrite").save()
        seconds = time.perf_counter() - t
        error = None
    except Exception as ex:
        seconds = time.perf_counter() - t
        error = f"{type(ex).__name__}: {str(ex).strip().splitlines()[0][:300]}"
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return {
        "seconds": seconds,
        "error": error,
        "python": read_python_memory(mem_dir),
        "jvm": jvm_task_memory(spark, group),
    }


def start_spark(args: argparse.Namespace, *, reuse_workers: bool, ui: bool):
    conf = {
        "spark.sql.shuffle.partitions": str(args.partitions),
        "spark.sql.autoBroadcastJoinThreshold": "-1",  # the join is a shuffle join
        "spark.driver.maxResultSize": "0",
        "spark.python.worker.reuse": "true" if reuse_workers else "false",
        # the tasks' memory is read by the harness (_task_memory): its folder on their path
        "spark.executorEnv.PYTHONPATH": str(HERE),
    }
    if args.worker_memory:
        conf["spark.executor.pyspark.memory"] = args.worker_memory
    # the UI for its REST API: each task's peakExecutionMemory
    return local_spark("bench_side_inputs", args.cores, args.driver_memory, conf, ui=ui)


def memory_pass(args: argparse.Namespace) -> None:
    """Subprocess: one run per approach in fresh Python workers; prints JSON last."""
    spark = start_spark(args, reuse_workers=False, ui=False)
    mem_dir = os.path.join(args.data_dir, "mem")
    os.makedirs(mem_dir, exist_ok=True)
    try:
        main_df = spark.read.parquet(os.path.join(args.data_dir, "main"))
        side_df = spark.read.parquet(os.path.join(args.data_dir, "side"))
        out = {}
        for name in ["baseline", *args.approaches.split(",")]:
            if name == "join":
                continue  # no Python
            r = run_once(spark, name.strip(), main_df, side_df, mem_dir, args.partitions)
            out[name] = {"error": r["error"], **r["python"]}
        print("MEMORY " + json.dumps(out))
    finally:
        spark.stop()


def run_memory_pass(args: argparse.Namespace, root: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--memory-pass",
        "--data-dir",
        root,
        "--cores",
        str(args.cores),
        "--partitions",
        str(args.partitions),
        "--driver-memory",
        args.driver_memory,
        "--approaches",
        args.approaches,
    ]
    if args.worker_memory:
        cmd += ["--worker-memory", args.worker_memory]
    try:
        out: dict[str, Any] = run_worker(
            cmd, "MEMORY", what="memory pass", new_session=True, stderr_tail=2000
        )
        return out
    except WorkerFailed as ex:
        return {"error": str(ex)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--entries", type=int, default=10_000_000)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument(
        "--partitions", type=int, default=8, help="partitions of main, side and shuffle"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--driver-memory", default="8g")
    ap.add_argument("--worker-memory", default=None, help="e.g. 2g: spark.executor.pyspark.memory")
    ap.add_argument(
        "--approaches", default="keyed,broadcast,join,join_python", help="comma-separated subset"
    )
    ap.add_argument("--skip-memory-pass", action="store_true")
    ap.add_argument("--memory-pass", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "side_inputs.json"))
    args = ap.parse_args()
    if args.memory_pass:
        memory_pass(args)
        return

    spark = start_spark(args, reuse_workers=True, ui=True)
    root = tempfile.mkdtemp(prefix="bench_side_inputs_")
    mem_dir = os.path.join(root, "mem")
    os.makedirs(mem_dir)
    try:
        t = time.perf_counter()
        main_path, side_path = generate(spark, args.rows, args.entries, args.partitions, root)
        print(
            f"generated {args.rows:,} main rows and {args.entries:,} side entries in "
            f"{time.perf_counter() - t:.1f}s"
        )
        main_df = spark.read.parquet(main_path)
        side_df = spark.read.parquet(side_path)
        approaches = [a.strip() for a in args.approaches.split(",") if a.strip()]
        runs: dict[str, list[dict[str, Any]]] = {a: [] for a in approaches}
        for rep in range(args.repeats):
            for name in approaches:
                r = run_once(spark, name, main_df, side_df, mem_dir, args.partitions)
                runs[name].append(r)
                jvm = r["jvm"].get("max_bytes")
                print(
                    f"  [{rep}] {name:12s} {r['seconds']:8.2f}s"
                    + (f"  JVM peak/task {jvm / 2**20:6.0f} MiB" if jvm else "")
                    + (f"  FAILED {r['error']}" if r["error"] else "")
                )
        spark.stop()
        spark = None
        memory = {} if args.skip_memory_pass else run_memory_pass(args, root)
        summary: dict[str, Any] = {}
        for name, rs in runs.items():
            ok = [r for r in rs if r["error"] is None]
            mem = memory.get(name, {}) if isinstance(memory.get(name), dict) else {}
            summary[name] = {
                "median_seconds": statistics.median(r["seconds"] for r in ok) if ok else None,
                "seconds": [r["seconds"] for r in rs],
                "failed_runs": len(rs) - len(ok),
                "errors": sorted({r["error"] for r in rs if r["error"]}),
                "python_peak_rss_per_task_max_bytes": mem.get("peak_rss_max_bytes"),
                "python_peak_rss_per_task_median_bytes": mem.get("peak_rss_median_bytes"),
                "side_entries_held_per_task_max": mem.get("side_entries_held_max"),
                "side_entries_held_per_task_median": mem.get("side_entries_held_median"),
                "jvm_peak_execution_memory_per_task_max_bytes": max(
                    (r["jvm"].get("max_bytes", 0) for r in rs), default=0
                ),
            }
        base_mem = memory.get("baseline", {}) if isinstance(memory.get("baseline"), dict) else {}
        ratios: dict[str, float] = {}
        base = summary.get("keyed", {}).get("median_seconds")
        for name in approaches:
            sec = summary[name]["median_seconds"]
            if base and sec and name != "keyed":
                ratios[f"{name}/keyed seconds"] = sec / base
        kp = summary.get("keyed", {}).get("python_peak_rss_per_task_max_bytes")
        bp = summary.get("broadcast", {}).get("python_peak_rss_per_task_max_bytes")
        b0 = base_mem.get("peak_rss_max_bytes")
        if kp and bp:
            ratios["broadcast/keyed python peak RSS per task"] = bp / kp
            if b0 and kp > b0:
                ratios["broadcast/keyed python RSS above baseline per task"] = (bp - b0) / (kp - b0)
        print("\nmedian seconds:", {k: v["median_seconds"] for k, v in summary.items()})
        print("ratios:", {k: round(v, 3) for k, v in ratios.items()})
        if b0:
            print(
                f"  baseline     python peak RSS/task {b0 / 2**20:8.0f} MiB (a task reading its rows)"
            )
        for name, sm in summary.items():
            p = sm["python_peak_rss_per_task_max_bytes"]
            held = sm["side_entries_held_per_task_max"]
            print(
                f"  {name:12s} python peak RSS/task {p / 2**20 if p else 0:8.0f} MiB, "
                f"side entries/task {held or 0:>12,}, JVM peak execution memory/task "
                f"{sm['jvm_peak_execution_memory_per_task_max_bytes'] / 2**20:8.0f} MiB"
            )
        report = {
            "benchmark": "side_inputs",
            "params": {k: v for k, v in vars(args).items() if k not in ("memory_pass", "data_dir")},
            "summary": summary,
            "python_memory_pass": memory,
            "ratios": ratios,
        }
        print(f"wrote {write_report(report, args.out)}")
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
