"""``Session.local`` starts Spark's JVM and Ray side by side: the session is usable as
before (its SparkSession the active one of the caller's thread), and when one side fails
while the other starts, the error names the side and the cause and nothing of either is
left running (each case in a process of its own: ``session_start_job.py``)."""

from __future__ import annotations

from fresh_process import run_job


def _failed_start(side: str) -> dict:
    return run_job("session_start_job", side, timeout=400)


def test_spark_failing_to_start_is_named_and_ray_started_beside_it_is_stopped():
    got = _failed_start("spark")
    kind, message = got["error"]
    assert kind == "SessionError"
    assert "Spark local[1] did not start" in message
    assert "event-log" in message  # the cause, Spark's own words
    assert "at org.apache" not in message  # not the JVM's stack trace
    assert "Ray, started beside it, was stopped" in message
    assert got["ray_initialized"] is False and got["spark_active"] is False
    assert got["children"] == {}, got["children"]  # no JVM, GCS, raylet or worker left


def test_ray_failing_to_start_is_named_and_spark_started_beside_it_is_stopped():
    got = _failed_start("ray")
    kind, message = got["error"]
    assert kind == "SessionError"
    assert "Ray did not start" in message
    assert "object store memory" in message  # the cause, Ray's own words
    assert "Spark, started beside it, was stopped" in message
    assert got["ray_initialized"] is False and got["spark_active"] is False
    # Ray had started its GCS before refusing the setting: those processes go too
    assert got["children"] == {}, got["children"]


def test_the_session_spark_is_the_active_one_of_the_thread_that_made_it(session):
    """Spark starts in a thread of its own; the JVM keeps the active session per thread,
    and the session hands it to the caller's thread."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    assert active is not None
    assert active.sparkContext.applicationId == session.spark.sparkContext.applicationId
    assert active.range(3).count() == 3
