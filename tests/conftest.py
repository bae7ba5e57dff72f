"""Session-scoped Spark and Ray on loopback, shared by every test.

One SparkSession (local[4], UI off) and one Ray instance per test session, started by
``hybrid_iter.Session.local`` and stopped at the end. Test modules are deliberately not
on the workers' PYTHONPATH: operators defined in them reach Spark's Python workers and
the Ray actor the way a user's own files do (pickled by value).
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import tempfile
import threading
import time

import pytest

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# the JVM class archive the suite's session makes and later drivers (fresh processes
# too) map: the suite's own, not the user's cache (spark_ops._class_archive)
os.environ["HYBRID_ITER_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybrid-iter-cache-")
atexit.register(shutil.rmtree, os.environ["HYBRID_ITER_CACHE_DIR"], True)

# Ray's background processes, tuned for a suite that starts ~50 Ray clusters and ~300
# Ray workers on 2 cores (measured with 10 idle actors over a minute, CPU-s of Ray's
# per-node agent / log monitor): every process reports metrics to the agent every 3 s,
# not 10 s, so the tests of the exported metrics wait less (every second cost 3.2 agent
# CPU-s a minute against 1.0 at 10 s); the agent gathers every worker's stats (psutil)
# for the dashboard's node view, which no test reads, once a minute instead of every
# 5 s; the log monitor looks for new worker log files every 0.5 s instead of on each
# 0.1 s pass (2.2 -> 1.2 CPU-s a minute). What a test sees is the same, later at most
# by those intervals (every check of an exported value polls with a deadline).
os.environ.setdefault("RAY_metrics_report_interval_ms", "3000")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")

# Every JVM the suite starts (its session's driver, each fresh job's, the local-cluster
# executors, the Spark Connect servers; all launched by `java`, which reads this
# variable) compiles with C1 only. Measured on tests/hybrid_iter/ml/test_ml.py: the
# driver JVM spent 105 of its 234 CPU-s in C2's compiler threads, optimising code for a
# run of minutes on tiny data; with C1 only it spent 135 CPU-s in all and the module
# took 158 s instead of 203. What the JVM computes is the same; only how hot code is
# compiled differs. A user's own value stays, after ours.
os.environ["JDK_JAVA_OPTIONS"] = " ".join(
    ["-XX:TieredStopAtLevel=1", os.environ.get("JDK_JAVA_OPTIONS", "")]
).strip()

# which functions of spark_ops/_spark_compat.py run (test_spark_lines.py checks that each
# runs in every environment that can reach it); fresh processes append theirs to this file
import compat_trace  # noqa: E402

os.environ[compat_trace.TRACE_ENV] = os.path.join(
    tempfile.mkdtemp(prefix="hybrid-iter-compat-trace-"), "ran.txt"
)
atexit.register(shutil.rmtree, os.path.dirname(os.environ[compat_trace.TRACE_ENV]), True)
compat_trace.install()

#: Task slots of the shared session: enough for 1-4 partition tests on 2 cores.
SLOTS = 4


def _raydp_skip_reason() -> str | None:
    from spark_ops._spark_compat import raydp_problem

    problem = raydp_problem()
    if problem is None or os.environ.get("HYBRID_ITER_REQUIRE_RAYDP") == "1":
        return None  # runs (and fails with the problem where RayDP is required)
    return f"RayDP cannot run in this environment ({problem}); .ci/run runs it"


#: Marks tests of Session.raydp (the ``raydp`` marker: .ci/run's RayDP environment runs
#: ``-m raydp``): skipped where RayDP cannot run (the default install, Spark 4); where
#: .ci/run sets HYBRID_ITER_REQUIRE_RAYDP=1, a broken RayDP install fails instead.
requires_raydp = pytest.mark.raydp


def _children() -> dict[int, str]:
    """Live (non-zombie) direct children of this process: pid -> command name."""
    me = os.getpid()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(ppid) == me and state != "Z":
            found[int(entry)] = name
    return found


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _check_leaks(fds_before: int, keep: set[int], threads_before: set[int]) -> None:
    """Fail the session if stopping Spark and Ray left processes, threads or descriptors.

    The py4j gateway JVM (``keep``) lives as long as the interpreter by design. Children
    are given a bounded time to exit after Ray's shutdown signalled them (a condition
    polled with a deadline, not a sleep standing in for synchronisation).
    """
    deadline = time.monotonic() + 30
    left = {p: n for p, n in _children().items() if p not in keep}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {p: n for p, n in _children().items() if p not in keep}
    threads = [
        t
        for t in threading.enumerate()
        if t.ident not in threads_before and not t.daemon and t is not threading.current_thread()
    ]
    gc.collect()  # a descriptor held by an unreachable object is closed by collection, not leaked
    grown = _fd_count() - fds_before
    problems = []
    if left:
        problems.append(f"child processes still running: {sorted(left.items())}")
    if threads:
        problems.append(f"non-daemon threads still running: {[t.name for t in threads]}")
    # Slack for what lives as long as the interpreter: the gateway JVM's pipes and
    # connections, Ray's driver log files (open after its shutdown), the event
    # descriptors of I/O threads, lazily opened files. A full run ends near 90 (about 50
    # sockets, 30 event descriptors, seen with the listing below); a per-test leak over
    # the suite's ~900 tests is far above the limit.
    if grown > 160:
        kinds: dict[str, int] = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            kind = target if target.startswith("/") else target.split(":")[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        problems.append(
            f"{grown} more open file descriptors than before the session (now: "
            f"{sorted(kinds.items(), key=lambda kv: -kv[1])[:12]})"
        )
    if problems:
        raise AssertionError("resources leaked by the test session: " + "; ".join(problems))


@pytest.fixture(scope="session")
def session():
    import hybrid_iter as hi

    fds_before = _fd_count()
    children_before = set(_children())
    threads_before = {t.ident for t in threading.enumerate()}
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
        # tests count Spark jobs and Ray actors: they start once the session's background
        # warm-up (its own Spark job, a spare coordinator, the array store) has ended
        s.warmed(timeout=600)
        yield s
    finally:
        from spark_ops._spark_compat import jvm_pid

        gateway = jvm_pid(s.spark)
        s.stop()
    _check_leaks(fds_before, children_before | {gateway}, threads_before)


@pytest.fixture(scope="session")
def spark(session):
    return session.spark


@pytest.fixture
def validate_cores(monkeypatch):
    """Every ``CoordinatorCore``, ``OnlineLedger`` and ``ShardCore`` the test makes (also
    inside a coordinator or shard it drives) has its invariants checked (``validate()``)
    when the test ends."""
    from coordinator import CoordinatorCore
    from coordinator._online import OnlineLedger
    from coordinator._shard_core import ShardCore

    made: list[CoordinatorCore | OnlineLedger | ShardCore] = []
    for cls in (CoordinatorCore, OnlineLedger, ShardCore):
        monkeypatch.setattr(cls, "__init__", _recording(cls.__init__, made))
    yield made
    for core in made:
        core.validate()


def _recording(init, made):
    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    return recording_init


# -- markers: the fast lane and the environments ------------------------------------------

#: Fixtures that start or use Spark and Ray: a test that needs one (directly or through
#: another fixture) is an ``integration`` test. The fast lane, ``pytest -m "not
#: integration"``, runs the rest: pure tests, which must start no JVM and no Ray.
PROCESS_FIXTURES = frozenset({"session", "spark"})
#: node ids of the collected ``integration`` tests (``fresh_process.run_job`` refuses
#: to start a job for any other test)
INTEGRATION: set[str] = set()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Marks before ``-m`` selects: ``integration`` from the fixtures a test needs, and the
    skip of a ``raydp`` test where RayDP cannot run."""
    skip_raydp = _raydp_skip_reason()
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("raydp") is not None:
            if item.get_closest_marker("integration") is None:
                item.add_marker(pytest.mark.integration)
            if skip_raydp is not None:
                item.add_marker(pytest.mark.skip(reason=skip_raydp))
        if item.get_closest_marker("integration") is not None:
            INTEGRATION.add(item.nodeid)


def _spark_or_ray_running() -> list[str]:
    """What of Spark and Ray runs in this process (nothing is imported to find out)."""
    running = []
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        running.append("Ray (ray.is_initialized())")
    pyspark = sys.modules.get("pyspark")
    if pyspark is not None and pyspark.SparkContext._active_spark_context is not None:
        running.append("a SparkContext")
    return running


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_process(request):
    """A test not marked ``integration`` leaves no process behind and starts no Spark or
    Ray in this process: the fast lane must run where neither can (and fast)."""
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    before = set(_children())
    running_before = _spark_or_ray_running()
    yield
    started = [f"{n} (pid {p})" for p, n in _children().items() if p not in before]
    running = [r for r in _spark_or_ray_running() if r not in running_before]
    if started or running:
        pytest.fail(
            f"{request.node.nodeid} is not marked integration but left "
            f"{', '.join(started + running)} running: mark it "
            f"(pytest.mark.integration) or use the spark/session fixture"
        )


# -- jobs started early ---------------------------------------------------------------------


def pytest_collection_finish(session):
    """The fresh-process jobs the selected test modules name in ``EARLY_JOBS`` start now,
    beside the tests before theirs (``fresh_process.py``)."""
    if session.config.option.collectonly:
        return
    import fresh_process

    for module in {getattr(i, "module", None) for i in session.items} - {None}:
        for job in getattr(module, "EARLY_JOBS", ()):
            fresh_process.start_early(*job)


def pytest_sessionfinish(session, exitstatus):
    import fresh_process

    fresh_process.stop_early()


# -- the compatibility set (pytest -m spark_lines) ---------------------------------------

_CHECK = "test_every_function_of_the_compatibility_module_runs_in_this_environment"
_deselected_compat: list[str] = []


def pytest_deselected(items):
    _deselected_compat.extend(i.nodeid for i in items if i.get_closest_marker("spark_lines"))


class _CompatCheckGoesLast:
    """A plugin of its own: a conftest holds one implementation per hook, and this one
    must run after ``-m`` and ``-k`` have deselected (trylast)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        _compat_check_goes_last(config, items)


def pytest_configure(config):
    config.pluginmanager.register(_CompatCheckGoesLast(), "hybrid_iter_compat_check_last")


def _compat_check_goes_last(config, items):
    """The check that every compatibility function ran goes last, and learns whether the
    whole compatibility set (and the whole suite) is in this run."""
    checks = [i for i in items if i.name == _CHECK]
    if not checks:
        return
    items[:] = [i for i in items if i.name != _CHECK] + checks
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    files = sorted(tests.rglob("test_*.py"))
    marked_files = {p for p in files if "mark.spark_lines" in p.read_text()}
    collected = {Path(str(i.path)).resolve() for i in items}
    run = sys.modules[checks[0].module.__name__].COMPAT_RUN
    run["complete"] = marked_files <= collected and not _deselected_compat
    run["whole_suite"] = set(files) <= collected and not (
        config.getoption("-k") or config.getoption("-m") not in ("", "not slow")
    )


# -- where the suite's time went -----------------------------------------------------------

_module_seconds: dict[str, float] = {}
_module_tests: dict[str, set[str]] = {}


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration
    _module_tests.setdefault(module, set()).add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The test modules that took most of the run (set-up, call and tear-down of their
    tests, module fixtures included): where a minute of the suite goes, on every run."""
    if not _module_seconds:
        return
    total = sum(_module_seconds.values())
    top = sorted(_module_seconds.items(), key=lambda kv: -kv[1])[:25]
    terminalreporter.write_sep("=", f"slowest modules ({total:.0f} s in tests)")
    for module, seconds in top:
        terminalreporter.write_line(
            f"{seconds:8.1f} s {100 * seconds / total:5.1f} % "
            f"{len(_module_tests[module]):4d} tests  {module}"
        )
