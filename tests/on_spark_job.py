"""hybrid_iter on a Spark cluster it did not start (``Session.on_spark``), run in a
process of its own.

A process has one SparkContext and the test suite shares a ``local[4]`` one, so
``test_on_spark.py`` runs this module in a subprocess::

    PYTHONPATH=tests:. python -c "import on_spark_job, sys; sys.exit(on_spark_job.main())"

``main()`` starts Spark on a ``local-cluster[2, 2, 1024]`` master (two executors, each a
JVM of its own with two cores, as Ray's own tests of Ray on Spark run), everything on
127.0.0.1, and the environment of a user who set nothing for Ray: no ``ray`` on PATH,
no Ray token. Then, in one process and on ONE Ray on Spark cluster (it takes 35-40 s to
start on two idle cores):

1. bad input that must fail before Ray starts (too few free slots, a worker node larger
   than an executor, executors whose Python has no ``ray`` executable);
2. ``Session.on_spark(spark)``: the start, then a sync iteration, an ``ml`` fit, a
   ``ps.train``, a subtask's Python worker SIGKILLed from outside (the run must recover
   bit for bit from its checkpoint), a session joining the running cluster, what listens
   where (``ss -ltnp``), a client with a wrong token;
3. the stop: which of the Ray processes it started are left (by PID), and the state of
   the environment it handed out.

It prints one JSON line (prefixed ``RESULT ``) with what it saw and the references
(numpy, scikit-learn) to compare with. The operators live in this module, not in
``__main__``, so Spark's Python workers and the Ray actors import them by name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

import hybrid_iter as hi

FEATURES = ["x0", "x1", "x2", "x3"]
RESULT_PREFIX = "RESULT "
MiB = 1 << 20
#: local-cluster[EXECUTORS, CORES, MEMORY]: two executors of two cores
EXECUTORS, CORES = 2, 2
ROWS, EPOCHS, LR = 2000, 12, 0.3
KILL_AT, CHECKPOINT_EVERY = 7, 3


def make_data(rows: int, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, len(FEATURES)))
    y = X @ np.arange(1.0, len(FEATURES) + 1) + 0.25 * rng.standard_normal(rows)
    return X, y


def numpy_gradient_descent(X: np.ndarray, y: np.ndarray, lr: float, epochs: int):
    """The reference of ``LinRegGradient`` + ``GradientStep``: full-batch steps."""
    w = np.zeros(X.shape[1])
    losses = []
    for _ in range(epochs):
        r = X @ w - y
        losses.append(float(r @ r) / len(y))
        w = w - lr * (X.T @ r) / len(y)
    return w, losses


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class LinRegGradient(hi.PartitionOperator):
    """Least-squares gradient of the subtask's rows; at epoch 0 it says where it runs
    (process, Ray node, the Ray token mode of its Python worker). With ``marker`` set,
    partition 1 writes its pid there at epoch ``block_at`` and waits to be SIGKILLed
    (first life only)."""

    def __init__(self, marker: str | None = None, block_at: int | None = None):
        self.marker, self.block_at = marker, block_at

    def open(self, ctx):
        self.cache = hi.NumpyCache(FEATURES, extra=["y"])

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = np.asarray(variables["w"], dtype=float)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if self.marker and epoch == self.block_at and ctx.partition_id == 1:
            marker = Path(self.marker)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    time.sleep(0.05)
                raise RuntimeError("the test did not kill this worker")
        X, y = self.cache.matrix(), self.cache.column("y")
        r = X @ self.w - y
        if epoch == 0:
            out.output(
                "where",
                {
                    "partition": ctx.partition_id,
                    "pid": os.getpid(),
                    "node": _node_id(),
                    "auth_mode": os.environ.get("RAY_AUTH_MODE"),
                },
            )
        out.feedback((X.T @ r, float(r @ r), len(y)))


class GradientStep(hi.CoordinatorOperator):
    """Sync: sum the epoch's gradients, take one step, publish ``w``; says its node."""

    def __init__(self, lr: float):
        self.lr = lr

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"], dtype=float)
        self.acc = None

    def process_feedback(self, value, ctx, out):
        g, sq, n = value
        self.acc = (
            (g, sq, n) if self.acc is None else (self.acc[0] + g, self.acc[1] + sq, self.acc[2] + n)
        )

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if epoch == 0:
            out.output("coordinator_node", _node_id())
        (g, sq, n), self.acc = self.acc, None
        out.output("loss", sq / n)
        self.w = self.w - self.lr * g / n
        out.publish_variables(w=self.w)


def linreg_grad(params, batch):
    """``ps.train``'s gradient function: mean squared error of a batch, and its gradient."""
    X = np.column_stack([batch[c] for c in FEATURES])
    r = X @ params["w"] - batch["y"]
    return float(r @ r) / len(r), {"w": X.T @ r / len(r)}


# -- processes ----------------------------------------------------------------------------


def _process_table() -> dict[int, tuple[int, str]]:
    """``pid -> (ppid, state)`` of every process (Linux /proc)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            table[int(entry.name)] = (int(ppid), state)
        except (OSError, ValueError):  # gone meanwhile
            continue
    return table


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def descendants(root: int | None = None) -> dict[int, str]:
    """``pid -> command line`` of the live (not zombie) processes below ``root``."""
    root = os.getpid() if root is None else root
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in found or pid not in table:
            continue
        if table[pid][1] != "Z":
            found[pid] = _cmdline(pid)
        todo.extend(children.get(pid, []))
    return found


#: what a process of a Ray node looks like on its command line
_RAY_PROCESS = re.compile(
    r"raylet|gcs_server|ray\.util\.spark\.start_ray_node|hybrid_iter-ray-[^ ]*/ray start|"
    r"bin/ray start|ray/_private/|ray/autoscaler/|ray/dashboard/|^ray::"
)


def ray_processes() -> dict[int, str]:
    return {p: c for p, c in descendants().items() if _RAY_PROCESS.search(c)}


def executor_jvms() -> set[int]:
    return {p for p, c in descendants().items() if "CoarseGrainedExecutorBackend" in c}


def is_below(pid: int, ancestors: set[int]) -> bool:
    table = _process_table()
    while pid in table and pid > 1:
        if pid in ancestors:
            return True
        pid = table[pid][0]
    return False


def listening() -> list[dict[str, str]]:
    """TCP listening sockets of this process and its descendants, from ``ss -ltnp``."""
    mine = {os.getpid(), *descendants()}
    proc = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True)
    found = []
    for line in proc.stdout.splitlines():
        parts = line.split()
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in mine:
                found.append({"address": parts[3], "process": name, "pid": pid})
    return found


def wait_gone(pids: set[int], seconds: float) -> dict[int, str]:
    """The ``pids`` still alive after at most ``seconds`` (waiting for them to exit)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = {p: _cmdline(p) for p in pids if Path(f"/proc/{p}").exists()}
        table = _process_table()
        alive = {p: c for p, c in alive.items() if p in table and table[p][1] != "Z"}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.25)  # waiting for processes to exit, not test synchronisation


# -- the scenarios -----------------------------------------------------------------------


def _jobs_without_group(sc: Any) -> int:
    return len(sc.statusTracker().getJobIdsForGroup())


def _handed_out(sc: Any) -> dict[str, Any]:
    """What of Ray's environment is in this process and in the workers' environment."""
    return {
        "process": sorted(k for k in os.environ if k.startswith("RAY_AUTH")),
        "workers": sorted(k for k in sc.environment if k.startswith("RAY_")),
        "start_hook": os.environ.get("RAY_ON_SPARK_START_HOOK"),
        "ray_address_env": os.environ.get("RAY_ADDRESS"),
    }


def _bad(call: Any, spark: Any) -> dict[str, Any]:
    """Run ``call`` expecting a SessionError; what it said, what ran, what was left."""
    import ray

    from spark_ops import available_task_slots

    sc = spark.sparkContext
    jobs = _jobs_without_group(sc)
    t0 = time.perf_counter()
    try:
        call()
    except hi.SessionError as ex:
        error, kind = str(ex), "SessionError"
    except Exception as ex:  # reported, and the test fails on the kind
        error, kind = f"{ex}\n{traceback.format_exc()}", type(ex).__name__
    else:
        error, kind = "", "none"
    return {
        "kind": kind,
        "error": error,
        "seconds": round(time.perf_counter() - t0, 2),
        "jobs": _jobs_without_group(sc) - jobs,
        "ray_processes": sorted(ray_processes().values()),
        "ray_initialized": ray.is_initialized(),
        "handed_out": _handed_out(sc),
        "task_slots": available_task_slots(spark),
    }


def bare_python(work: Path) -> str:
    """A Python for the executors without a ``ray`` executable beside it or on PATH: a
    venv that sees this one's packages (through a .pth) but not its ``bin``."""
    bare = work / "bare"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120
    )
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    tests = Path(__file__).resolve().parent
    (next((bare / "lib").glob("python3*")) / "site-packages" / "_main.pth").write_text(
        f"{site}\n{tests.parent}\n{tests}\n"
    )
    return str(bare / "bin" / "python")


def run_iteration(df: Any, epochs: int, **config: Any) -> Any:
    partition = config.pop("partition", None) or LinRegGradient()
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(len(FEATURES))},
        hi.ReplayableDataStreamList.not_replay(hi.DataStream(df, numeric_columns=[*FEATURES, "y"])),
        hi.IterationConfig(staleness=0, max_epochs=epochs, progress=False, **config),
        hi.IterationBody(partition=partition, coordinator=GradientStep(LR)),
    )


def _kill_when_written(
    marker: Path, done: threading.Event, seen: dict[str, Any]
) -> threading.Thread:
    """SIGKILL the pid written to ``marker`` (a condition with a deadline, no timing)."""

    def target() -> None:
        deadline = time.monotonic() + 300
        while not done.is_set() and time.monotonic() < deadline:
            if marker.exists() and marker.read_text():
                pid = int(marker.read_text())
                seen["cmdline"] = _cmdline(pid)
                seen["below_executor"] = is_below(pid, executor_jvms())
                os.kill(pid, signal.SIGKILL)
                seen["killed"] = pid
                return
            time.sleep(0.05)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def ray_actor_nodes(prefix: str) -> dict[str, str]:
    """``actor name -> node id`` of the named live actors whose name starts with
    ``prefix`` (GCS's actor table: the dashboard, and with it ``ray.util.state``, is
    off), each waited for until it is placed and up (a spare the run's end started may
    still be pending, with no node yet)."""
    import ray
    from ray._private import state

    for a in state.actors().values():
        if a.get("Name", "").startswith(prefix) and a.get("State") != "DEAD":
            handle = ray.get_actor(a["Name"], namespace="hybrid_iter")
            ray.get(handle.__ray_ready__.remote(), timeout=300)
    return {
        a["Name"]: a["Address"]["NodeID"]
        for a in state.actors().values()
        if a.get("Name", "").startswith(prefix) and a.get("State") != "DEAD"
    }


def wrong_token_probe(address: str) -> dict[str, Any]:
    """Another process asking the cluster's GCS with a wrong token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
    code = (
        "import sys\nfrom hybrid_iter._cluster.ray_join import probe_ray_cluster\n"
        "try:\n    probe_ray_cluster(sys.argv[1], 30)\nexcept Exception as ex:\n"
        "    print(type(ex).__name__, ex)\n    sys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, address],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return {
        "returncode": proc.returncode,
        "stdout": proc.stdout[-2000:],
        "stderr": proc.stderr[-2000:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True)
    args = parser.parse_args(argv)
    work = Path(args.work_dir)

    import ray
    from pyspark.sql import SparkSession
    from pyspark.sql.types import DoubleType, StructField, StructType

    from hybrid_iter import ml, ps
    from spark_ops import available_task_slots

    report: dict[str, Any] = {"python": sys.executable}
    t_spark = time.perf_counter()
    spark = (
        SparkSession.builder.master(f"local-cluster[{EXECUTORS}, {CORES}, 1024]")
        .appName("hybrid_iter_on_spark_job")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executor.memory", "512m")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    report["spark_seconds"] = round(time.perf_counter() - t_spark, 2)
    report["master"] = sc.master
    report["path_has_ray"] = any(
        os.access(os.path.join(d, "ray"), os.X_OK)
        for d in os.environ["PATH"].split(os.pathsep)
        if d
    )

    # -- 1. bad input, each before Ray starts ------------------------------------------
    bad: dict[str, Any] = {}
    bad["too_few_slots"] = _bad(
        lambda: hi.Session.on_spark(spark, worker_nodes=3, parallelism=2), spark
    )
    bad["node_larger_than_executor"] = _bad(
        lambda: hi.Session.on_spark(spark, worker_node_cpus=CORES + 1), spark
    )
    own_python = sc.pythonExec
    sc.pythonExec = bare_python(work)  # the executors' Python from now on, for new jobs
    try:
        bad["no_ray_executable"] = _bad(lambda: hi.Session.on_spark(spark), spark)
    finally:
        sc.pythonExec = own_python
    bad["no_ray_executable"]["python"] = str(work / "bare" / "bin" / "python")
    report["bad"] = bad
    report["slots_before"] = available_task_slots(spark)

    # -- 2. the session ------------------------------------------------------------------
    schema = StructType(
        [StructField(c, DoubleType(), False) for c in FEATURES]
        + [StructField("y", DoubleType(), False)]
    )
    X, y = make_data(ROWS)
    rows = [(*map(float, X[i]), float(y[i])) for i in range(ROWS)]
    # Ray's socket paths must stay under 108 bytes: a short temp root
    ray_root = tempfile.mkdtemp(prefix="hi-ros-", dir="/tmp")
    # the session's warm-up is waited for at once, with no job of the user's to let go
    # first: it need not wait 5 s for a quiet Spark
    from hybrid_iter._cluster import warm_up

    warm_up.QUIET_BEFORE_WARM_UP = 1.0
    t0 = time.perf_counter()
    session = hi.Session.on_spark(
        spark,
        ray_temp_root_dir=ray_root,
        setup_options={
            "memory_worker_node": 512 * MiB,
            "object_store_memory_worker_node": 128 * MiB,
            "memory_head_node": 512 * MiB,
            "object_store_memory_head_node": 128 * MiB,
        },
    )
    with session:
        report["start_seconds"] = round(time.perf_counter() - t0, 2)
        # the warm-up's job has no job group: the counts of group-less jobs below start
        # once it has ended
        report["warmed"] = session.warmed(timeout=600)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        head = next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"])
        report["session"] = {
            "kind": session.kind,
            "ray_address": session.ray_address,
            "describe": session.describe(),
            "coordinator_resources": session.coordinator_resources,
            "task_slots": available_task_slots(spark),
            "head": head,
            "nodes": [
                {
                    "id": n["NodeID"],
                    "ip": n["NodeManagerAddress"],
                    "worker_node": "NODE_ID_AS_RESOURCE" in n["Resources"],
                    "cpus": n["Resources"].get("CPU", 0.0),
                }
                for n in nodes
            ],
            "handed_out": _handed_out(sc),
            "auth_mode_here": os.environ.get("RAY_AUTH_MODE"),
            "token_length": len(os.environ.get("RAY_AUTH_TOKEN", "")),
        }
        df = spark.createDataFrame(sc.parallelize(rows, 2), schema).cache()
        df.count()

        # a barrier stage wider than the slots the worker nodes leave: refused up front
        # (Spark itself would accept it, counting the slots they hold, and wait for ever)
        jobs = len(sc.statusTracker().getJobIdsForGroup())
        try:
            run_iteration(df, 1, parallelism=EXECUTORS * CORES - EXECUTORS + 1)
            report["too_wide"] = {"error": None}
        except hi.IterationConfigError as ex:
            report["too_wide"] = {"error": str(ex)}
        report["too_wide"]["jobs"] = len(sc.statusTracker().getJobIdsForGroup()) - jobs

        t1 = time.perf_counter()
        result = run_iteration(df, EPOCHS, name="on_spark")
        report["iteration"] = {
            "seconds": round(time.perf_counter() - t1, 2),
            "first_epoch_seconds": result.epoch_seconds[0] if result.epoch_seconds else None,
            "w": [float(v) for v in result.variables["w"]],
            "loss": [float(v) for v in result.outputs["loss"]],
            "epochs": result.epochs,
            "num_partitions": result.num_partitions,
            "where": sorted(result.outputs["where"], key=lambda w: w["partition"]),
            "coordinator_node": result.outputs["coordinator_node"],
        }
        jvms = executor_jvms()
        report["iteration"]["subtasks_below_executors"] = [
            is_below(w["pid"], jvms) for w in report["iteration"]["where"]
        ]

        # an ml fit (L-BFGS, the default solver), against scikit-learn
        t1 = time.perf_counter()
        label = (
            X @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.3 + np.random.default_rng(3).logistic(size=ROWS)
            > 0
        ).astype(float)
        lrows = [(*map(float, X[i]), float(label[i])) for i in range(ROWS)]
        ldf = spark.createDataFrame(
            sc.parallelize(lrows, 2),
            StructType(
                [StructField(c, DoubleType(), False) for c in FEATURES]
                + [StructField("label", DoubleType(), False)]
            ),
        )
        model = ml.LogisticRegression(
            features_col=FEATURES, label_col="label", tol=1e-10, max_iter=200
        ).fit(ldf)
        from sklearn.linear_model import LogisticRegression as SkLR

        sk = SkLR(penalty=None, tol=1e-12, max_iter=10_000).fit(X, label)
        report["ml"] = {
            "seconds": round(time.perf_counter() - t1, 2),
            "coefficients": [float(v) for v in model.coefficients],
            "intercept": float(model.intercept),
            "sk_coefficients": [float(v) for v in sk.coef_[0]],
            "sk_intercept": float(sk.intercept_[0]),
        }

        # ps.train, sync, one full-batch step per epoch, two shards
        t1 = time.perf_counter()
        trained = ps.train(
            df,
            linreg_grad,
            {"w": np.zeros(len(FEATURES))},
            optimizer=ps.SGD(LR),
            epochs=6,
            columns=[*FEATURES, "y"],
            num_shards=2,
            progress=False,
            name="on_spark_ps",
        )
        w_ref = np.zeros(len(FEATURES))
        for _ in range(6):
            w_ref = w_ref - LR * X.T @ (X @ w_ref - y) / ROWS
        report["ps"] = {
            "seconds": round(time.perf_counter() - t1, 2),
            "w": [float(v) for v in trained.params["w"]],
            "reference_w": [float(v) for v in w_ref],
            "shard_nodes": ray_actor_nodes("hybrid_iter.ps."),
        }

        # a subtask's Python worker SIGKILLed from outside, mid-run
        t1 = time.perf_counter()
        clean = run_iteration(df, EPOCHS, name="clean")
        marker, done, seen = work / "worker.pid", threading.Event(), {}
        killer = _kill_when_written(marker, done, seen)
        try:
            faulty = run_iteration(
                df,
                EPOCHS,
                name="killed",
                partition=LinRegGradient(str(marker), KILL_AT),
                # one machine: its local disk is shared by every Ray node
                checkpoint=hi.CheckpointConfig(
                    str(work / "ckpt"), every_epochs=CHECKPOINT_EVERY, shared_filesystem=True
                ),
            )
            report["kill"] = {
                "attempts": len(faulty.attempts),
                "restored_from": faulty.checkpoint["restored_from"],
                "same_bytes": faulty.variables["w"].tobytes() == clean.variables["w"].tobytes(),
                "same_loss": [float(v) for v in faulty.outputs["loss"]]
                == [float(v) for v in clean.outputs["loss"]],
            }
        except Exception as ex:
            report["kill"] = {"error": f"{type(ex).__name__}: {ex}"}
        finally:
            done.set()
            killer.join()
        report["kill"].update(seen)
        report["kill"]["seconds"] = round(time.perf_counter() - t1, 2)

        # a second session joining the running cluster, and leaving it running
        inner = hi.Session.on_spark(spark)
        joined = {
            "kind": inner.kind,
            "ray_address": inner.ray_address,
            "started": inner._stops.started,
            "task_slots": available_task_slots(spark),
        }
        inner.stop()
        joined["ray_still_connected"] = ray.is_initialized()
        joined["alive_nodes_after"] = len([n for n in ray.nodes() if n["Alive"]])
        joined["task_slots_after"] = available_task_slots(spark)
        joined["token_still_here"] = bool(os.environ.get("RAY_AUTH_TOKEN"))
        report["joined"] = joined

        report["listening"] = listening()
        report["wrong_token"] = wrong_token_probe(session.ray_address)
        started_ray = ray_processes()
        launcher = session._stops.launcher_dir
        t_stop = time.perf_counter()

    # -- 3. after the stop -------------------------------------------------------------
    stop_seconds = time.perf_counter() - t_stop
    t1 = time.perf_counter()
    left = wait_gone(set(started_ray), 90)
    from ray.util.spark import cluster_init

    report["stop"] = {
        "ray_processes_while_running": sorted(set(started_ray.values()))[:40],
        "ray_process_count": len(started_ray),
        "left": {str(p): c for p, c in left.items()},
        "stop_seconds": round(stop_seconds, 2),
        "seconds_until_gone": round(time.perf_counter() - t1, 2),
        "new_ray_processes": sorted(ray_processes().values()),
        "ray_initialized": ray.is_initialized(),
        "session_current": hi.Session.current() is not None,
        "handed_out": _handed_out(sc),
        "task_slots": available_task_slots(spark),
        "launcher_left": launcher is not None and os.path.exists(launcher),
        "active_cluster": cluster_init._active_ray_cluster is not None,
    }
    report["stop"]["ray_temp_left"] = sorted(os.listdir(ray_root))
    shutil.rmtree(ray_root, ignore_errors=True)
    spark.stop()
    w_ref, loss_ref = numpy_gradient_descent(X, y, LR, EPOCHS)
    report["reference_w"] = [float(v) for v in w_ref]
    report["reference_loss"] = loss_ref
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        sys.exit(main(["--work-dir", d, *sys.argv[1:]]))
