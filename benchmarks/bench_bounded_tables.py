"""A sparse table on an endless stream of ids: rows held, bytes and the process's memory
over the steps, bounded (admission after N sightings, expiry, a cap) against unbounded.

    python benchmarks/bench_bounded_tables.py                   # 1,000 steps x 10,000 new ids
    python benchmarks/bench_bounded_tables.py --steps 200 --new 2000 --skip-unbounded

Each step is what a parameter shard takes from a worker (``coordinator._shard_core``,
driven here event by event in this process, one worker, async: the core's own cost, no
Ray, no Spark): ``--new`` ids never seen before (each seen once: they must take no row)
and a hot set of ``--hot`` ids seen every step (they must keep theirs), a gradient row
for each, SGD. The bounded table admits an id at its second sighting, expires rows not
updated for ``--ttl`` steps and keeps at most ``--cap`` rows. Reported per contender:
rows held and table bytes (rows + index + sketch) every 10 steps, the process's RSS, the
least-squares slope of each over the second half of the run (flat: ~0), the hot ids
still held at the end, and the median ms per step. JSON beside a figure in
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _harness import figure, rss, slope, write_report  # noqa: E402

from coordinator._bounds import Bounds  # noqa: E402
from coordinator._shard_core import ShardCore  # noqa: E402
from coordinator._shard_protocol import Pull, Push, Reply, ShardSpec  # noqa: E402
from coordinator._tables import Init, TableSpec  # noqa: E402


def _spec(bounds: Bounds) -> ShardSpec:
    table = TableSpec("ids", 1, Init(), "sgd", {"learning_rate": 0.1}, bounds)
    return ShardSpec(
        shard_id=0,
        lo=0,
        hi=0,
        init=np.zeros(0),
        rule="sgd",
        rule_params={"learning_rate": 0.1},
        num_workers=1,
        sync=False,
        token="t",
        tables=(table,),
    )


def _step_keys(s: int, new: int, hot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step ``s``'s ids (the hot set, then ``new`` ids no other step has) and their
    sightings (hot ids 3 each, new ones 1)."""
    fresh = np.arange(new, dtype=np.int64) + (1 << 40) + s * new
    keys = np.concatenate([hot, fresh])
    counts = np.concatenate([np.full(len(hot), 3), np.ones(new, dtype=np.int64)])
    return keys, counts


def run(name: str, bounds: Bounds, steps: int, new: int, hot: np.ndarray) -> dict[str, Any]:
    gc.collect()
    core = ShardCore(_spec(bounds))
    tab = core.tables[0]
    keys, counts = _step_keys(0, new, hot)
    core.handle(Pull("p", 0, 0, 0, "t", (keys,), (counts,)))
    rng = np.random.default_rng(1)
    trace: list[dict[str, float]] = []
    ms: list[float] = []
    rss0 = rss()
    for s in range(steps):
        nkeys, ncounts = _step_keys(s + 1, new, hot)
        g = rng.normal(size=(len(keys), 1)) * 0.01
        t0 = time.perf_counter()
        out = core.handle(
            Push("q", 0, 0, s, None, 1.0, False, True, "t", (g,), (nkeys,), None, (ncounts,))
        )
        ms.append(1e3 * (time.perf_counter() - t0))
        assert isinstance(out[-1], Reply), out
        keys, counts = nkeys, ncounts
        if s % 10 == 9 or s == steps - 1:
            sketch = 0 if tab.sketch is None else tab.sketch.nbytes
            trace.append(
                {
                    "step": s + 1,
                    "rows": len(tab),
                    "table_bytes": tab.nbytes + sketch,
                    "rss_bytes": rss() - rss0,
                }
            )
    half = [t for t in trace if t["step"] > steps // 2]
    xs = [t["step"] for t in half]
    hot_held = int((tab.index.find(hot) >= 0).sum())
    return {
        "contender": name,
        "bounds": bounds.to_plain(),
        # every step's ids and the next step's, asked for by the last push
        "ids_seen": (steps + 1) * new + len(hot),
        "rows_end": len(tab),
        "max_rows_seen": max(t["rows"] for t in trace),
        "table_bytes_end": trace[-1]["table_bytes"],
        "rows_slope_per_step": slope(xs, [t["rows"] for t in half]),
        "table_bytes_slope_per_step": slope(xs, [t["table_bytes"] for t in half]),
        "rss_slope_per_step": slope(xs, [t["rss_bytes"] for t in half]),
        "hot_held": hot_held,
        "hot": len(hot),
        "admitted": tab.admitted,
        "expired": tab.expired,
        "median_ms_per_step": statistics.median(ms),
        "trace": trace,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--new", type=int, default=10_000, help="ids never seen before, per step")
    ap.add_argument("--hot", type=int, default=1000, help="ids seen every step")
    ap.add_argument("--ttl", type=int, default=50)
    ap.add_argument("--cap", type=int, default=100_000)
    ap.add_argument("--skip-unbounded", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "bounded_tables.json"))
    args = ap.parse_args(argv)
    hot = np.arange(args.hot, dtype=np.int64) * 7 + 11
    bounded = Bounds(min_count=2, ttl_steps=args.ttl, max_rows=args.cap)
    results = [run("bounded", bounded, args.steps, args.new, hot)]
    if not args.skip_unbounded:
        results.append(run("unbounded", Bounds(), args.steps, args.new, hot))
    for r in results:
        print(
            f"{r['contender']:>9}: {r['rows_end']:,} rows at the end (at most "
            f"{r['max_rows_seen']:,}) of {r['ids_seen']:,} ids, "
            f"{r['table_bytes_end'] / 2**20:.1f} MiB; slope over the second half: "
            f"{r['rows_slope_per_step']:.1f} rows, "
            f"{r['rss_slope_per_step'] / 1024:.1f} KiB RSS per step; hot ids held "
            f"{r['hot_held']}/{r['hot']}; {r['median_ms_per_step']:.2f} ms per step (median)"
        )
    report = {"args": vars(args), "results": results}
    path = Path(args.out)
    write_report(report, path)

    def draw(axes: Any) -> None:
        left, right = axes[0]
        for r in results:
            steps = [t["step"] for t in r["trace"]]
            left.plot(steps, [t["rows"] for t in r["trace"]], label=r["contender"])
            right.plot(steps, [t["rss_bytes"] / 2**20 for t in r["trace"]], label=r["contender"])
        left.set(xlabel="step", ylabel="rows held", yscale="log")
        right.set(xlabel="step", ylabel="process RSS growth (MiB)")
        left.legend()

    figure(path.with_suffix(".png"), draw, cols=2)
    print(json.dumps({k: v for k, v in results[0].items() if k != "trace"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
