"""A small sync iteration on Spark on Ray (RayDP), run in a process of its own.

Only one SparkContext can live in a process (and its JVM keeps the classpath it was
launched with), while the test suite shares one ``Session.local``; so ``test_raydp.py``
runs this module in a subprocess::

    PYTHONPATH=tests:. python -c "import raydp_job, sys; sys.exit(raydp_job.main())"

``main()`` starts ``hybrid_iter.Session.raydp`` on loopback, runs a linear regression by
full-batch gradient descent over generated rows, stops the session and prints one JSON
line (prefixed with ``RESULT ``) with the results, a numpy reference and what the
processes it started were bound to. The operators live in this module (not in
``__main__``) so Spark's Python workers and the Ray coordinator actor import them by name.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import hybrid_iter as hi

FEATURES = ["x0", "x1", "x2", "x3"]
RESULT_PREFIX = "RESULT "


def make_data(rows: int, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, len(FEATURES)))
    y = X @ np.arange(1.0, len(FEATURES) + 1) + 0.25 * rng.standard_normal(rows)
    return X, y


def numpy_gradient_descent(X: np.ndarray, y: np.ndarray, lr: float, epochs: int):
    """The reference: the same full-batch steps as LinRegGradient + GradientStep."""
    w = np.zeros(X.shape[1])
    losses = []
    for _ in range(epochs):
        r = X @ w - y
        losses.append(float(r @ r) / len(y))
        w = w - lr * (X.T @ r) / len(y)
    return w, losses


class LinRegGradient(hi.PartitionOperator):
    """Least-squares gradient of the subtask's rows at the current ``w``."""

    def open(self, ctx):
        self.cache = hi.NumpyCache(FEATURES, extra=["y"])

    def process_data(self, stream, batch, ctx, out):
        self.cache.add(batch)

    def process_variables(self, variables, ctx, out):
        self.w = np.asarray(variables["w"], dtype=float)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        X = self.cache.matrix()
        y = self.cache.column("y")
        r = X @ self.w - y
        if epoch == 0:
            out.output("worker", (ctx.partition_id, sys.executable, os.getpid()))
        out.feedback((X.T @ r, float(r @ r), len(y)))


class GradientStep(hi.CoordinatorOperator):
    """Sync: sum the epoch's gradients, take one step, publish ``w``."""

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
        (g, sq, n), self.acc = self.acc, None
        out.output("loss", sq / n)
        self.w = self.w - self.lr * g / n
        out.publish_variables(w=self.w)


# -- what the session's processes listen on ------------------------------------------------


def _process_table() -> dict[int, tuple[int, str, str]]:
    """``pid -> (ppid, state, command name)`` of every process (Linux /proc)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # pid (comm) state ppid ...; comm may contain spaces and parentheses
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            table[int(entry.name)] = (int(ppid), state, comm)
        except (OSError, ValueError):  # the process exited meanwhile
            continue
    return table


def _descendants(root: int, *, skip: int | None = None) -> dict[int, str]:
    """``pid -> command name`` of the live (not zombie) processes below ``root``,
    leaving out ``skip`` and everything below it."""
    children: dict[int, list[int]] = {}
    table = _process_table()
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in found or pid == skip or pid not in table:
            continue
        _, state, comm = table[pid]
        if state != "Z":
            found[pid] = comm
        todo.extend(children.get(pid, []))
    return found


def _hex_address(hex_addr: str) -> str:
    """``/proc/net/tcp*`` ``ADDR:PORT`` (hex, little-endian words) as ``host:port``."""
    host, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}:{int(port, 16)}"
    return f"{ip}:{int(port, 16)}"


def listening_sockets(root: int | None = None) -> list[dict[str, object]]:
    """TCP listening sockets (v4 and v6) held by ``root`` and its descendants."""
    root = os.getpid() if root is None else root
    procs = {root: "self", **_descendants(root)}
    inodes: dict[str, tuple[int, str]] = {}
    for pid, name in procs.items():
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = (pid, name)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                continue
            pid, name = inodes[parts[9]]
            found.append({"address": _hex_address(parts[1]), "pid": pid, "process": name})
    return found


def _left_after_stop(grace_seconds: float = 15.0) -> dict[str, str]:
    """Processes this one started that outlive the session (Ray, JVMs, Python workers).

    PySpark's own gateway JVM (the Spark driver) stays until the process exits, as
    after any ``SparkSession.stop()``; it and its children are not counted.
    """
    from pyspark import SparkContext

    gateway = SparkContext._gateway.proc.pid if SparkContext._gateway is not None else None
    deadline = time.monotonic() + grace_seconds
    while True:
        left = {str(p): n for p, n in _descendants(os.getpid(), skip=gateway).items()}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)  # waiting for processes to exit, not test synchronisation


# -- the job ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", type=int, default=2)
    parser.add_argument("--cores", type=int, default=1)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.3)
    args = parser.parse_args(argv)

    import ray
    from pyspark.sql.types import DoubleType, StructField, StructType

    from spark_ops import available_task_slots

    X, y = make_data(args.rows)
    t0 = time.perf_counter()
    session = hi.Session.raydp(
        num_executors=args.executors,
        executor_cores=args.cores,
        executor_memory="512m",
        app_name="hybrid_iter_raydp_job",
        executor_wait_seconds=90,
    )
    with session:
        start_seconds = time.perf_counter() - t0
        warmed = session.warmed(600)
        spark = session.spark
        sc = spark.sparkContext
        conf = dict(sc.getConf().getAll())
        executors = sorted(
            str(e.host()) for e in sc._jsc.sc().statusTracker().getExecutorInfos()
        )  # includes the driver
        schema = StructType(
            [StructField(c, DoubleType(), False) for c in FEATURES]
            + [StructField("y", DoubleType(), False)]
        )
        rows = [(*map(float, X[i]), float(y[i])) for i in range(args.rows)]
        df = spark.createDataFrame(sc.parallelize(rows, args.partitions), schema)
        t1 = time.perf_counter()
        result = hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(len(FEATURES))},
            hi.ReplayableDataStreamList.not_replay(
                hi.DataStream(df, numeric_columns=[*FEATURES, "y"])
            ),
            hi.IterationConfig(staleness=0, max_epochs=args.epochs, progress=False, name="raydp"),
            hi.IterationBody(partition=LinRegGradient(), coordinator=GradientStep(args.lr)),
        )
        iteration_seconds = time.perf_counter() - t1
        listening = listening_sockets()
        report = {
            "master": sc.master,
            "session_kind": session.kind,
            "ray_address": session.ray_address,
            "ray_node_ips": sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}),
            "driver_host": conf.get("spark.driver.host"),
            "driver_bind_address": conf.get("spark.driver.bindAddress"),
            "executor_hosts": executors,
            "task_slots": available_task_slots(spark),
            "variables_w": [float(v) for v in result.variables["w"]],
            "loss": [float(v) for v in result.outputs["loss"]],
            "workers": sorted(tuple(w) for w in result.outputs.get("worker", [])),
            "epochs": result.epochs,
            "terminated_by": result.terminated_by,
            "num_partitions": result.num_partitions,
            "rows": list(result.rows),
            "summary": result.summary(),
            "listening": listening,
            "warmed": warmed,
        }
    left = _left_after_stop()
    w_ref, loss_ref = numpy_gradient_descent(X, y, args.lr, args.epochs)
    report.update(
        {
            "reference_w": [float(v) for v in w_ref],
            "reference_loss": loss_ref,
            "python": sys.executable,
            "ray_initialized_after_stop": ray.is_initialized(),
            "left_after_stop": left,
            "session_current_after_stop": hi.Session.current() is not None,
            "start_seconds": round(start_seconds, 2),
            "iteration_seconds": round(iteration_seconds, 2),
            "total_seconds": round(time.perf_counter() - t0, 2),
        }
    )
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
