"""The Spark lines (3.5 and 4.x) through their one compatibility module,
``spark_ops/_spark_compat.py``: versions refused before anything starts, RayDP's
requirements, job tags, Arrow types with time zones, observed metrics. (A real Spark Connect session, recognised,
its job tags and ``Session.attach``'s refusals: ``test_connect.py``, on its server.)"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

import hybrid_iter as hi
from spark_ops import _spark_compat as compat

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SPARK4 = compat.spark_version() >= (4, 0, 0)


@pytest.fixture(scope="module", autouse=True)
def ship_this_module_by_value():
    """The task functions below reach Spark's Python workers pickled by value, as a
    user's own script would ship them (this module is not importable there)."""
    from pyspark import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # PySpark's own copy of cloudpickle
    yield
    cloudpickle.unregister_pickle_by_value(module)


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("RAY_ADDRESS", None)
    return env


def _run(code: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=str(TESTS),
        env=_subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # on a timeout, the JVMs it started go too
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"subprocess did not finish in {timeout}s\nstderr:\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# -- versions ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["3.5.0", "3.5.7", "3.5.9", "4.0.0", "4.1.4", "4.3.0"])
def test_supported_spark_versions_pass(version):
    compat.check_spark_version(version)


@pytest.mark.parametrize("version", ["3.4.4", "3.6.0", "4.4.0", "5.0.0", "2.4.8"])
def test_an_unsupported_spark_version_is_refused_naming_it_and_the_fix(version):
    with pytest.raises(compat.UnsupportedSparkVersion) as err:
        compat.check_spark_version(version)
    message = str(err.value)
    assert f"PySpark {version} is not supported" in message
    assert "3.5.x, 4.0.x, 4.1.x, 4.2.x, 4.3.x" in message
    assert "pip install 'pyspark>=3.5,<4.4'" in message
    assert isinstance(err.value, hi.SparkOpsError)


def test_this_environment_runs_a_supported_spark():
    compat.check_spark_version()


def test_a_session_refuses_an_unsupported_pyspark_before_starting_anything():
    # the installed PySpark is made to report another version before hybrid_iter reads it
    code = (
        "import json, pyspark.version\n"
        "pyspark.version.__version__ = '4.4.0'\n"
        "import ray, hybrid_iter as hi\n"
        "from pyspark import SparkContext\n"
        "out = {}\n"
        "for kind in ('local', 'raydp'):\n"
        "    try:\n"
        "        hi.Session.local(1) if kind == 'local' else hi.Session.raydp(address='local')\n"
        "        out[kind] = 'started'\n"
        "    except hi.SessionError as ex:\n"
        "        out[kind] = str(ex)\n"
        "out['jvm'] = SparkContext._gateway is not None\n"
        "out['ray'] = ray.is_initialized()\n"
        "print('RESULT ' + json.dumps(out))\n"
    )
    proc = _run(code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["local"].startswith("Session.local: PySpark 4.4.0 is not supported"), out
    assert out["raydp"].startswith("Session.raydp: PySpark 4.4.0 is not supported"), out
    assert out["jvm"] is False and out["ray"] is False  # nothing started


def test_raydp_requirements_name_the_extra():
    missing = compat.raydp_problem_of(None, "4.3.0")
    assert missing is not None and "pip install 'hybrid-iter[raydp]'" in missing
    old = compat.raydp_problem_of("1.6.4", "3.5.7")
    assert old is not None and "RayDP 1.6.4 is installed" in old and "hybrid-iter[raydp]" in old
    newer = compat.raydp_problem_of("1.7.0", "3.5.7")
    assert newer is not None and "RayDP 1.7.0" in newer
    spark4 = compat.raydp_problem_of("1.6.5", "4.3.0")
    assert spark4 is not None
    assert "runs Spark 3.5 only" in spark4 and "PySpark 4.3.0" in spark4
    assert "pip install 'hybrid-iter[raydp]'" in spark4
    assert compat.raydp_problem_of("1.6.5", "3.5.7") is None


@pytest.mark.skipif(
    compat.raydp_problem() is None, reason="RayDP runs in this environment (test_raydp.py)"
)
def test_session_raydp_without_a_usable_raydp_says_how_to_install_it():
    # here the default install: Spark 4 without the raydp extra
    with pytest.raises(hi.SessionError) as err:
        hi.Session.raydp(address="local")
    assert "pip install 'hybrid-iter[raydp]'" in str(err.value)
    assert str(err.value) == compat.raydp_problem()


# -- job tags ------------------------------------------------------------------------------


def _block(batches):
    deadline = time.monotonic() + 300  # bounded: a missed cancel ends the job by itself
    for batch in batches:
        while time.monotonic() < deadline:
            time.sleep(0.05)
        yield batch


def test_a_job_tag_cancels_the_jobs_of_its_thread_only(spark):
    tagged = compat.JobTag(spark, "hybrid_iter.test,tag")  # a comma Spark would refuse
    other = compat.JobTag(spark, "hybrid_iter.test-other")
    outcome: dict[str, str] = {}

    def run(tag: compat.JobTag, key: str) -> None:
        try:
            with tag.on_this_thread(f"job of {key}"):
                spark.range(1, numPartitions=1).mapInArrow(_block, "id long").collect()
            outcome[key] = "finished"
        except Exception as ex:
            outcome[key] = f"failed: {type(ex).__name__}: {ex}"

    threads = [threading.Thread(target=run, args=(t, k)) for t, k in ((tagged, "a"), (other, "b"))]
    for t in threads:
        t.start()
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + 120
    while len(tracker.getActiveJobsIds()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling Spark until both jobs run, bounded
    assert len(tracker.getActiveJobsIds()) == 2
    tagged.cancel()
    threads[0].join(60)
    assert not threads[0].is_alive()
    assert outcome["a"].startswith("failed") and "cancel" in outcome["a"].lower(), outcome
    assert "b" not in outcome and threads[1].is_alive()  # the other tag's job runs on
    other.cancel()
    threads[1].join(60)
    assert outcome["b"].startswith("failed"), outcome
    # the threads' own tags were removed again: a later job on this thread is untagged
    assert spark.range(3).count() == 3


# -- what differs between the lines -------------------------------------------------------


def test_timestamps_convert_to_arrow_on_every_line():
    from pyspark.sql.types import (
        LongType,
        StructField,
        StructType,
        TimestampNTZType,
        TimestampType,
    )

    struct = StructType(
        [
            StructField("at", TimestampType()),
            StructField("local", TimestampNTZType()),
            StructField("n", LongType()),
        ]
    )
    schema = compat.to_arrow_schema(struct)
    assert schema.field("at").type == pa.timestamp("us", tz="UTC")
    assert schema.field("local").type == pa.timestamp("us")
    back = compat.from_arrow_schema(schema)
    assert [type(f.dataType) for f in back.fields] == [TimestampType, TimestampNTZType, LongType]


def test_map_partition_carries_timestamps(spark):
    # Spark 4 refused this schema ("a type Arrow cannot carry") before the time zone
    from spark_ops import full_window_partition

    when = dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.timezone.utc)
    df = spark.createDataFrame([(1, when), (2, when)], "n long, at timestamp").repartition(1)

    def shift(rows):
        for r in rows:
            yield (r["n"], r["at"] + dt.timedelta(hours=1))

    out = full_window_partition(df).map_partition(shift, "n long, at timestamp").collect()
    got = sorted((r["n"], r["at"].astimezone(dt.timezone.utc)) for r in out)
    assert got == [(1, when + dt.timedelta(hours=1)), (2, when + dt.timedelta(hours=1))]


def test_observed_metrics_read_as_dicts_from_both_progress_shapes():
    from pyspark.sql import Row

    as_dict = {"observedMetrics": {"m": {"rows_in": 3, "partials_shuffled": 2}}}
    as_row = {"observedMetrics": {"m": Row(rows_in=3, partials_shuffled=2)}}
    for progress in (as_dict, as_row):
        assert compat.observed_metrics(progress, "m") == {"rows_in": 3, "partials_shuffled": 2}
        assert compat.observed_metrics(progress, "other") is None
    assert compat.observed_metrics(None, "m") is None
    assert compat.observed_metrics({"observedMetrics": {}}, "m") is None


def test_collect_arrow_keeps_types_and_empty_results(spark):
    df = spark.createDataFrame([(1, "a"), (2, "b")], "n long, s string")
    table = compat.collect_arrow(df)
    assert table.column("n").to_pylist() == [1, 2] and table.column("s").to_pylist() == ["a", "b"]
    empty = compat.collect_arrow(df.filter("n > 5"))
    assert empty.num_rows == 0 and empty.schema.names == ["n", "s"]


def test_a_classic_session_is_not_connect(spark):
    assert not compat.is_connect(spark)
    assert compat.is_session(spark)
    assert not compat.is_session(object())


def test_a_streaming_parquet_source_is_recognised_from_its_plan(spark, tmp_path):
    # the online path reads such a source's files itself; Spark 4's unanalyzed plan holds
    # an unresolved relation, so the plan is read after analysis on every line
    path = str(tmp_path / "in")
    spark.range(3).write.parquet(path)
    stream = spark.readStream.schema("id long").parquet(path)
    found = compat.streaming_file_source(stream)
    assert found is not None
    name, options = found
    assert name.lower().endswith("parquet") and options["path"] == path
    assert compat.streaming_file_source(stream.select((stream.id + 1).alias("id"))) is None
    assert compat.streaming_file_source(spark.range(3)) is None
