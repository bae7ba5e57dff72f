"""``Session.attach`` of a Spark Connect client, end to end (``test_connect.py``).

``main("all")`` starts a Spark Connect server in a child process (a classic ``local[2]``
with Spark's Connect plugin on a free loopback port), whose Python workers cannot
import Ray at all (a ``ray`` package that raises comes first on their path: a subtask
that used Ray would fail). This process is the Connect client: no JVM, Ray started here
on loopback. It attaches, runs bounded iterations, the ml estimators and the refusals,
and prints one JSON line (``RESULT ...``) for the test to compare with the classic runs
of its own session. One server start serves every check.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import numpy as np

RESULT_PREFIX = "RESULT "
EPOCHS = 12
BIG = 300_000  # float64s of the large variable (2.4 MB: streamed, not inlined)

SERVER = """
import sys
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]")
    .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
    .config("spark.sql.execution.arrow.maxRecordsPerBatch", "256")  # as the test session
    .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
    .config("spark.connect.grpc.binding.address", "127.0.0.1")
    .config("spark.connect.grpc.binding.port", sys.argv[1]).getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
print("READY", flush=True)
for line in sys.stdin:  # "jobs": Spark jobs run so far; "active": stages running now
    tracker = spark.sparkContext.statusTracker()
    if line.strip() == "active":
        print("ACTIVE", len(tracker.getActiveStageIds()), flush=True)
    else:
        print("JOBS", len(tracker.getJobIdsForGroup()), flush=True)
spark.stop()
"""

NO_RAY = 'raise ImportError("no Ray on this Spark Connect server")\n'


def features(spark: Any) -> Any:
    """The regression data of every check: the same rows and partitions on a classic
    session and on a Connect client (hash partitioning of ``id``)."""
    from checkpoint_job import data

    return data(spark)


def feature_names() -> list[str]:
    from checkpoint_job import DIMS

    return [f"x{j}" for j in range(DIMS)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    def __init__(self, shim: Path) -> None:
        self.port = _free_port()
        env = {**os.environ}
        env["PYTHONPATH"] = os.pathsep.join([str(shim), env.get("PYTHONPATH", "")])
        for key in [k for k in env if k.startswith("RAY_")]:
            env.pop(key)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"the Spark Connect server did not start: {line!r}")

    def _ask(self, what: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline().split()[1])

    def jobs(self) -> int:
        """Every Spark job the server ran so far (Connect jobs carry tags, not a group)."""
        return self._ask("jobs")

    def active_stages(self) -> int:
        return self._ask("active")

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _iterate(hi: Any, init: dict, df: Any, body: Any, **config: Any) -> Any:
    return hi.iterate_bounded_streams_until_termination(
        init, hi.ReplayableDataStreamList.not_replay(df), hi.IterationConfig(**config), body
    )


def _check(report: dict, name: str, fn: Any) -> None:
    try:
        report[name] = fn()
    except Exception as ex:
        report[name] = {"error": f"{type(ex).__name__}: {ex}", "trace": traceback.format_exc()}


def main(case: str = "all") -> int:
    del case
    with tempfile.TemporaryDirectory() as tmp:
        shim = Path(tmp) / "shim"
        (shim / "ray").mkdir(parents=True)
        (shim / "ray" / "__init__.py").write_text(NO_RAY)
        server = _Server(shim)
        try:
            report = _run(server, Path(tmp))
        finally:
            server.stop()
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


BLOCK_SECONDS = 120.0  # a task that is never cancelled ends by itself after this


def block(batches: Any) -> Any:
    """The workload of the job to cancel: holds its task until cancelled (bounded)."""
    import time

    deadline = time.monotonic() + BLOCK_SECONDS
    for batch in batches:
        while time.monotonic() < deadline:
            time.sleep(0.05)
        yield batch


def lines(remote: Any, server: _Server) -> dict:
    """What ``spark_ops._spark_compat`` makes of a Connect client, before this process has
    Ray: recognised as Connect; ``Session.attach`` to a Ray that cannot be reached refused
    with no Spark job run; a ``JobTag`` cancelling a Connect job of another thread."""
    import threading
    import time

    import ray

    import hybrid_iter as hi
    from spark_ops._spark_compat import JobTag, is_connect

    out: dict[str, Any] = {"is_connect": is_connect(remote), "rows": remote.range(5).count()}
    before = server.jobs()
    try:
        hi.Session.attach(remote, ray_address="127.0.0.1:1")
        out["attach"] = "accepted"
    except hi.SessionError as ex:
        out["attach"] = "refused"
        out["attach_message"] = str(ex)
    out["jobs_for_attach"] = server.jobs() - before
    out["ray_initialized"] = ray.is_initialized()

    tag = JobTag(remote, "hybrid_iter.connect-test")
    outcome: dict[str, Any] = {}

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
    deadline = time.monotonic() + 60
    while not server.active_stages() and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the server for the job's start, bounded
    out["job_started"] = bool(server.active_stages())
    tag.cancel()
    thread.join(BLOCK_SECONDS + 30)
    out["cancel"] = outcome
    return out


def _run(server: _Server, tmp: Path) -> dict:
    from pyspark.sql import SparkSession

    remote = SparkSession.builder.remote(f"sc://127.0.0.1:{server.port}").getOrCreate()
    report: dict[str, Any] = {}
    _check(report, "lines", lambda: lines(remote, server))  # before this process has Ray
    import ray

    from hybrid_iter._cluster.processes import start_own_ray

    # a loaded 2-core machine (this job's JVMs start beside it) can exceed Ray's fixed
    # raylet wait: once more, as the sessions do
    start_own_ray(
        lambda: ray.init(
            address="local",  # its own, never a `ray start` cluster of another run here
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=2,
            namespace="connect",
        )
    )
    import connect_ops as cops
    from checkpoint_job import ROWS, Step
    from ops import GradientDescent, Recorder, RecordingCoordinator

    import hybrid_iter as hi
    from hybrid_iter.testing import FaultInjection

    session = hi.Session.attach(remote)
    report["session"] = repr(session)
    df = features(remote)
    names = feature_names()

    def sync() -> dict:
        r = _iterate(
            hi,
            {"w": np.zeros(len(names)), "b": 0.0},
            df,
            hi.IterationBody(
                cops.WhereLinReg(names),
                GradientDescent(lr=0.3, total_rows=ROWS, intercept=True),
            ),
            max_epochs=EPOCHS,
            parallelism=2,
        )
        return {
            "w": r.variables["w"].tolist(),
            "b": float(r.variables["b"]),
            "loss": r.outputs["loss"],
            "epochs": r.epochs,
            "terminated_by": r.terminated_by,
            "where": r.outputs["where"],
        }

    def async_() -> dict:
        r = _iterate(
            hi,
            {"w": np.zeros(len(names))},
            df,
            hi.IterationBody(cops.WhereLinReg(names), GradientDescent(lr=0.5, total_rows=ROWS)),
            staleness=None,
            max_epochs=30,
            parallelism=2,
        )
        return {
            "w": r.variables["w"].tolist(),
            "subtask_epochs": {str(k): v for k, v in r.subtask_epochs.items()},
            "where": r.outputs["where"],
        }

    def termination() -> dict:
        r = _iterate(
            hi,
            {"version": 0},
            remote.range(40, numPartitions=2),
            hi.IterationBody(Recorder(criteria_until=3), RecordingCoordinator(), criteria=True),
            parallelism=2,
            max_epochs=50,
        )
        return {
            "terminated_by": r.terminated_by,
            "epochs": r.epochs,
            "events": sorted(r.outputs["event"]),
            "coord": r.outputs["coord"],
        }

    def large() -> dict:
        r = _iterate(
            hi,
            {"big": np.zeros(BIG)},
            remote.range(20, numPartitions=2),
            hi.IterationBody(cops.ReadsBig(), cops.PublishesBig()),
            parallelism=2,
            max_epochs=3,
        )
        return {"seen": sorted(map(list, r.outputs["seen"])), "where": r.outputs["where"]}

    def restore() -> dict:
        clean = _iterate(
            hi,
            {"w": np.zeros(len(names))},
            df,
            hi.IterationBody(cops.WhereGrad(), Step()),
            max_epochs=24,
            parallelism=2,
        )
        faulty = _iterate(
            hi,
            {"w": np.zeros(len(names))},
            df,
            hi.IterationBody(cops.WhereGrad(), Step()),
            max_epochs=24,
            parallelism=2,
            checkpoint=hi.CheckpointConfig(str(tmp / "ckpt"), every_epochs=4),
            hooks=FaultInjection(fail_partition=0, at_epoch=14),
        )
        return {
            "attempts": len(faulty.attempts),
            "restored_from": faulty.checkpoint["restored_from"],
            "same": faulty.variables["w"].tobytes() == clean.variables["w"].tobytes(),
            "w": clean.variables["w"].tolist(),
        }

    def ml() -> dict:
        from hybrid_iter.ml import KMeans, LinearRegression, LogisticRegression

        labelled = cops.with_class(df)
        lin = LinearRegression(features_col=names, label_col="y", parallelism=2).fit(df)
        log = LogisticRegression(features_col=names, label_col="c", parallelism=2).fit(labelled)
        km = KMeans(features_col=names, k=3, seed=7, parallelism=2).fit(df)
        return {
            "linear": [*lin.coefficients.tolist(), float(lin.intercept)],
            "logistic": [*log.coefficients.tolist(), float(log.intercept)],
            "kmeans": km.cluster_centers.tolist(),
        }

    def refused(call: Any) -> dict:
        before = server.jobs()
        actors = len(ray.util.list_named_actors(all_namespaces=True))
        try:
            call()
            out: dict[str, Any] = {"refused": False}
        except hi.SessionError as ex:
            out = {"refused": True, "message": str(ex)}
        out["jobs"] = server.jobs() - before
        out["named_actors"] = len(ray.util.list_named_actors(all_namespaces=True)) - actors
        out["queries"] = len(remote.streams.active)
        return out

    def ps_train() -> dict:
        return cops.ps_run(df, names)

    def online() -> dict:
        stream = remote.readStream.format("rate").load()
        return refused(
            lambda: hi.iterate_unbounded_streams(
                {"version": 0},
                hi.ReplayableDataStreamList.not_replay(stream),
                hi.IterationBody(Recorder(), RecordingCoordinator()),
            )
        )

    def unreachable() -> dict:
        where = f"127.0.0.1:{_free_port()}"  # nothing listens there
        try:
            _iterate(
                hi,
                {"version": 0},
                remote.range(10, numPartitions=2),
                hi.IterationBody(Recorder(), RecordingCoordinator()),
                parallelism=2,
                max_epochs=2,
                endpoint=hi.EndpointConfig(advertise=where, connect_timeout=5),
            )
            return {"where": where, "error": None}
        except Exception as ex:
            return {"where": where, "type": type(ex).__name__, "error": str(ex)}

    for name, fn in [
        ("sync", sync),
        ("async", async_),
        ("termination", termination),
        ("large", large),
        ("restore", restore),
        ("ml", ml),
        ("ps_train", ps_train),
        ("online", online),
        ("unreachable", unreachable),
    ]:
        _check(report, name, fn)

    from pyspark import SparkContext

    report["client_jvm"] = SparkContext._gateway is not None
    report["client_classic_context"] = SparkContext._active_spark_context is not None
    session.stop()
    remote.stop()
    ray.shutdown()
    return report


if __name__ == "__main__":
    sys.exit(main())
