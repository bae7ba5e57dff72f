"""A ``Session.local`` and its background warm-up, in a process of its own (the suite's
shared session already runs Spark and Ray in the test process)::

    PYTHONPATH=tests:. python -c "import warm_up_job, sys; sys.exit(warm_up_job.main('same'))"

``main(case)`` reports as one JSON line (prefixed with ``RESULT ``):

* ``same``: fits right after the session returns (Spark never quiet yet: the warm-up
  not started), fits started with the warm-up, and the same fits once it has ended,
  each from Spark (the array cache emptied first); their models, as hex of the float64
  bytes; and whether the warm-up had started anything before Spark was quiet (the
  user's first jobs and the first fits' coming must not start it);
* ``taken``: what the warm-up made ready, and what the first fit and the first
  ``iterate`` ran on: the spare pool, the array store, the Python workers' pids;
* ``closed``: the session stopped while the warm-up's Spark job runs (its tasks held in
  ``warm_up_block``'s import until the stop); what stop raised and what was left.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULT_PREFIX = "RESULT "
HERE = Path(__file__).resolve().parent


def children() -> dict[int, str]:
    """Live (non-zombie) descendants of this process: pid -> command name."""
    from session_start_job import children as found

    return found()


def _data(spark: Any) -> Any:
    rng = np.random.default_rng(7)
    X = rng.normal(size=(4000, 3))
    y = X @ np.array([1.5, -2.0, 0.5]) + 0.3 + rng.normal(scale=0.1, size=4000)
    rows = [(*map(float, x), float(t), float(t > 0.3)) for x, t in zip(X, y, strict=True)]
    df = spark.createDataFrame(rows, ["a", "b", "c", "y", "late"]).repartition(2).cache()
    df.count()
    return df


def _fits(df: Any) -> dict[str, str]:
    from hybrid_iter import ml

    out = {}
    ml.clear_array_cache()
    lin = ml.LinearRegression(features_col=["a", "b", "c"], label_col="y", progress=False)
    m = lin.fit(df)
    out["linear"] = np.append(m.coefficients, m.intercept).tobytes().hex()
    ml.clear_array_cache()
    log = ml.LogisticRegression(features_col=["a", "b", "c"], label_col="late", progress=False)
    m = log.fit(df)
    out["logistic"] = np.append(m.coefficients, m.intercept).tobytes().hex()
    ml.clear_array_cache()
    km = ml.KMeans(features_col=["a", "b", "c"], k=3, seed=1, progress=False).fit(df)
    out["kmeans"] = np.asarray(km.cluster_centers).tobytes().hex()
    return out


def _iterate_pids(spark: Any) -> list[int]:
    import hybrid_iter as hi

    class Once(hi.PartitionOperator):
        def process_data(self, stream, batch, ctx, out):
            pass

        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            out.output("pid", os.getpid())
            out.feedback(1.0)

    class Publish(hi.CoordinatorOperator):
        def process_feedback(self, value, ctx, out):
            pass

        def on_epoch_watermark_incremented(self, epoch, ctx, out):
            out.publish_variables(w=np.ones(1))

    result = hi.iterate_bounded_streams_until_termination(
        {"w": np.zeros(1)},
        hi.ReplayableDataStreamList.not_replay(hi.DataStream(spark.range(0, 4, 1, 2))),
        hi.IterationConfig(parallelism=2, progress=False, max_epochs=1),
        hi.IterationBody(partition=Once(), coordinator=Publish()),
    )
    return sorted(set(result.outputs["pid"]))


def main(case: str) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    import ray

    import hybrid_iter as hi
    from hybrid_iter._cluster import spares, warm_up
    from hybrid_iter._runtime import array_store
    from hybrid_iter._runtime.iterate import coordinator_kind

    report: dict[str, Any] = {}
    if case == "closed":
        # every warm-up task imports warm_up_block, which holds it (the directory is
        # in HYBRID_ITER_TEST_BLOCK_DIR, set by the test; PYTHONPATH reaches the workers)
        warm_up.WORKER_MODULES = (*warm_up.WORKER_MODULES, "warm_up_block")
        # nothing else runs here: the warm-up need not wait 5 s for a quiet Spark
        warm_up.QUIET_BEFORE_WARM_UP = 1.0
        block = Path(os.environ["HYBRID_ITER_TEST_BLOCK_DIR"])
        session = hi.Session.local(2)
        deadline = time.monotonic() + 300
        while not any(block.glob("started.*")) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling a file a Spark task writes, bounded
        report["task_started"] = any(block.glob("started.*"))
        report["warm_up_running"] = not session._warm._done.is_set()
        from spark_ops._spark_compat import jvm_pid

        gateway = jvm_pid(session.spark)
        try:
            session.stop()
            report["error"] = None
        except Exception as ex:
            report["error"] = [type(ex).__name__, str(ex)]
        report["warm_up_report"] = session._warm.report
        report["threads"] = [t.name for t in threading.enumerate() if "warm" in t.name]
        report["ray_initialized"] = ray.is_initialized()
        deadline = time.monotonic() + 60
        left = {p: n for p, n in children().items() if p != gateway}
        while left and time.monotonic() < deadline:
            time.sleep(0.2)  # polling processes' exit, bounded
            left = {p: n for p, n in children().items() if p != gateway}
        report["children"] = left
        print(RESULT_PREFIX + json.dumps(report), flush=True)
        return 0

    if case == "same":
        # Spark never counts as quiet until the first fits have run: neither the user's
        # first jobs nor the fits' coming start the warm-up
        warm_up.QUIET_BEFORE_WARM_UP = float("inf")
    with hi.Session.local(2) as session:
        df = _data(session.spark)
        if case == "same":
            report["first"] = _fits(df)
            warm = session._warm
            report["started_before_quiet"] = warm._tag is not None or any(
                warm.report[k] for k in ("spare", "store", "shard_spares", "python_workers")
            )
            warm_up.QUIET_BEFORE_WARM_UP = 0.0  # now it starts, beside the next fits
            report["during"] = _fits(df)
            report["warm"] = session.warmed(600)
            report["after"] = _fits(df)
        else:
            warmed = session.warmed(600)
            report["warm"] = warmed
            kind = coordinator_kind(1)  # the warm-up's kind
            report["spares_before"] = spares.spares(kind)
            got = array_store._store(create=False)
            report["store_before"] = None if got is None else got[1]
            report["iterate_pids"] = _iterate_pids(session.spark)
            report["spares_after_iterate"] = spares.spares(kind)
            from hybrid_iter import ml

            ml.LinearRegression(features_col=["a", "b", "c"], label_col="y", progress=False).fit(df)
            got = array_store._store(create=False)
            report["store_after"] = None if got is None else got[1]
            report["store_stats"] = array_store.store_stats()
            report["spares_after_fit"] = spares.spares(kind)
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
