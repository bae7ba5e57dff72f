"""The coordinator endpoint against the Ray path, side by side in one run.

    python benchmarks/bench_endpoint.py                  # defaults below
    python benchmarks/bench_endpoint.py --repeats 5

Both transports run the same iterations in the same session, interleaved (ray, endpoint,
ray, endpoint, ...), each with one warm-up run and ``--repeats`` timed runs:

* ``empty``: a sync epoch with an empty body on 2 subtasks (a scalar fed back and
  published): the transport's cost per epoch. Figure: the median epoch after the first
  (steady), per run; the report gives the median over runs. Target: endpoint <= 1.5x Ray.
* ``variable``: a 1e6-float64 variable (8 MB) published every epoch and read by every
  subtask (each sums it, so every byte is touched): Ray puts each version into the object
  store once and every subtask maps it zero-copy; the endpoint writes each version once
  to a shared-memory file that every Python worker of this host maps (``endpoint``), or
  streams it to each Python worker (``streamed``: ``shared_memory=False``, what
  executors on other hosts get). Figure: the steady epoch minus the empty body's steady
  epoch of the same transport (what the variable adds). Target: endpoint <= Ray.

Prints medians and ratios; writes JSON to benchmarks/results/endpoint.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import ratio, write_report  # noqa: E402

import hybrid_iter as hi  # noqa: E402

TRANSPORTS = ("ray", "endpoint")
#: the variable's contenders: the transports, and the endpoint without shared memory
VARIABLE = {
    "ray": ("ray", None),
    "endpoint": ("endpoint", None),
    "streamed": ("endpoint", hi.EndpointConfig(shared_memory=False)),
}


class Tick(hi.PartitionOperator):
    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(1.0)


class Count(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.total = 0.0

    def process_feedback(self, value, ctx, out):
        self.total += value

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.publish_variables(total=self.total)


class SumBig(hi.PartitionOperator):
    def process_variables(self, variables, ctx, out):
        self.s = float(variables["w"].sum())  # touch every byte that arrived

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(self.s)


class PublishBig(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])
        self.sums = []

    def process_feedback(self, value, ctx, out):
        self.sums.append(value)

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.w[epoch % len(self.w)] += 1.0  # a new version every epoch
        out.publish_variables(w=self.w)


def empty(spark, transport, epochs):
    df = spark.range(20, numPartitions=2)
    result = hi.iterate_bounded_streams_until_termination(
        {"total": 0.0},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(staleness=0, max_epochs=epochs, parallelism=2, transport=transport),
        hi.IterationBody(Tick(), Count()),
    )
    assert float(result.variables["total"]) == 2 * epochs
    return statistics.median(result.epoch_seconds[1:])


def variable(spark, contender, epochs, size):
    transport, endpoint = VARIABLE[contender]
    df = spark.range(20, numPartitions=2)
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(size)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(
            staleness=0, max_epochs=epochs, parallelism=2, transport=transport, endpoint=endpoint
        ),
        hi.IterationBody(SumBig(), PublishBig()),
    )
    assert float(result.variables["w"].sum()) == epochs
    return statistics.median(result.epoch_seconds[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--empty-epochs", type=int, default=200)
    ap.add_argument("--variable-epochs", type=int, default=30)
    ap.add_argument("--size", type=int, default=1_000_000)
    ap.add_argument("--out", default=str(HERE / "results" / "endpoint.json"))
    args = ap.parse_args()

    runs: dict[str, dict[str, list[float]]] = {t: {"empty": [], "variable": []} for t in TRANSPORTS}
    runs["streamed"] = {"variable": []}
    with hi.Session.local(parallelism=2) as session:
        spark = session.spark
        for t in TRANSPORTS:  # one warm-up run of each, untimed
            empty(spark, t, 20)
        for c in VARIABLE:
            variable(spark, c, 4, args.size)
        for i in range(args.repeats):
            for t in TRANSPORTS:
                runs[t]["empty"].append(empty(spark, t, args.empty_epochs))
            for c in VARIABLE:
                runs[c]["variable"].append(variable(spark, c, args.variable_epochs, args.size))
            print(
                f"repeat {i}: empty "
                + ", ".join(f"{t} {runs[t]['empty'][-1] * 1e3:.2f}" for t in TRANSPORTS)
                + " ms/epoch; with the variable "
                + ", ".join(f"{c} {runs[c]['variable'][-1] * 1e3:.2f}" for c in VARIABLE)
                + " ms/epoch",
                flush=True,
            )
    med = {c: {k: statistics.median(v) for k, v in runs[c].items()} for c in runs}
    # the streamed endpoint's empty epoch is the endpoint's (shared memory is not used)
    med["streamed"]["empty"] = med["endpoint"]["empty"]
    added = {c: med[c]["variable"] - med[c]["empty"] for c in VARIABLE}
    report = {
        "benchmark": "endpoint",
        "params": vars(args),
        "runs_seconds_per_epoch": runs,
        "median_seconds_per_epoch": med,
        "variable_added_seconds_per_epoch": added,
        "ratios_endpoint_over_ray": {
            "empty_epoch": ratio(med["endpoint"]["empty"], med["ray"]["empty"]),
            "variable_epoch": ratio(med["endpoint"]["variable"], med["ray"]["variable"]),
            "variable_added": ratio(added["endpoint"], added["ray"]),
            "streamed_variable_epoch": ratio(med["streamed"]["variable"], med["ray"]["variable"]),
            "streamed_variable_added": ratio(added["streamed"], added["ray"]),
        },
        "targets": {"empty_epoch": "<= 1.5", "variable_added": "<= 1.0"},
    }
    path = write_report(report, Path(args.out))
    r = report["ratios_endpoint_over_ray"]
    print()
    print(f"{'':28s}{'ray':>10s}{'endpoint':>10s}{'ratio':>8s}{'streamed':>10s}{'ratio':>8s}")
    print(
        f"{'empty epoch, ms':28s}{med['ray']['empty'] * 1e3:10.2f}"
        f"{med['endpoint']['empty'] * 1e3:10.2f}{r['empty_epoch']:8.2f}   (target <= 1.5)"
    )
    print(
        f"{'1e6-float64 epoch, ms':28s}{med['ray']['variable'] * 1e3:10.2f}"
        f"{med['endpoint']['variable'] * 1e3:10.2f}{r['variable_epoch']:8.2f}"
        f"{med['streamed']['variable'] * 1e3:10.2f}{r['streamed_variable_epoch']:8.2f}"
    )
    print(
        f"{'  of which the variable, ms':28s}{added['ray'] * 1e3:10.2f}"
        f"{added['endpoint'] * 1e3:10.2f}{r['variable_added']:8.2f}"
        f"{added['streamed'] * 1e3:10.2f}{r['streamed_variable_added']:8.2f}   (target <= 1.0)"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
