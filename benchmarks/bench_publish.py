"""The cost of publishing a large model version (issue 20: "an async publish copies and
puts the whole model on every feedback").

    python benchmarks/bench_publish.py
    python benchmarks/bench_publish.py --sizes 1000000 --updates 100 --repeats 2  # quicker

Two parts, both with real Ray:

* ``store``: the coordinator's ``VariablesStore``, publish + the payload the subtasks
  read, for M float64 values, side by side in one run: ``copy + put`` (the version
  copied by ``publish``, then put into the object store when first read: two copies)
  against ``put as the copy`` (the put is the immutable snapshot; the store keeps its
  read-only views: one copy). Same warm-up and repeats for both; median milliseconds
  per version and the ratio.
* ``async``: an async iteration (2 partitions, ``staleness=None``) whose coordinator
  publishes an M-value model on every feedback and whose subtasks read every version
  they are handed: median milliseconds per update (run wall time / updates) over
  ``--repeats`` runs after one warm-up run. Run the script on two checkouts to compare
  them (``PYTHONPATH=<checkout> python benchmarks/bench_publish.py``).

Writes JSON to benchmarks/results/publish.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _harness import measure, ratio, write_report

import hybrid_iter as hi

HERE = Path(__file__).resolve().parent


class Step(hi.PartitionOperator):
    """Reads the variables it is handed; feeds back one small gradient per epoch."""

    def process_variables(self, variables, ctx, out):
        self.head = float(variables["w"][0])  # touch the version it was handed

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(1e-3)


class Server(hi.CoordinatorOperator):
    """Publishes a new version of the whole model on every feedback (async)."""

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])

    def process_feedback(self, value, ctx, out):
        self.w += value
        out.publish_variables(w=self.w)


def store_cost(size: int, versions: int, repeats: int) -> dict:
    import ray

    from coordinator import VariablesStore

    def contender(get):
        def run():
            store = VariablesStore({"w": np.zeros(size)}, put=ray.put, get=get)
            w = np.zeros(size)
            for _ in range(versions):
                w += 1e-3
                store.publish({"w": w})
                store.payload()

        return run

    try:
        VariablesStore({"w": np.zeros(1)}, put=ray.put, get=ray.get)
    except TypeError:  # a checkout from before the put was the copy
        return {}
    twice = measure(contender(None), repeats)
    once = measure(contender(ray.get), repeats)
    a, b = twice.median / versions, once.median / versions
    return {"copy_then_put_ms": a * 1e3, "put_as_copy_ms": b * 1e3, "ratio": ratio(b, a)}


def async_cost(spark, size: int, updates: int, repeats: int) -> dict:
    df = spark.range(20, numPartitions=2)
    epochs = max(1, updates // 2)  # one feedback per partition per epoch

    def run():
        return hi.iterate_bounded_streams_until_termination(
            {"w": np.zeros(size)},
            hi.ReplayableDataStreamList.not_replay(df),
            hi.IterationConfig(max_epochs=epochs, parallelism=2, staleness=None),
            hi.IterationBody(Step(), Server()),
        )

    got = measure(run, repeats)
    return {"ms_per_update": got.median / (2 * epochs) * 1e3, "updates": 2 * epochs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--versions", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "publish.json"))
    args = ap.parse_args()
    report: dict = {"benchmark": "publishing a large model version (issue 20)"}
    report["models"] = {}
    with hi.Session.local(parallelism=2) as session:
        for size in args.sizes:
            s = store_cost(size, args.versions, args.repeats)
            a = async_cost(session.spark, size, args.updates, args.repeats)
            report["models"][str(size)] = {"store": s, "async": a}
            print(
                f"model {size:>10,} values: "
                + (
                    f"publish + payload {s['copy_then_put_ms']:.2f} ms (copy, then put) vs "
                    f"{s['put_as_copy_ms']:.2f} ms (the put is the copy), x{s['ratio']:.2f}; "
                    if s
                    else ""
                )
                + f"async iteration {a['ms_per_update']:.2f} ms per update"
            )
    write_report(report, args.out)


if __name__ == "__main__":
    main()
