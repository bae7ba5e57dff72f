"""Losing the node that runs the coordinator, on a real multi-node Ray cluster.

Three raylets on 127.0.0.1 (``k8s_ray_cluster.ClusterProcess``): a head with no CPUs and
two 1-CPU workers offering the custom resource ``coord`` the coordinator asks for. The
driver (``coordinator_node_job.main``) runs in a subprocess with ``RAY_ADDRESS`` set and
Spark ``local[2]``; in its faulted run the coordinator SIGKILLs its own node's raylet and
then itself at one alignment. Ray restarts the actor on the other worker node, which
restores the newest checkpoint from the shared directory and must end bit for bit like
the fault-free run. The cluster is stopped by PID at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import requires_raydp
from coordinator_node_job import EPOCHS, KILL_AT, RESULT_PREFIX
from k8s_ray_cluster import ClusterProcess, cluster_env
from paths import TESTS

MiB = 1 << 20
JOB_TIMEOUT = 600  # a safety net; about 1-2 min on 2 cores

pytestmark = [pytest.mark.timeout(900), requires_raydp]


@pytest.fixture(scope="module")
def run(spark) -> dict[str, Any]:  # the shared session first: it outlives this module
    env = cluster_env(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    head = {"ray_start_params": {"num-cpus": "0", "object-store-memory": str(100 * MiB)}}
    worker = {
        "ray_start_params": {
            "num-cpus": "1",
            "resources": "'{\"coord\": 1}'",
            "object-store-memory": str(100 * MiB),
        }
    }
    cluster = ClusterProcess(
        [head, worker, worker],
        env,
        # A killed raylet is declared dead after ~3 s instead of ~30 s.
        system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 6},
    )
    try:
        cluster.start()
        home = cluster.tmp / "home"  # no ~/.ray/auth_token of the machine's
        home.mkdir()
        work = cluster.tmp / "work"
        work.mkdir()
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, coordinator_node_job as m; sys.exit(m.main(sys.argv[1:]))",
                str(work),
            ],
            env={**cluster.env, "RAY_ADDRESS": cluster.address, "HOME": str(home)},
            cwd=TESTS,
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT,
        )
    finally:
        cluster.stop()
    detail = (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-8000:]}"
    )
    assert proc.returncode == 0, detail
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, detail
    report = json.loads(lines[0][len(RESULT_PREFIX) :])
    report["detail"] = detail
    return report


def test_a_node_local_checkpoint_path_is_refused_on_a_multi_node_cluster(run):
    local = run["local_path"]
    assert local["error"] is not None, "a node-local checkpoint path was accepted"
    assert "node-local" in local["error"] and "shared_filesystem=True" in local["error"]
    assert local["jobs"] == 0 and not local["written"]


def test_the_coordinator_restarts_on_another_node_and_ends_like_the_fault_free_run(run):
    alignments = run["alignments"]  # [epoch, node, restarted]
    killed = run["killed_node"]
    assert killed is not None, "the hook never fired: " + run["detail"]
    first = [a for a in alignments if a[2] == "0"]
    second = [a for a in alignments if a[2] == "1"]
    assert {a[1] for a in first} == {killed}
    assert second, "no alignment after the restart"
    assert {a[1] for a in second} != {killed} and len({a[1] for a in second}) == 1
    assert not run["nodes"][killed]["alive"]
    # the restarted coordinator resumed from the newest checkpoint (before KILL_AT), not
    # from epoch 0: its first alignment is after that checkpoint
    assert 0 < int(second[0][0]) <= KILL_AT
    assert run["faulted"]["epochs"] == run["clean"]["epochs"] == EPOCHS
    assert run["faulted"]["w_hex"] == run["clean"]["w_hex"]
    assert run["faulted"]["w0"] == run["clean"]["w0"]
