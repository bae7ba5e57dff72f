"""A Ray cluster on 127.0.0.1 shaped like k8s/'s RayCluster, run by test_k8s.py.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python tests/k8s_ray_cluster.py SPEC.json

SPEC is ``{"temp_dir": DIR, "port": GCS_PORT, "nodes": [NODE, ...]}`` (optionally
``"system_config": {...}``, Ray's ``_system_config`` of the head); the first NODE is
the head. A NODE is ``{"ray_start_params": {...}, "env": {...}}``: a pod's
rayStartParams (the resource ones are applied; ports stay Ray's choice, the machine is
shared) and its container environment, which becomes the raylet's (and so every Ray
worker's on that node) as in the pod. The nodes are raylets of this machine started
with ``ray.cluster_utils.Cluster``, Ray's own multi-node-on-one-host tool: unlike
``ray start``, it adds worker nodes while Ray stays on loopback. Prints ``READY
<gcs address>`` once every node is up, then keeps the cluster until SIGTERM or SIGINT.

``ClusterProcess`` is the test side: it writes the SPEC, starts this script in a process
group of its own, waits for READY and stops it (then, by PID, whatever carries its tag).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: rayStartParams that size a node, and how to read them.
_SIZES = {
    "num-cpus": ("num_cpus", int),
    "memory": ("memory", int),
    "object-store-memory": ("object_store_memory", int),
    # KubeRay pastes the value into a bash command line: unquote it like bash.
    "resources": ("resources", lambda v: json.loads("".join(shlex.split(v)))),
}


def node_args(node: dict[str, Any], temp_dir: str) -> dict[str, Any]:
    args: dict[str, Any] = {
        "node_ip_address": "127.0.0.1",
        "temp_dir": temp_dir,
        "include_dashboard": False,
        "env_vars": dict(node["env"]),
    }
    for key, value in node["ray_start_params"].items():
        if key in _SIZES:
            name, parse = _SIZES[key]
            args[name] = parse(value)
    return args


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    # Block the stop signals first: sigwait() below takes them, no handler races.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    # Cluster() records the head's address in <RAY_TMPDIR>/ray/ray_current_cluster
    # (default /tmp/ray, shared by every Ray on the machine and absent on a fresh one):
    # keep that file inside this cluster's own directory.
    os.environ["RAY_TMPDIR"] = spec["temp_dir"]
    os.makedirs(os.path.join(spec["temp_dir"], "ray"), exist_ok=True)
    from ray.cluster_utils import Cluster

    head, *workers = spec["nodes"]
    head_args = node_args(head, spec["temp_dir"])
    head_args["gcs_server_port"] = spec["port"]
    if spec.get("system_config"):
        head_args["_system_config"] = spec["system_config"]
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    try:
        for worker in workers:
            cluster.add_node(**node_args(worker, spec["temp_dir"]))
        cluster.wait_for_nodes()
        print(f"READY {cluster.address}", flush=True)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
    finally:
        cluster.shutdown()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env(**extra: str) -> dict[str, str]:
    """The environment of a test cluster's nodes and driver: this process's, without its
    own Ray, Spark and hybrid_iter settings; several raylets on loopback, token auth on,
    tests/ and the repository importable; plus ``extra``."""
    tests = Path(__file__).resolve().parent
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "PYSPARK_", "SPARK_", "HYBRID_ITER_"))
    }
    env.update(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            # Several raylets on one host, all on loopback (a pod would use its own IP).
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)]),
            **extra,
        }
    )
    return env


def tagged(tag: str) -> list[int]:
    """PIDs of live processes carrying ``tag`` in their environment (ours only)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class ClusterProcess:
    """A Ray cluster of several raylets on 127.0.0.1, run by this script in a child
    process (test side). ``env`` is every node's environment (each process of the
    cluster carries ``tag`` in it, so that ``stop`` can find stragglers by PID)."""

    def __init__(
        self,
        nodes: list[dict[str, Any]],
        env: dict[str, str],
        *,
        system_config: dict[str, Any] | None = None,
        timeout: float = 180,
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="hirc-", dir="/tmp"))  # short: socket paths
        self.tag = f"HYBRID_ITER_TEST_CLUSTER={secrets.token_hex(8)}"
        self.address = f"127.0.0.1:{free_port()}"
        self.env = {**env, self.tag.split("=")[0]: self.tag.split("=")[1]}
        self.nodes = [{**n, "env": {**n.get("env", {}), **self.env}} for n in nodes]
        self.system_config = system_config or {}
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def start(self, attempts: int = 2) -> None:
        """Start the cluster; on a loaded machine a raylet can miss Ray's fixed 30 s
        registration window, so a failed start is cleaned up and tried again."""
        for attempt in range(attempts):
            try:
                self._start_once()
                return
            except RuntimeError:
                self._stop_processes()
                if attempt == attempts - 1:
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    raise
                self.address = f"127.0.0.1:{free_port()}"

    def _start_once(self) -> None:
        spec = self.tmp / "cluster.json"
        port = int(self.address.rsplit(":", 1)[1])
        spec.write_text(
            json.dumps(
                {
                    "temp_dir": str(self.tmp),
                    "port": port,
                    "nodes": self.nodes,
                    "system_config": self.system_config,
                }
            )
        )
        log = self.tmp / "cluster.log"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(spec)],
                env=self.env,
                cwd=self.tmp,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.timeout
        while f"READY {self.address}" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)  # polling an external process's readiness

    def _stop_processes(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the script shuts the cluster down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + 15
        while (left := tagged(self.tag)) and time.monotonic() < deadline:
            time.sleep(0.25)  # waiting for processes to exit
        for pid in left:  # ours for sure: they carry the tag
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._stop_processes()
        shutil.rmtree(self.tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
