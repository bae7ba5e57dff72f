"""Spark on Ray through RayDP (``Session.raydp``), end to end, on loopback.

A process has one SparkContext (and one JVM, launched with RayDP's jars or not), and the
rest of the suite shares a ``Session.local``; so the iteration runs in a subprocess
(``raydp_job.main``) that prints its results as one JSON line. No session fixture.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import requires_raydp
from paths import ROOT, TESTS

pytestmark = requires_raydp


EXECUTORS, CORES, ROWS, PARTITIONS, EPOCHS = 2, 1, 2000, 2, 15
# seconds, a safety net: the job takes about 25 s on 2 idle cores, minutes on busy ones
TIMEOUT = 420


def _is_loopback(host_port: str) -> bool:
    host = host_port.rsplit(":", 1)[0].strip("[]")
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.fixture(scope="module")
def job() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env.pop("PYSPARK_PYTHON", None)  # Session.raydp must pick this interpreter itself
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    env.pop("SPARK_LOCAL_IP", None)  # ... and loopback, too
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # force_loopback sets it
    env.pop("RAY_ADDRESS", None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    args = [
        f"--executors={EXECUTORS}",
        f"--cores={CORES}",
        f"--rows={ROWS}",
        f"--partitions={PARTITIONS}",
        f"--epochs={EPOCHS}",
    ]
    started = time.perf_counter()
    # Its own process group, so that on a timeout Ray and the JVMs it started go too.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, raydp_job; sys.exit(raydp_job.main(sys.argv[1:]))",
            *args,
        ],
        cwd=str(TESTS),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"raydp_job did not finish in {TIMEOUT}s\nstderr:\n{stderr[-6000:]}")
    seconds = time.perf_counter() - started
    detail = f"exit {proc.returncode} after {seconds:.1f}s\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}"
    assert proc.returncode == 0, detail
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, detail
    report = json.loads(lines[0][len("RESULT ") :])
    report["subprocess_seconds"] = seconds
    print(
        f"raydp job: session start {report['start_seconds']}s, iteration "
        f"{report['iteration_seconds']}s, subprocess {seconds:.1f}s; {report['summary']}"
    )
    return report


def test_runs_on_a_raydp_master(job):
    assert job["session_kind"] == "raydp"
    assert job["master"].startswith("ray://"), job["master"]
    assert job["task_slots"] == EXECUTORS * CORES


def test_sync_linear_regression_matches_numpy(job):
    assert job["num_partitions"] == PARTITIONS
    assert job["terminated_by"] == "max_epochs"
    assert job["epochs"] == EPOCHS
    assert sum(job["rows"]) == ROWS
    np.testing.assert_allclose(job["variables_w"], job["reference_w"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(job["loss"], job["reference_loss"], rtol=1e-9, atol=0)
    # and it actually learned y = x . (1, 2, 3, 4) + noise
    np.testing.assert_allclose(job["variables_w"], [1, 2, 3, 4], atol=0.05)


def test_the_warm_up_readies_a_spare_the_store_and_a_python_worker_per_executor_slot(job):
    warmed = job["warmed"]
    assert warmed["errors"] == {}, warmed
    assert warmed["spare"] is not None and warmed["store"] is not None
    assert len(warmed["python_workers"]) == job["task_slots"]


def test_python_workers_run_this_interpreter(job):
    workers = job["workers"]
    assert sorted(w[0] for w in workers) == list(range(PARTITIONS))
    assert {w[1] for w in workers} == {job["python"]}


def test_everything_is_on_loopback(job):
    assert _is_loopback(job["master"].rsplit("@", 1)[1]), job["master"]
    assert _is_loopback(job["ray_address"]), job["ray_address"]
    assert job["ray_node_ips"] == ["127.0.0.1"]
    assert job["driver_host"] == job["driver_bind_address"] == "127.0.0.1"
    assert job["executor_hosts"] and set(job["executor_hosts"]) == {"127.0.0.1"}
    listening = job["listening"]
    processes = {s["process"] for s in listening}
    # Ray (gcs_server, raylet), the JVMs (Spark driver, RayDP app master, executors)
    assert {"gcs_server", "raylet", "java"} <= processes, processes
    outward = [s for s in listening if not _is_loopback(s["address"])]
    assert not outward, outward


def test_stop_shuts_the_session_down(job):
    assert job["ray_initialized_after_stop"] is False
    assert job["session_current_after_stop"] is False
    assert job["left_after_stop"] == {}
