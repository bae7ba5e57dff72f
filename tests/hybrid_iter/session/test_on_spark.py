"""``Session.on_spark``: hybrid_iter on a Spark cluster it did not start, with Ray started
on it by Ray on Spark, on loopback.

The scenarios on a real cluster run in one subprocess (``on_spark_job.main``: a process
has one SparkContext, and this suite's is a ``local[4]``), on a ``local-cluster[2, 2,
1024]`` master and ONE Ray on Spark cluster, and report as one JSON line; the tests
below read that report. The refusals that need no cluster run here, on the suite's
``local[4]`` session or on the pure checks.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from on_spark_job import CHECKPOINT_EVERY, CORES, EPOCHS, EXECUTORS, KILL_AT
from paths import ROOT, TESTS

import hybrid_iter as hi
from hybrid_iter._session.on_spark_plan import (
    Executor,
    check_master,
    executors_without_raylet,
    expected_executors,
    plan_slots,
)
from spark_ops import _spark_compat

TIMEOUT = 900  # seconds, a safety net: the job takes ~100 s on 2 quiet cores
pytestmark = [pytest.mark.timeout(TIMEOUT + 120), pytest.mark.integration]


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "*":
        return False
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _job_env(home: Path) -> dict[str, str]:
    """The environment of a user who set nothing for Ray: no `ray` on PATH, no token
    (a HOME without ~/.ray/auth_token), only Spark's own settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "PYSPARK_", "SPARK_", "HYBRID_ITER_"))
    }
    env["PATH"] = os.pathsep.join(
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not os.access(os.path.join(d, "ray"), os.X_OK)
    )
    env.update(
        {
            "HOME": str(home),
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]),
            "PYSPARK_PYTHON": sys.executable,  # the executors' Python, as a cluster sets it
            "SPARK_LOCAL_IP": "127.0.0.1",  # the local-cluster's workers and executors
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray on Spark's own knobs, as its tests set them: shorter fixed waits, and
            # the worker machine's size instead of this whole (shared) machine's
            "RAY_ON_SPARK_BACKGROUND_JOB_STARTUP_WAIT": "1",
            "RAY_ON_SPARK_RAY_WORKER_NODE_STARTUP_INTERVAL": "2",
            "RAY_ON_SPARK_WORKER_CPU_CORES": str(CORES),
            "RAY_ON_SPARK_WORKER_PHYSICAL_MEMORY_BYTES": str(4 << 30),
            "RAY_ON_SPARK_WORKER_SHARED_MEMORY_BYTES": str(2 << 30),
        }
    )
    return env


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("on_spark")
    home = work / "home"
    home.mkdir()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, on_spark_job; sys.exit(on_spark_job.main(sys.argv[1:]))",
            "--work-dir",
            str(work),
        ],
        cwd=str(TESTS),
        env=_job_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # on a timeout, its JVMs and Ray go with it
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"on_spark_job did not finish in {TIMEOUT}s\nstderr:\n{stderr[-8000:]}")
    seconds = time.perf_counter() - started
    detail = (
        f"exit {proc.returncode} after {seconds:.1f}s\nstdout:\n{stdout[-3000:]}\n"
        f"stderr:\n{stderr[-8000:]}"
    )
    assert proc.returncode == 0, detail
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, detail
    report = json.loads(lines[0][len("RESULT ") :])
    report["subprocess_seconds"] = seconds
    print(
        f"on_spark job: {seconds:.1f}s in all; Spark {report['spark_seconds']}s, "
        f"Session.on_spark {report['start_seconds']}s, iteration "
        f"{report['iteration']['seconds']}s, ml {report['ml']['seconds']}s, ps "
        f"{report['ps']['seconds']}s, kill {report['kill']['seconds']}s"
    )
    return report


# -- refused before anything runs (no cluster needed) ------------------------------------


def test_a_plain_local_master_is_refused_pointing_to_session_local(spark):
    jobs = len(spark.sparkContext.statusTracker().getJobIdsForGroup())
    with pytest.raises(hi.SessionError, match=r"local\[4\].*Session\.local\(parallelism=N\)"):
        hi.Session.on_spark(spark)
    assert len(spark.sparkContext.statusTracker().getJobIdsForGroup()) == jobs
    assert hi.Session.current() is None or hi.Session.current().kind != "on_spark"


@pytest.mark.parametrize(
    "master, says",
    [
        ("k8s://https://10.0.0.1:6443", r"Kubernetes.*KubeRay.*Session\.attach"),
        ("mesos://10.0.0.1:5050", r"not one Ray on Spark supports.*yarn"),
        ("local", r"Session\.local"),
        ("local[*]", r"Session\.local"),
    ],
)
def test_a_cluster_manager_ray_on_spark_cannot_use_is_refused_naming_it(master, says):
    with pytest.raises(hi.SessionError, match=says) as info:
        check_master(master)
    assert repr(master) in str(info.value)


@pytest.mark.parametrize("master", ["spark://10.0.0.1:7077", "yarn", "local-cluster[2, 2, 1024]"])
def test_the_masters_ray_on_spark_supports_pass(master):
    check_master(master)


def test_a_spark_connect_session_is_refused_before_anything_runs():
    pytest.importorskip("grpc_status", reason="the Spark Connect client's dependencies")
    if _spark_compat.spark_version() < (4, 0, 0):
        pytest.skip(
            "PySpark 3.5's Connect client calls its server inside builder.create() (and "
            "retries for minutes with none there); the refusal runs on the Spark 4 line"
        )
    # A Connect client to a server that is not there, in a process of its own: at exit
    # the client retries its clean-up RPCs for minutes (os._exit skips that).
    code = (
        "import os, sys\n"
        "from pyspark.sql.connect.session import SparkSession\n"
        "import hybrid_iter as hi\n"
        "remote = SparkSession.builder.remote('sc://127.0.0.1:1').create()\n"
        "try:\n"
        "    hi.Session.on_spark(remote)\n"
        "except hi.SessionError as ex:\n"
        "    print('REFUSED', ex, flush=True)\n"
        "os._exit(0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert "REFUSED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "Spark Connect session" in proc.stdout and "Session.attach" in proc.stdout


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"worker_nodes": 0}, r"worker_nodes\) must be an int >= 1"),
        ({"worker_node_cpus": 1.5}, r"worker_node_cpus\) must be an int >= 1"),
        ({"parallelism": True}, r"parallelism\) must be an int >= 1"),
        ({"ray_address": "local"}, r"ray_address='local'"),
        ({"ray_address": "ray://head:10001"}, r"Ray Client address"),
        ({"ray_address": "head:6379", "setup_options": {"memory_worker_node": 1}}, "drop one"),
        ({"executor_wait_seconds": 0}, r"executor_wait_seconds\) must be seconds > 0"),
        ({"setup_options": {"max_worker_nodes": 4}}, r"Session\.on_spark\(worker_nodes=\.\.\.\)"),
        ({"coordinator_resources": {"CPU": 1}}, "not a placement resource"),
    ],
)
def test_bad_arguments_are_refused_naming_them(spark, kwargs, says):
    with pytest.raises(hi.SessionError, match=says):
        hi.Session.on_spark(spark, **kwargs)


def _executors(*cores: int, host: str = "10.0.0.1", busy: int = 0) -> list[Executor]:
    return [Executor(str(i), host, c, busy if i == 0 else 0) for i, c in enumerate(cores)]


def test_slots_left_for_subtasks_count_the_worker_nodes_and_what_runs_now():
    assert plan_slots(_executors(2, 2), 1, 2, 1, None) == 2
    assert plan_slots(_executors(4, 4), 2, 2, 1, 2) == 2  # a 1-core node holds a 2-core slot
    assert plan_slots(_executors(4, 4), 1, 2, 3, None) == 2  # pigeonhole: one per executor
    with pytest.raises(hi.SessionError, match=r"hold 3 .* need 2 more .* 4 slot\(s\), 4 free"):
        plan_slots(_executors(2, 2), 1, 3, 1, 2)
    with pytest.raises(hi.SessionError, match=r"4 slot\(s\), 3 free \(1 running now\)"):
        plan_slots(_executors(2, 2, busy=1), 1, 2, 1, 2)
    with pytest.raises(hi.SessionError, match=r"worker_node_cpus=3.*largest executor has 2"):
        plan_slots(_executors(2, 2), 1, 1, 3, None)


def test_the_executors_to_wait_for_come_from_the_master_or_the_settings():
    assert expected_executors("local-cluster[3, 2, 1024]", {}) == 3
    assert expected_executors("yarn", {"spark.executor.instances": "8"}) == 8
    assert expected_executors("spark://h:7077", {}) == 1


def test_an_executor_without_a_raylet_on_its_host_is_named():
    executors = [
        Executor("0", "10.0.0.1", 4),
        Executor("1", "10.0.0.2", 4),
        Executor("2", "10.0.0.3", 1),  # smaller than spark.task.cpus=2: runs no subtask
    ]
    missing = executors_without_raylet(executors, ["10.0.0.1", "10.0.0.9"], 2)
    assert [e.id for e in missing] == ["1"]
    assert executors_without_raylet(executors, ["10.0.0.1", "10.0.0.2"], 2) == []


class _RecordingTime:
    """A ``time`` module whose sleeps are only recorded (the real clock otherwise)."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_ray_on_sparks_wait_for_its_head_ends_once_a_new_head_is_up():
    import types

    from hybrid_iter._session.ray_on_spark import _HeadStartWait

    checks = iter([False, False, True])
    module = types.SimpleNamespace(
        time=_RecordingTime(),
        _RAY_HEAD_STARTUP_TIMEOUT=3600,  # a full sleep would outlast pytest-timeout
    )
    recorded = module.time
    module.time = _HeadStartWait(module, lambda: next(checks))
    module.time.sleep(module._RAY_HEAD_STARTUP_TIMEOUT)  # up at the third look
    assert recorded.slept == [] and next(checks, "spent") == "spent"
    module.time.sleep(3)  # another sleep is the caller's own
    assert recorded.slept == [3]
    other = threading.Thread(target=module.time.sleep, args=(3600,))
    other.start()  # the same sleep on another thread: the real one
    other.join()
    assert recorded.slept == [3, 3600]


def test_the_head_wait_is_swapped_in_only_around_the_setup_and_matches_ray_on_spark():
    import inspect

    import ray
    from ray._private import services
    from ray.util.spark import cluster_init

    from hybrid_iter._session.ray_on_spark import _head_start_polled, _new_gcs

    with _head_start_polled():
        assert type(cluster_init.time).__name__ == "_HeadStartWait"
        assert cluster_init.time.monotonic is time.monotonic
    assert cluster_init.time is time
    # no Ray started during the call: no new head (this test's own Ray is not new)
    services.find_gcs_addresses.cache_clear()
    assert _new_gcs(frozenset(services.find_gcs_addresses()))() is False
    # read from Ray 2.60's Ray on Spark: a sleep of that name after the head's launch,
    # and Ray's finder of local clusters. A Ray without them keeps its 20 s sleep (the
    # stand-in is not put in); this says so first, naming the Ray it runs on
    source = inspect.getsource(cluster_init._setup_ray_cluster)
    assert "time.sleep(_RAY_HEAD_STARTUP_TIMEOUT)" in source, ray.__version__
    assert hasattr(services.find_gcs_addresses, "cache_clear"), ray.__version__


# -- on a local-cluster master (the subprocess) ------------------------------------------


def test_bad_input_fails_before_ray_starts_naming_the_value_and_the_fix(job):
    untouched = {
        "process": [],
        "workers": [],
        "start_hook": None,
        "ray_address_env": None,
    }
    slots = job["bad"]["too_few_slots"]
    assert slots["kind"] == "SessionError", slots["error"]
    assert "3 Ray worker node(s) hold 3" in slots["error"]
    assert "need 2 more" in slots["error"] and "lower worker_nodes" in slots["error"]
    big = job["bad"]["node_larger_than_executor"]
    assert big["kind"] == "SessionError", big["error"]
    assert f"worker_node_cpus={CORES + 1}" in big["error"]
    assert f"largest executor has {CORES}" in big["error"]
    for case in (slots, big):
        assert case["jobs"] == 0  # not a single Spark job
    no_ray = job["bad"]["no_ray_executable"]
    assert no_ray["kind"] == "SessionError", no_ray["error"]
    assert "no `ray` executable" in no_ray["error"]
    assert no_ray["python"] in no_ray["error"] and "(host " in no_ray["error"]
    assert "hybrid-iter[on_spark]" in no_ray["error"]
    assert no_ray["jobs"] == 1  # the probe, and nothing else
    for case in (slots, big, no_ray):
        assert case["ray_processes"] == [] and case["ray_initialized"] is False
        assert case["handed_out"] == untouched
        assert case["task_slots"] == EXECUTORS * CORES
    assert job["path_has_ray"] is False  # so the session below had to hand `ray` over


def test_ray_starts_on_the_executors_and_leaves_the_subtasks_their_slots(job):
    s = job["session"]
    assert job["master"] == f"local-cluster[{EXECUTORS}, {CORES}, 1024]"
    assert s["kind"] == "on_spark"
    workers = [n for n in s["nodes"] if n["worker_node"]]
    assert len(workers) == EXECUTORS and len(s["nodes"]) == EXECUTORS + 1
    assert all(n["cpus"] == 1.0 for n in workers)
    assert job["slots_before"] == EXECUTORS * CORES
    # each Ray worker node holds one slot; iterations see the rest
    assert s["task_slots"] == EXECUTORS * CORES - EXECUTORS
    assert s["describe"]["task_slots"] == s["task_slots"]
    assert s["describe"]["ray_nodes"] == EXECUTORS + 1


def test_a_barrier_stage_wider_than_the_free_slots_is_refused_before_any_job(job):
    wide = job["too_wide"]
    free = EXECUTORS * CORES - EXECUTORS
    assert wide["error"] and f"needs {free + 1} Spark task slots" in wide["error"], wide
    assert f"only {free} exist" in wide["error"]
    assert wide["jobs"] == 0


def test_the_warm_up_readies_a_spare_the_store_and_the_executors_python_workers(job):
    warmed = job["warmed"]
    assert warmed["errors"] == {}, warmed
    assert warmed["spare"] is not None and warmed["store"] is not None
    assert len(warmed["python_workers"]) == job["session"]["task_slots"]


def test_a_sync_iteration_equals_numpy_with_its_subtasks_in_the_executors(job):
    it = job["iteration"]
    assert it["epochs"] == EPOCHS and it["num_partitions"] == EXECUTORS * CORES - EXECUTORS
    np.testing.assert_allclose(it["w"], job["reference_w"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(it["loss"], job["reference_loss"], rtol=1e-9, atol=0)
    assert all(it["subtasks_below_executors"]), it["where"]  # executor JVMs, not the driver
    alive = {n["id"] for n in job["session"]["nodes"]}
    assert all(w["node"] in alive for w in it["where"])


def test_the_coordinator_and_the_ps_shards_run_on_the_drivers_node(job):
    head = job["session"]["head"]
    assert job["session"]["coordinator_resources"] == {"node:__internal_head__": 0.001}
    assert job["iteration"]["coordinator_node"] == [head]
    shards = job["ps"]["shard_nodes"]
    # the run's 2 shards and the spare shards kept for the next run (``hybrid_iter.ps.``
    # names too): every one on the head
    assert len(shards) >= 2 and set(shards.values()) == {head}, shards


def test_an_ml_fit_reaches_scikit_learns_optimum(job):
    m = job["ml"]
    np.testing.assert_allclose(m["coefficients"], m["sk_coefficients"], rtol=1e-4, atol=1e-5)
    assert m["intercept"] == pytest.approx(m["sk_intercept"], rel=1e-4, abs=1e-5)


def test_ps_train_equals_the_numpy_loop(job):
    np.testing.assert_allclose(job["ps"]["w"], job["ps"]["reference_w"], rtol=1e-9, atol=1e-12)


def test_a_sigkilled_subtask_worker_is_recovered_bit_for_bit(job):
    kill = job["kill"]
    assert "error" not in kill, kill
    assert "pyspark" in kill["cmdline"] and kill["below_executor"], kill
    assert kill["attempts"] == 1
    newest = (KILL_AT - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    assert kill["restored_from"].endswith(f"chk-{newest:010d}.ckpt"), kill
    assert kill["same_bytes"] and kill["same_loss"]


def test_a_second_session_joins_the_running_cluster_and_leaves_it_running(job):
    joined = job["joined"]
    assert joined["kind"] == "on_spark" and joined["started"] is False
    assert joined["ray_address"] == job["session"]["ray_address"]
    assert joined["task_slots"] == joined["task_slots_after"] == EXECUTORS * CORES - EXECUTORS
    assert joined["ray_still_connected"] is True
    assert joined["alive_nodes_after"] == EXECUTORS + 1
    assert joined["token_still_here"] is True


def test_token_authentication_is_on_and_reaches_the_executors(job):
    s = job["session"]
    assert s["auth_mode_here"] == "token" and s["token_length"] == 64
    assert s["handed_out"]["workers"] == ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN"]
    assert all(w["auth_mode"] == "token" for w in job["iteration"]["where"])
    wrong = job["wrong_token"]
    assert wrong["returncode"] == 3, wrong
    assert "refused this driver" in wrong["stdout"], wrong


def test_everything_of_the_session_listens_on_loopback_only(job):
    listening = job["listening"]
    processes = {s["process"] for s in listening}
    assert {"gcs_server", "raylet", "java"} <= processes, processes
    outward = [s for s in listening if not _is_loopback(s["address"])]
    assert not outward, outward


def test_stop_ends_every_ray_process_it_started_and_puts_the_environment_back(job):
    stop = job["stop"]
    assert stop["ray_process_count"] >= 3 * 2  # gcs_server + raylets, start_ray_node, ...
    assert any("raylet" in c for c in stop["ray_processes_while_running"])
    assert stop["left"] == {}, stop["left"]
    assert stop["new_ray_processes"] == []
    assert stop["ray_initialized"] is False and stop["session_current"] is False
    assert stop["handed_out"] == {
        "process": [],
        "workers": [],
        "start_hook": None,
        "ray_address_env": None,
    }
    assert stop["task_slots"] == EXECUTORS * CORES
    assert stop["launcher_left"] is False and stop["active_cluster"] is False
    assert stop["ray_temp_left"] == []  # the cluster's temp dir and its lock file
