"""A Ray cluster on 127.0.0.1 shaped like k8s/'s RayCluster, run by test_k8s.py.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python tests/k8s_ray_cluster.py SPEC.json

SPEC is ``{"temp_dir": DIR, "port": GCS_PORT, "nodes": [NODE, ...]}``; the first NODE is
the head. A NODE is ``{"ray_start_params": {...}, "env": {...}}``: a pod's
rayStartParams (the resource ones are applied; ports stay Ray's choice, the machine is
shared) and its container environment, which becomes the raylet's (and so every Ray
worker's on that node) as in the pod. The nodes are raylets of this machine started
with ``ray.cluster_utils.Cluster``, Ray's own multi-node-on-one-host tool: unlike
``ray start``, it adds worker nodes while Ray stays on loopback. Prints ``READY
<gcs address>`` once every node is up, then keeps the cluster until SIGTERM or SIGINT.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
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
    from ray.cluster_utils import Cluster

    head, *workers = spec["nodes"]
    head_args = node_args(head, spec["temp_dir"])
    head_args["gcs_server_port"] = spec["port"]
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
