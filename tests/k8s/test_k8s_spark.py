"""k8s/components/spark-k8s: Spark on Kubernetes beside the KubeRay cluster, offline.

The builds ``overlays/spark-k8s`` and ``overlays/spark-k8s-endpoint-tls`` also go through
every check of ``tests/k8s/test_k8s.py`` (schemas, security, RBAC, egress table). Here, what
is particular to them:

* the executors' pod template (a file in a ConfigMap, which kustomize does not see)
  against Kubernetes' strict Pod schema, and every pod's security settings;
* the NetworkPolicies, evaluated on the labels of the pods (the driver Job's, the
  executors' from their template plus the labels Spark adds, KubeRay's): the coordinator
  endpoint's port admitted from the executors to the head and nothing else new;
* the endpoint's token from a Secret, in the driver only, never a literal; the
  advertised address, the bound port and the Service agreeing; the image and the Ray
  node's ports matching the Ray cluster's;
* the driver program run locally on the embedded default, from the Job's own arguments
  and its container's environment, its subtasks forced over the endpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from test_k8s import (
    API_SERVER,
    BUILDS,
    CHECKPOINT_KEY_SECRET,
    CLUSTER,
    K8S,
    K8S_VERSIONS,
    KUBE_DNS,
    METADATA_ADDRESSES,
    OBJECT_STORE,
    OPERATOR_NAMESPACE,
    SAFE_SYSCTLS,
    SPARK_DRIVER_ACCOUNT,
    LocalPod,
    Pod,
    PodTemplate,
    _check_container_security,
    admitted,
    egress_admitted,
    jvm_footprint,
    kuberay_pod,
    kustomize,
    of_kind,
    one,
    pod_templates,
    quantity,
    resolve_env,
    spark_bytes,
)

from hybrid_iter._runtime.endpoint import TOKEN_ENV

COMPONENT = K8S / "components" / "spark-k8s"
SPARK_BUILDS = ("spark-k8s", "spark-k8s-endpoint-tls")
JOB = "hybrid-iter-spark-example"
CONFIG_MAP = "hybrid-iter-spark"
SERVICE = "hybrid-iter-endpoint"
ENDPOINT_TOKEN_SECRET = ("hybrid-iter-endpoint-token", "token")
ENDPOINT_TLS_SECRET = "hybrid-iter-endpoint-tls"
#: the only variables from a Secret in the driver pod, per container: name -> (Secret, key)
DRIVER_SECRET_ENV = {
    "ray-node": {"RAY_AUTH_TOKEN": (CLUSTER, "auth_token")},
    "spark-driver": {
        "RAY_AUTH_TOKEN": (CLUSTER, "auth_token"),
        TOKEN_ENV: ENDPOINT_TOKEN_SECRET,
        "HYBRID_ITER_CHECKPOINT_KEY": (CHECKPOINT_KEY_SECRET, "key"),
        "HYBRID_ITER_CHECKPOINT_PREVIOUS_KEY": (CHECKPOINT_KEY_SECRET, "previous-key"),
    },
}
SA_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
MiB = 1 << 20
LOCAL_RUN_TIMEOUT = 300  # seconds; about 35 s on 2 idle cores


@pytest.fixture(scope="module")
def builds() -> dict[str, list[dict[str, Any]]]:
    return {name: kustomize(BUILDS[name]) for name in ("laptop", *SPARK_BUILDS)}


def driver_program() -> ModuleType:
    """k8s/components/spark-k8s/driver.py, imported as the pod runs it."""
    spec = importlib.util.spec_from_file_location("spark_k8s_driver", COMPONENT / "driver.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job_pod(docs: list[dict[str, Any]]) -> PodTemplate:
    job = one(docs, "Job")
    assert job["metadata"]["name"] == JOB
    return PodTemplate("spark-driver", "spark-driver", job["spec"]["template"])


def containers(pod: PodTemplate) -> dict[str, dict[str, Any]]:
    spec = pod.spec
    return {c["name"]: c for c in spec["containers"] + spec.get("initContainers", [])}


def config_map_files(docs: list[dict[str, Any]]) -> dict[str, str]:
    (cm,) = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"] == CONFIG_MAP]
    return dict(cm["data"])


def executor_template(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(config_map_files(docs)["executor-pod.yaml"])


def spark_submit(docs: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """The driver's ``spark-submit`` command: its options, its ``--conf`` pairs, and the
    program with its arguments."""
    c = containers(job_pod(docs))["spark-driver"]
    assert c["command"] == ["spark-submit"]
    args, options, conf = list(c["args"]), {}, {}
    while args and args[0].startswith("--"):
        flag, value = args.pop(0), args.pop(0)
        if flag == "--conf":
            key, _, v = value.partition("=")
            assert key not in conf, f"--conf {key} twice"
            conf[key] = v
        else:
            options[flag] = value
    return options, conf, args


def service_port(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], int, int]:
    (svc,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == SERVICE]
    (port,) = svc["spec"]["ports"]
    return svc, int(port["port"]), int(port["targetPort"])


def ray_node_flags(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The ``--flag=value`` options of the sidecar's ``ray start``."""
    script = containers(job_pod(docs))["ray-node"]["args"][0]
    start = script[script.index("ray start") :].replace("\\\n", " ")
    return dict(re.findall(r"--([a-z-]+)=(\S+)", start))


def pods(docs: list[dict[str, Any]]) -> dict[str, Pod]:
    """The pods of a build, with the labels they get in the cluster: KubeRay's, the
    Job's template's, and Spark's on the executors (spark-role, spark-app-selector)."""
    namespace = one(docs, "Namespace")["metadata"]["name"]
    job_name = one(docs, "RayJob")["metadata"]["name"]
    found = {t.role: kuberay_pod(namespace, t, job_name) for t in pod_templates(docs)}
    if of_kind(docs, "Job"):  # the Spark builds
        found["driver"] = Pod(
            "driver", namespace, {**job_pod(docs).template["metadata"]["labels"], "job-name": JOB}
        )
        executor_labels = executor_template(docs)["metadata"]["labels"]
        found["executor"] = Pod(
            "executor",
            namespace,
            {
                **executor_labels,
                "spark-role": "executor",
                "spark-app-selector": "spark-0123",
                "spark-exec-id": "1",
            },
        )
    found["stranger"] = Pod("other-app", namespace, {"app": "notebook"})
    # another team's Spark application in the namespace: its executors are not ours
    found["other-spark"] = Pod("other-spark", namespace, {"spark-role": "executor"})
    found["operator"] = Pod(
        "operator", OPERATOR_NAMESPACE, {"app.kubernetes.io/name": "kuberay-operator"}
    )
    if "executor" in found:
        found["foreign-executor"] = Pod("foreign", "elsewhere", dict(found["executor"].labels))
    return found


#: ports probed between every pair of pods: Ray's, Spark's, the endpoint's, and others
PROBED_PORTS = (
    22,
    443,
    6379,
    6380,
    6383,
    7078,
    7080,
    7095,
    8080,
    8265,
    8815,
    8816,
    10001,
    10002,
    19999,
    20000,
    24999,
    52365,
)


# -- objects and pods ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_executor_pod_template_matches_the_strict_pod_schema(builds, version):
    import kubernetes_validate

    if version == "latest":
        version = kubernetes_validate.latest_version()
    for name in SPARK_BUILDS:
        pod = executor_template(builds[name])
        assert pod["kind"] == "Pod" and "image" not in pod["spec"]["containers"][0]
        # Spark adds the image (spark.kubernetes.container.image) and a name.
        pod = {**pod, "metadata": {**pod["metadata"], "name": "exec-1"}}
        pod["spec"]["containers"][0]["image"] = "hybrid-iter"
        try:
            kubernetes_validate.validate(pod, version, strict=True)
        except kubernetes_validate.ValidationError as ex:
            pytest.fail(f"{name}: executor-pod.yaml: {'.'.join(map(str, ex.path))}: {ex.message}")


def test_the_config_map_ships_the_components_files_unchanged(builds):
    for name in SPARK_BUILDS:
        files = config_map_files(builds[name])
        assert set(files) == {"driver.py", "executor.sh", "executor-pod.yaml"}, name
        for file, text in files.items():
            assert text == (COMPONENT / file).read_text(), (name, file)
        _, _, program = spark_submit(builds[name])
        mounts = {
            m["name"]: m for m in containers(job_pod(builds[name]))["spark-driver"]["volumeMounts"]
        }
        volumes = {v["name"]: v for v in job_pod(builds[name]).spec["volumes"]}
        (spark_volume,) = [
            n for n, v in volumes.items() if v.get("configMap", {}).get("name") == CONFIG_MAP
        ]
        assert program[0] == f"{mounts[spark_volume]['mountPath']}/driver.py", program


def test_the_driver_pod_and_the_executors_are_non_root_unprivileged_and_read_only(builds):
    for name in SPARK_BUILDS:
        docs = builds[name]
        driver = job_pod(docs)
        executor = executor_template(docs)
        for where, spec in (("driver pod", driver.spec), ("executor pods", executor["spec"])):
            psc = spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, where
            assert psc.get("runAsGroup", 1) != 0, where
            assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert {s["name"] for s in psc.get("sysctls", [])} <= SAFE_SYSCTLS, where
            for key in ("hostNetwork", "hostPID", "hostIPC"):
                assert not spec.get(key), (where, key)
            assert spec.get("enableServiceLinks") is False, where
            assert spec["automountServiceAccountToken"] is False, where
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for volume in volumes.values():
                assert set(volume) - {"name"} <= {"emptyDir", "secret", "configMap", "projected"}
            for c in spec["containers"] + spec.get("initContainers", []):
                _check_container_security(f"{name} {where} {c['name']}", c["securityContext"])
                mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
                assert mounts["/tmp"]["emptyDir"]["sizeLimit"], (where, c["name"])
                assert {"name": "HOME", "value": "/tmp"} in c["env"], (where, c["name"])
                for m in c.get("volumeMounts", []):
                    if "emptyDir" not in volumes[m["name"]]:
                        assert m.get("readOnly") is True, (where, c["name"], m)
        # Both containers of the driver pod share Ray's session directory and object store.
        by_name = containers(driver)
        for path in ("/tmp", "/dev/shm"):
            names = {
                next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == path)
                for c in by_name.values()
            }
            assert len(names) == 1, (name, path, names)
        # The Ray node is a native sidecar: it runs beside the driver and ends with it.
        assert by_name["ray-node"]["restartPolicy"] == "Always"
        assert by_name["ray-node"]["startupProbe"]["tcpSocket"]["port"] == int(
            ray_node_flags(docs)["node-manager-port"]
        )
        assert driver.spec["restartPolicy"] == "Never"
        assert executor["spec"]["serviceAccountName"] != SPARK_DRIVER_ACCOUNT


def test_only_the_spark_driver_container_holds_an_api_token(builds):
    for name in SPARK_BUILDS:
        docs = builds[name]
        driver = job_pod(docs)
        assert driver.spec["serviceAccountName"] == SPARK_DRIVER_ACCOUNT
        volumes = {v["name"]: v for v in driver.spec["volumes"]}
        tokens = {
            n
            for n, v in volumes.items()
            if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))
        }
        assert len(tokens) == 1, name
        (token,) = tokens
        (sa,) = [
            s["serviceAccountToken"]
            for s in volumes[token]["projected"]["sources"]
            if "serviceAccountToken" in s
        ]
        assert sa["expirationSeconds"] <= 3600 and "audience" not in sa
        assert volumes[token]["projected"]["defaultMode"] & 0o007 == 0, "world-readable"
        for cname, c in containers(driver).items():
            mounted = {m["name"]: m for m in c.get("volumeMounts", [])}
            if cname == "spark-driver":
                assert mounted[token] == {
                    "name": token,
                    "mountPath": SA_TOKEN_PATH,
                    "readOnly": True,
                }
            else:
                assert token not in mounted, (name, cname)
                assert not any(
                    m["mountPath"].startswith("/var/run/secrets") for m in mounted.values()
                )
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert (ref["name"], ref["key"]) == DRIVER_SECRET_ENV[cname][var["name"]]
        spec = executor_template(docs)["spec"]
        assert not any("secret" in v or "projected" in v for v in spec.get("volumes", []))
        for c in spec["containers"]:
            assert not any("valueFrom" in e for e in c.get("env", [])), "an executor Secret"


def test_the_endpoint_token_comes_from_a_secret_in_the_driver_only_and_is_never_a_literal(builds):
    """The driver reads HYBRID_ITER_ENDPOINT_TOKEN (the name hybrid_iter reads) from a
    Secret, required; no container of any build sets it as a value, and the executors get
    no Secret at all: the token reaches them in their task plan."""
    for name, docs in builds.items():
        text = json.dumps(docs)
        for d in docs:
            for c in _all_containers(d):
                for var in c.get("env", []):
                    if var["name"] == TOKEN_ENV:
                        assert "value" not in var, f"{name}: {TOKEN_ENV} is a literal"
        if name not in SPARK_BUILDS:
            assert TOKEN_ENV not in text
            continue
        env = {e["name"]: e for e in containers(job_pod(docs))["spark-driver"]["env"]}
        ref = env[TOKEN_ENV]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ENDPOINT_TOKEN_SECRET and not ref.get("optional")
        assert TOKEN_ENV not in {e["name"] for e in containers(job_pod(docs))["ray-node"]["env"]}
        assert TOKEN_ENV not in config_map_files(docs)["executor-pod.yaml"]
        assert not of_kind(docs, "Secret")


def _all_containers(doc: Any) -> list[dict[str, Any]]:
    """Every container (and init container) anywhere in a rendered object."""
    found = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                found += value
            else:
                found += _all_containers(value)
    elif isinstance(doc, list):
        for item in doc:
            found += _all_containers(item)
    return found


# -- the endpoint's address ---------------------------------------------------------------------


def driver_env(docs: list[dict[str, Any]], **secrets_: str) -> dict[str, str]:
    """The spark-driver container's environment as the kubelet resolves it in namespace
    hybrid-iter (stand-in Secrets)."""
    stand_ins = {
        (CLUSTER, "auth_token"): secrets.token_hex(16),
        ENDPOINT_TOKEN_SECRET: secrets.token_hex(32),
        (CHECKPOINT_KEY_SECRET, "key"): secrets.token_hex(32),
    }
    fields = {
        "status.podIP": "10.1.2.3",
        "metadata.name": f"{JOB}-abcde",
        "metadata.namespace": one(docs, "Namespace")["metadata"]["name"],
    }
    return resolve_env(containers(job_pod(docs))["spark-driver"], secrets_=stand_ins, fields=fields)


def test_the_advertised_endpoint_is_the_service_in_front_of_the_bound_port_of_the_head(builds):
    driver = driver_program()
    for name in SPARK_BUILDS:
        docs = builds[name]
        namespace = one(docs, "Namespace")["metadata"]["name"]
        env = driver_env(docs)
        env.pop(driver.TLS_CERT, None), env.pop(driver.TLS_KEY, None)  # files: the TLS test
        config = driver.endpoint_config(env)
        svc, port, target = service_port(docs)
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
        # the executors dial the Service's name and port ...
        assert config.advertise == f"{svc['metadata']['name']}.{namespace}.svc:{port}", name
        # ... which forwards to the port the coordinator binds, on every address of its pod
        assert config.bind == f"0.0.0.0:{target}", name
        # ... of the Ray head, where the coordinator runs (its hybrid_iter_head resource;
        # nothing in the driver moves it elsewhere)
        all_pods = pods(docs)
        selected = [k for k, p in all_pods.items() if _selects(svc["spec"]["selector"], p)]
        assert selected == ["head"], (name, selected)
        (head,) = [t for t in pod_templates(docs) if t.role == "head"]
        assert "hybrid_iter_head" in head.ray_start_params["resources"]
        assert "HYBRID_ITER_COORDINATOR_RESOURCES" not in env
        # a port nothing else on the head uses: Ray's and Spark's are elsewhere
        assert not any(
            low <= target <= high for low, high in _policy_ports(docs, "hybrid-iter-ray-internal")
        )
        # the Ray cluster the driver joins is the head's Service, as the workers join it
        assert env[driver.RAY_ADDRESS] == ray_node_head_address(docs)


def ray_node_head_address(docs: list[dict[str, Any]]) -> str:
    env = {e["name"]: e.get("value") for e in containers(job_pod(docs))["ray-node"]["env"]}
    worker = next(t for t in pod_templates(docs) if t.role == "worker")
    (wait,) = [c for c in worker.spec["initContainers"] if c["name"] == "wait-gcs-ready"]
    workers_join = {e["name"]: e.get("value") for e in wait["env"]}["HEAD_GCS_ADDRESS"]
    assert env["HEAD_GCS_ADDRESS"] == workers_join
    return workers_join


def _selects(selector: dict[str, str], pod: Pod) -> bool:
    return all(pod.labels.get(k) == v for k, v in selector.items())


def _policy_ports(docs: list[dict[str, Any]], policy: str) -> list[tuple[int, int]]:
    (p,) = [p for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == policy]
    return [
        (port["port"], port.get("endPort", port["port"]))
        for rule in p["spec"]["ingress"]
        for port in rule["ports"]
    ]


@pytest.mark.integration
def test_tls_reads_the_certificate_the_component_mounts_into_the_driver(builds, tmp_path):
    """The TLS build's driver finds its certificate and key where the Secret is mounted
    (the pod's files made locally: LocalPod), and only the driver mounts it."""
    driver = driver_program()
    docs = builds["spark-k8s-endpoint-tls"]
    svc, port, _ = service_port(docs)
    host = f"{svc['metadata']['name']}.hybrid-iter.svc"
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
            "-days",
            "2",
            "-keyout",
            str(tmp_path / "tls.key"),
            "-out",
            str(tmp_path / "tls.crt"),
            "-subj",
            "/CN=hybrid-iter-endpoint",
            "-addext",
            f"subjectAltName=DNS:{host}",
        ],
        check=True,
        capture_output=True,
    )
    stand_ins = {
        (ENDPOINT_TLS_SECRET, key): (tmp_path / key).read_text() for key in ("tls.crt", "tls.key")
    }
    stand_ins |= {(CLUSTER, "auth_token"): "t", ENDPOINT_TOKEN_SECRET: "e"}
    stand_ins |= {(CHECKPOINT_KEY_SECRET, "key"): "k"}
    pod = LocalPod(docs, job_pod(docs), tmp_path / "pod", stand_ins)
    config = driver.endpoint_config(pod.env("spark-driver"))
    assert config.tls_cert is not None and config.tls_key is not None
    assert Path(config.tls_cert).read_text() == stand_ins[(ENDPOINT_TLS_SECRET, "tls.crt")]
    assert Path(config.tls_key).read_text() == stand_ins[(ENDPOINT_TLS_SECRET, "tls.key")]
    assert config.advertise == f"{host}:{port}"
    for cname, c in containers(job_pod(docs)).items():
        mounted = {m["name"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in job_pod(docs).spec["volumes"]}
        has = any(
            volumes[m].get("secret", {}).get("secretName") == ENDPOINT_TLS_SECRET for m in mounted
        )
        assert has is (cname == "spark-driver"), cname
    # the build without TLS has none
    plain = driver.endpoint_config(driver_env(builds["spark-k8s"]))
    assert plain.tls_cert is None and plain.tls_key is None


# -- network policy -----------------------------------------------------------------------------


def test_the_policies_admit_the_endpoint_port_from_the_executors_to_the_coordinator_only(builds):
    for name in SPARK_BUILDS:
        docs = builds[name]
        policies = of_kind(docs, "NetworkPolicy")
        p = pods(docs)
        _, _, endpoint = service_port(docs)
        head, worker, driver, executor = p["head"], p["worker"], p["driver"], p["executor"]
        # The coordinator's endpoint: from our executors to the head, that port only.
        assert admitted(policies, head, executor, endpoint), name
        assert egress_admitted(policies, executor, head, endpoint), name
        for port in PROBED_PORTS:
            if port != endpoint:
                assert not admitted(policies, head, executor, port), (name, port)
                assert not egress_admitted(policies, executor, head, port), (name, port)
            # no other pod of Ray's, and nothing of Ray's from the executors
            assert not admitted(policies, worker, executor, port), (name, port)
            assert not egress_admitted(policies, executor, worker, port), (name, port)
        # Nobody else reaches the endpoint: not the driver (it uses Ray), another
        # application's executors, another namespace, strangers, the submitter.
        for source in (
            "driver",
            "other-spark",
            "foreign-executor",
            "stranger",
            "submitter",
            "worker",
        ):
            assert not admitted(policies, head, p[source], endpoint), (name, source)
        # Spark's own ports between the driver and its executors, both ways.
        for port in (7078, 7079, 7080, 7095):
            assert admitted(policies, driver, executor, port), (name, port)
            assert egress_admitted(policies, executor, driver, port), (name, port)
            assert admitted(policies, executor, driver, port), (name, port)
            assert egress_admitted(policies, driver, executor, port), (name, port)
            assert admitted(policies, executor, executor, port), (name, port)
            for outsider in ("stranger", "other-spark", "head", "worker"):
                assert not admitted(policies, executor, p[outsider], port), (name, outsider)
                assert not admitted(policies, driver, p[outsider], port), (name, outsider)
        for port in (22, 6379, 8080, 8815, 10002):
            assert not admitted(policies, executor, driver, port), (name, port)
            assert not admitted(policies, driver, executor, port), (name, port)
        # Ray between the driver pod's Ray node and the Ray pods, as between Ray pods,
        # without Spark's ports.
        for ray_pod in (head, worker):
            for port in (6380, 6383, 52365, 10002, 19999, 20000, 24999):
                assert admitted(policies, ray_pod, driver, port), (name, ray_pod.name, port)
                assert egress_admitted(policies, driver, ray_pod, port), (name, port)
                assert admitted(policies, driver, ray_pod, port), (name, ray_pod.name, port)
                assert egress_admitted(policies, ray_pod, driver, port), (name, port)
            for port in (22, 8080, 10001):
                assert not admitted(policies, ray_pod, driver, port), (name, port)
                assert not admitted(policies, driver, ray_pod, port), (name, port)
            assert not admitted(policies, driver, ray_pod, 7078), name
            assert not admitted(policies, ray_pod, driver, 7078), name
        assert admitted(policies, head, driver, 6379), name
        assert not admitted(policies, driver, p["stranger"], 6380), name
        # Egress off the cluster: the API server only from the driver, the object store
        # from both, DNS from both, never the metadata service nor the internet.
        for port in (443, 6443):
            assert egress_admitted(policies, driver, API_SERVER, port), (name, port)
            assert not egress_admitted(policies, executor, API_SERVER, port), (name, port)
        for source in (driver, executor):
            assert egress_admitted(policies, source, OBJECT_STORE, 443), name
            assert egress_admitted(policies, source, KUBE_DNS, 53, "UDP"), name
            for address in (*METADATA_ADDRESSES, "8.8.8.8", "10.0.0.1"):
                for port in (53, 80, 443, 6443, 8815):
                    assert not egress_admitted(policies, source, address, port), (name, address)


def test_the_spark_policies_open_nothing_new_between_the_ray_clusters_own_pods(builds):
    """Every connection among the laptop build's pods (Ray's, the submitter, outsiders)
    is admitted in the Spark builds exactly when it is in the laptop build."""
    laptop = builds["laptop"]
    before = of_kind(laptop, "NetworkPolicy")
    old = pods(laptop)
    names = ("head", "worker", "submitter", "stranger", "operator")
    for name in SPARK_BUILDS:
        after = of_kind(builds[name], "NetworkPolicy")
        new = pods(builds[name])
        for target in names:
            for source in names:
                for port in PROBED_PORTS:
                    a, b = old[target], old[source]
                    assert admitted(after, new[target], new[source], port) == admitted(
                        before, a, b, port
                    ), (name, target, source, port)
                    if new[source].namespace == new[target].namespace:
                        assert egress_admitted(after, new[source], new[target], port) == (
                            egress_admitted(before, b, a, port)
                        ), (name, source, target, port)


# -- the driver's command, ports and image ------------------------------------------------------


def test_the_driver_pods_ray_node_and_spark_ports_match_the_cluster_and_its_policies(builds):
    for name in SPARK_BUILDS:
        docs = builds[name]
        flags = ray_node_flags(docs)
        worker = next(t for t in pod_templates(docs) if t.role == "worker")
        # the Ray node pins every port a worker pins, to the same numbers (the ones the
        # policies admit), and offers no CPU: nothing is scheduled beside the driver
        for key, value in worker.ray_start_params.items():
            if key.endswith("port"):
                assert flags[key] == value, (name, key)
        assert flags["num-cpus"] == "0" and flags["node-ip-address"] == '"$POD_IP"'
        # every flag is one `ray start` of the image's Ray takes, and it stays in the
        # foreground (the sidecar's life is the Ray node's)
        from ray.scripts.scripts import start

        known = {o for p in start.params for o in p.opts}
        assert {f"--{flag}" for flag in flags} <= known, {f"--{f}" for f in flags} - known
        assert "exec ray start --block " in containers(job_pod(docs))["ray-node"]["args"][0]
        assert "resources" not in flags  # not hybrid_iter_head: the coordinator stays there
        assert (
            job_pod(docs).spec["securityContext"]["sysctls"]
            == (worker.spec["securityContext"]["sysctls"])
        )
        options, conf, program = spark_submit(docs)
        assert options["--master"] == "k8s://https://kubernetes.default.svc"
        assert options["--deploy-mode"] == "client"
        # Spark's ports are pinned inside the range the policies admit
        retries = int(conf["spark.port.maxRetries"])
        (driver_ports,) = [
            rule["ports"]
            for rule in next(
                p
                for p in of_kind(docs, "NetworkPolicy")
                if p["metadata"]["name"] == "hybrid-iter-spark-driver"
            )["spec"]["ingress"]
            if any("spark-role" in peer["podSelector"]["matchLabels"] for peer in rule["from"])
        ]
        (spark_range,) = driver_ports
        for key in (
            "spark.driver.port",
            "spark.driver.blockManager.port",
            "spark.blockManager.port",
        ):
            low = int(conf[key])
            assert spark_range["port"] <= low and low + retries <= spark_range["endPort"], key
        assert conf["spark.driver.host"] == conf["spark.driver.bindAddress"] == "$(POD_IP)"
        assert conf["spark.kubernetes.driver.pod.name"] == "$(POD_NAME)"
        assert conf["spark.kubernetes.namespace"] == "$(POD_NAMESPACE)"
        assert conf["spark.dynamicAllocation.enabled"] == "false"  # barrier stages
        assert conf["spark.authenticate"] == conf["spark.network.crypto.enabled"] == "true"
        assert conf["spark.ui.enabled"] == "false"
        # the executor template is the mounted file, its container the one named
        template_path = conf["spark.kubernetes.executor.podTemplateFile"]
        assert template_path == str(Path(program[0]).with_name("executor-pod.yaml"))
        template = executor_template(docs)
        (container,) = template["spec"]["containers"]
        assert container["name"] == conf["spark.kubernetes.executor.podTemplateContainerName"]
        (script_mount,) = [m for m in container["volumeMounts"] if m["name"] == "spark"]
        assert container["command"] == ["/bin/bash", f"{script_mount['mountPath']}/executor.sh"]
        # the task slots the driver program asks for are the executors'
        slots = int(conf["spark.executor.instances"]) * int(conf["spark.executor.cores"])
        assert program[program.index("--partitions") + 1] == str(slots)


def test_the_driver_and_the_executors_run_the_ray_clusters_image(builds):
    """One image on both sides of the endpoint and in the Ray cluster: the same
    hybrid_iter, Ray, Spark and pyarrow (the endpoint refuses another protocol version)."""
    for name in SPARK_BUILDS:
        docs = builds[name]
        (head,) = [t for t in pod_templates(docs) if t.role == "head"]
        image = head.container["image"]
        for c in containers(job_pod(docs)).values():
            assert c["image"] == image, (name, c["name"])
        env = {e["name"]: e.get("value") for e in containers(job_pod(docs))["spark-driver"]["env"]}
        assert env["SPARK_IMAGE"] == image
        _, conf, _ = spark_submit(docs)
        assert conf["spark.kubernetes.container.image"] == "$(SPARK_IMAGE)"
        # the Python the executors' and the driver's PySpark run: the image's venv
        dockerfile = (K8S / "image" / "Dockerfile").read_text()
        assert "ENV PATH=/opt/venv/bin:$PATH" in dockerfile
        assert conf["spark.pyspark.python"] == conf["spark.pyspark.driver.python"]
        assert conf["spark.pyspark.python"] == "/opt/venv/bin/python"


def test_the_driver_pod_is_sized_for_its_jvm_and_its_ray_node(builds):
    for name in SPARK_BUILDS:
        docs = builds[name]
        options, conf, _ = spark_submit(docs)
        by_name = containers(job_pod(docs))
        for c in by_name.values():
            assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
        driver_limit = quantity(by_name["spark-driver"]["resources"]["limits"]["memory"])
        # the driver's heap and its off-heap memory, the Python driver and its Ray worker
        assert driver_limit >= jvm_footprint(spark_bytes(options["--driver-memory"])) + 512 * MiB
        store = int(ray_node_flags(docs)["object-store-memory"])
        ray_limit = quantity(by_name["ray-node"]["resources"]["limits"]["memory"])
        assert ray_limit >= store + 512 * MiB + 256 * MiB  # raylet, agents
        shm = next(v for v in job_pod(docs).spec["volumes"] if v["name"] == "shm")
        assert quantity(shm["emptyDir"]["sizeLimit"]) >= store
        assert spark_bytes(conf["spark.executor.memory"]) >= 512 * MiB


# -- the driver program, run locally ------------------------------------------------------------


#: Put on the PYTHONPATH of the local run: in Spark's Python workers only (they alone
#: get HYBRID_ITER_TEST_EXECUTOR, a spark.executorEnv setting), ``import ray`` fails, as
#: on an executor pod with no Ray; each such worker notes its pid.
_NO_RAY_ON_EXECUTORS = """
import os, sys
_marks = os.environ.get("HYBRID_ITER_TEST_EXECUTOR")
if _marks:
    with open(_marks, "a") as f:
        f.write(f"{os.getpid()}\\n")

    class _NoRay:
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ImportError("a Spark executor pod has no Ray (test stand-in)")
            return None

    sys.meta_path.insert(0, _NoRay())
"""


@pytest.mark.integration
def test_the_driver_program_trains_the_example_over_the_endpoint_on_the_embedded_default(
    builds, tmp_path
):
    """driver.py with the Job's own arguments and its container's environment (stand-in
    Secrets), on the embedded default instead of the KubeRay cluster and executor pods:
    the same EndpointConfig path, bound to loopback. Spark's Python workers cannot import
    Ray (as on an executor pod), so the run converges only if its subtasks use the
    endpoint."""
    docs = builds["spark-k8s"]
    _, conf, program = spark_submit(docs)
    env = driver_env(docs)
    token = env[TOKEN_ENV]
    driver = driver_program()
    for key in (driver.RAY_ADDRESS, driver.ADVERTISE):  # no KubeRay, no Service here
        env.pop(key)
    env[driver.BIND] = "127.0.0.1:0"
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # the embedded Ray makes its own
        env.pop(key)
    no_ray, spark_conf = tmp_path / "no-ray", tmp_path / "spark-conf"
    no_ray.mkdir(), spark_conf.mkdir()
    (no_ray / "sitecustomize.py").write_text(_NO_RAY_ON_EXECUTORS)
    marks = tmp_path / "executor-workers"
    (spark_conf / "spark-defaults.conf").write_text(
        f"spark.executorEnv.HYBRID_ITER_TEST_EXECUTOR {marks}\n"
    )
    env.update(
        {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join([str(no_ray), str(K8S.parent)]),
            "SPARK_CONF_DIR": str(spark_conf),
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "HOME": str(tmp_path),
        }
    )
    assert env[TOKEN_ENV] == token  # the Secret's token is the one the run uses
    proc = subprocess.run(
        [sys.executable, str(COMPONENT / "driver.py"), *program[1:]],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=LOCAL_RUN_TIMEOUT,
        check=False,
    )
    from hybrid_iter.cli import RESULT_PREFIX

    detail = f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, detail
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    report = json.loads(line[len(RESULT_PREFIX) :])
    assert report["session"] == "local" and report["endpoint"]["bind"] == "127.0.0.1:0"
    result = report["result"]
    args = dict(zip(program[1::2], program[2::2]))
    assert result["rows"] == int(args["--rows"])
    assert (
        result["partitions"]
        == int(args["--partitions"])
        == (int(conf["spark.executor.instances"]) * int(conf["spark.executor.cores"]))
    )
    assert result["terminated_by"] == "criteria", result
    assert result["max_weight_error"] < 0.05, result
    assert marks.read_text().split(), "no Spark Python worker ran without Ray"


def test_the_driver_program_refuses_bad_endpoint_settings_before_spark_starts():
    driver = driver_program()
    import hybrid_iter as hi

    with pytest.raises(hi.IterationConfigError, match=r"EndpointConfig\.bind"):
        driver.endpoint_config({driver.BIND: "no-port"})
    with pytest.raises(hi.IterationConfigError, match="tls_cert and tls_key"):
        driver.endpoint_config({driver.TLS_CERT: __file__})


#: Stands in for ``java`` on the PATH: prints its arguments, one JSON list.
_ECHO_JAVA = """#!/usr/bin/env python3
import json, sys
print(json.dumps(sys.argv[1:]))
"""


@pytest.mark.integration
def test_the_executor_command_starts_sparks_kubernetes_executor_backend(tmp_path):
    """executor.sh, as the executor pod runs it: the environment Spark gives an executor
    container becomes the JVM's command line (a stand-in ``java`` prints it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java").write_text(_ECHO_JAVA)
    (bin_dir / "java").chmod(0o755)
    spark_env = {
        "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@10.1.2.3:7078",
        "SPARK_EXECUTOR_ID": "3",
        "SPARK_EXECUTOR_CORES": "2",
        "SPARK_EXECUTOR_MEMORY": "1g",
        "SPARK_APPLICATION_ID": "spark-0123",
        "SPARK_EXECUTOR_POD_IP": "10.1.2.4",
        "SPARK_RESOURCE_PROFILE_ID": "0",
        "SPARK_EXECUTOR_POD_NAME": "hybrid-iter-spark-example-exec-3",
        # out of order, two digits, a value with a space and an '='
        "SPARK_JAVA_OPT_10": "-Dlast=10",
        "SPARK_JAVA_OPT_2": "-Dspark.driver.port=7078",
        "SPARK_JAVA_OPT_0": "-Dmessage=a b",
    }
    env = {
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), "/usr/bin:/bin"]),
        "HOME": str(tmp_path),
        **spark_env,
    }
    script = str(COMPONENT / "executor.sh")
    run = subprocess.run(
        ["/bin/bash", script, "executor"], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    argv = json.loads(run.stdout)
    import pyspark

    jars = f"{Path(pyspark.__file__).parent}/jars/*"
    assert argv == [
        "-Dmessage=a b",
        "-Dspark.driver.port=7078",
        "-Dlast=10",
        "-Xms1g",
        "-Xmx1g",
        "-cp",
        jars,
        "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend",
        "--driver-url",
        spark_env["SPARK_DRIVER_URL"],
        "--executor-id",
        "3",
        "--cores",
        "2",
        "--app-id",
        "spark-0123",
        "--hostname",
        "10.1.2.4",
        "--resourceProfileId",
        "0",
        "--podName",
        spark_env["SPARK_EXECUTOR_POD_NAME"],
    ], argv
    # the jars are there: pyspark ships Spark's Kubernetes backend
    assert list(Path(jars[:-2]).glob("spark-kubernetes_*.jar")), jars
    # not an executor's container: a clear refusal naming what is missing
    del env["SPARK_DRIVER_URL"]
    run = subprocess.run(
        ["/bin/bash", script, "executor"], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "SPARK_DRIVER_URL is not set" in run.stderr, run.stderr
    run = subprocess.run(["/bin/bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "argument 'executor'" in run.stderr, run.stderr
