"""Micro-benchmark of one training step against sparse tables: ms and bytes per step as
the table grows (keys held 2^20 .. 2^24 or more), the worker's own share of the step.

    python benchmarks/micro_ps_tables.py                     # 2^20 and 2^24 keys held
    python benchmarks/micro_ps_tables.py --held 20,22,24,26 --steps 300

A step is what a ``ps.train`` worker does (the same client code, here in the driver
process, one worker): a batch of 1,024 rows x 50 hashed ids (85% from 3,000 frequent
features, 15% from the whole table: ~10,000 distinct per batch, near the flights'
11,400), its key plan (unique ids, routing), then one fused push per shard carrying the
gradient rows of this step and the ids of the next, whose reply brings their rows. FTRL
on a dim-1 table pre-filled with ``2^held`` random int64 keys on 2 shards; the batches
draw from those keys, so every lookup lands in a table of that size (a later epoch; the
first epoch's inserts are measured by ``--fresh``).
Prints one JSON line per size: ms per step (median, p90), bytes per step (both ways,
all shards), the worker's ms for its key plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import hybrid_iter as hi
from coordinator._tables import Init, TableSpec
from hybrid_iter import ps
from hybrid_iter.ps._client import Shards, TablePlan, step_keys
from hybrid_iter.ps._shards import _launch, stop_shards

ROWS, IDS = 1024, 50


def batches(rng: np.random.Generator, keys: np.ndarray, steps: int) -> list[np.ndarray]:
    """Each batch's ids: 85% from the 3,000 first keys (frequent features), 15% from all."""
    out = []
    n = ROWS * IDS
    for _ in range(steps):
        hot = keys[rng.integers(0, 3000, int(0.85 * n))]
        cold = keys[rng.integers(0, len(keys), n - int(0.85 * n))]
        out.append(np.concatenate([hot, cold]))
    return out


def fill(handles: list, held: int, chunk: int = 1 << 20) -> np.ndarray:
    """``held`` random int64 keys loaded into the shards; returns them."""
    import ray

    from coordinator._tables import shard_of

    rng = np.random.default_rng(1)
    everything = np.unique(rng.integers(-(2**63), 2**63 - 1, held, dtype=np.int64))
    rng.shuffle(everything)
    for lo in range(0, len(everything), chunk):
        keys = everything[lo : lo + chunk]
        owner = shard_of(keys, len(handles))
        ray.get(
            [
                h.load_rows.remote("w", keys[owner == j], np.zeros((int((owner == j).sum()), 1)))
                for j, h in enumerate(handles)
            ]
        )
    return everything


def measure(held_log2: int, steps: int, num_shards: int) -> dict:
    import ray

    table = TableSpec("w", 1, Init(), "ftrl", ps.FTRL(alpha=0.05, l1=1.0, l2=1.0).rule_params())
    names, handles, _ = _launch(
        np.zeros(0),
        [0] * (num_shards + 1),
        ps.SGD(1.0),
        num_workers=1,
        sync=False,
        tables=(table,),
    )
    try:
        t = time.perf_counter()
        filled = fill(handles, 1 << held_log2)
        fill_s = time.perf_counter() - t
        plan = TablePlan.of([("w", 1, ("ids",))])
        client = Shards(names, [0] * (num_shards + 1), "<f8", sync=False, plan=plan)
        rng = np.random.default_rng(0)
        data = batches(rng, filled, steps + 1)
        del filled
        keys = [step_keys(plan, {"ids": b}, num_shards) for b in data[:2]]
        client.pull(0, 0, keys[0], 0)
        before = ray.get([h.info.remote() for h in handles])
        times, plans, distinct = [], [], []
        for s in range(steps):
            t0 = time.perf_counter()
            nxt = step_keys(plan, {"ids": data[s + 1]}, num_shards)
            t1 = time.perf_counter()
            g = np.full((len(keys[0].uniq[0]), 1), 1e-3)
            client.push(
                0, 0, s, None, float(ROWS), False, keys=keys[0], table_grads=[g], next_keys=nxt
            )
            times.append(time.perf_counter() - t0)
            plans.append(t1 - t0)
            distinct.append(len(keys[0].uniq[0]))
            keys = [nxt]
        after = ray.get([h.info.remote(0) for h in handles])
        moved = sum(
            a["bytes_in"] + a["bytes_out"] - b["bytes_in"] - b["bytes_out"]
            for a, b in zip(after, before)
        )
        held = sum(a["tables"]["w"]["keys"] for a in after)
        ms = sorted(x * 1e3 for x in times)
        return {
            "held_log2": held_log2,
            "keys_held": held,
            "shards": num_shards,
            "steps": steps,
            "distinct_keys_per_step": statistics.median(distinct),
            "ms_per_step_median": round(statistics.median(ms), 3),
            "ms_per_step_p90": round(ms[int(0.9 * len(ms))], 3),
            "worker_key_plan_ms_median": round(statistics.median(plans) * 1e3, 3),
            "bytes_per_step": round(moved / steps),
            "fill_seconds": round(fill_s, 1),
        }
    finally:
        stop_shards(handles)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--held", default="20,24", help="log2 of the keys each run holds")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args()
    with hi.Session.local(2):
        for h in (int(x) for x in args.held.split(",")):
            print(json.dumps(measure(h, args.steps, args.shards)), flush=True)


if __name__ == "__main__":
    main()
