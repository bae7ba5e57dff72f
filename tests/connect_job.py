"""A real Spark Connect session, in a process of its own (``test_spark_lines.py``).

A process holds either classic SparkSessions or Connect clients, and the suite shares a
classic ``Session.local``; so this runs in a subprocess::

    PYTHONPATH=tests:. python -c "import connect_job, sys; sys.exit(connect_job.main())"

``main()`` starts a classic Spark ``local[2]`` with Spark's Connect server plugin bound
to a free loopback port, connects a Connect client to it, and reports as one JSON line
(prefixed with ``RESULT ``): whether the client is recognised as Connect, what
``Session.attach`` says about it and whether any Spark job ran for it, and whether a
``JobTag`` cancels a running Connect job (session operation tags).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

RESULT_PREFIX = "RESULT "
BLOCK_SECONDS = 120.0  # a task that is never cancelled ends by itself after this


def block(batches):
    """The workload of the job to cancel: holds its task until cancelled (bounded)."""
    deadline = time.monotonic() + BLOCK_SECONDS
    for batch in batches:
        while time.monotonic() < deadline:
            time.sleep(0.05)
        yield batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _jobs(classic) -> list[int]:
    """Every job the server's SparkContext ran (Connect jobs carry tags, not a group)."""
    return sorted(classic.sparkContext.statusTracker().getJobIdsForGroup())


def main() -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    port = _free_port()
    classic = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
        .config("spark.connect.grpc.binding.address", "127.0.0.1")
        .config("spark.connect.grpc.binding.port", str(port))
        .getOrCreate()
    )
    classic.sparkContext.setLogLevel("ERROR")
    remote = ConnectSession.builder.remote(f"sc://127.0.0.1:{port}").getOrCreate()
    import ray

    import hybrid_iter as hi
    from spark_ops._spark_compat import JobTag, is_connect

    report: dict = {
        "is_connect": is_connect(remote),
        "classic_is_connect": is_connect(classic),
        "remote_type": type(remote).__module__ + "." + type(remote).__name__,
    }
    report["rows"] = remote.range(5).count()  # the client really runs jobs
    before = _jobs(classic)
    try:
        hi.Session.attach(remote, ray_address="127.0.0.1:1")
        report["attach"] = "accepted"
    except hi.SessionError as ex:
        report["attach"] = "refused"
        report["attach_message"] = str(ex)
    report["jobs_for_attach"] = len(_jobs(classic)) - len(before)
    report["ray_initialized"] = ray.is_initialized()

    # a job tag on a Connect session: the job of another thread is cancelled by it
    tag = JobTag(remote, "hybrid_iter.connect-test")
    outcome: dict = {}

    def run() -> None:
        try:
            with tag.on_this_thread():
                remote.range(1, numPartitions=1).mapInArrow(block, "id long").collect()
            outcome["result"] = "finished"
        except Exception as ex:
            outcome["result"] = "failed"
            outcome["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    tracker = classic.sparkContext.statusTracker()
    deadline = time.monotonic() + 60
    while not tracker.getActiveStageIds() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling Spark for the job's start, bounded
    report["job_started"] = bool(tracker.getActiveStageIds())
    tag.cancel()
    thread.join(BLOCK_SECONDS + 30)
    report["cancel"] = outcome
    remote.stop()
    classic.stop()
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
