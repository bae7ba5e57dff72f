"""Click-stream enrichment with evolving side inputs (FLIP-17) on Structured Streaming.

    python examples/clickstream_side_inputs.py --rounds 4 --clicks-per-round 500

Three streams of JSON files dropped into directories (as into a landing zone):

* ``clicks`` (user_id, page, dwell_ms): the main input;
* ``users`` (user_id, segment): a slowly changing dimension table, a new row replaces a
  user's segment. A keyed ``MapSideInput``: co-partitioned with the clicks by user_id,
  so each task holds only its users, never the whole table;
* ``feedback`` (dwell_ms, converted): labelled sessions. The threshold is learned from
  them by a streaming aggregation (mean dwell time of converting sessions, in 'complete'
  mode): a broadcast ``SingletonSideInput`` updated by this second stream.

Each click is enriched with its user's segment and kept only if its dwell time reaches
the learned threshold. Round 0's clicks arrive before any side data: they wait in the
side-input buffer until both views have their first data. Each later round first
updates some segments and adds feedback, then sends clicks, which see the new versions.
Every output row carries the versions it saw, and is checked against them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import uuid
from typing import Any

from pyspark.sql import functions as F

import hybrid_iter as hi
from spark_ops import MapSideInput, SingletonSideInput, with_side_inputs

SEGMENTS = ["new", "casual", "loyal", "vip"]
OUT_SCHEMA = (
    "user_id long, page string, dwell_ms double, segment string, threshold double, "
    "users_version long, threshold_version long"
)


def put(directory: str, rows: list[dict[str, Any]]) -> None:
    """One JSON-lines file, renamed into place so the stream never reads half of it."""
    tmp = os.path.join(directory, f".{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    os.rename(tmp, os.path.join(directory, f"{uuid.uuid4().hex}.json"))


def build(spark, dirs: dict[str, str]):
    """The views and the operation (a not yet started ``SideInputStream``)."""
    clicks = spark.readStream.schema("user_id long, page string, dwell_ms double").json(
        dirs["clicks"]
    )
    users = MapSideInput(
        spark.readStream.schema("user_id long, segment string").json(dirs["users"]),
        key="user_id",
        value="segment",
        keyed=True,
        name="users",
    )
    learned = (
        spark.readStream.schema("dwell_ms double, converted boolean")
        .json(dirs["feedback"])
        .filter("converted")
        .groupBy()
        .agg(F.avg("dwell_ms").alias("threshold"))
    )
    threshold = SingletonSideInput(learned, "threshold", output_mode="complete", name="threshold")

    def enrich_and_filter(rows, ctx):
        """Runs in a Spark task, once per partition of each micro-batch."""
        segments = ctx.side_input(users)  # answers for the current row's user
        for r in rows:
            limit = ctx.side_input(threshold)
            if r.dwell_ms >= limit:
                yield (
                    r.user_id,
                    r.page,
                    r.dwell_ms,
                    segments.get(r.user_id, "unknown"),
                    limit,
                    ctx.side_input_version(users),
                    ctx.side_input_version(threshold),
                )

    op = with_side_inputs(clicks, users, threshold, key="user_id")
    return op.map_partition(enrich_and_filter, OUT_SCHEMA)


def main(
    session: hi.Session,
    *,
    rounds: int = 4,
    clicks_per_round: int = 500,
    users: int = 100,
    seed: int = 0,
    work_dir: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    spark = session.spark
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix="clickstream_", dir=work_dir)
    dirs = {name: os.path.join(root, name) for name in ("clicks", "users", "feedback")}
    for d in dirs.values():
        os.makedirs(d)

    out: list[Any] = []
    query = build(spark, dirs).start(
        foreach_batch=lambda df, batch_id: out.extend(df.collect()),
        work_dir=os.path.join(root, "work"),
        key_groups=8,
        ready_timeout=600,
    )
    # what the driver sent, per version, to check every row against
    table: dict[int, str] = {}
    tables: dict[int, dict[int, str]] = {}
    converted: list[float] = []
    thresholds: dict[int, float] = {}
    sent: list[dict[str, Any]] = []
    buffered_before_ready = 0
    try:
        for rnd in range(rounds):
            clicks = [
                {
                    "user_id": rng.randrange(users),
                    "page": f"/p{rng.randrange(20)}",
                    "dwell_ms": rng.uniform(0, 6000),
                }
                for _ in range(clicks_per_round)
            ]
            if rnd == 0:  # clicks first: nothing to enrich them with yet
                put(dirs["clicks"], clicks)
                query.process_all_available()
                buffered_before_ready = query.status()["buffer"]["records"]
                assert not query.ready and not out
            changed = range(users) if rnd == 0 else rng.sample(range(users), max(1, users // 5))
            update = [{"user_id": u, "segment": rng.choice(SEGMENTS)} for u in changed]
            put(dirs["users"], update)
            query.process_all_available()
            table.update({r["user_id"]: r["segment"] for r in update})
            tables[rnd + 1] = dict(table)
            feedback = [
                {
                    "dwell_ms": rng.uniform(1000 + 400 * rnd, 3000 + 400 * rnd),
                    "converted": rng.random() < 0.5,
                }
                for _ in range(50)
            ]
            put(dirs["feedback"], feedback)
            query.process_all_available()
            converted += [f["dwell_ms"] for f in feedback if f["converted"]]
            thresholds[rnd + 1] = sum(converted) / len(converted)
            if rnd > 0:
                put(dirs["clicks"], clicks)
                query.process_all_available()
            sent += clicks
            if progress:
                print(
                    f"round {rnd}: threshold {thresholds[rnd + 1]:.0f} ms, {len(out)} clicks kept "
                    f"so far, versions {query.versions()}"
                )
        history = list(query.history)
    finally:
        query.stop()
        shutil.rmtree(root, ignore_errors=True)

    mismatches = 0
    for r in out:
        expect_seg = tables[r.users_version].get(r.user_id, "unknown")
        limit = thresholds[r.threshold_version]
        if r.segment != expect_seg or abs(r.threshold - limit) > 1e-6 or r.dwell_ms < r.threshold:
            mismatches += 1
    kept_expected = sum(
        1
        for rnd, rows in enumerate(
            [sent[i : i + clicks_per_round] for i in range(0, len(sent), clicks_per_round)]
        )
        for c in rows
        if c["dwell_ms"] >= thresholds[rnd + 1]
    )
    summary = {
        "rows": len(out),
        "expected_rows": kept_expected,
        "dropped_by_threshold": len(sent) - len(out),
        "mismatches": mismatches + abs(kept_expected - len(out)),
        "buffered_before_ready": buffered_before_ready,
        "thresholds_seen": sorted({round(r.threshold, 6) for r in out}),
        "dimension_versions_seen": sorted({r.users_version for r in out}),
        "output_batches": [(h.source, dict(h.versions)) for h in history],
    }
    if progress:
        print(
            f"{summary['rows']} of {len(sent)} clicks kept and enriched; "
            f"{buffered_before_ready} waited for the side inputs; "
            f"{summary['mismatches']} rows disagree with the versions they saw"
        )
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clicks-per-round", type=int, default=500)
    ap.add_argument("--users", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with hi.Session.local(parallelism=2) as session:
        main(
            session,
            rounds=args.rounds,
            clicks_per_round=args.clicks_per_round,
            users=args.users,
            seed=args.seed,
        )
