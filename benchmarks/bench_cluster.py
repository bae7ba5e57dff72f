"""Multi-node Ray cluster on loopback (Session.raydp) against Session.local, same work.

    python benchmarks/bench_cluster.py [--epochs 6] [--repeats 3]

The cluster is the one of tests/hybrid_iter/session/test_multinode.py: a head (num-cpus 0, the coordinator's
node) and three 1-CPU workers, four raylets each with its own object store, token
authentication on; two RayDP executors of one core. ``Session.local(2)`` has the same two
task slots. Each contender runs in its own process (one JVM per process) and does the
same: open the session (timed: "session start"), one warm-up run, then ``--repeats``
runs of ``--epochs`` epochs of the sync linear regression of tests/multinode_job.py
(its variables carry a 1.6 MB array through the object store each epoch), sync and
async (staleness 1); seconds per epoch = run time / epochs. The weights both reach are
reported (sync: equal up to rounding; async: timing-dependent, close). Reports medians and ratios
cluster / local and writes ``benchmarks/results/cluster.json``.

On one 2-core machine the "cluster" adds processes and hops without adding cores: this
measures the overhead of the multi-node path (RayDP executors, the object store between
raylets, token auth), not a speed-up. Noisy when other work shares the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "tests"
RESULTS = HERE / "results"
MiB = 1 << 20
sys.path.insert(0, str(HERE))
from _harness import run_worker, write_report  # noqa: E402


def worker(kind: str, epochs: int, repeats: int) -> dict[str, Any]:
    """In the contender's process: time the session start and the runs."""
    import hybrid_iter as hi

    sys.path.insert(0, str(TESTS))
    import multinode_job as job

    t0 = time.perf_counter()
    if kind == "local":
        session = hi.Session.local(2, driver_memory="1g")
    else:
        session = hi.Session.raydp(
            num_executors=2, executor_cores=1, executor_memory="512m", executor_wait_seconds=300
        )
    out: dict[str, Any] = {"kind": kind}
    with session:
        out["session_start_seconds"] = time.perf_counter() - t0
        out["where"] = session.describe()
        job.linreg_big(session.spark, epochs=2)  # warm-up: Python workers, imports
        for label, staleness in (("sync", 0), ("async", 1)):
            per_epoch, w = [], None
            for _ in range(repeats):
                t = time.perf_counter()
                r = job.linreg_big(session.spark, staleness=staleness, epochs=epochs)
                per_epoch.append((time.perf_counter() - t) / epochs)
                w = [float(v) for v in r.variables["w"]]
            out[label] = {"seconds_per_epoch": per_epoch, "w": w}
    return out


def _run_worker(kind: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind]
    cmd += ["--epochs", str(args.epochs), "--repeats", str(args.repeats)]
    out: dict[str, Any] = run_worker(cmd, "WORKER", what=kind, env=env, cwd=ROOT)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=["local", "raydp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("WORKER " + json.dumps(worker(args.worker, args.epochs, args.repeats)), flush=True)
        return 0

    sys.path.insert(0, str(TESTS))
    from k8s_ray_cluster import ClusterProcess

    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "PYSPARK_", "SPARK_", "HYBRID_ITER_"))
    }
    base.update(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
        }
    )
    local = _run_worker("local", args, base)

    cluster_env = {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    head = {
        "ray_start_params": {
            "num-cpus": "0",
            "resources": "'{\"hybrid_iter_head\": 1000}'",
            "object-store-memory": str(200 * MiB),
        }
    }
    node = {
        "ray_start_params": {
            "num-cpus": "1",
            "memory": str(1024 * MiB),
            "object-store-memory": str(200 * MiB),
        }
    }
    cluster = ClusterProcess([head, node, node, node], cluster_env)
    t0 = time.perf_counter()
    try:
        cluster.start()
        cluster_start = time.perf_counter() - t0
        env = {**cluster.env, "RAY_ADDRESS": cluster.address, "HOME": str(cluster.tmp)}
        multi = _run_worker("raydp", args, env)
    finally:
        cluster.stop()

    report: dict[str, Any] = {
        "benchmark": "cluster",
        "note": (
            "noisy: one 2-core machine shared with other work; the 4-raylet loopback "
            "cluster adds processes, not cores (overhead of the multi-node path)"
        ),
        "epochs": args.epochs,
        "repeats": args.repeats,
        "cluster_start_seconds": round(cluster_start, 2),
        "local": local,
        "cluster": multi,
    }
    for label in ("sync", "async"):
        a = statistics.median(multi[label]["seconds_per_epoch"])
        b = statistics.median(local[label]["seconds_per_epoch"])
        report[f"{label}_seconds_per_epoch_median"] = {"cluster": a, "local": b}
        report[f"{label}_ratio_cluster_over_local"] = a / b
        # sync is deterministic (equal up to summation order); async depends on timing
        report[f"{label}_max_weight_difference"] = max(
            abs(x - y) for x, y in zip(multi[label]["w"], local[label]["w"], strict=True)
        )
    report["session_start_ratio_cluster_over_local"] = (
        multi["session_start_seconds"] / local["session_start_seconds"]
    )
    write_report(report, RESULTS / "cluster.json")
    for label in ("sync", "async"):
        m = report[f"{label}_seconds_per_epoch_median"]
        print(
            f"{label}: {m['cluster']:.3f} s/epoch on the cluster, {m['local']:.3f} s/epoch "
            f"local, ratio {report[f'{label}_ratio_cluster_over_local']:.2f} "
            f"(max weight difference {report[f'{label}_max_weight_difference']:.1e})"
        )
    print(
        f"session start: {multi['session_start_seconds']:.1f} s cluster (after the cluster "
        f"was up in {cluster_start:.1f} s), {local['session_start_seconds']:.1f} s local, "
        f"ratio {report['session_start_ratio_cluster_over_local']:.2f}  (noisy: 2 shared cores)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
