"""A replayed round vs an all-round epoch vs a Spark MLlib iteration.

    python benchmarks/bench_replay.py                  # 1,000,000 x 50, 2 partitions
    python benchmarks/bench_replay.py --rows 200000    # quicker

Side by side in one run, on the same generated logistic-regression data (fixed seed),
the same full-batch gradient per epoch:

* ``all_round``: the data read once into each subtask's numpy cache (``not_replay``, the
  foundation's single barrier stage): seconds between global alignments.
* ``replayed``: ``ReplayableDataStreamList.replay`` with PER_ROUND operators: every round
  is one Spark barrier job over Spark's MEMORY_AND_DISK cache of the data (Arrow IPC
  framed per subtask), and a fresh operator rebuilds its numpy matrix from the replayed
  batches: seconds per round.
* ``replay_overhead``: the same replayed rounds with an operator that does no arithmetic
  (it only counts rows): what a round costs beyond the computation.
* ``spark_job``: one Spark job over the same cached data (a count, in the JVM), and
  ``spark_python_job``: one that hands every cached row to Python (``mapInArrow``
  counting rows): the floor for anything that feeds Python operators per round.
* ``mllib``: Spark MLlib LogisticRegression per iteration (marginal and amortised), as
  in benchmarks/bench_iteration.py.

Prints medians and ratios; writes JSON to benchmarks/results/replay.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

from _harness import write_report  # noqa: E402
from bench_iteration import mllib_seconds_per_iteration  # noqa: E402
from logistic_regression import LogisticGradient, ParameterServer, generate  # noqa: E402

import hybrid_iter as hi  # noqa: E402


def _count_rows(batches):
    import pyarrow as pa

    yield pa.RecordBatch.from_pydict({"n": [sum(b.num_rows for b in batches)]})


class CountOnly(hi.PartitionOperator):
    """Reads every replayed batch, does no arithmetic."""

    def open(self, ctx):
        self.rows = 0

    def process_data(self, stream, batch, ctx, out):
        self.rows += batch.num_rows

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(self.rows)


class Tick(hi.CoordinatorOperator):
    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.publish_variables(round=epoch + 1)


def run(df, cols, rows, epochs, *, replay):
    streams = (
        hi.ReplayableDataStreamList.replay(df)
        if replay
        else hi.ReplayableDataStreamList.not_replay(df)
    )
    lifecycle = hi.OperatorLifecycle.PER_ROUND if replay else hi.OperatorLifecycle.ALL_ROUND
    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(len(cols)), "b": 0.0},
        streams,
        hi.IterationConfig(max_epochs=epochs, operator_lifecycle=lifecycle),
        hi.IterationBody(LogisticGradient(cols, "label"), ParameterServer(2.0, rows)),
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--features", type=int, default=50)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-mllib", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "replay.json"))
    args = ap.parse_args()

    runs: dict[str, list[float]] = {
        "all_round": [],
        "replayed": [],
        "replay_overhead": [],
        "spark_job": [],
        "spark_python_job": [],
    }
    w = {}
    with hi.Session.local(parallelism=args.partitions, driver_memory="4g") as session:
        df, _, _ = generate(session.spark, args.rows, args.features, args.partitions, seed=42)
        df = df.cache()
        df.count()
        cols = [f"x{j}" for j in range(args.features)]
        for r in range(args.repeats):
            res = run(df, cols, args.rows, args.epochs, replay=False)
            runs["all_round"].append(statistics.median(res.epoch_seconds[1:]))
            w["all_round"] = res.variables["w"]
            res = run(df, cols, args.rows, args.epochs, replay=True)
            runs["replayed"].append(statistics.median(res.epoch_seconds[1:]))
            w["replayed"] = res.variables["w"]
            res = hi.iterate_bounded_streams_until_termination(
                {"round": 0},
                hi.ReplayableDataStreamList.replay(df),
                hi.IterationConfig(
                    max_epochs=args.epochs, operator_lifecycle=hi.OperatorLifecycle.PER_ROUND
                ),
                hi.IterationBody(CountOnly(), Tick()),
            )
            runs["replay_overhead"].append(statistics.median(res.epoch_seconds[1:]))
            times = []
            for _ in range(5):
                t = time.perf_counter()
                df.count()
                times.append(time.perf_counter() - t)
            runs["spark_job"].append(statistics.median(times))
            times = []
            for _ in range(3):
                t = time.perf_counter()
                df.mapInArrow(_count_rows, "n long").collect()
                times.append(time.perf_counter() - t)
            runs["spark_python_job"].append(statistics.median(times))
            print(
                f"run {r + 1}/{args.repeats}: all-round {runs['all_round'][-1] * 1e3:.1f} ms/epoch | "
                f"replayed {runs['replayed'][-1] * 1e3:.1f} ms/round | replay overhead "
                f"{runs['replay_overhead'][-1] * 1e3:.1f} ms/round | a Spark job over the cache "
                f"{runs['spark_job'][-1] * 1e3:.1f} ms (into Python "
                f"{runs['spark_python_job'][-1] * 1e3:.1f} ms)",
                flush=True,
            )
        mllib = amortised = None
        if not args.skip_mllib:
            mllib, amortised, _ = mllib_seconds_per_iteration(df, cols, args.repeats)
            print(
                f"mllib: {mllib * 1e3:.1f} ms per extra iteration, {amortised * 1e3:.1f} ms per iteration of a fit"
            )

    med = {k: statistics.median(v) for k, v in runs.items()}
    same = float(np.max(np.abs(w["all_round"] - w["replayed"])))
    report = {
        "benchmark": "replayed rounds vs all-round epochs (issue 3)",
        "rows": args.rows,
        "features": args.features,
        "partitions": args.partitions,
        "epochs": args.epochs,
        "repeats": args.repeats,
        **{f"{k}_s": v for k, v in med.items()},
        "mllib_marginal_s_per_iteration": mllib,
        "mllib_amortised_s_per_iteration": amortised,
        "ratio_replayed_over_all_round": med["replayed"] / med["all_round"],
        "ratio_replay_overhead_over_spark_job": med["replay_overhead"] / med["spark_job"],
        "ratio_replay_overhead_over_spark_python_job": med["replay_overhead"]
        / med["spark_python_job"],
        "ratio_replayed_over_mllib_marginal": (med["replayed"] / mllib) if mllib else None,
        "ratio_replayed_over_mllib_amortised": (med["replayed"] / amortised) if amortised else None,
        "max_abs_diff_w_all_round_vs_replayed": same,
        "runs": runs,
    }
    print()
    print(f"replayed / all-round          {report['ratio_replayed_over_all_round']:.1f}x")
    print(
        f"replay overhead per round     {med['replay_overhead'] * 1e3:.0f} ms "
        f"({report['ratio_replay_overhead_over_spark_python_job']:.2f}x a Spark job feeding the "
        f"cached rows to Python, {report['ratio_replay_overhead_over_spark_job']:.2f}x a JVM count)"
    )
    if mllib:
        print(
            f"replayed / mllib iteration    {report['ratio_replayed_over_mllib_marginal']:.2f}x marginal, {report['ratio_replayed_over_mllib_amortised']:.2f}x amortised"
        )
    print(f"max |w_all_round - w_replayed| {same:.2e}")
    print(
        "pick: not_replay (all-round cache) when the data fits in the subtasks' memory; "
        "replay when it does not, or when an operator must start afresh each round"
    )
    out = write_report(report, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
