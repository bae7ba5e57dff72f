"""Issue 10 benchmark: the parameter server's pull + push round trip and updates per second,
1e3 .. 1e7 float64 parameters on 1, 2 and 4 shards, and a 10,000,000-parameter
``ps.train`` end to end.

    python benchmarks/bench_ps.py                           # sizes 1e3..1e7, shards 1,2,4
    python benchmarks/bench_ps.py --sizes 1000,1000000 --shards 1,2 --repeats 10

Measured side by side in one run (async shards, SGD; the client is the same code a Spark
task runs, ``hybrid_iter.ps._train._Shards``, here in the driver process):

* ``round_trip``: ``pull`` of the whole vector (zero-copy from the object store when a
  slice is over 64 KiB) + ``push`` of a dense gradient of the same size, one worker.
* ``step``: one fused call, ``push`` whose reply carries the next parameters (what each
  training step costs in ``ps.train``).
* ``updates_per_s``: two workers (Ray tasks) pushing fused steps at once, total updates
  per second.
* ``plain_actor_round_trip``: the reference, in the same run: one plain actor,
  ``ray.put`` per pull, ``w -= lr * g`` per push (the machine is shared and noisy; the
  ratio to this is the fair figure).
* ``train_10m``: ``ps.train`` of a 10,000,000-parameter model (dense gradients) on a
  small DataFrame: seconds per step and that the result is right.

Reference measured here before this work: 1e6 float64 round trip ~ 13 ms with one actor.
Prints medians; writes JSON to benchmarks/results/ps.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import hybrid_iter as hi
from hybrid_iter import ps
from hybrid_iter.ps._train import _shard_bounds, _Shards, launch_shards, stop_shards

HERE = Path(__file__).resolve().parent


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


class _PushLoop:
    """A worker process (Ray actor) pushing fused steps, like a Spark task of ps.train."""

    def __init__(self, names: list[str], bounds: list[int], size: int) -> None:
        self.client = _Shards(names, bounds, "<f8")
        self.grad = np.full(size, 1e-3)
        self.client.pull(0, 0)

    def run(self, pid: int, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.client.push(pid, 0, 0, self.grad, 1.0, False)
        return time.perf_counter() - t


class _PlainServer:
    """The reference: one plain actor, ``ray.put`` per pull, ``w -= lr * g`` per push."""

    def __init__(self, size: int) -> None:
        self.w = np.zeros(size)

    def pull(self) -> list:
        import ray

        return [ray.put(self.w)]

    def push(self, g: np.ndarray) -> None:
        self.w -= 1e-3 * g


def plain_round_trip(size: int, repeats: int) -> float:
    import ray

    actor = ray.remote(num_cpus=0)(_PlainServer).remote(size)
    g = np.full(size, 1e-3)

    def rt() -> None:
        ray.get(ray.get(actor.pull.remote())[0])
        ray.get(actor.push.remote(g))

    rt()
    times = _timed(rt, repeats)
    ray.kill(actor)
    return statistics.median(times)


def measure(size: int, shards: int, repeats: int, worker_steps: int) -> dict:
    import ray

    worker_cls = ray.remote(num_cpus=0)(_PushLoop)
    flat = np.zeros(size)
    bounds = _shard_bounds(size, shards)
    names, handles = launch_shards(flat, bounds, ps.SGD(1e-3), num_workers=2, sync=False)
    try:
        client = _Shards(names, bounds, "<f8")
        grad = np.full(size, 1e-3)
        client.pull(0, 0)  # warm-up: the first put of each shard

        def round_trip() -> None:
            client.pull(0, 0)
            client.push(0, 0, 0, grad, 1.0, True)

        def step() -> None:
            client.push(0, 0, 0, grad, 1.0, False)

        rt = _timed(round_trip, repeats)
        st = _timed(step, repeats)

        workers = [worker_cls.remote(names, bounds, size) for _ in range(2)]
        ray.get([w.run.remote(p, 2) for p, w in enumerate(workers)])  # warm-up
        elapsed = ray.get([w.run.remote(p, worker_steps) for p, w in enumerate(workers)])
        wall = max(elapsed)
        for w in workers:
            ray.kill(w)
        info = ray.get([h.info.remote() for h in handles])
        updates = info[0]["updates"]
    finally:
        stop_shards(handles)
    return {
        "size": size,
        "shards": shards,
        "round_trip_s": statistics.median(rt),
        "step_s": statistics.median(st),
        "updates_per_s_two_workers": 2 * worker_steps / wall,
        "plain_actor_round_trip_s": plain_round_trip(size, repeats) if shards == 1 else None,
        "shard_updates": updates,
        "mb": size * 8 / 1e6,
    }


def train_10m(spark, size: int, rows: int, batch: int) -> dict:
    """ps.train of a ``size``-parameter linear model with a dense weight-decay gradient."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((rows, 8))
    y = X @ np.arange(1.0, 9.0)
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(
            [([float(v) for v in X[i]], float(y[i])) for i in range(rows)], 2
        ),
        "x array<double>, y double",
    ).cache()
    df.count()

    def grad_fn(w, b):
        r = b["x"] @ w[:8] - b["y"]
        g = 1e-4 * w
        g[:8] += b["x"].T @ r / len(r)
        return float(r @ r) / (2 * len(r)), g

    t = time.perf_counter()
    out = ps.train(
        df,
        grad_fn,
        np.zeros(size),
        optimizer=ps.SGD(0.1),
        epochs=2,
        batch_size=batch,
        columns=["x", "y"],
        parallelism=2,
    )
    wall = time.perf_counter() - t
    steps = 2 * -(-rows // 2 // batch)
    df.unpersist()
    return {
        "parameters": size,
        "shards": len(out.shards),
        "rows": rows,
        "steps_per_subtask": steps,
        "seconds": wall,
        "train_seconds": sum(out.result.epoch_seconds),
        "seconds_per_step": sum(out.result.epoch_seconds) / steps,
        "loss": out.loss,
        "w_head_error": float(np.max(np.abs(out.params[:8] - np.arange(1.0, 9.0)))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000,1000000,10000000")
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--worker-steps", type=int, default=20)
    ap.add_argument("--train-size", type=int, default=10_000_000)
    ap.add_argument("--train-rows", type=int, default=20_000)
    ap.add_argument("--train-batch", type=int, default=2_000)
    ap.add_argument("--out", default=str(HERE / "results" / "ps.json"))
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    shard_counts = [int(s) for s in args.shards.split(",")]

    rows = []
    with hi.Session.local(2, driver_memory="2g", object_store_memory=2 << 30) as session:
        for size in sizes:
            for shards in shard_counts:
                if shards > size:
                    continue
                reps = args.repeats if size < 5_000_000 else max(5, args.repeats // 4)
                r = measure(size, shards, reps, args.worker_steps)
                rows.append(r)
                plain = r["plain_actor_round_trip_s"]
                print(
                    f"{size:>10,} params {shards} shard(s): round trip "
                    f"{r['round_trip_s'] * 1e3:8.2f} ms | fused step {r['step_s'] * 1e3:8.2f} ms "
                    f"| {r['updates_per_s_two_workers']:8.1f} updates/s (2 workers)"
                    + (f" | plain actor round trip {plain * 1e3:8.2f} ms" if plain else ""),
                    flush=True,
                )
        big = train_10m(session.spark, args.train_size, args.train_rows, args.train_batch)
        print(
            f"ps.train {big['parameters']:,} parameters on {big['shards']} shards: "
            f"{big['seconds_per_step'] * 1e3:.0f} ms/step, total {big['seconds']:.1f} s, "
            f"loss {big['loss'][0]:.4g} -> {big['loss'][-1]:.4g}",
            flush=True,
        )
    ref = next((r for r in rows if r["size"] == 1_000_000 and r["shards"] == 1), None)
    report = {
        "benchmark": "parameter server round trips (issue 10)",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": rows,
        "train_10m": big,
        "reference": {"round_trip_1e6_one_actor_s": 0.013},
        "ratio_round_trip_1e6_over_reference": (ref["round_trip_s"] / 0.013) if ref else None,
        "ratio_round_trip_1e6_over_plain_actor_same_run": (
            ref["round_trip_s"] / ref["plain_actor_round_trip_s"] if ref else None
        ),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
