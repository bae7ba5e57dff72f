"""Work on the DataFrames of a stopped session, in a process of its own (stopping the
suite's shared session would end every later test's)::

    PYTHONPATH=tests:. python -c "import stopped_session_job, sys; sys.exit(stopped_session_job.main('closed'))"

``main("closed")`` makes a bounded and a streaming DataFrame in a SparkSession, stops
it (as a notebook's later cell finds it after ``spark.stop()`` or a closed
``hybrid_iter.Session``; no Ray is needed for that, nor started), then hands them to
every entry point of hybrid_iter and reports, as one JSON line (prefixed with
``RESULT ``), the error type and text each raised, and whether a SparkContext was
active afterwards (an entry point must not start one to fail later).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

RESULT_PREFIX = "RESULT "


def _calls(df: Any, stream: Any, hi: Any) -> dict[str, Any]:
    import numpy as np

    from hybrid_iter import ml, ps

    class Partition(hi.PartitionOperator):
        def process_data(self, stream: int, batch: Any, ctx: Any, out: Any) -> None:
            pass

    class Coordinator(hi.CoordinatorOperator):
        pass

    def body() -> Any:
        return hi.IterationBody(Partition(), Coordinator())

    init = {"w": np.zeros(1)}
    streams = hi.ReplayableDataStreamList
    return {
        "iterate_bounded": lambda: hi.iterate_bounded_streams_until_termination(
            init, streams.not_replay(df), hi.IterationConfig(max_epochs=2), body()
        ),
        "iterate_unbounded": lambda: hi.iterate_unbounded_streams(
            init, streams.not_replay(stream), body()
        ),
        "LinearRegression.fit": lambda: ml.LinearRegression(features_col=["x"], label_col="y").fit(
            df
        ),
        "KMeans.fit": lambda: ml.KMeans(k=2, features_col=["x"]).fit(df),
        "ps.train": lambda: ps.train(
            df, lambda params, batch: (0.0, {"w": np.zeros(1)}), init, columns=["x"]
        ),
    }


def main(case: str) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    import hybrid_iter as hi

    assert case == "closed", case
    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    df = spark.createDataFrame([(float(i), float(i % 2)) for i in range(20)], ["x", "y"])
    stream = spark.readStream.format("rate").load()
    spark.stop()
    report: dict[str, Any] = {}
    for name, call in _calls(df, stream, hi).items():
        try:
            call()
            report[name] = None
        except Exception as ex:
            report[name] = [type(ex).__name__, str(ex), isinstance(ex, hi.SessionError)]
    report["spark_active"] = SparkContext._active_spark_context is not None
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
