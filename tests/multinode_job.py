"""The workload of test_multinode.py, run as the driver of a multi-node Ray cluster.

``test_multinode.py`` starts a Ray cluster of several raylets on 127.0.0.1 (each with its
own object store; ``k8s_ray_cluster.py``) and runs ``main()`` here in a subprocess with
``RAY_ADDRESS`` pointing at it, as ``ray job submit`` would. ``main()`` opens
``hybrid_iter.Session.raydp()`` (the address from ``RAY_ADDRESS``), then runs, noting on
which node each piece ran:

* ``linreg_big``: a sync linear regression whose variables include a 1.6 MB array that
  travels through the object store, checked by every subtask at every version;
* ``fit_ml``: ``hybrid_iter.ml.LogisticRegression``;
* ``train_ps``: ``hybrid_iter.ps.train`` with two shards;
* ``linreg_big`` again with a checkpoint on a directory every node shares (one machine:
  a local directory is a shared mount), during which the worker node of one executor is
  killed from outside (SIGKILL of its raylet and the executor's JVM) at epoch 3.

It prints one ``RESULT {json}`` line. The same functions run on the test session's
single-node ``Session.local`` in the test, for the equality check. The operators live
in this module, which every node imports by name (the cluster's PYTHONPATH has tests/).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import hybrid_iter as hi
from hybrid_iter import ml, ps

FEATURES = ["x0", "x1", "x2", "x3"]
BIG = 200_000  # float64: 1.6 MB, far above the inline limit: the object store
RESULT_PREFIX = "RESULT "
PARTITIONS = 2
EPOCHS = 6
KILL_AT = 3


# -- where am I ----------------------------------------------------------------------------


def raylet_of(pid: int) -> int | None:
    """PID of the raylet above ``pid`` (Linux /proc): the Ray node a process belongs to."""
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if comm == "raylet":
            return pid
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return None


def raylet_node_ids() -> dict[int, str]:
    """``raylet pid -> Ray node id`` from the raylets' command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "raylet":
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(b"--node_id="):
                found[int(entry.name)] = arg.split(b"=", 1)[1].decode()
    return found


def driver_nodes() -> set[str]:
    """The Ray nodes whose raylet a driver of this job is attached to: this Python driver,
    and the Spark driver's JVM, which RayDP connects to Ray as a Java driver (its core
    worker log names the node). On one machine every raylet shares 127.0.0.1 and a
    driver attaches to any of them; killing that raylet takes the driver's connection
    and every actor it owns (RayDP's app master and executors) with it. On a real
    cluster the driver runs on the head or the submitting machine, so losing a worker
    node never does that: the node to kill is one no driver is attached to."""
    import re

    import ray

    nodes = {ray.get_runtime_context().get_node_id()}
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    for log in logs.glob("java-core-driver-*.log"):
        found = re.search(r"node_id=([0-9a-f]+)", log.read_text(errors="replace"))
        if found:
            nodes.add(found.group(1))
    return nodes


def node_of_this_process() -> str | None:
    """The Ray node id of the raylet this process descends from (None: not under one)."""
    raylet = raylet_of(os.getpid())
    return None if raylet is None else raylet_node_ids().get(raylet)


# -- the iteration -------------------------------------------------------------------------


def make_data(rows: int, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, len(FEATURES)))
    y = X @ np.arange(1.0, len(FEATURES) + 1) + 0.25 * rng.standard_normal(rows)
    return X, y


def frame(spark: Any, rows: int = 2000) -> Any:
    X, y = make_data(rows)
    data = [(*map(float, X[i]), float(y[i]), int(X[i, 0] + X[i, 1] > 0)) for i in range(rows)]
    return spark.createDataFrame(
        spark.sparkContext.parallelize(data, PARTITIONS), [*FEATURES, "y", "label"]
    )


class Gradient(hi.PartitionOperator):
    """Least-squares gradient at ``w``; checks the big variable it was handed."""

    def open(self, ctx):
        self.cache = hi.NumpyCache(FEATURES, extra=["y"])

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = np.asarray(variables["w"], dtype=float)
        big = variables["big"]
        # every element equals the version that published it: a stale or torn copy shows
        ok = big.shape == (BIG,) and float(big.min()) == float(big.max()) == ctx.variables_version
        out.output("seen", (ctx.partition_id, ctx.variables_version, bool(ok)))

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        if epoch == 0:
            out.output("task_node", (ctx.partition_id, node_of_this_process()))
        X, y = self.cache.matrix(), self.cache.column("y")
        r = X @ self.w - y
        out.feedback((X.T @ r, float(r @ r), len(y)))


class Step(hi.CoordinatorOperator):
    """Sync: one gradient step per epoch; publishes ``w`` and a new 1.6 MB ``big``."""

    def __init__(self, lr: float, marker_dir: str | None = None):
        self.lr = lr
        self.marker_dir = marker_dir

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"], dtype=float)
        self.acc = None
        self.node = node_of_this_process()

    def process_feedback(self, value, ctx, out):
        g, sq, n = value
        a = self.acc
        self.acc = value if a is None else (a[0] + g, a[1] + sq, a[2] + n)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        (g, sq, n), self.acc = self.acc, None
        out.output("loss", sq / n)
        out.output("coordinator_node", self.node)
        self.w = self.w - self.lr * g / n
        if self.marker_dir is not None and epoch == KILL_AT:
            self._wait_for_the_kill()
        out.publish_variables(w=self.w, big=np.full(BIG, float(epoch + 1)))

    def _wait_for_the_kill(self) -> None:
        # The first time only (not after the restore): tell the driver, whose killer
        # thread takes a worker node down, and hold the epoch until it has.
        reached = Path(self.marker_dir, "reached")
        if reached.exists():
            return
        reached.write_text(str(os.getpid()))
        killed = Path(self.marker_dir, "killed")
        deadline = time.monotonic() + 300
        while not killed.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for an external event (the kill), bounded


def linreg_big(
    spark: Any,
    *,
    checkpoint: str | None = None,
    marker_dir: str | None = None,
    staleness: int = 0,
    epochs: int = EPOCHS,
) -> Any:
    config: dict[str, Any] = {"staleness": staleness, "max_epochs": epochs, "progress": False}
    if checkpoint is not None:
        # every raylet runs on this machine: a local directory is shared by all nodes,
        # which a multi-node checkpoint must declare (else it is refused as node-local)
        config["checkpoint"] = hi.CheckpointConfig(
            path=checkpoint, every_epochs=1, shared_filesystem=True
        )
        config["max_restarts"] = 3
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(len(FEATURES)), "big": np.zeros(BIG)},
        hi.ReplayableDataStreamList.not_replay(
            hi.DataStream(frame(spark).drop("label"), numeric_columns=[*FEATURES, "y"])
        ),
        hi.IterationConfig(**config),
        hi.IterationBody(partition=Gradient(), coordinator=Step(0.3, marker_dir)),
    )


def fit_ml(spark: Any) -> Any:
    return ml.LogisticRegression(
        features_col=FEATURES,
        label_col="label",
        max_iter=5,
        solver="sgd",
        learning_rate=0.8,
        progress=False,
    ).fit(frame(spark))


def linreg_grad(params: dict[str, np.ndarray], batch: dict[str, np.ndarray]):
    X = np.stack([batch[c] for c in FEATURES], axis=1)
    r = X @ params["w"] + params["b"] - batch["y"]
    return float(r @ r) / (2 * len(r)), {"w": X.T @ r / len(r), "b": r.mean()}


def train_ps(spark: Any) -> Any:
    return ps.train(
        frame(spark),
        linreg_grad,
        {"w": np.zeros(len(FEATURES)), "b": 0.0},
        optimizer=ps.SGD(0.2),
        epochs=2,
        batch_size=250,
        columns=[*FEATURES, "y"],
        num_shards=2,
        parallelism=PARTITIONS,
        progress=False,
    )


def summary(result: Any) -> dict[str, Any]:
    """What the test compares between the cluster and the single-node run."""
    seen = result.outputs["seen"]
    return {
        "w": [float(v) for v in result.variables["w"]],
        "big0": float(result.variables["big"][0]),
        "loss": [float(v) for v in result.outputs["loss"]],
        "epochs": result.epochs,
        "seen_ok": all(ok for _, _, ok in seen),
        "versions": sorted({(p, v) for p, v, _ in seen}),
        "attempts": list(result.attempts),
    }


# -- the actors' nodes, from the GCS (no dashboard needed) -------------------------------------


def actors() -> list[dict[str, Any]]:
    import ray

    return [
        {
            "class": a.get("ActorClassName") or "",
            "name": a.get("Name") or "",
            "node": (a.get("Address") or {}).get("NodeID"),
            "pid": a.get("Pid"),
            "state": a.get("State"),
        }
        for a in ray._private.state.actors().values()
    ]


def _kill_a_worker_node(marker_dir: Path, report: dict[str, Any]) -> None:
    """Driver thread: once the coordinator holds epoch KILL_AT, SIGKILL the raylet of a
    node running an executor, and the executor, from outside; then release the epoch."""
    reached = marker_dir / "reached"
    deadline = time.monotonic() + 300
    while not reached.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for an external event, bounded
    try:
        drivers = driver_nodes()
        report["driver_nodes"] = sorted(drivers)
        executors = [
            a
            for a in actors()
            if "Executor" in a["class"]
            and a["state"] == "ALIVE"
            and a["pid"]
            and a["node"] not in drivers
        ]
        if not executors:
            raise RuntimeError(f"every executor runs on a node a driver is attached to ({drivers})")
        victim = executors[0]
        raylets = {node: pid for pid, node in raylet_node_ids().items()}
        os.kill(raylets[victim["node"]], signal.SIGKILL)
        os.kill(victim["pid"], signal.SIGKILL)
        report["killed_node"] = victim["node"]
    except Exception as ex:  # reported, and the test fails on it
        report["kill_error"] = f"{type(ex).__name__}: {ex}"
    finally:
        (marker_dir / "killed").write_text("")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--work-dir", required=True)
    args = parser.parse_args(argv)

    import ray

    from spark_ops import available_task_slots

    work = Path(args.work_dir)
    t0 = time.perf_counter()
    session = hi.Session.raydp(
        num_executors=args.executors,
        executor_cores=1,
        executor_memory="512m",
        app_name="hybrid_iter_multinode",
        executor_wait_seconds=180,
    )
    report: dict[str, Any] = {}
    with session:
        report["start_seconds"] = round(time.perf_counter() - t0, 2)
        spark = session.spark
        report["where"] = session.describe()
        nodes = [n for n in ray.nodes() if n["Alive"]]
        report["nodes"] = {
            n["NodeID"]: {
                "head": "node:__internal_head__" in n["Resources"],
                "resources": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")},
            }
            for n in nodes
        }
        report["driver_node"] = node_of_this_process()
        report["task_slots"] = available_task_slots(spark)

        r = linreg_big(spark)
        report["linreg"] = summary(r)
        report["linreg_task_nodes"] = sorted(map(tuple, r.outputs["task_node"]))
        report["linreg_coordinator_nodes"] = sorted(set(r.outputs["coordinator_node"]))
        model = fit_ml(spark)
        report["ml"] = {
            "coefficients": [float(v) for v in model.coefficients],
            "intercept": float(model.intercept),
        }
        trained = train_ps(spark)
        report["ps"] = {
            "w": [float(v) for v in trained.params["w"]],
            "b": float(trained.params["b"]),
        }
        report["executors_before_kill"] = [
            a["node"] for a in actors() if "Executor" in a["class"] and a["state"] == "ALIVE"
        ]

        marker_dir = work / "markers"
        marker_dir.mkdir()
        # a daemon: a run that fails before the kill must not leave the job waiting for it
        killer = threading.Thread(
            target=_kill_a_worker_node, args=(marker_dir, report), daemon=True
        )
        killer.start()
        # A local directory is a shared path here: every raylet runs on this machine.
        r = linreg_big(spark, checkpoint=str(work / "checkpoints"), marker_dir=str(marker_dir))
        killer.join()
        report["after_kill"] = summary(r)
        report["after_kill_coordinator_nodes"] = sorted(set(r.outputs["coordinator_node"]))
        report["actors"] = actors()
        from raydp_job import listening_sockets

        report["listening"] = [
            s for pid in {os.getpid()} for s in listening_sockets(pid)
        ]  # the driver's own (the Spark driver JVM is its child)
    report["total_seconds"] = round(time.perf_counter() - t0, 2)
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
