"""``Session.local`` starts Spark's JVM and Ray side by side: the session is usable as
before (its SparkSession the active one of the caller's thread), and when one side fails
while the other starts, the error names the side and the cause and nothing of either is
left running (each case in a process of its own: ``session_start_job.py``). A SIGINT
while the start waits for Spark reaches the caller as a KeyboardInterrupt, ends the
start (the JVM's launch too) and leaves the interpreter to exit as on any
KeyboardInterrupt (``interrupted_start_job.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from fresh_process import ROOT, TESTS, run_job

pytestmark = pytest.mark.integration  # each test starts its own Spark or Ray


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


def _in_session(sid: int) -> dict[int, str]:
    """Live (non-zombie) processes of session ``sid``: pid -> command name."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                found[int(entry)] = stat[stat.index("(") + 1 : stat.rindex(")")]
    return found


def test_sigint_while_the_start_waits_for_spark_ends_it_and_exits_as_a_keyboard_interrupt(
    tmp_path,
):
    marks, conf = tmp_path / "marks", tmp_path / "conf"
    marks.mkdir()
    conf.mkdir()
    # spark-submit sources it before the JVM: the launch is under way and never ends
    (conf / "spark-env.sh").write_text(
        f"touch {marks}/jvm\nwhile [ ! -e {marks}/go ]; do sleep 0.05; done\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "SPARK_CONF_DIR": str(conf),
    }
    env.pop("RAY_ADDRESS", None)
    code = f"import sys, interrupted_start_job as j; sys.exit(j.main({str(marks)!r}))"
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as stdout, open(err_path, "w") as stderr:  # no pipe to fill
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-c", code],
            cwd=str(TESTS),
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while not ((marks / "waiting").exists() and (marks / "jvm").exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the start never waited for Spark:\n{err_path.read_text()[-4000:]}")
            time.sleep(0.05)  # polling the child's marks, bounded
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            # -X faulthandler: SIGABRT writes every thread's stack, where the start hangs
            proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            pytest.fail(f"the interrupted start did not end:\n{err_path.read_text()[-8000:]}")
        err = err_path.read_text()
        # the interpreter's own exit on an uncaught KeyboardInterrupt: killed by SIGINT
        assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT), err[-4000:]
        assert "KeyboardInterrupt" in err and "Fatal Python error" not in err, err[-4000:]
        (line,) = [x for x in out_path.read_text().splitlines() if x.startswith("RESULT ")]
        got = json.loads(line[len("RESULT ") :])
        assert got["children"] == {}, got  # no JVM launch, GCS, raylet or worker left
        assert "hybrid_iter-spark-start" not in got["threads"], got  # the start ended
        deadline = time.monotonic() + 30
        while _in_session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling processes' exit (an orphan's), bounded
        assert _in_session(proc.pid) == {}
    finally:
        for pid in _in_session(proc.pid):  # the child's session: ours for sure
            with contextlib.suppress(ProcessLookupError):  # it may end meanwhile
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
