"""The operator end to end, on the local control plane.

The Helm chart is installed for real (namespaced RBAC, into its own namespace, two operator
replicas electing a leader), so the operator runs as the chart's pods, with the chart's
ServiceAccount and nothing more; its engines are real `kvpilot serve` processes on a
generated tiny model, on the CPU, asking the fake nodes for `nvidia.com/gpu`. The tests run
in file order and share one InferenceService, `tiny`, from examples/local-cpu.yaml: it is
created, served from, edited, scaled, survives the leader operator's kill (the standby takes
over), and is deleted last.
"""

from __future__ import annotations

import copy
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot.engine_contract import API_KEY_ENV, CHAT_TEMPLATE_ENV
from kvpilot.kube_contract import pod_ready, pod_url
from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders, crd
from kvpilot.operator.kube import Kube

from .service_reads import engine_arg, engine_pods

pytestmark = pytest.mark.e2e

NS = "kvpilot-e2e"
RELEASE = "kv"
OPERATOR_SELECTOR = "app.kubernetes.io/instance=kv,app.kubernetes.io/component=operator"
EXAMPLES = crd.REPO_ROOT / "examples"
ENGINE_READY_S = 240  # a pod's engine process imports torch and loads the model on 2 shared cores
RESYNC_SECONDS = 5
OPERATOR_HEALTH_PORT = 18481  # pods share the host's network: keep clear of common ports
LEASE = f"{RELEASE}-kvpilot"  # the chart's Lease, named after the release
LEASE_SECONDS = 15  # the chart's default leaderElection.leaseSeconds


# --- fixtures and helpers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def operator(cluster, kube):
    """The chart, installed with namespaced RBAC; yields once its operator pod runs."""
    cluster.kubectl("create", "namespace", NS)
    cluster.helm(
        "install", RELEASE, str(crd.REPO_ROOT / "charts" / "kvpilot"), "--namespace", NS,
        "--set", "rbac.scope=namespaced",
        "--set", "engine.bindPodIP=true",
        "--set", "engine.shutdownGraceSeconds=2",
        "--set", "engine.drainSeconds=1",
        "--set", "engine.startupSeconds=600",
        "--set", f"resyncSeconds={RESYNC_SECONDS}",
        "--set", f"healthPort={OPERATOR_HEALTH_PORT}",
        "--set", f"metricsPort={OPERATOR_HEALTH_PORT + 1}",
        "--set", "logLevel=DEBUG",
        "--set", "replicaCount=2",
        "--set", "bindPodIP=true",  # two operators on one host: each listens on its pod IP
    )
    _wait_operator_running(cluster, kube)
    yield
    cluster.helm("uninstall", RELEASE, "--namespace", NS, "--wait", check=False)
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _lease_holder(kube) -> str | None:
    lease = kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE)
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or None


def _wait_operator_running(cluster, kube) -> dict:
    """Both operator replicas run and one of them holds the Lease; returns the leader's pod."""
    def running():
        pods = {p["metadata"]["name"]: p for p in kube.list("v1", "Pod", NS, label_selector=OPERATOR_SELECTOR)
                if not p["metadata"].get("deletionTimestamp")}
        leader = pods.get(_lease_holder(kube) or "")
        return leader if len(pods) == 2 and all(pod_ready(p) for p in pods.values()) else None

    return _wait(cluster, running, 90, "two operator replicas, one of them leading")


def _diagnostics(cluster) -> str:
    """What a failed wait shows: the operator's log tail, the services and pods."""
    parts = []
    for pod in Kube(cluster.api_client()).list("v1", "Pod", NS, label_selector=OPERATOR_SELECTOR):
        parts.append(f"--- operator {pod['metadata']['name']} log tail:\n"
                     + cluster.pod_log(NS, pod["metadata"]["name"], "operator")[-6000:])
    for what in (("get", "kvis", "-o", "yaml"), ("get", "pods,deploy,pdb", "-o", "wide")):
        parts.append(cluster.kubectl(*what, "-n", NS, check=False).stdout[-6000:])
    return "\n".join(parts)


def _wait(cluster, predicate, timeout: float, what: str):
    try:
        return wait_until(predicate, timeout, what, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diagnostics(cluster)}") from None


def _apply(cluster, manifest: dict) -> None:
    cluster.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(manifest))


def _kvis(kube, name: str) -> dict | None:
    return kube.get_inference_service(NS, name)


def _condition(kvis: dict | None, kind: str) -> dict:
    conditions = ((kvis or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def _wait_ready(cluster, kube, name: str, replicas: int) -> dict:
    def ready():
        kvis = _kvis(kube, name)
        status = (kvis or {}).get("status") or {}
        return kvis if (_condition(kvis, "Ready").get("status") == "True"
                        and status.get("readyReplicas") == replicas
                        and status.get("observedGeneration") == kvis["metadata"]["generation"]) else None

    return _wait(cluster, ready, ENGINE_READY_S, f"InferenceService {name} Ready with {replicas} replicas")


def _engine_processes(model_dir: Path) -> list[int]:
    """PIDs of `kvpilot serve` processes of this model (the kubelet runs pods as local processes)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(model_dir).encode() in argv:
            pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def tiny_spec(tiny_model_dir) -> dict:
    manifest = yaml.safe_load((EXAMPLES / "local-cpu.yaml").read_text())
    manifest["spec"]["model"]["uri"] = f"file://{Path(tiny_model_dir).resolve()}"
    return manifest


# --- the API server's validation ----------------------------------------------------------


# Invalid specs: tests/e2e/test_bad_crs.py, against the CRD alone.


def test_kubectl_explain_reads_the_field_docs(cluster, operator):
    explained = cluster.kubectl("explain", "kvis.spec.tuning").stdout
    assert "Tune engine parameters live against an SLO" in explained
    assert "Bounds for engine.maxNumSeqs" in explained


# --- one service's life ---------------------------------------------------------------------


def test_example_becomes_children_and_serves(cluster, kube, operator, tiny_spec):
    _apply(cluster, tiny_spec)
    owner = _wait(cluster, lambda: _kvis(kube, "tiny"), 10, "the InferenceService")
    deployment = _wait(cluster, lambda: kube.get("apps/v1", "Deployment", NS, "tiny"), 30, "the Deployment")
    for kind, name in (("Service", "tiny"), ("ConfigMap", "tiny-tuning"), ("Secret", "tiny-admin")):
        child = _wait(cluster, lambda k=kind, n=name: kube.get("v1", k, NS, n), 30, f"{kind} {name}")
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == owner["metadata"]["uid"] and ref["controller"] is True
    assert kube.get("policy/v1", "PodDisruptionBudget", NS, "tiny") is None  # one replica

    pod_spec = deployment["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    # The node's model folder is mounted at /mnt/models, which the engine serves.
    assert container["args"][:2] == ["serve", "/mnt/models"]
    volume = next(v for v in pod_spec["volumes"] if v["name"] == "model")
    assert volume["hostPath"] == {"path": tiny_spec["spec"]["model"]["uri"][len("file://"):], "type": "Directory"}
    assert engine_arg(deployment["spec"]["template"], "--served-model-name") == "tiny"
    assert engine_arg(deployment["spec"]["template"], "--max-num-seqs") == "16"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    service = kube.get("v1", "Service", NS, "tiny")
    assert service["spec"]["ports"][0]["port"] == 8000 and service["spec"]["ports"][0]["name"] == "http"
    configmap = kube.get("v1", "ConfigMap", NS, "tiny-tuning")
    assert json.loads(configmap["data"]["tuning.json"]) == {"maxNumSeqs": 16}

    kvis = _wait_ready(cluster, kube, "tiny", 1)
    status = kvis["status"]
    assert status["url"] == f"http://tiny.{NS}.svc.cluster.local:8000/v1"
    assert status["phase"] == "Ready" and status["replicas"] == 1
    assert status["selector"] == builders.selector_string("tiny")
    assert status["engine"]["maxNumSeqs"] == 16

    (pod,) = engine_pods(kube, NS, "tiny")
    response = httpx.post(f"{pod_url(pod['status']['podIP'])}/v1/completions",
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4

    table = cluster.kubectl("get", "kvis", "-n", NS).stdout
    header, row = table.splitlines()[0], next(r for r in table.splitlines() if r.startswith("tiny "))
    assert re.split(r"\s{2,}", header.strip()) == ["NAME", "READY", "REPLICAS", "MAXSEQS", "TOK/S", "ITL P99", "AGE"]
    assert row.split()[1:4] == ["True", "1", "16"]

    events = cluster.kubectl("get", "events", "-n", NS, "--field-selector",
                             "involvedObject.kind=InferenceService,involvedObject.name=tiny").stdout
    assert "Created Deployment tiny" in events


def test_editing_the_engine_rolls_the_pods(cluster, kube, operator):
    (old_pod,) = engine_pods(kube, NS, "tiny")
    cluster.kubectl("patch", "kvis", "tiny", "-n", NS, "--type", "merge",
                    "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 8}}}))

    def rolled():
        pods = engine_pods(kube, NS, "tiny")
        return len(pods) == 1 and pods[0]["metadata"]["uid"] != old_pod["metadata"]["uid"] and pod_ready(pods[0])

    _wait(cluster, rolled, ENGINE_READY_S, "a new engine pod to replace the old one")
    kvis = _wait_ready(cluster, kube, "tiny", 1)
    assert kvis["status"]["engine"]["maxNumSeqs"] == 8
    (pod,) = engine_pods(kube, NS, "tiny")
    assert engine_arg(pod, "--max-num-seqs") == "8"
    configmap = kube.get("v1", "ConfigMap", NS, "tiny-tuning")
    assert json.loads(configmap["data"]["tuning.json"]) == {"maxNumSeqs": 8}


def test_kubectl_scale_adds_a_replica_and_a_pdb(cluster, kube, operator):
    cluster.kubectl("scale", "kvis/tiny", "-n", NS, "--replicas=2")
    _wait_ready(cluster, kube, "tiny", 2)
    pdb = _wait(cluster, lambda: kube.get("policy/v1", "PodDisruptionBudget", NS, "tiny"), 30, "the PDB")
    assert pdb["spec"]["maxUnavailable"] == 1
    scale = json.loads(cluster.kubectl("get", "--raw", f"/apis/kvpilot.io/v1alpha1/namespaces/{NS}/"
                                       "inferenceservices/tiny/scale").stdout)
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == builders.selector_string("tiny")

    cluster.kubectl("scale", "kvis/tiny", "-n", NS, "--replicas=1")
    _wait(cluster, lambda: kube.get("policy/v1", "PodDisruptionBudget", NS, "tiny") is None, 30, "the PDB to go")
    _wait_ready(cluster, kube, "tiny", 1)


def _deployment_max_num_seqs(kube) -> str:
    return engine_arg(kube.get("apps/v1", "Deployment", NS, "tiny")["spec"]["template"], "--max-num-seqs")


def test_the_standby_takes_over_when_the_leader_is_killed_mid_reconcile(cluster, kube, operator, converged):
    token_before = kube.get("v1", "Secret", NS, "tiny-admin")["data"]["token"]
    leader = _wait_operator_running(cluster, kube)["metadata"]["name"]
    transitions = kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE)["spec"].get("leaseTransitions", 0)
    cluster.kubectl("patch", "kvis", "tiny", "-n", NS, "--type", "merge",
                    "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 11}}}))
    # No grace: the leader is killed mid-reconcile. Whether it still hands the Lease back between
    # SIGTERM and SIGKILL is a race, and so is which replica then takes it: the standby, or the
    # killed pod's replacement starting up. Either is a correct takeover; the killed one is not.
    cluster.kubectl("delete", "pod", leader, "-n", NS, "--grace-period=0", "--force")
    killed = time.monotonic()
    cluster.kubectl("patch", "kvis", "tiny", "-n", NS, "--type", "merge",
                    "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 12}}}))

    _wait(cluster, lambda: _lease_holder(kube) not in (None, leader), LEASE_SECONDS + 30,
          "another replica to take the Lease")
    took_lease = time.monotonic() - killed
    _wait(cluster, lambda: _deployment_max_num_seqs(kube) == "12", 60, "the new leader to apply the spec")
    acted = time.monotonic() - killed
    print(f"\ntakeover after the leader's kill: Lease in {took_lease:.1f} s, spec applied in {acted:.1f} s "
          f"(lease {LEASE_SECONDS} s)")
    # The Lease expires after LEASE_SECONDS unrenewed (2 s retries); then kopf starts and reconciles.
    assert acted < LEASE_SECONDS + 25, acted
    assert kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE)["spec"]["leaseTransitions"] == transitions + 1

    new_leader = _wait_operator_running(cluster, kube)
    assert new_leader["metadata"]["name"] == _lease_holder(kube) != leader
    # Rolled out, not only Ready: the status can read Ready while the old pod goes and the new one
    # is not yet listed (seen once in CI: no engine pod right after the status said Ready).
    converged(NS, "tiny", "--max-num-seqs", "12", ENGINE_READY_S)
    assert _kvis(kube, "tiny")["status"]["engine"]["maxNumSeqs"] == 12

    # Converged means still: another resync changes nothing (no new rollout, no new token).
    deployment = kube.get("apps/v1", "Deployment", NS, "tiny")
    replica_sets = kube.list("apps/v1", "ReplicaSet", NS, label_selector=builders.selector_string("tiny"))
    time.sleep(2 * RESYNC_SECONDS + 1)
    assert kube.get("apps/v1", "Deployment", NS, "tiny")["metadata"]["generation"] == \
        deployment["metadata"]["generation"]
    assert len(kube.list("apps/v1", "ReplicaSet", NS, label_selector=builders.selector_string("tiny"))) == \
        len(replica_sets)
    assert kube.get("v1", "Secret", NS, "tiny-admin")["data"]["token"] == token_before
    assert len(kube.list("apps/v1", "Deployment", NS, label_selector=builders.selector_string("tiny"))) == 1


def test_too_many_gpus_is_degraded_naming_the_shortage(cluster, kube, operator, tiny_spec):
    greedy = copy.deepcopy(tiny_spec)
    greedy["metadata"]["name"] = "greedy"
    greedy["spec"]["resources"]["gpus"] = 8  # each fake node has 4

    _apply(cluster, greedy)

    def degraded():
        condition = _condition(_kvis(kube, "greedy"), "Degraded")
        return condition if condition.get("status") == "True" else None

    condition = _wait(cluster, degraded, 60, "greedy to report Degraded")
    assert condition["reason"] == "InsufficientGPU"
    assert "8 free nvidia.com/gpu" in condition["message"] and "Insufficient nvidia.com/gpu" in condition["message"]
    kvis = _kvis(kube, "greedy")
    assert kvis["status"]["phase"] == "Degraded" and _condition(kvis, "Ready")["status"] == "False"
    events = cluster.kubectl("get", "events", "-n", NS, "--field-selector",
                             "involvedObject.kind=InferenceService,involvedObject.name=greedy").stdout
    assert "InsufficientGPU" in events
    cluster.kubectl("delete", "kvis", "greedy", "-n", NS, "--wait=true", "--timeout=60s")


def test_full_example_renders_every_field(cluster, kube, operator):
    full = yaml.safe_load((EXAMPLES / "full.yaml").read_text())
    # Keep the service still while its children are inspected: no autoscaler or tuner moves it.
    full["spec"]["autoscaling"]["enabled"] = False
    full["spec"]["tuning"]["enabled"] = False
    # The example's IfNotPresent is what the API server defaults a tagged image to: it would show unrendered.
    full["spec"]["imagePullPolicy"] = "Always"
    _apply(cluster, full)
    deployment = _wait(cluster, lambda: kube.get("apps/v1", "Deployment", NS, "llama3-8b"), 30, "the Deployment")
    template = deployment["spec"]["template"]
    pod_spec = template["spec"]
    container = pod_spec["containers"][0]
    assert deployment["spec"]["replicas"] == 2
    assert container["image"] == "ghcr.io/kvpilot/kvpilot:0.1.0" and container["imagePullPolicy"] == "Always"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1", "cpu": "8", "memory": "48Gi"}
    args = container["args"]
    assert engine_arg(template, "--max-num-batched-tokens") == "8192" and engine_arg(template, "--dtype") == "bfloat16"
    assert engine_arg(template, "--served-model-name") == "llama3" and args[-2:] == ["--max-waiting-requests", "512"]
    assert engine_arg(template, "--max-num-seqs") == "64" and engine_arg(template, "--gpu-memory-utilization") == "0.9"
    assert engine_arg(template, "--block-size") == "16" and engine_arg(template, "--max-model-len") == "8192"
    assert "--enable-chunked-prefill" in args and "--enable-prefix-caching" in args
    assert engine_arg(template, "--quantization") == "auto" and engine_arg(template, "--tool-call-parser") == "json"
    assert json.loads(engine_arg(template, "--speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "disable_by_batch_size": 4,
    }
    # The client API key reaches the engine from its Secret, never as a value in the pod spec.
    env = {e["name"]: e for e in container["env"]}
    assert env[API_KEY_ENV] == {"name": API_KEY_ENV,
                                "valueFrom": {"secretKeyRef": {"name": "llama3-8b-api-key", "key": "key"}}}
    assert env[CHAT_TEMPLATE_ENV]["value"] == full["spec"]["engine"]["chatTemplate"]
    assert pod_spec["nodeSelector"] == full["spec"]["nodeSelector"]
    assert pod_spec["tolerations"] == full["spec"]["tolerations"]
    assert pod_spec["affinity"] == full["spec"]["affinity"]
    volume = next(v for v in pod_spec["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"]["claimName"] == "models"
    assert _wait(cluster, lambda: kube.get("policy/v1", "PodDisruptionBudget", NS, "llama3-8b"), 30, "the PDB")

    def degraded():
        condition = _condition(_kvis(kube, "llama3-8b"), "Degraded")
        return condition if condition.get("status") == "True" else None

    condition = _wait(cluster, degraded, 60, "llama3-8b to report its missing model volume")
    assert condition["reason"] == "ModelVolumeMissing" and "'models'" in condition["message"]
    cluster.kubectl("delete", "kvis", "llama3-8b", "-n", NS, "--wait=true", "--timeout=60s")


def test_deleting_removes_every_child_and_stops_the_engines(cluster, kube, operator, tiny_model_dir):
    assert _engine_processes(Path(tiny_model_dir).resolve()), "the engine should be running before the delete"
    cluster.kubectl("delete", "kvis", "tiny", "-n", NS, "--wait=true", "--timeout=60s")
    children = (("apps/v1", "Deployment", "tiny"), ("v1", "Service", "tiny"), ("v1", "ConfigMap", "tiny-tuning"),
                ("v1", "Secret", "tiny-admin"), ("policy/v1", "PodDisruptionBudget", "tiny"))
    _wait(cluster, lambda: all(kube.get(v, k, NS, n) is None for v, k, n in children), 60, "every child to go")
    _wait(cluster, lambda: not engine_pods(kube, NS, "tiny"), 60, "the engine pods to go")
    _wait(cluster, lambda: not _engine_processes(Path(tiny_model_dir).resolve()), 60, "the engine processes to stop")
