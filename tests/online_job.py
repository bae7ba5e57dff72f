"""An online iteration in its own process (so test_online.py can kill its driver):
``python online_job.py INPUT_DIR CHECKPOINT_DIR [KILL_AFTER_BATCH]``. Prints
``COMMITTED <batch id>`` after every committed batch (a test may SIGKILL it from there)
and ``RESULT {...}`` at the end: the row count and column sums the coordinator trained on
(exactly once means they equal the files')."""

from __future__ import annotations

import json
import sys

import numpy as np
from online_ops import SCHEMA, Sums, Total

import hybrid_iter as hi
from hybrid_iter.testing import FaultInjection


def main(input_dir: str, checkpoint: str, kill_after: int | None) -> int:
    # warm_up=False: the warm-up's processes are not what this job tests, and on 2 cores
    # their start is the killed and the restarted run's time
    with hi.Session.local(2, warm_up=False) as session:
        stream = (
            session.spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).csv(input_dir)
        )
        it = hi.iterate_unbounded_streams(
            {"total": np.zeros(5)},
            hi.ReplayableDataStreamList.not_replay(stream),
            hi.IterationBody(Sums(), Total()),
            hi.OnlineConfig(
                checkpoint_location=checkpoint,
                trigger={"availableNow": True},
                hooks=FaultInjection(kill_driver_after_batch=kill_after),
                on_outputs=lambda batch_id, _: print(f"COMMITTED {batch_id}", flush=True),
            ),
        )
        it.await_termination()
        result = {
            "total_hex": it.latest_variables()["total"].tobytes().hex(),
            "batches": it.progress.batches,
            "rows": it.progress.rows,
        }
        it.stop()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None))
