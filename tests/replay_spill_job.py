"""Replay data larger than Spark's storage memory (run by test_replay_spill.py in a
subprocess: it needs a Spark with a tiny storage budget)."""

from __future__ import annotations

import json
import sys

import numpy as np

import hybrid_iter as hi


class Sums(hi.PartitionOperator):
    def open(self, ctx):
        self.total, self.rows = 0.0, 0

    def process_data(self, stream, batch, ctx, out):
        for col in batch.columns:
            self.total += float(np.sum(col.to_numpy()))
        self.rows += batch.num_rows

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.feedback((self.rows, self.total))


class Collect(hi.CoordinatorOperator):
    def open(self, init_variables, ctx):
        self.rows, self.total = 0, 0.0

    def process_feedback(self, value, ctx, out):
        self.rows += value[0]
        self.total += value[1]

    def on_epoch_watermark_incremented(self, epoch, ctx, out):
        out.output("round", (epoch, self.rows, self.total))
        out.publish_variables(round=epoch + 1)


def main() -> int:
    rows, cols = 200_000, 10
    conf = {"spark.memory.fraction": "0.02", "spark.memory.storageFraction": "0.5"}
    # warm_up=False: the warm-up's processes are not what this job measures
    with hi.Session.local(2, driver_memory="512m", spark_conf=conf, warm_up=False) as session:
        # random values: the cache cannot shrink them by compression
        df = session.spark.range(rows, numPartitions=4).selectExpr(
            *[f"rand({j}) as c{j}" for j in range(cols)]
        )
        expected = float(
            df.selectExpr(f"sum({' + '.join(f'c{j}' for j in range(cols))})").first()[0]
        )
        result = hi.iterate_bounded_streams_until_termination(
            {"round": 0},
            hi.ReplayableDataStreamList.replay(df),
            hi.IterationConfig(operator_lifecycle=hi.OperatorLifecycle.PER_ROUND, max_epochs=3),
            hi.IterationBody(Sums(), Collect()),
        )
    print(
        "RESULT "
        + json.dumps(
            {
                "rounds": result.outputs["round"],
                "expected_total": expected,
                "rows": rows,
                "disk": result.replay.disk_bytes,
                "memory": result.replay.memory_bytes,
                "raw_bytes": rows * cols * 8,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
