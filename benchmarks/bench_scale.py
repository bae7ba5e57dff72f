"""How the coordinator's per-epoch cost grows with the number of
subtasks N and the feedback size, flat (every subtask sends its feedback to the actor)
against tree aggregation (``IterationBody(feedback_combine="sum")``, fan-in 32); and the
variables fan-out of one object-store put per version to N subtasks.

    python benchmarks/bench_scale.py            # N = 2..1024, feedback 1e3, 1e5, 1e6
    python benchmarks/bench_scale.py --quick    # a smaller grid, about a minute

A **simulation on one 2-core machine**: the real coordinator actor
(``coordinator.IterationCoordinator``, with its group aggregator actors in tree mode) and
the real task-side protocol code (``hybrid_iter._runtime.task._Subtask``: the same calls a Spark
task makes, minus Spark), driven by N simulated subtasks: threads in a few client
processes (Ray actors), real Ray calls, no mocks. The clients compete with the
coordinator for the 2 cores, so the wall times (alignment time per epoch) measure the
machine as much as the design. The design is what the coordinator process itself does:
its CPU time per epoch (measured inside the actor, every thread of its process), the
calls and bytes it receives per epoch, its peak RSS. Growth is fitted as
``cost ~ N^a`` (least squares on log-log) and printed.

Per configuration: alignment time per epoch (median, p99), coordinator CPU per epoch,
calls and payload bytes into the coordinator per epoch (array data of the feedback plus
a nominal 200 bytes per call), peak coordinator RSS, the group actors' CPU per epoch,
the clients' CPU per epoch. The flat baseline at N x size beyond ``--flat-cap-bytes``
per epoch (default 1.2 GB) is skipped with the reason printed (1,024 x 1e6 float64 is
8 GB into one process per epoch); tree runs beyond ``--tree-cap-bytes`` in flight are
skipped likewise (the groups still receive every subtask's array).

Writes JSON to benchmarks/results/scale.json.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the harness, also when a test imports this file by path

from _harness import peak_rss, write_report  # noqa: E402

if __name__ != "__main__":  # imported (e.g. by the tests): ship this module's code by value
    import cloudpickle
    from ray import cloudpickle as ray_cloudpickle  # Ray pickles actor classes with its own

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: subtasks per client process at most (threads); clients = ceil(N / this), at most 4
PER_CLIENT = 256
MAX_CLIENTS = 4


def _nbytes(v: Any) -> int:
    if isinstance(v, np.ndarray):
        return v.nbytes
    if isinstance(v, tuple | list):
        return sum(_nbytes(x) for x in v)
    if isinstance(v, dict):
        return sum(_nbytes(x) for x in v.values())
    return 8


def _measured_coordinator_class() -> type:
    """``IterationCoordinator`` plus read-only probes (CPU, RSS, calls, bytes in)."""
    from coordinator import IterationCoordinator

    class Measured(IterationCoordinator):
        bytes_in = 0
        calls_in = 0

        async def report(
            self, pid, epoch, known_version, emissions, rows=None, attempt=0, offered=None
        ):
            self.calls_in += 1
            self.bytes_in += 200 + _nbytes(emissions.feedback)
            return await super().report(
                pid, epoch, known_version, emissions, rows, attempt, offered
            )

        async def report_group(self, first_pid, epoch, members, combined, attempt=0):
            self.calls_in += 1
            self.bytes_in += 200 + 100 * len(members) + _nbytes(combined.feedback)
            return await super().report_group(first_pid, epoch, members, combined, attempt)

        def _aligned(self, ins, events) -> None:
            if ins.epoch >= 1:
                # CPU of this process at each alignment k >= 1: per-epoch CPU is the
                # difference
                self.__dict__.setdefault("cpu_marks", []).append(time.process_time())
                # the event-loop thread alone: the protocol's Python work and the user's
                # operator, without Ray's transport threads
                self.__dict__.setdefault("loop_marks", []).append(time.thread_time())
            super()._aligned(ins, events)

        async def probe(self) -> dict:
            tree = self._tree
            return {
                "cpu": time.process_time(),
                "pid": os.getpid(),  # its peak memory is read from outside
                "calls": self.calls_in,
                "bytes_in": self.bytes_in,
                "aligned": self.core.sm.aligned,
                "cpu_marks": list(self.__dict__.get("cpu_marks", [])),
                "loop_marks": list(self.__dict__.get("loop_marks", [])),
                "groups": len(tree.groups) if tree is not None else 0,
            }

        async def group_probe(self) -> list:

            # the groups, then the root aggregator (the last entry) when there is one
            if self._tree is None or not self._tree.groups:
                return []
            root = [self._tree.root] if self._tree.root is not None else []
            return list(await _gather([g.info.remote() for g in [*self._tree.groups, *root]]))

    return Measured


async def _gather(refs: list) -> list:
    import asyncio

    return list(await asyncio.gather(*refs))


def _make_ops(size: int, epochs: int, combine: bool) -> tuple[bytes, bytes]:
    """The partition operator (feeds back ``size`` float64 per epoch: one shared array
    per client process, so client memory stays flat) and the coordinator operator (sums,
    continues until ``epochs``, outputs the first element of the sum)."""
    import cloudpickle

    import hybrid_iter as hi

    class FeedbackOp(hi.PartitionOperator):
        def __init__(self, size: int) -> None:
            self.size = size

        def open(self, ctx):
            self.value = _shared(self.size)

        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            # size 0: the empty body, one scalar (one call per subtask and epoch still
            # reaches the coordinator: that is what the harness measures)
            out.feedback(self.value if self.size else 0.5)

    class SumOp(hi.CoordinatorOperator):
        def __init__(self, epochs: int) -> None:
            self.epochs = epochs

        def open(self, init_variables, ctx):
            self.acc = None
            self.calls = 0
            self.w = init_variables["w"]

        def process_feedback(self, value, ctx, out):
            self.calls += 1
            self.acc = np.atleast_1d(value) if self.acc is None else self.acc + value

        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            if self.acc is not None:
                out.output("first", float(self.acc[0]))
            out.output("process_feedback_calls", self.calls)
            self.acc, self.calls = None, 0
            if epoch + 1 < self.epochs:
                # the feedback edge (Flink ML): a publish keeps the loop alive; the
                # criteria stream says when to stop
                out.publish_variables(w=self.w)
                out.criteria()

    return cloudpickle.dumps(FeedbackOp(size)), cloudpickle.dumps((SumOp(epochs), None, []))


def _shared(size: int) -> np.ndarray:
    """One read-only feedback array per client process and size (operators are unpickled
    per subtask, so the cache lives in a module registered in ``sys.modules``)."""
    import sys
    import types

    mod = sys.modules.setdefault("_bench_scale_cache", types.ModuleType("_bench_scale_cache"))
    cache = mod.__dict__.setdefault("arrays", {})
    v = cache.get(size)
    if v is None:
        v = cache[size] = np.full(size, 0.5)
        v.flags.writeable = False
    return v


class _Client:
    """A client process: runs many simulated subtasks, one thread each, through the
    real task-side protocol (``_Subtask``: start, epoch, terminate). A Ray actor."""

    def run(self, plan: Any, pids: list[int], coord: Any) -> dict:
        import pyarrow as pa

        from coordinator import RayLink
        from hybrid_iter._runtime.task import _Subtask

        batch = pa.record_batch({"x": pa.array([1.0])})
        stamps: dict[int, list[float]] = {}
        errors: list[str] = []
        cpu0 = time.process_time()

        def one(pid: int) -> None:
            try:
                sub = _Subtask(plan, pid, RayLink(coord))
                t = stamps[pid] = []
                done = sub.start(iter([(0, batch)]))
                t.append(time.time())  # variables of call 0 resolved
                while not done:
                    done = sub.epoch()
                    t.append(time.time())  # this call's reply and variables resolved
                sub.terminate()
            except Exception as ex:  # reported, never hidden
                errors.append(f"subtask {pid}: {type(ex).__name__}: {ex}")

        threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in pids]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return {"stamps": stamps, "errors": errors, "cpu": time.process_time() - cpu0}


def run_config(
    n: int,
    size: int,
    *,
    tree: bool,
    epochs: int = 4,
    variables_size: int = 1,
    fan_in: int = 32,
    ops: tuple[bytes, bytes] | None = None,
    clients: list | None = None,
    idle_window: float = 2.0,
) -> dict:
    """One configuration on the connected Ray: N simulated subtasks, ``epochs`` epochs
    (the first is a warm-up and is left out of the per-epoch figures)."""
    import cloudpickle
    import ray

    from coordinator import CoordinatorSpec
    from coordinator._tree import TreeSpec
    from hybrid_iter._cluster.ray_util import NAMESPACE
    from hybrid_iter._runtime.task import TaskPlan

    op_bytes, coord_bytes = ops or _make_ops(size, epochs, tree)
    spec_tree = TreeSpec(cloudpickle.dumps("sum"), fan_in) if tree else None
    spec = CoordinatorSpec(
        num_subtasks=n,
        num_streams=1,
        staleness=0,
        max_epochs=epochs + 1,
        has_criteria=True,
        init_variables={"w": np.zeros(variables_size)},
        operators=coord_bytes,
        tree=spec_tree,
    )
    coord = ray.remote(num_cpus=0, max_concurrency=max(1000, n + 16))(
        _measured_coordinator_class()
    ).remote(spec)
    run = f"bench_scale.{time.time_ns()}"
    plan = TaskPlan(
        ray_address="",
        namespace=NAMESPACE,
        actor_name=run,
        run=run,  # the task-side caches key on it
        operator=op_bytes,
        num_subtasks=n,
        numeric_columns=(None,),
        staleness=0,
        has_criteria=True,
        tree=spec_tree,
    )
    clients_n = min(MAX_CLIENTS, max(1, math.ceil(n / PER_CLIENT)), n)
    own = clients is None
    if clients is None:
        clients = start_clients(clients_n)
    clients = clients[:clients_n]
    try:
        ray.get(coord.begin_attempt.remote(0))
        ray.get([c.__ray_ready__.remote() for c in clients])
        before = ray.get(coord.probe.remote())
        groups_before = ray.get(coord.group_probe.remote())
        parts = [list(range(n))[i::clients_n] for i in range(clients_n)]
        runs = ray.get([c.run.remote(plan, p, coord) for c, p in zip(clients, parts)])
        errors = [e for r in runs for e in r["errors"]]
        if errors:
            raise RuntimeError(f"{len(errors)} simulated subtask(s) failed: {errors[:3]}")
        after = ray.get(coord.probe.remote())
        rss_peak = peak_rss(after["pid"])  # the coordinator's high-water mark (same machine)
        groups = ray.get(coord.group_probe.remote())
        result = ray.get(coord.result.remote())
        # Ray's own threads in the coordinator process burn CPU while nothing happens
        # (polling, heartbeats): that rate (measured once the run is over and everything
        # is quiet) times an epoch's wall time is CPU that does not depend on the work
        idle0 = ray.get(coord.probe.remote())
        time.sleep(idle_window)
        idle_rate = (ray.get(coord.probe.remote())["cpu"] - idle0["cpu"]) / idle_window
    finally:
        if own:
            for c in clients:
                ray.kill(c)
        ray.kill(coord)
    times = result.alignment_times  # alignment k at times[k]; epochs are k -> k + 1
    per_epoch = [b - a for a, b in itertools.pairwise(times[1:])]  # the warm-up epoch left out
    measured = max(len(per_epoch), 1)
    # CPU at alignments 1, 2, ...: epoch k -> k + 1 for k >= 1 (the warm-up left out)
    marks = after["cpu_marks"]
    cpu_epochs = [b - a for a, b in itertools.pairwise(marks)]
    cpu = statistics.median(cpu_epochs) if cpu_epochs else (after["cpu"] - before["cpu"])
    loop_epochs = [b - a for a, b in itertools.pairwise(after["loop_marks"])]
    loop_cpu = statistics.median(loop_epochs) if loop_epochs else None
    calls = after["calls"] - before["calls"]
    first = [v for v in result.outputs if v.tag == "first"]
    pf_calls = [v.value for v in result.outputs if v.tag == "process_feedback_calls"]
    expected = 0.5 * n
    if first and not all(math.isclose(v.value, expected, rel_tol=1e-12) for v in first):
        raise AssertionError(f"wrong sum: {[v.value for v in first]} != {expected}")
    # fan-out of a version: alignment -> the last subtask has resolved its variables
    fan = []
    for k in range(1, len(times)):
        got = [r["stamps"][p][k] for r in runs for p in r["stamps"] if len(r["stamps"][p]) > k]
        if got:
            fan.append(max(got) - times[k])
    return {
        "n": n,
        "feedback_values": size,
        "mode": "tree" if tree else "flat",
        "fan_in": fan_in if tree else None,
        "groups": after["groups"],
        "epochs_measured": measured,
        "alignment_s_median": statistics.median(per_epoch) if per_epoch else None,
        "alignment_s_p99": float(np.percentile(per_epoch, 99)) if per_epoch else None,
        "coordinator_cpu_s_per_epoch": cpu,
        "coordinator_loop_thread_cpu_s_per_epoch": loop_cpu,
        # what the process burns per second of wall time with nothing to do (not
        # subtracted: at 1,024 subtasks it grows to ~12 ms/s, and Ray's threads do not
        # burn at the same rate while busy)
        "coordinator_idle_cpu_s_per_s": idle_rate,
        "coordinator_calls_per_epoch": calls / (epochs + 1),  # calls 0 .. epochs
        "coordinator_bytes_in_per_epoch": (after["bytes_in"] - before["bytes_in"]) / epochs,
        "coordinator_rss_peak_bytes": rss_peak,
        "process_feedback_calls_per_epoch": statistics.median(pf_calls) if pf_calls else 0,
        "group_cpu_s_per_epoch_max": (
            max(
                g["cpu_seconds"] - g0["cpu_seconds"]
                for g, g0 in zip(groups, groups_before)
                if "lo" in g
            )
            / (epochs + 1)
            if groups
            else None
        ),
        "root_cpu_s_per_epoch": next(
            (
                (g["cpu_seconds"] - g0["cpu_seconds"]) / (epochs + 1)
                for g, g0 in zip(groups, groups_before)
                if "lo" not in g
            ),
            None,
        ),
        "clients": clients_n,
        "client_cpu_s_per_epoch": sum(r["cpu"] for r in runs) / (epochs + 1),
        "variables_values": variables_size,
        "fanout_s_median": statistics.median(fan) if fan else None,
        "object_store_puts": result.object_store_puts,
        "publishes": result.publishes,
    }


def start_clients(n: int = MAX_CLIENTS) -> list:
    """Client processes (Ray actors), reusable across configurations."""
    import ray

    client_cls = ray.remote(num_cpus=0, max_concurrency=2)(_Client)
    clients = [client_cls.remote() for _ in range(n)]
    ray.get([c.__ray_ready__.remote() for c in clients])
    return clients


def fit_growth(ns: list[int], ys: list[float]) -> float | None:
    """``a`` of ``y ~ N^a`` (least squares on log-log; None with under 2 usable points)."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys) if y and y > 0]
    if len(pts) < 2:
        return None
    xs, ls = zip(*pts)
    return float(np.polyfit(xs, ls, 1)[0])


def _fanout_config(n: int, values: int, epochs: int, clients: list | None = None) -> dict:
    """Variables broadcast: the coordinator publishes ``values`` float64 every epoch."""
    import cloudpickle

    import hybrid_iter as hi

    class Publisher(hi.CoordinatorOperator):
        def __init__(self, epochs: int) -> None:
            self.epochs = epochs

        def open(self, init_variables, ctx):
            self.w = np.array(init_variables["w"])

        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            self.w[0] = epoch
            out.publish_variables(w=self.w)
            if epoch + 1 < self.epochs:
                out.criteria()

    op, _ = _make_ops(0, epochs, False)
    ops = (op, cloudpickle.dumps((Publisher(epochs), None, [])))
    return run_config(
        n, 0, tree=False, epochs=epochs, variables_size=values, ops=ops, clients=clients
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="N = 2, 32, 256; feedback 0, 1e5; a few minutes"
    )
    ap.add_argument("--ns", default=None, help="comma-separated subtask counts")
    ap.add_argument("--sizes", default=None, help="comma-separated feedback sizes (float64)")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--fanout-sizes", default=None, help="variables sizes for the fan-out")
    ap.add_argument("--modes", default="flat,tree")
    ap.add_argument("--fan-in", type=int, default=32)
    ap.add_argument("--flat-cap-bytes", type=float, default=1.2e9)
    ap.add_argument("--tree-cap-bytes", type=float, default=2.2e9)
    ap.add_argument("--object-store-gb", type=float, default=3.0)
    ap.add_argument("--out", default=str(HERE / "results" / "scale.json"))
    args = ap.parse_args()
    if args.quick:
        ns, sizes, epochs, fanout = [2, 32, 256], [0, 100_000], 3, [1_000_000]
    else:
        ns = [2, 8, 32, 128, 512, 1024]
        sizes, epochs, fanout = [0, 1000, 100_000, 1_000_000], 4, [1_000_000, 10_000_000]
    if args.ns:
        ns = [int(x) for x in args.ns.split(",")]
    if args.sizes:
        sizes = [int(float(x)) for x in args.sizes.split(",")]
    if args.fanout_sizes is not None:
        fanout = [int(float(x)) for x in args.fanout_sizes.split(",") if x]
    epochs = args.epochs or epochs

    from hybrid_iter._cluster.ray_util import NAMESPACE, force_loopback

    force_loopback()
    import ray

    for tries in range(3):  # an overloaded shared machine can time a node start out
        try:
            ray.init(
                address="local",
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                namespace=NAMESPACE,
                num_cpus=2,
                object_store_memory=int(args.object_store_gb * (1 << 30)),
                log_to_driver=False,
            )
            break
        except Exception as ex:
            if tries == 2 or "timed out during startup" not in str(ex):
                raise
            print(f"Ray did not start ({ex}); trying again", flush=True)
            ray.shutdown()
    print(
        "SIMULATION on one machine with 2 shared cores (other jobs run too): N subtasks are "
        "threads in <= 4 client processes next to the coordinator. Alignment wall times "
        "include the clients' CPU contention (the machine); the coordinator's CPU per epoch, "
        "calls and bytes in are its own work (the design).",
        flush=True,
    )
    rows: list[dict] = []
    skipped: list[dict] = []
    clients = start_clients()  # the same client processes for every configuration
    try:
        for size in sizes:
            for mode in args.modes.split(","):
                for n in ns:
                    epoch_bytes = n * size * 8
                    cap = args.flat_cap_bytes if mode == "flat" else args.tree_cap_bytes
                    if epoch_bytes > cap:
                        why = (
                            f"{n} x {size:,} float64 = {epoch_bytes / 1e9:.1f} GB per epoch "
                            + (
                                "into the one coordinator process"
                                if mode == "flat"
                                else "in flight through the object store to the groups"
                            )
                            + f" (> {cap / 1e9:.1f} GB cap on this shared 24 GiB machine)"
                        )
                        print(f"skip {mode:4s} N={n:5d} feedback={size:>9,}: {why}", flush=True)
                        skipped.append({"n": n, "feedback_values": size, "mode": mode, "why": why})
                        continue
                    r = run_config(
                        n,
                        size,
                        tree=mode == "tree",
                        epochs=epochs,
                        clients=clients,
                        fan_in=args.fan_in,
                    )
                    rows.append(r)
                    print(_line(r), flush=True)
        fan_rows = []
        for values in fanout:
            for n in ns:
                r = _fanout_config(n, values, epochs, clients)
                fan_rows.append(r)
                print(
                    f"fan-out {values:>10,} values to N={n:5d}: alignment -> last subtask has "
                    f"the version {r['fanout_s_median'] * 1e3:8.1f} ms (median), "
                    f"{r['object_store_puts']} object-store puts for {r['publishes'] + 1} versions",
                    flush=True,
                )
    finally:
        ray.shutdown()
    fits = []
    for size in sorted({r["feedback_values"] for r in rows}):
        for mode in ("flat", "tree"):
            sel = sorted(
                (r for r in rows if r["feedback_values"] == size and r["mode"] == mode),
                key=lambda r: r["n"],
            )
            if len(sel) < 2:
                continue
            n_ = [r["n"] for r in sel]
            fit = {
                "feedback_values": size,
                "mode": mode,
                "ns": n_,
                "a_alignment": fit_growth(n_, [r["alignment_s_median"] for r in sel]),
                "a_coordinator_cpu": fit_growth(
                    n_, [r["coordinator_cpu_s_per_epoch"] for r in sel]
                ),
                "a_bytes_in": fit_growth(n_, [r["coordinator_bytes_in_per_epoch"] for r in sel]),
            }
            fits.append(fit)
            print(
                f"growth {mode:4s} feedback={size:>9,} over N={n_[0]}..{n_[-1]}: alignment "
                f"~ N^{_fmt(fit['a_alignment'])}, coordinator CPU ~ N^"
                f"{_fmt(fit['a_coordinator_cpu'])}, bytes in ~ N^{_fmt(fit['a_bytes_in'])}",
                flush=True,
            )
    report = {
        "benchmark": "coordinator scale: flat vs tree feedback, variables fan-out (issue 19)",
        "note": "simulation: N subtasks as threads in <= 4 client processes on 2 shared cores",
        "results": rows,
        "skipped": skipped,
        "growth": fits,
        "fanout": fan_rows,
    }
    out = write_report(report, args.out)
    print(f"wrote {out}")


def _fmt(a: float | None) -> str:
    return "n/a" if a is None else f"{a:.2f}"


def _line(r: dict) -> str:
    rss = r["coordinator_rss_peak_bytes"] / 1e6
    grp = r["group_cpu_s_per_epoch_max"]
    return (
        f"{r['mode']:4s} N={r['n']:5d} feedback={r['feedback_values']:>9,}: alignment "
        f"{r['alignment_s_median'] * 1e3:8.1f} ms (p99 {r['alignment_s_p99'] * 1e3:8.1f}) | "
        f"coordinator CPU {r['coordinator_cpu_s_per_epoch'] * 1e3:7.1f} ms/epoch "
        f"(loop thread {(r.get('coordinator_loop_thread_cpu_s_per_epoch') or 0) * 1e3:.1f}; "
        f"idle {r.get('coordinator_idle_cpu_s_per_s', 0) * 1e3:.1f} ms/s), "
        f"{r['coordinator_calls_per_epoch']:6.0f} calls, "
        f"{r['coordinator_bytes_in_per_epoch'] / 1e6:9.2f} MB in, "
        f"{r['process_feedback_calls_per_epoch']:5.0f} process_feedback/epoch, "
        f"RSS peak {rss:6.0f} MB"
        + (f" | group CPU max {grp * 1e3:.1f} ms/epoch" if grp is not None else "")
        + (
            f", root {r['root_cpu_s_per_epoch'] * 1e3:.1f}"
            if r.get("root_cpu_s_per_epoch") is not None
            else ""
        )
        + f" | clients CPU {r['client_cpu_s_per_epoch'] * 1e3:.0f} ms/epoch"
    )


if __name__ == "__main__":
    main()
