"""A Spark Python worker killed mid-fit, from outside, on real Spark + Ray.

The subtask stops in ``hybrid_iter.testing.pause_worker`` (a ``PauseWorker`` hook of the
estimators, or a call in ``ps.train``'s grad_fn) after writing its pid to a file; the
test checks that the pid is a worker forked by a Python worker daemon under this
session's JVM (the session's own, ``hybrid_iter._runtime.worker_daemon``, or PySpark's)
and sends it SIGKILL, as an out-of-memory killer would. A fit relaunches once and gives
the model of a fault-free fit bit for bit; a worker killed on every launch fails the fit
with ``WorkerDiedError`` naming the partition, without Spark's JVM trace in its message.
Which Spark messages count as a worker death is one pure function, tested on a table.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import hybrid_iter as hi
from hybrid_iter import ml, ps
from hybrid_iter._session.local import WORKER_DAEMON
from hybrid_iter.testing import FaultInjection, PauseWorker, pause_worker
from spark_ops import WorkerDeath, python_worker_death

D = 3

# -- which Spark messages report a dead worker ----------------------------------------------

_PY_FRAMES = (
    "\tat org.apache.spark.api.python.BasePythonRunner$WriterThread.$anonfun$run$1"
    "(PythonRunner.scala:440)\n"
    "\tat org.apache.spark.api.python.BasePythonRunner$WriterThread.run(PythonRunner.scala:282)\n"
)
_DRIVER = (
    "\nDriver stacktrace:\n\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages"
    "(DAGScheduler.scala:2898)\n"
)
_BARRIER = (
    "An error occurred while calling o109.collectToPython.\n: org.apache.spark.SparkException: "
    "Job aborted due to stage failure: Could not recover from a failed barrier ResultStage. "
    "Most recent failure reason: Stage failed because barrier task ResultTask(9, {p}) "
    "finished unsuccessfully.\n{reason}\n"
)
_LOST = (
    "org.apache.spark.SparkException: Job aborted due to stage failure: Task {p} in stage 5.0 "
    "failed 1 times, most recent failure: Lost task {p}.0 in stage 5.0 (TID 20) (127.0.0.1 "
    "executor driver): {reason}\n"
)
_CRASHED = "org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)"
_CRASHED_4 = (
    _CRASHED + ". Consider setting 'spark.sql.execution.pyspark.udf.faulthandler.enabled' or"
    "'spark.python.worker.faulthandler.enabled' configuration to 'true' for the better "
    "Python traceback."
)
_USER_RAISED = (
    "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
    '  File "job.py", line 3, in f\nConnectionResetError: [Errno 104] Connection reset by '
    "peer; Python worker exited unexpectedly (crashed)\n"
)

DEATH_TABLE = [
    # Spark 3.5, barrier stage, the worker gone while its output was read
    (
        _BARRIER.format(p=1, reason=_CRASHED)
        + "\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator$$anonfun$1"
        ".applyOrElse(PythonRunner.scala:612)\nCaused by: java.io.EOFException\n" + _DRIVER,
        WorkerDeath(1, "Python worker exited unexpectedly (crashed)"),
    ),
    # the worker gone while the JVM's writer thread fed it (what the issue saw)
    (
        _BARRIER.format(p=0, reason="java.net.SocketException: Connection reset")
        + "\tat java.base/sun.nio.ch.NioSocketImpl.implRead(NioSocketImpl.java:328)\n"
        + _PY_FRAMES
        + _DRIVER,
        WorkerDeath(0, "java.net.SocketException: Connection reset"),
    ),
    (
        _BARRIER.format(p=3, reason="java.net.SocketException: Broken pipe (Write failed)")
        + _PY_FRAMES,
        WorkerDeath(3, "java.net.SocketException: Broken pipe (Write failed)"),
    ),
    (
        _BARRIER.format(p=2, reason="java.io.EOFException")
        + "\tat java.base/java.io.DataInputStream.readInt(DataInputStream.java:386)\n"
        "\tat org.apache.spark.sql.execution.python.PythonArrowOutput$$anon$1.read"
        "(PythonArrowOutput.scala:105)\n",
        WorkerDeath(2, "java.io.EOFException"),
    ),
    # Spark 3.5 handed a task a pooled worker its kill monitor had stopped
    (
        _LOST.format(p=0, reason="java.net.SocketException: Socket is closed")
        + "\tat java.base/java.net.Socket.getInputStream(Socket.java:927)\n"
        "\tat org.apache.spark.api.python.BasePythonRunner.compute(PythonRunner.scala:209)\n"
        + _DRIVER,
        WorkerDeath(0, "java.net.SocketException: Socket is closed"),
    ),
    # a non-barrier stage (or Spark's message with task retries)
    (
        _LOST.format(p=2, reason=_CRASHED) + "Caused by: java.io.EOFException\n",
        WorkerDeath(2, "Python worker exited unexpectedly (crashed)"),
    ),
    # Spark 4.x: the same sentence with advice, or the fault handler's report
    (
        _BARRIER.format(p=1, reason=_CRASHED_4) + _DRIVER,
        WorkerDeath(1, "Python worker exited unexpectedly (crashed)"),
    ),
    (
        _LOST.format(
            p=0,
            reason=_CRASHED + ": Fatal Python error: Segmentation fault",
        )
        + '\nCurrent thread 0x00007f (most recent call first):\n  File "f.py", line 1\n',
        WorkerDeath(
            0,
            "Python worker exited unexpectedly (crashed): Fatal Python error: Segmentation fault",
            signal="SIGSEGV",
        ),
    ),
    # no task named (a streaming batch): Spark's own sentence still counts
    (
        _CRASHED + "\n\tat org.apache.spark.api.python.X\n",
        WorkerDeath(None, "Python worker exited unexpectedly (crashed)"),
    ),
    # not a death: user code raised, whatever its message says
    (_BARRIER.format(p=1, reason=_USER_RAISED) + _DRIVER, None),
    (_LOST.format(p=1, reason=_USER_RAISED), None),
    (_USER_RAISED, None),
    # not a death: a socket error outside any Python worker (a JDBC source)
    (
        _BARRIER.format(p=0, reason="java.net.SocketException: Connection reset")
        + "\tat org.postgresql.core.PGStream.receiveChar(PGStream.java:455)\n"
        + _DRIVER
        + _PY_FRAMES,
        None,
    ),
    # not a death of a Python worker: a lost executor, a cancelled job, a worker that
    # never started
    (
        _LOST.format(
            p=1,
            reason="ExecutorLostFailure (executor 2 exited caused by one of the running "
            "tasks) Reason: Container killed on request. Exit code is 137",
        ),
        None,
    ),
    ("org.apache.spark.SparkException: Job 7 cancelled part of cancelled job group x", None),
    (
        _LOST.format(
            p=0, reason="org.apache.spark.SparkException: Python worker failed to connect back."
        )
        + _PY_FRAMES,
        None,
    ),
]


@pytest.mark.parametrize("text, expected", DEATH_TABLE)
def test_a_dead_python_worker_is_recognised_in_what_spark_reports(text, expected):
    assert python_worker_death(text) == expected


@pytest.mark.parametrize(
    ("fatal", "says"),
    [
        ("Bus error", "SIGBUS: it read memory mapped from a file that was cut short"),
        ("Segmentation fault", "SIGSEGV: it crashed in native code"),
        ("Aborted", "SIGABRT: it crashed in native code"),
    ],
)
def test_a_worker_dead_of_a_fault_signal_is_not_advised_more_memory(fatal, says):
    from hybrid_iter._runtime.iterate import _worker_died

    text = _BARRIER.format(p=1, reason=f"{_CRASHED}: Fatal Python error: {fatal}") + _DRIVER
    err = _worker_died(RuntimeError(text))
    assert err is not None and err.partition == 1
    assert says in err.message and "more memory does not help" in err.message
    assert "spark.executor.memory" not in err.message


def test_a_worker_killed_or_dead_of_an_unknown_cause_is_advised_memory_and_how_to_know():
    from hybrid_iter._runtime.iterate import _worker_died

    unknown = _worker_died(RuntimeError(_BARRIER.format(p=0, reason=_CRASHED_4) + _DRIVER))
    assert unknown is not None and unknown.signal is None
    assert "spark.executor.memory" in unknown.message
    assert "spark.python.worker.faulthandler.enabled=true" in unknown.message
    killed = _worker_died(
        RuntimeError(_BARRIER.format(p=0, reason=f"{_CRASHED}: killed by SIGKILL") + _DRIVER)
    )
    assert killed is not None and killed.signal == "SIGKILL"
    assert "out-of-memory killer" in killed.message and "spark.executor.memory" in killed.message


# -- from outside: the handshake and the kill -------------------------------------------------


def _ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent, ... (Linux /proc)."""
    out = []
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        out.append(pid)
    return out


def _is_our_python_worker(pid: int) -> bool:
    """A Python worker forked under this test session's JVM: by the daemon a
    ``Session.local`` names, or by PySpark's own."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    forked_by_a_daemon = WORKER_DAEMON.encode() in argv or b"pyspark.daemon" in argv
    return forked_by_a_daemon and os.getpid() in _ancestors(pid)


class Killer:
    """A thread that waits for ``kills`` paused workers in ``directory`` (their pid
    files, one per launch) and SIGKILLs each from outside (or sends ``sig``)."""

    def __init__(self, directory: Path, kills: int, sig: int = signal.SIGKILL) -> None:
        self.directory, self.kills, self.sig = directory, kills, sig
        self.killed: list[int] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for n in range(self.kills):
                path = self.directory / f"pid-{n}"
                deadline = time.monotonic() + 300
                while not path.exists():  # the task writes it: a handshake, bounded
                    if time.monotonic() > deadline:
                        raise AssertionError(f"no worker paused as {path}")
                    time.sleep(0.02)
                pid = int(path.read_text())
                assert _is_our_python_worker(pid), pid
                os.kill(pid, self.sig)
                self.killed.append(pid)
        except BaseException as ex:
            self.errors.append(ex)
            for n in range(self.kills):  # never leave a task waiting
                (self.directory / f"release-{n}").touch()

    def __enter__(self) -> Killer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(timeout=330)
        assert not self.errors, self.errors

    def launches(self) -> int:
        return len(list(self.directory.glob("pid-*")))


@pytest.fixture(scope="module")
def data(spark):
    """Two partitions of a 3-feature classification and regression problem."""
    rng = np.random.default_rng(3)
    n = 600
    X = rng.standard_normal((n, D))
    label = (X @ np.array([1.0, -1.5, 0.5]) + 0.3 * rng.standard_normal(n) > 0).astype(float)
    y = X @ np.array([2.0, -1.0, 0.5]) + 0.7 + 0.05 * rng.standard_normal(n)
    rows = [
        (*map(float, X[i]), float(label[i]), float(y[i]), [*map(float, X[i])]) for i in range(n)
    ]
    df = spark.createDataFrame(
        spark.sparkContext.parallelize(rows, 2),
        "a double, b double, c double, label double, y double, x array<double>",
    )
    return df


FEATURES = ["a", "b", "c"]


def _relaunched(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "relaunching the fit once" in str(w.message)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "make, arrays",
    [
        (lambda: ml.LogisticRegression(features_col=FEATURES, max_iter=15), "coefficients"),
        (lambda: ml.KMeans(features_col=FEATURES, k=3, seed=4, max_iter=8), "centres"),
    ],
    ids=["logistic-regression", "kmeans"],
)
def test_a_worker_killed_mid_fit_is_relaunched_once_and_gives_the_same_model(
    data, tmp_path, make, arrays
):
    clean = make().fit(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Killer(tmp_path, kills=1) as killer:
            model = make()._fit(
                data, hooks=PauseWorker(directory=str(tmp_path), partition=1, at_epoch=2)
            )
    assert len(killer.killed) == 1 and killer.launches() == 2  # killed once, relaunched once
    (said,) = _relaunched(caught)
    assert "partition 1" in said and "Python worker" in said
    for name, value in clean._arrays.items():
        np.testing.assert_array_equal(model._arrays[name], value, err_msg=name)
    assert model._arrays[arrays].size > 0


@pytest.mark.timeout(900)
def test_a_worker_killed_on_every_launch_fails_naming_the_partition(data, tmp_path):
    est = ml.LinearRegression(features_col=FEATURES, label_col="y", solver="sgd", max_iter=10)
    hooks = PauseWorker(directory=str(tmp_path), partition=1, at_epoch=2, pauses=2)
    with Killer(tmp_path, kills=2) as killer:
        with pytest.raises(hi.WorkerDiedError) as info:
            est._fit(data, hooks=hooks)
    assert len(killer.killed) == 2 and killer.launches() == 2  # one relaunch, no more
    err = info.value
    text = str(err)
    assert err.partition == 1 and "partition 1" in text
    assert "Python worker" in text and "died" in text and "relaunched once" in text
    assert "\tat org.apache" not in text and "Py4J" not in text  # no wall of JVM trace
    assert len(text) < 2000, text
    assert "Python worker exited unexpectedly" in err.spark_message  # Spark's report kept
    causes = []
    cause = err.__cause__
    while cause is not None:
        causes.append(cause)
        cause = cause.__cause__
    assert any("collectToPython" in str(c) or "Job aborted" in str(c) for c in causes)
    assert isinstance(err, hi.IterationFailedError) and isinstance(err, hi.HybridIterError)
    assert list(err.failures) == [1]


@pytest.mark.timeout(900)
def test_a_worker_dead_of_sigbus_names_the_signal_and_no_memory_advice(spark, data, tmp_path):
    """SIGBUS, sent from outside to the paused worker of a plain iteration (no relaunch),
    with Spark told to report a crash's signal (faulthandler): the error names it and
    advises about a mapped file cut short, not memory."""
    from ops import Recorder, RecordingCoordinator

    key = "spark.sql.execution.pyspark.udf.faulthandler.enabled"
    before = spark.conf.get(key, None)
    spark.conf.set(key, "true")
    try:
        with Killer(tmp_path, kills=1, sig=signal.SIGBUS) as killer:
            with pytest.raises(hi.WorkerDiedError) as info:
                hi.iterate_bounded_streams_until_termination(
                    {"version": 0},
                    hi.ReplayableDataStreamList.not_replay(data),
                    hi.IterationConfig(
                        max_epochs=4,
                        parallelism=2,
                        hooks=PauseWorker(directory=str(tmp_path), partition=1, at_epoch=2),
                    ),
                    hi.IterationBody(Recorder(), RecordingCoordinator()),
                )
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)
    assert len(killer.killed) == 1
    err = info.value
    assert err.partition == 1 and err.signal == "SIGBUS", err.spark_message[-2000:]
    assert "cut short" in err.message and "more memory does not help" in err.message
    assert "spark.executor.memory" not in err.message


@pytest.mark.timeout(600)
def test_a_failure_of_code_is_not_relaunched(data):
    est = ml.LinearRegression(features_col=FEATURES, label_col="y", solver="sgd", max_iter=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(hi.IterationFailedError, match="injected fault") as info:
            est._fit(data, hooks=FaultInjection(fail_partition=1, at_epoch=2))
    assert not isinstance(info.value, hi.WorkerDiedError)
    assert not _relaunched(caught)


# -- ps.train: the grad_fn pauses, the test kills ------------------------------------------------


class PausingGrad:
    """A least-squares grad_fn that, on its seventh call in partition 1 of a launch (epoch
    2 of 3 steps each), stops in ``pause_worker`` for the test to kill its worker."""

    def __init__(self, directory: str, pauses: int) -> None:
        self.directory, self.pauses, self.calls = directory, pauses, 0

    def __call__(self, params, batch):
        from pyspark import TaskContext

        self.calls += 1
        if self.calls == 7 and TaskContext.get().partitionId() == 1:
            pause_worker(self.directory, pauses=self.pauses)
        X, y = batch["x"], batch["y"]
        r = X @ params["w"] + params["b"] - y
        return float(r @ r) / (2 * len(y)), {"w": X.T @ r / len(y), "b": r.mean()}


def _train(df, grad_fn):
    init = {"w": np.zeros(D), "b": np.array(0.0)}
    return ps.train(
        df, grad_fn, init, optimizer=ps.SGD(0.1), epochs=6, batch_size=100, columns=["x", "y"]
    )


@pytest.mark.timeout(900)
def test_ps_train_relaunches_once_after_a_killed_worker_and_gives_the_same_parameters(
    data, tmp_path
):
    never = tmp_path / "never"
    never.mkdir()
    clean = _train(data, PausingGrad(str(never), pauses=0))
    killed = tmp_path / "killed"
    killed.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Killer(killed, kills=1) as killer:
            result = _train(data, PausingGrad(str(killed), pauses=1))
    assert len(killer.killed) == 1 and killer.launches() == 2
    assert any("ps.train" in m and "partition 1" in m for m in _relaunched(caught))
    for name in ("w", "b"):
        np.testing.assert_array_equal(result.params[name], clean.params[name], err_msg=name)


@pytest.mark.timeout(900)
def test_ps_train_fails_naming_the_partition_when_its_worker_dies_again(data, tmp_path):
    with Killer(tmp_path, kills=2) as killer:
        with pytest.raises(hi.WorkerDiedError, match=r"ps\.train failed.*partition 1") as info:
            _train(data, PausingGrad(str(tmp_path), pauses=2))
    assert len(killer.killed) == 2
    assert info.value.partition == 1 and "\tat org.apache" not in str(info.value)
