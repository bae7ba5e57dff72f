"""Issue 16 soak: an online iteration that runs long, restarts, and is SIGKILLed.

    python benchmarks/soak_online.py                                    # the full soak
    python benchmarks/soak_online.py --batches 1000 --restart-every 250 --kill-runs 5

Part 1 (long run): ``--batches`` small Parquet files (``--rows`` rows each, an ``id``
column) land in a directory; an online iteration reads them one file per micro-batch with
a processing-time trigger, in a driver subprocess that stops itself (``stop()``: drains
the batch in progress) every ``--restart-every`` batches and is started again. The
coordinator sums the rows and the ids it trained on (as variables), so the end checks
that every batch was applied exactly once: row count and id sum equal the files'.
Sampled along the way: driver RSS (Python, its Spark JVM), coordinator actor RSS, files
under the checkpoint location (ours and Spark's), the time from starting a driver to its
first newly committed batch (restart time) and the time to restore the coordinator.

Part 2 (SIGKILL): ``--kill-runs`` times, a fresh stream of ``--kill-files`` files; the
driver subprocess gets SIGKILL at a random moment, then a new driver finishes the
stream; row count and id sum must be exact.

Writes JSON to benchmarks/results/soak_online.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _harness import WorkerFailed, role, rss, run_worker, tree, write_report

HERE = Path(__file__).resolve().parent
SCHEMA = "id long, x double"


def write_files(directory: Path, start: int, count: int, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i in range(start, start + count):
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        tmp = directory / f".f{i:06d}.tmp"
        pq.write_table(pa.table({"id": ids, "x": ids.astype(float) * 0.5}), tmp)
        os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))
        tmp.rename(directory / f"f{i:06d}.parquet")


def expected(files: int, rows: int) -> tuple[int, int]:
    n = files * rows
    return n, n * (n - 1) // 2


def rss_kb(pid: int) -> int:
    return rss(pid) // 1024


def jvm_kb() -> int:
    """The RSS of this driver's Spark JVM (its process started from whichever thread)."""
    return sum(rss(p) for p in tree() if role(p) == "spark_jvm") // 1024


def count_files(root: Path) -> dict[str, int]:
    total = ours = 0
    for _, _, names in os.walk(root):
        total += len(names)
    if (root / "hybrid_iter").exists():
        ours = len(os.listdir(root / "hybrid_iter"))
    return {"total": total, "hybrid_iter": ours}


# -- the driver job (a subprocess) -------------------------------------------------------


def job(data: str, ckpt: str, until: int, sample_every: int) -> int:
    import ray

    import hybrid_iter as hi

    class Count(hi.PartitionOperator):
        def open(self, ctx):
            self.n = 0
            self.ids = 0

        def process_data(self, stream, batch, ctx, out):
            self.n += batch.num_rows
            self.ids += int(np.asarray(batch.column("id")).sum())

        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            out.feedback((self.n, self.ids))

    class Sum(hi.CoordinatorOperator):
        def open(self, init_variables, ctx):
            self.total = np.array(init_variables["total"], dtype=np.int64)

        def process_feedback(self, value, ctx, out):
            self.total = self.total + np.array(value, dtype=np.int64)

        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            out.publish_variables(total=self.total)

    t0 = time.perf_counter()
    final = until < 0  # the last driver: drain what is left (availableNow), then report
    retain = {  # what Spark's driver keeps of finished jobs: see docs/online.md
        "spark.ui.retainedJobs": "100",
        "spark.ui.retainedStages": "100",
        "spark.sql.ui.retainedExecutions": "50",
    }
    with hi.Session.local(2, driver_memory="1g", spark_conf=retain) as session:
        t_session = time.perf_counter()
        stream = (
            session.spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).parquet(data)
        )
        it = hi.iterate_unbounded_streams(
            {"total": np.zeros(2, dtype=np.int64)},
            hi.ReplayableDataStreamList.not_replay(stream),
            hi.IterationBody(Count(), Sum()),
            hi.OnlineConfig(
                checkpoint_location=ckpt,
                trigger={"availableNow": True} if final else {"processingTime": "10 milliseconds"},
                parallelism=1,
                log_every_seconds=None,
            ),
        )
        t_started = time.perf_counter()
        print("STARTED", flush=True)
        state = ray.get(it._actor.online_state.remote())
        first, actor_pid = state.batches, state.pid
        restore_s = state.restore.seconds
        samples: list[dict] = []
        t_first = None
        next_sample = first
        seen = -1
        while True:
            p = it.progress
            if t_first is None and p.batches > first:
                t_first = time.perf_counter()
            if p.batches != seen:
                seen = p.batches
                print(f"BATCH {seen}", flush=True)  # a killer may watch for this
            if p.batches >= next_sample and not final:
                samples.append(
                    {
                        "batches": p.batches,
                        "driver_kb": rss_kb(os.getpid()),
                        "jvm_kb": jvm_kb(),
                        "coordinator_kb": rss_kb(actor_pid),
                        "files": count_files(Path(ckpt)),
                        "batches_per_s": p.batches_per_s,
                    }
                )
                next_sample = p.batches + sample_every
            if final and not it.query.isActive:
                break
            if not final and p.batches >= until:
                break
            if it.exception() is not None:
                raise RuntimeError(str(it.exception()))
            time.sleep(0.05)
        total = [int(v) for v in it.latest_variables()["total"]] if final else None
        it.stop()
        p = it.progress
        result = {
            "batches": p.batches,
            "rows": p.rows,
            "total": total,
            "session_s": t_session - t0,
            "start_s": t_started - t_session,
            "restore_s": restore_s,
            "first_commit_s": (t_first - t_started) if t_first is not None else None,
            "files": count_files(Path(ckpt)),
            "samples": samples,
        }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -- the soak ------------------------------------------------------------------------------


def _cmd(data: Path, ckpt: Path, until: int, sample_every: int) -> list[str]:
    return [sys.executable, __file__, "--job", str(data), str(ckpt), str(until), str(sample_every)]


def run_job(data: Path, ckpt: Path, until: int, sample_every: int, timeout: float) -> dict:
    out: dict = run_worker(
        _cmd(data, ckpt, until, sample_every),
        "RESULT",
        what="driver job",
        timeout=timeout,
        new_session=True,
        stderr_tail=4000,
    )
    return out


def long_run(root: Path, batches: int, every: int, rows: int, sample_every: int) -> dict:
    data, ckpt = root / "long_in", root / "long_ckpt"
    data.mkdir()
    write_files(data, 0, batches, rows)
    runs = []
    for until in range(every, batches, every):
        r = run_job(data, ckpt, until, sample_every, timeout=7200)
        runs.append(r)
        last = r["samples"][-1] if r["samples"] else {}
        print(
            f"  driver {len(runs)}: batches {r['batches']}, start {r['start_s']:.1f} s, first "
            f"commit after {r['first_commit_s'] or 0:.1f} s, restore {r['restore_s'] or 0:.3f} s, "
            f"driver {last.get('driver_kb', 0) / 1024:.0f} MiB + JVM "
            f"{last.get('jvm_kb', 0) / 1024:.0f} MiB, coordinator "
            f"{last.get('coordinator_kb', 0) / 1024:.0f} MiB, files {r['files']}",
            flush=True,
        )
    end = run_job(data, ckpt, -1, sample_every, timeout=7200)
    runs.append(end)
    want = expected(batches, rows)
    got = (end["rows"], end["total"][1] if end["total"] else None)
    # rows and id sum, not the batch count: a driver stopped or killed while Spark was
    # planning a batch can make Spark put two files into one later batch (each file still
    # exactly once)
    ok = tuple(end["total"] or ()) == want and got[0] == want[0]
    print(
        f"  end: {end['batches']} batches, rows {end['rows']} (want {want[0]}), total "
        f"{end['total']} (want {list(want)}): {'exactly once' if ok else 'MISMATCH'}",
        flush=True,
    )
    return {"runs": runs, "exactly_once": ok, "expected": list(want)}


def kill_runs(root: Path, runs: int, files: int, rows: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for k in range(runs):
        data, ckpt = root / f"kill{k}_in", root / f"kill{k}_ckpt"
        data.mkdir()
        write_files(data, 0, files, rows)
        # the fault's moment: once batch `target` has committed, plus up to half a second,
        # so kills land anywhere: between batches, mid-batch, mid-checkpoint
        target = rng.randrange(0, files)
        extra = rng.uniform(0.0, 0.5)
        proc = subprocess.Popen(
            _cmd(data, ckpt, files, 10**9),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        killed_at = None
        try:
            for line in proc.stdout:
                if line.startswith("BATCH ") and int(line.split()[1]) >= target:
                    break
            time.sleep(extra)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # the driver process only, from outside
                killed_at = target
            proc.wait(timeout=120)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what the dead driver had started
            except ProcessLookupError:
                pass
        try:
            end = run_job(data, ckpt, -1, 10**9, timeout=1800)
        except WorkerFailed as ex:  # e.g. Ray could not start on an overloaded machine
            print(f"  kill run {k}: the restart could not run: {str(ex)[-300:]}", flush=True)
            out.append({"run": k, "killed_after_batch": killed_at, "infra_failure": str(ex)})
            continue
        want = expected(files, rows)
        ok = tuple(end["total"] or ()) == want and end["rows"] == want[0]
        out.append({"run": k, "spark_commits_at_kill": killed_at, "end": end, "exactly_once": ok})
        print(
            f"  kill run {k}: SIGKILL {extra:.2f} s after batch {killed_at} committed, end "
            f"{end['batches']} batches, total {end['total']} want {list(want)}: "
            f"{'exactly once' if ok else 'MISMATCH'}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=5000)
    ap.add_argument("--restart-every", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--sample-every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=200, help="batches per driver before RSS counts")
    ap.add_argument("--kill-runs", type=int, default=20)
    ap.add_argument("--kill-files", type=int, default=30)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--out", default=str(HERE / "results" / "soak_online.json"))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="soak_online_"))
    report: dict = {"benchmark": "online soak (issue 16)", "args": vars(args)}
    try:
        if args.batches:
            print(f"long run: {args.batches} batches, a restart every {args.restart_every}")
            report["long_run"] = long_run(
                root, args.batches, args.restart_every, args.rows, args.sample_every
            )
        if args.kill_runs:
            print(f"SIGKILL runs: {args.kill_runs} x {args.kill_files} files")
            report["kill_runs"] = kill_runs(
                root, args.kill_runs, args.kill_files, args.rows, args.seed
            )
    except Exception as ex:  # keep what was measured
        report["error"] = repr(ex)
        print(f"soak stopped: {ex!r}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarize(report)
    report["summary"] = summary
    print(json.dumps(summary, indent=2))
    print(f"wrote {write_report(report, args.out)}")


def summarize(report: dict) -> dict:
    s: dict = {}
    lr = report.get("long_run")
    if lr:
        samples = [x for r in lr["runs"] for x in r["samples"]]
        warmup = report["args"]["warmup"]
        # per driver process: its samples after its own warm-up (a restart is a new process)
        warm_runs = [
            [x for x in r["samples"] if x["batches"] >= r["samples"][0]["batches"] + warmup]
            for r in lr["runs"]
            if r["samples"]
        ]
        warm_runs = [w for w in warm_runs if len(w) >= 2]

        def spread(key: str) -> dict:
            ratios = [max(x[key] for x in w) / min(x[key] for x in w) for w in warm_runs]
            v = [x[key] for w in warm_runs for x in w] or [0]
            return {
                "min_mib": min(v) / 1024,
                "max_mib": max(v) / 1024,
                "max_over_min_within_a_driver": max(ratios) if ratios else None,
            }

        starts = [r["first_commit_s"] for r in lr["runs"] if r["first_commit_s"] is not None]
        s["exactly_once"] = lr["exactly_once"]
        s["driver_rss"] = spread("driver_kb")
        s["jvm_rss"] = spread("jvm_kb")
        s["coordinator_rss"] = spread("coordinator_kb")
        s["max_files_total"] = max(x["files"]["total"] for x in samples)
        s["max_files_hybrid_iter"] = max(x["files"]["hybrid_iter"] for x in samples)
        s["first_commit_after_restart_s"] = starts
        s["restore_s"] = [r["restore_s"] for r in lr["runs"]]
        s["median_batches_per_s"] = statistics.median(
            [x["batches_per_s"] for x in samples if x["batches_per_s"]] or [0]
        )
    kr = report.get("kill_runs")
    if kr:
        s["kill_runs"] = len(kr)
        s["kill_runs_exactly_once"] = sum(1 for r in kr if r.get("exactly_once"))
        s["kill_runs_not_restarted_infra"] = sum(1 for r in kr if "infra_failure" in r)
    return s


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        sys.exit(job(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
    main()
