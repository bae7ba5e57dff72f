"""What the Ray metrics of a run cost: the empty-body iteration with the metrics on and
off, paired in one session.

    python benchmarks/bench_metrics.py                # 10 pairs of 300-epoch runs

``HYBRID_ITER_METRICS`` is read at each run's start, so one Spark and one Ray serve both
sides; each pair runs on/off in alternating order, so that drift in the machine's load
falls on both alike. Prints each side's median steady ms/epoch (the median epoch after
the first) and end-to-end ms/epoch, and the median of the paired differences; then the
driver CPU the metrics take per call: recording a progress snapshot (what the driver
does per poll) and one refresh of a run's series into Ray (every 2.5 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import timeit

from bench_iteration import ours_empty, per_epoch

import hybrid_iter as hi
from coordinator import Progress
from hybrid_iter._runtime import metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--partitions", type=int, default=2)
    args = ap.parse_args()
    with hi.Session.local(parallelism=args.partitions) as session:
        spark = session.spark

        def run(on: bool) -> dict:
            os.environ[metrics.ENV] = "1" if on else "0"
            return per_epoch(lambda e: ours_empty(spark, args.partitions, e), args.epochs)

        run(True), run(False)  # warm-up
        sides: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(args.pairs):
            for on in (True, False) if i % 2 == 0 else (False, True):
                sides[on].append(run(on))
            print(
                f"pair {i + 1}/{args.pairs}: steady ms/epoch on "
                f"{sides[True][-1]['steady'] * 1e3:.2f} off {sides[False][-1]['steady'] * 1e3:.2f}",
                flush=True,
            )
        os.environ[metrics.ENV] = "1"
        meter = metrics.bounded_meter("bench", "0" * 12, "sync")
        p = Progress(
            aligned=10,
            epochs=10,
            last_epoch_seconds=0.002,
            loss=0.5,
            terminated_by=None,
            done=False,
            failed=False,
            subtask_epochs=(10, 10),
            rows=1000,
            version=10,
        )
        per_snapshot = timeit.timeit(lambda: meter.progress(p, attempt=0), number=20000) / 20000
        series = next(iter(metrics._EXPORTER._series.values()))
        work = [(series.cluster, series.tags, dict(series.gauges), {}, [])]
        per_refresh = timeit.timeit(lambda: metrics._EXPORTER._record(work), number=2000) / 2000
        meter.close(failed=False)

    med = statistics.median
    for kind in ("steady", "end_to_end"):
        on = [r[kind] * 1e3 for r in sides[True]]
        off = [r[kind] * 1e3 for r in sides[False]]
        diff = med(a - b for a, b in zip(on, off))
        print(
            f"{kind:>10} ms/epoch: on {med(on):.3f} (min {min(on):.3f}), off {med(off):.3f} "
            f"(min {min(off):.3f}); median paired difference {diff:+.3f}"
        )
    print(
        f"driver CPU: {per_snapshot * 1e6:.1f} us per progress snapshot (one per poll: per "
        f"epoch with the progress line, else every 0.5 s), {per_refresh * 1e6:.1f} us per "
        f"refresh of a run's {len(work[0][2])} gauges into Ray (every "
        f"{metrics._refresh_seconds():.1f} s, on the exporter's thread)"
    )


if __name__ == "__main__":
    main()
