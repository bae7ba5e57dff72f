"""The workload of test_coordinator_node.py: the driver of a multi-node Ray cluster whose
node running the coordinator dies mid-run.

``test_coordinator_node.py`` starts Ray raylets on 127.0.0.1 (``k8s_ray_cluster.py``): a
head that runs no actors of ours and two worker nodes that offer the custom resource
``coord``, which the coordinator asks for (``coordinator_resources``). ``main()`` here
runs in a subprocess with ``RAY_ADDRESS`` set, with Spark ``local[2]`` on this machine
and ``Session.attach``, and:

1. refuses a node-local checkpoint path on the multi-node cluster (no job may run);
2. runs checkpoint_job's sync body with a checkpoint every epoch on a directory every
   node shares (one machine: a local directory, declared ``shared_filesystem=True``);
3. runs it again with a hook that, at one alignment in the coordinator's first life,
   SIGKILLs the raylet of the node the coordinator runs on and then the coordinator's
   own process: the whole node is gone. Ray restarts the actor on the other worker node,
   which must find the checkpoint, restore it and end bit for bit like run 2.

It prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from checkpoint_job import DIMS, Grad, Step, data
from multinode_job import raylet_of

import hybrid_iter as hi
from hybrid_iter.testing import RuntimeHooks

EPOCHS = 8
KILL_AT = 4
RESULT_PREFIX = "RESULT "


class NodeKiller(RuntimeHooks):
    """In the coordinator actor: log ``epoch node restarted`` at every alignment; at
    ``at``, in the first life only, kill the node this process runs on."""

    def __init__(self, log: str, marker: str, at: int) -> None:
        self.log, self.marker, self.at = log, marker, at

    def at_alignment(self, epoch: int, *, attempt: int | None, restarted: bool) -> None:
        import ray

        node = ray.get_runtime_context().get_node_id()
        with open(self.log, "a") as f:
            f.write(f"{epoch} {node} {int(restarted)}\n")
        if epoch == self.at and not os.path.exists(self.marker):
            Path(self.marker).write_text(node)
            raylet = raylet_of(os.getpid())
            if raylet is not None:
                os.kill(raylet, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def iterate(df: Any, directory: Path, **config: Any) -> hi.IterationResult:
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(DIMS)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(max_epochs=EPOCHS, parallelism=2, **config),
        hi.IterationBody(Grad(), Step()),
    )


def main(argv: list[str]) -> int:
    from pyspark.sql import SparkSession

    work = Path(argv[0])
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.task.maxFailures", "1")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    report: dict[str, Any] = {}
    session = hi.Session.attach(
        spark, os.environ["RAY_ADDRESS"], coordinator_resources={"coord": 0.001}
    )
    try:
        df = data(spark).cache()
        df.count()

        # 1. A plain local path on a multi-node cluster: refused before any Spark job.
        jobs = spark.sparkContext.statusTracker().getJobIdsForGroup()
        try:
            iterate(df, work / "local", checkpoint=hi.CheckpointConfig(str(work / "local")))
            report["local_path"] = {"error": None}
        except hi.IterationConfigError as ex:
            report["local_path"] = {"error": str(ex)}
        report["local_path"]["jobs"] = len(
            spark.sparkContext.statusTracker().getJobIdsForGroup()
        ) - len(jobs)
        report["local_path"]["written"] = (work / "local").exists()

        # 2. Fault-free, 3. the coordinator's node killed at KILL_AT.
        shared = {"every_epochs": 1, "shared_filesystem": True}
        t0 = time.perf_counter()
        clean = iterate(df, work / "a", checkpoint=hi.CheckpointConfig(str(work / "a"), **shared))
        report["clean_seconds"] = time.perf_counter() - t0
        log, marker = work / "alignments.log", work / "killed"
        t0 = time.perf_counter()
        faulted = iterate(
            df,
            work / "b",
            checkpoint=hi.CheckpointConfig(str(work / "b"), **shared),
            hooks=NodeKiller(str(log), str(marker), KILL_AT),
        )
        report["faulted_seconds"] = time.perf_counter() - t0
        report["clean"] = {
            "w_hex": clean.variables["w"].tobytes().hex(),
            "epochs": clean.epochs,
            "w0": clean.outputs["w0"],
        }
        report["faulted"] = {
            "w_hex": faulted.variables["w"].tobytes().hex(),
            "epochs": faulted.epochs,
            "w0": faulted.outputs["w0"],
            "checkpoint": faulted.checkpoint,
        }
        report["killed_node"] = marker.read_text() if marker.exists() else None
        report["alignments"] = [line.split() for line in log.read_text().splitlines()]
        report["nodes"] = {
            n["NodeID"]: {"alive": n["Alive"], "resources": n.get("Resources", {})}
            for n in __import__("ray").nodes()
        }
    finally:
        session.stop()
        spark.stop()
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
