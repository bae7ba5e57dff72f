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
* ``ps_step``: ``ps.train`` of a logistic model on a sparse table (dim 8, hashed ids,
  ~10 ids per row) plus a dense part, sync, 2 subtasks, 2 shards, ``--ps-batch`` rows per
  step: over Ray each step is one actor call per shard; over the endpoint one Flight
  ``DoAction`` per shard (the fused push + pull of the next step's keys). Figure: the
  median epoch after the first divided by the steps per epoch, per run.

* ``tree``: the ``empty`` body with a 1000-float64 feedback vector merged by
  ``feedback_combine="sum"`` with ``feedback_fan_in=1``: the 2 subtasks report to one
  group aggregator actor (Ray: an actor call; the endpoint: a ``DoAction`` to the group's
  own endpoint), which calls the root and the coordinator over Ray. Figure: as ``empty``.

``--parts`` picks what runs (default all). Prints medians and ratios; writes JSON to
benchmarks/results/endpoint.json.
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
from hybrid_iter import ps  # noqa: E402

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


class TickVector(hi.PartitionOperator):
    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(np.ones(1000))


class CountVector(Count):
    def process_feedback(self, value, ctx, out):
        self.total += float(value[0])


def tree(spark, transport, epochs):
    df = spark.range(20, numPartitions=2)
    result = hi.iterate_bounded_streams_until_termination(
        {"total": 0.0},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(staleness=0, max_epochs=epochs, parallelism=2, transport=transport),
        hi.IterationBody(TickVector(), CountVector(), feedback_combine="sum", feedback_fan_in=1),
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


def ps_frame(spark, rows):
    rng = np.random.default_rng(5)
    data = [
        (
            [int(v) for v in rng.integers(0, 1 << 40, 10)],
            float(rng.random() < 0.3),
            float(rng.normal()),
        )
        for _ in range(rows)
    ]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(data, 2), "ids array<long>, label double, x double"
    ).cache()
    df.count()
    return df


def fm_grad(params, batch):
    ids, y, x = batch["ids"], batch["label"], batch["x"]
    v = params["v"]
    z = ids.dot(v).sum(axis=1) + params["a"][0] * x
    p = 1.0 / (1.0 + np.exp(-z))
    r = (p - y) / len(y)
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    return loss, {"v": ids.t_dot(r).reshape(-1, 1) * np.ones(8), "a": np.array([r @ x])}


def ps_step(df, transport, epochs, batch):
    out = ps.train(
        df,
        fm_grad,
        {"v": ps.Table(dim=8), "a": np.zeros(1)},
        keys={"v": "ids"},
        optimizer=ps.Adagrad(0.05),
        epochs=epochs,
        batch_size=batch,
        num_shards=2,
        parallelism=2,
        progress=False,
        transport=transport,
    )
    try:
        # sync: one update per step of the longest subtask's epoch, on every shard
        per_epoch = out.shards[0]["updates"] / epochs
        if transport == "endpoint":
            assert all(s["endpoint_calls"] >= s["pushes"] for s in out.shards)
        return statistics.median(out.result.epoch_seconds[1:]) / per_epoch
    finally:
        out.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--empty-epochs", type=int, default=200)
    ap.add_argument("--variable-epochs", type=int, default=30)
    ap.add_argument("--size", type=int, default=1_000_000)
    ap.add_argument("--ps-rows", type=int, default=4000)
    ap.add_argument("--ps-batch", type=int, default=20)
    ap.add_argument("--ps-epochs", type=int, default=3)
    ap.add_argument("--parts", default="empty,variable,ps_step,tree")
    ap.add_argument("--out", default=str(HERE / "results" / "endpoint.json"))
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    #: each part's contenders (the variable's: the transports and the streamed endpoint)
    who = {
        "empty": TRANSPORTS,
        "variable": tuple(VARIABLE),
        "ps_step": TRANSPORTS,
        "tree": TRANSPORTS,
    }

    runs: dict[str, dict[str, list[float]]] = {p: {c: [] for c in who[p]} for p in parts}
    with hi.Session.local(parallelism=2) as session:
        spark = session.spark
        df = ps_frame(spark, args.ps_rows) if "ps_step" in parts else None
        contenders = {
            "empty": lambda c, warm: empty(spark, c, 20 if warm else args.empty_epochs),
            "variable": lambda c, warm: variable(
                spark, c, 4 if warm else args.variable_epochs, args.size
            ),
            "ps_step": lambda c, warm: ps_step(df, c, 2 if warm else args.ps_epochs, args.ps_batch),
            "tree": lambda c, warm: tree(spark, c, 20 if warm else args.empty_epochs),
        }
        for p in parts:  # one warm-up run of each, untimed
            for c in who[p]:
                contenders[p](c, True)
        for i in range(args.repeats):
            for p in parts:
                for c in who[p]:
                    runs[p][c].append(contenders[p](c, False))
                line = ", ".join(f"{c} {runs[p][c][-1] * 1e3:.2f}" for c in who[p])
                print(f"repeat {i} {p}: {line} ms", flush=True)
    med = {p: {c: statistics.median(v) for c, v in runs[p].items()} for p in parts}
    ratios = {p: ratio(med[p]["endpoint"], med[p]["ray"]) for p in parts}
    report: dict = {
        "benchmark": "endpoint",
        "params": vars(args),
        "runs_seconds": runs,
        "median_seconds": med,
        "ratios_endpoint_over_ray": ratios,
        "targets": {
            "empty": "<= 1.5",
            "variable_added": "<= 1.0",
            "ps_step": "<= 1.0",
            "tree": "<= 1.0",
        },
    }
    if "variable" in parts:
        ratios["streamed_variable"] = ratio(med["variable"]["streamed"], med["variable"]["ray"])
    if "empty" in parts and "variable" in parts:
        # the streamed endpoint's empty epoch is the endpoint's (shared memory is not used)
        base = {**med["empty"], "streamed": med["empty"]["endpoint"]}
        added = {c: med["variable"][c] - base[c] for c in VARIABLE}
        report["variable_added_seconds_per_epoch"] = added
        ratios["variable_added"] = ratio(added["endpoint"], added["ray"])
        ratios["streamed_variable_added"] = ratio(added["streamed"], added["ray"])
    path = write_report(report, Path(args.out))
    print()
    print(f"{'':28s}{'ray':>10s}{'endpoint':>10s}{'ratio':>8s}{'streamed':>10s}{'ratio':>8s}")
    names = {
        "empty": "empty epoch, ms",
        "variable": "1e6-float64 epoch, ms",
        "ps_step": "ps.train step, ms",
        "tree": "feedback_combine epoch, ms",
    }
    for p in parts:
        streamed = (
            f"{med[p]['streamed'] * 1e3:10.2f}{ratios['streamed_variable']:8.2f}"
            if p == "variable"
            else ""
        )
        print(
            f"{names[p]:28s}{med[p]['ray'] * 1e3:10.2f}"
            f"{med[p]['endpoint'] * 1e3:10.2f}{ratios[p]:8.2f}{streamed}"
        )
    if "variable_added" in ratios:
        added = report["variable_added_seconds_per_epoch"]
        print(
            f"{'  of which the variable, ms':28s}{added['ray'] * 1e3:10.2f}"
            f"{added['endpoint'] * 1e3:10.2f}{ratios['variable_added']:8.2f}"
            f"{added['streamed'] * 1e3:10.2f}{ratios['streamed_variable_added']:8.2f}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
