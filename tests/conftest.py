"""Session-scoped Spark and Ray on loopback, shared by every test.

One SparkSession (local[4], UI off) and one Ray instance per test session, started by
``hybrid_iter.Session.local`` and stopped at the end. Test modules are deliberately not
on the workers' PYTHONPATH: operators defined in them reach Spark's Python workers and
the Ray actor the way a user's own files do (pickled by value).
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

#: Task slots of the shared session: enough for 1-4 partition tests on 2 cores.
SLOTS = 4


@pytest.fixture(scope="session")
def session():
    import hybrid_iter as hi

    s = hi.Session.local(
        SLOTS,
        spark_conf={
            "spark.task.maxFailures": "1",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "256",
        },
        driver_memory="1g",
        object_store_memory=512 * 1024 * 1024,
    )
    try:
        s.spark.range(4, numPartitions=SLOTS).count()  # warm-up: Python workers and JVM
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def spark(session):
    return session.spark
