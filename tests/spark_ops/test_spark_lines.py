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

import pyarrow as pa
import pytest
from paths import ROOT, TESTS

import hybrid_iter as hi
from spark_ops import _spark_compat as compat

SPARK4 = compat.spark_version() >= (4, 0, 0)

pytestmark = pytest.mark.spark_lines


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


@pytest.mark.integration
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
@pytest.mark.integration
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


# -- each kind of spark_ops work over the types that differ between lines ---------------

#: decimal, timestamp, date, map, binary, array and struct columns: what PySpark converts
#: differently from line to line (time zones, bytes or bytearray, Rows)
RICH = (
    "k long, amount decimal(12,2), at timestamp, day date, tags map<string,bigint>, "
    "blob binary, xs array<double>, point struct<x: double, y: double>"
)


@pytest.fixture(scope="module")
def rich(spark):
    import decimal

    utc = dt.timezone.utc
    rows = [
        (
            i % 3,
            decimal.Decimal(f"{i}.25"),
            dt.datetime(2024, 1, 1 + i, 12, 30, tzinfo=utc),
            dt.date(2024, 2, 1 + i),
            {"a": i, "b": -i},
            bytes([i, 255 - i, 0]),
            [float(i), 0.5],
            (float(i), -float(i)),
        )
        for i in range(9)
    ]
    return spark.createDataFrame(rows, RICH).repartition(2)


def _plain(value):
    """A collected value in a form comparable across lines (Rows, bytearray, tz-aware)."""
    from pyspark.sql import Row

    if isinstance(value, Row):
        return tuple(_plain(v) for v in value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.timezone.utc) if value.tzinfo else value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _rows(df):
    return sorted((tuple(_plain(v) for v in r) for r in df.collect()), key=repr)


def test_map_partition_hands_every_type_over_as_spark_collects_it(spark, rich):
    from spark_ops import full_window_partition

    seen_types = []

    def identity(rows):
        for r in rows:
            yield tuple(r)

    def blob_type(rows):
        for r in rows:
            yield (r["k"], type(r["blob"]).__name__)

    out = full_window_partition(rich).map_partition(identity, RICH)
    assert _rows(out) == _rows(rich)
    # a binary value reaches the function as this line's collect() gives it
    seen_types = {
        r[1]
        for r in full_window_partition(rich).map_partition(blob_type, "k long, t string").collect()
    }
    assert seen_types == {compat.python_binary_type().__name__}
    assert seen_types == {type(rich.first()["blob"]).__name__}


def test_local_aggregation_over_decimals_dates_and_timestamps_equals_spark(spark, rich):
    from pyspark.sql import functions as F

    from spark_ops import local_key_by

    view = local_key_by(rich.withColumn("x", F.col("amount").cast("double")), "k")
    ours = [
        view.count(alias="n"),
        view.max("at", alias="latest"),
        view.min("day", alias="first_day"),
        view.max("amount", alias="top"),
        view.sum("x", alias="total"),
    ]
    got = {}
    for agg in ours:
        for r in agg.df.collect():
            got.setdefault(r["k"], []).append(_plain(r[1]))
    want = {
        r["k"]: [_plain(v) for v in list(r)[1:]]
        for r in rich.groupBy("k")
        .agg(
            F.count("*"),
            F.max("at"),
            F.min("day"),
            F.max("amount"),
            F.sum(F.col("amount").cast("double")),
        )
        .collect()
    }
    assert got == want and len(got) == 3


def test_side_inputs_carry_every_type_to_the_main_records(spark, rich):
    from spark_ops import MapSideInput, with_side_inputs

    side = MapSideInput(rich.filter("k = 0"), key="amount", value=["blob", "tags", "at"])
    main = rich.select("k", "amount")

    def look(row, ctx):
        hit = ctx.side_input(side).get(row.amount)
        return (
            row.k,
            row.amount,
            None if hit is None else hit.blob,
            None if hit is None else hit.at,
        )

    out = with_side_inputs(main, side).map(
        look, "k long, amount decimal(12,2), blob binary, at timestamp"
    )
    want = {
        (
            r["k"],
            r["amount"],
            _plain(r["blob"]) if r["k"] == 0 else None,
            _plain(r["at"]) if r["k"] == 0 else None,
        )
        for r in rich.collect()
    }
    assert {tuple(_plain(v) for v in r) for r in out.collect()} == want


def test_a_numeric_column_check_names_the_real_cause_on_this_line(spark):
    df = spark.sql("SELECT CAST(1 AS DOUBLE) AS y, 'a' AS s")
    hi.DataStream(df, numeric_columns=["y"]).validate(0)  # a double is numeric everywhere
    with pytest.raises(hi.IterationConfigError, match="'s' has type string, which is not numeric"):
        hi.DataStream(df, numeric_columns=["s"]).validate(0)
    intervals = spark.sql("SELECT make_interval(0, 1) AS i")
    try:
        _ = intervals.schema
    except Exception:  # PySpark 3.5 has no Python form of a calendar interval at all
        return
    with pytest.raises(hi.IterationConfigError) as err:
        hi.DataStream(intervals, numeric_columns=["i"]).validate(0)
    assert "cannot hand to Python through Arrow" in str(err.value)
    assert isinstance(err.value.__cause__, TypeError)  # PySpark's own refusal, kept


def test_a_schema_string_spark_refuses_is_told_from_a_session_that_cannot_parse(spark):
    """Each way this line refuses a schema string is one of ``ddl_refusals`` (a config
    error naming the string, PySpark's refusal its cause); a failure that is not a
    refusal is not."""
    from pyspark.errors import PySparkRuntimeError
    from pyspark.sql.types import _parse_datatype_string

    from spark_ops import SparkOpsConfigError, full_window_partition

    refused = compat.ddl_refusals()
    df = spark.createDataFrame([(1,)], "k long")
    for text in ("id long, !", "blabla", "a decimal(50, 2)", "a array<>"):
        with pytest.raises(refused):
            _parse_datatype_string(text)
        with pytest.raises(SparkOpsConfigError, match="not a valid DDL") as err:
            full_window_partition(df).map_partition(lambda rows: rows, text)
        assert isinstance(err.value.__cause__, refused)
    assert not issubclass(PySparkRuntimeError, refused)  # no session to parse with


# -- the JVM's internals as this line lays them out ----------------------------------------


def test_the_driver_jvm_its_classes_and_executors_are_read_on_this_line(session, spark):
    pid = compat.jvm_pid(spark)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"java" in f.read().split(b"\0")[0]
    assert compat.jvm_has_class("org.apache.spark.SparkContext") is True
    assert compat.jvm_has_class("org.apache.spark.NoSuchClassHere") is False
    assert compat.executor_statuses(spark) == []  # local mode: the driver alone, left out
    described = session.describe()  # the driver's host and no executor besides it
    assert described["executors"] == 0 and len(described["spark_hosts"]) == 1
    assert described["task_slots"] == compat.available_task_slots(spark)


def test_hadoop_filesystems_are_looked_up_without_a_call(spark):
    assert compat.hadoop_filesystem_class(spark, "file").endswith("LocalFileSystem")
    assert compat.hadoop_filesystem_class(spark, "nosuchscheme") is None
    version = compat.hadoop_version(spark)
    assert version.count(".") >= 2 and version.split(".")[0].isdigit(), version


def test_a_failing_user_function_is_translated_on_this_line(spark):
    from spark_ops import UserFunctionError, full_window_partition
    from spark_ops._errors import install_error_translation

    install_error_translation()  # done on import; once more changes nothing

    def fail(rows):
        for _ in rows:
            raise KeyError("the user's own")
        yield from ()

    with pytest.raises(UserFunctionError) as err:
        full_window_partition(spark.range(3, numPartitions=1)).map_partition(
            fail, "id long"
        ).collect()
    assert err.value.raised(KeyError) and "the user's own" in str(err.value)


# -- every function of the compatibility module runs somewhere ---------------------------

#: functions that run only where some condition holds, and what it is; every other one
#: must run in every environment that runs the compatibility set (pytest -m spark_lines)
ONLY_WHERE = {
    # a Spark Connect client: test_connect.py's server, on the lines Connect clients run on
    "connect_endpoint": "connect",
    "connect_task_slots": "connect",
    # a start that failed: the class archive's tests (test_class_archive.py)
    "shut_down_jvm": "whole suite",
}


def _conditions() -> set[str]:
    held = set()
    if compat.dataframe_barrier_paths(None):  # Connect clients run from here on
        held.add("connect")
    if COMPAT_RUN.get("whole_suite"):
        held.add("whole suite")
    return held


#: filled by conftest.py's collection hook: whether every test of the compatibility set
#: (and whether the whole suite) is selected in this run
COMPAT_RUN: dict[str, bool] = {}


def test_every_function_of_the_compatibility_module_runs_in_this_environment():
    # conftest.py runs this test last; it checks only when the whole set ran
    if not COMPAT_RUN.get("complete"):
        pytest.skip("checks only a run of the whole compatibility set (pytest -m spark_lines)")
    import compat_trace

    assert set(ONLY_WHERE) <= compat_trace.defined(), "ONLY_WHERE names a function gone"
    held = _conditions()
    due = {f for f in compat_trace.defined() if ONLY_WHERE.get(f, None) in (None, *held)}
    ran = compat_trace.seen(os.environ.get(compat_trace.TRACE_ENV))
    missing = sorted(due - ran)
    assert not missing, (
        f"PySpark {compat.spark_version_string()}: these functions of "
        f"spark_ops/_spark_compat.py ran in no test of this environment: {missing}; give "
        f"each a test in the compatibility set (pytest -m spark_lines)"
    )
