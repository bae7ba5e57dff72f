"""Checkpoint cost (authenticated) and recovery time after a task failure and a
coordinator kill.

    python benchmarks/bench_checkpoint.py
    python benchmarks/bench_checkpoint.py --epochs 20 --repeats 2   # quicker

Side by side in one run, 2 partitions, a near-empty body whose coordinator publishes a
model of M float64 values every epoch (M = 1,000 and 1,000,000):

* ``never`` vs ``every``: median seconds per epoch without checkpoints and with a
  checkpoint at every epoch (local disk through pyarrow.fs); their difference is the
  per-epoch overhead, and the coordinator's own timing of each checkpoint (collecting the
  subtasks' state, pickling, writing atomically with a checksum) is reported too.
* ``recovery``: the same run with partition 1 failing at the middle epoch (checkpoints
  every 5 epochs): extra wall time over the fault-free run with the same checkpoints;
  and the same with the coordinator's process killed at the middle epoch (Ray restarts
  it, it reloads the checkpoint, the stage is relaunched).
* ``store``: the checkpoint file alone, side by side: an unauthenticated format (one
  pickle + sha256) against the authenticated one (numeric arrays as .npy + HMAC-SHA256),
  encoding and writing the same checkpoint dict to the same local disk.

Writes JSON to benchmarks/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
from _harness import write_report

import hybrid_iter as hi
from hybrid_iter.testing import FaultInjection

HERE = Path(__file__).resolve().parent


class Tick(hi.PartitionOperator):
    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback(1.0)


class Model(hi.CoordinatorOperator):
    """Holds the model; every epoch nudges it and publishes it."""

    def open(self, init_variables, ctx):
        self.w = np.array(init_variables["w"])

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        self.w += 1e-3
        out.publish_variables(w=self.w)


def run(spark, size, epochs, **config):
    df = spark.range(20, numPartitions=2)
    return hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(size)},
        hi.ReplayableDataStreamList.not_replay(df),
        hi.IterationConfig(max_epochs=epochs, parallelism=2, **config),
        hi.IterationBody(Tick(), Model()),
    )


def _old_format_save(directory: str, data: dict) -> None:
    """An unauthenticated checkpoint file, the baseline of the authenticated one: pickle,
    sha256, temp + rename."""
    payload = pickle.dumps(data, protocol=5)
    blob = b"HICKPT1\n" + hashlib.sha256(payload).digest() + struct.pack("<Q", len(payload))
    tmp = os.path.join(directory, ".chk.tmp")
    with open(tmp, "wb") as f:
        f.write(blob + payload)
    os.replace(tmp, os.path.join(directory, "chk-old.ckpt"))


def store_cost(size: int, repeats: int) -> dict:
    """Seconds to encode and write one checkpoint, old format vs authenticated."""
    from coordinator import CheckpointStore

    w = np.random.default_rng(0).standard_normal(size)
    data = {"variables": {"w": w}, "version": 3, "main": ("object", pickle.dumps(Model()))}
    d = tempfile.mkdtemp()
    store = CheckpointStore(d, key=b"k" * 32, run_id="bench", keep_last=2)
    old, new = [], []
    for i in range(repeats + 1):  # the first of each is the warm-up
        t = time.perf_counter()
        _old_format_save(d, data)
        old.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.save(i, data, [])
        new.append(time.perf_counter() - t)
    shutil.rmtree(d)
    o, n = statistics.median(old[1:]), statistics.median(new[1:])
    return {"old_s": o, "authenticated_s": n, "ratio": n / o}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 1_000_000])
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint.json"))
    args = ap.parse_args()
    report: dict = {
        "benchmark": "checkpoint cost and recovery (issues 5, 15)",
        "note": "shared 2-core machine, other jobs running: noisy",
        "epochs": args.epochs,
        "repeats": args.repeats,
        "models": {},
    }
    with hi.Session.local(parallelism=2) as session:
        for size in args.sizes:
            never, every, per_ckpt, clean_total, faulty_total = [], [], [], [], []
            killed_total, reconstructed = [], []
            for _ in range(args.repeats):
                r = run(session.spark, size, args.epochs)
                never.append(statistics.median(r.epoch_seconds[1:]))
                d = tempfile.mkdtemp()
                r = run(
                    session.spark,
                    size,
                    args.epochs,
                    checkpoint=hi.CheckpointConfig(d, every_epochs=1),
                )
                every.append(statistics.median(r.epoch_seconds[1:]))
                per_ckpt.append(statistics.median(s for _, _, s in r.checkpoint["checkpoints"]))
                shutil.rmtree(d)
                d = tempfile.mkdtemp()
                r = run(
                    session.spark,
                    size,
                    args.epochs,
                    checkpoint=hi.CheckpointConfig(d, every_epochs=5),
                )
                clean_total.append(r.seconds)
                shutil.rmtree(d)
                d = tempfile.mkdtemp()
                r = run(
                    session.spark,
                    size,
                    args.epochs,
                    checkpoint=hi.CheckpointConfig(d, every_epochs=5),
                    hooks=FaultInjection(fail_partition=1, at_epoch=args.epochs // 2 + 2),
                )
                assert len(r.attempts) == 1
                faulty_total.append(r.seconds)
                shutil.rmtree(d)
                d = tempfile.mkdtemp()
                r = run(
                    session.spark,
                    size,
                    args.epochs,
                    checkpoint=hi.CheckpointConfig(d, every_epochs=5),
                    hooks=FaultInjection(kill_coordinator_at=args.epochs // 2 + 2),
                )
                # Ray restarts the actor in place unless its creation arguments were
                # lost (large initial variables travel as an object); then the driver
                # starts a new coordinator from the checkpoint instead: record which
                reconstructed.append(bool(r.checkpoint["reconstructed"]))
                killed_total.append(r.seconds)
                shutil.rmtree(d)
            m = {
                "never_s_per_epoch": statistics.median(never),
                "every_epoch_s_per_epoch": statistics.median(every),
                "overhead_s_per_epoch": statistics.median(every) - statistics.median(never),
                "coordinator_s_per_checkpoint": statistics.median(per_ckpt),
                "recovery_s": statistics.median(faulty_total) - statistics.median(clean_total),
                "coordinator_kill_recovery_s": statistics.median(killed_total)
                - statistics.median(clean_total),
                "store": store_cost(size, max(5, args.repeats * 3)),
                "model_bytes": size * 8,
                "runs": {
                    "never": never,
                    "every": every,
                    "per_ckpt": per_ckpt,
                    "clean_total": clean_total,
                    "faulty_total": faulty_total,
                    "killed_total": killed_total,
                    "restarted_in_place_by_ray": reconstructed,
                },
            }
            report["models"][str(size)] = m
            print(
                f"model {size:>9,} values: {m['never_s_per_epoch'] * 1e3:7.2f} ms/epoch without "
                f"checkpoints, {m['every_epoch_s_per_epoch'] * 1e3:7.2f} with one every epoch "
                f"(+{m['overhead_s_per_epoch'] * 1e3:.2f} ms; {m['coordinator_s_per_checkpoint'] * 1e3:.2f} "
                f"ms per checkpoint in the coordinator); recovery from a task failure "
                f"{m['recovery_s']:.2f} s, from a coordinator kill "
                f"{m['coordinator_kill_recovery_s']:.2f} s; checkpoint file alone: "
                f"{m['store']['old_s'] * 1e3:.2f} ms unauthenticated, "
                f"{m['store']['authenticated_s'] * 1e3:.2f} ms authenticated "
                f"(x{m['store']['ratio']:.2f})",
                flush=True,
            )
    out = write_report(report, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
