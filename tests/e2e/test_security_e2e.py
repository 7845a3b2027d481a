"""Security on the local control plane: RBAC, the client API key, the admin port, and no secret leaks.

The chart is installed (namespaced RBAC, its NetworkPolicy on, DEBUG logs) and serves one
InferenceService, `guarded`, whose API key comes from a Secret. Checked:

- the operator's ServiceAccount may make every API call the operator makes (`kubectl auth can-i`
  against OPERATOR_CALLS below) and none of a list it must not (reading every Secret, deleting
  pods, cluster-wide objects), and its log shows no call refused;
- clients need the key on /v1/*; the key is in neither the pod spec nor the engine's command line;
- the admin API answers only on the engines' admin port, which the Service does not expose;
- neither secret (the API key, the engines' admin token) appears in the operator's or the engine's
  log or in any Event of the namespace, in clear or base64.
"""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot import engine_contract as contract
from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders, crd
from kvpilot.operator.kube import Kube

pytestmark = pytest.mark.e2e

NS = "kvpilot-sec"
RELEASE = "sec"
SERVICE_ACCOUNT = f"system:serviceaccount:{NS}:{RELEASE}-kvpilot"
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
API_KEY = "kvpilot-client-key-7c1e95b2d84f3a60"
ENGINE_READY_S = 240
OPERATOR_HEALTH_PORT = 18491

# Every Kubernetes API call the operator makes, as (verb, resource, subresource, name), in the
# namespace it watches unless the resource is the Lease (the release's namespace). Sources:
# operator/kube.py (the only code that calls the API), kopf's watches and Events (handlers.py),
# and leader_election.py.
OPERATOR_CALLS = (
    # kopf: watch InferenceServices, patch them for its finalizer and progress annotations
    ("list", "inferenceservices.kvpilot.io", None, None),
    ("watch", "inferenceservices.kvpilot.io", None, None),
    ("patch", "inferenceservices.kvpilot.io", None, None),
    ("get", "inferenceservices.kvpilot.io", None, None),  # Kube.get_inference_service
    ("patch", "inferenceservices.kvpilot.io", "status", None),  # Kube.patch_status
    ("patch", "inferenceservices.kvpilot.io", "scale", None),  # Kube.scale_inference_service (autoscaler)
    # children: Kube.get, and Kube.apply (server-side apply: create or patch); kopf watches them
    ("get", "deployments.apps", None, None), ("create", "deployments.apps", None, None),
    ("patch", "deployments.apps", None, None), ("list", "deployments.apps", None, None),
    ("watch", "deployments.apps", None, None),
    ("get", "services", None, None), ("create", "services", None, None), ("patch", "services", None, None),
    ("get", "configmaps", None, None), ("create", "configmaps", None, None), ("patch", "configmaps", None, None),
    ("list", "configmaps", None, None), ("watch", "configmaps", None, None),
    ("get", "poddisruptionbudgets.policy", None, None), ("create", "poddisruptionbudgets.policy", None, None),
    ("patch", "poddisruptionbudgets.policy", None, None), ("delete", "poddisruptionbudgets.policy", None, None),
    # the engines' admin token: Kube.create_if_missing once, Kube.get by the control loop
    ("create", "secrets", None, None), ("get", "secrets", None, None),
    # status diagnosis and the control loop's engines: Kube.list, kopf's watch; with the gateway on, also
    # GatewayDemand's list of the gateway's pods in the release's namespace (the watched one here; the chart
    # adds a Role for it when the release's namespace is not watched)
    ("get", "pods", None, None), ("list", "pods", None, None), ("watch", "pods", None, None),
    ("list", "events", None, None),  # Kube.pod_events
    ("create", "events", None, None),  # kopf's Events on InferenceServices
    # leader_election.py, in the release's namespace
    ("create", "leases.coordination.k8s.io", None, None),
    ("get", "leases.coordination.k8s.io", None, f"{RELEASE}-kvpilot"),
    ("patch", "leases.coordination.k8s.io", None, f"{RELEASE}-kvpilot"),
)
# What it never does, and so must not be allowed: read every Secret, change what it does not own.
FORBIDDEN_CALLS = (
    ("list", "secrets", None, None), ("watch", "secrets", None, None), ("update", "secrets", None, None),
    ("delete", "secrets", None, None), ("create", "pods", None, None), ("delete", "pods", None, None),
    ("create", "pods", "exec", None), ("delete", "deployments.apps", None, None),
    ("delete", "inferenceservices.kvpilot.io", None, None), ("create", "roles.rbac.authorization.k8s.io", None, None),
    ("patch", "leases.coordination.k8s.io", None, "someone-elses-lease"),
)


@pytest.fixture(scope="module")
def operator(chart_operator):
    chart_operator(NS, RELEASE, OPERATOR_HEALTH_PORT, "resyncSeconds=5", "networkPolicy.enabled=true", "logLevel=DEBUG")


@pytest.fixture(scope="module")
def guarded(cluster, kube, operator, tiny_model_dir) -> dict:
    """The InferenceService `guarded`, Ready, its API key in the Secret `guarded-clients`; yields its engine pod."""
    cluster.kubectl("create", "secret", "generic", "guarded-clients", "-n", NS, f"--from-literal=api-key={API_KEY}")
    manifest = yaml.safe_load((crd.REPO_ROOT / "examples" / "local-cpu.yaml").read_text())
    manifest["metadata"] = {"name": "guarded", "namespace": NS}
    manifest["spec"]["model"]["uri"] = f"file://{Path(tiny_model_dir).resolve()}"
    manifest["spec"]["apiKeySecretRef"] = {"name": "guarded-clients", "key": "api-key"}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def ready():
        kvis = kube.get_inference_service(NS, "guarded")
        status = (kvis or {}).get("status") or {}
        pods = [p for p in kube.list("v1", "Pod", NS, label_selector=builders.selector_string("guarded"))
                if not p["metadata"].get("deletionTimestamp")]
        return pods[0] if status.get("phase") == "Ready" and len(pods) == 1 else None

    try:
        return wait_until(ready, ENGINE_READY_S, "guarded to be Ready", interval=0.5)
    except AssertionError as exc:
        status = cluster.kubectl("get", "kvis,pods", "-n", NS, "-o", "yaml", check=False).stdout[-6000:]
        raise AssertionError(f"{exc}\n{status}") from None


def _can_i(cluster, call, namespace: str = NS) -> bool:
    verb, resource, subresource, name = call
    target = f"{resource}/{name}" if name else resource
    args = ["auth", "can-i", verb, target, "--as", SERVICE_ACCOUNT, "-n", namespace]
    if subresource:
        args.append(f"--subresource={subresource}")
    result = cluster.kubectl(*args, check=False)
    return result.stdout.strip() == "yes"


def _can_i_all(cluster, calls) -> dict:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(calls, pool.map(lambda call: _can_i(cluster, call), calls)))


def test_rbac_allows_every_call_the_operator_makes(cluster, operator):
    answers = _can_i_all(cluster, OPERATOR_CALLS)
    assert [call for call, allowed in answers.items() if not allowed] == []


def test_rbac_allows_nothing_the_operator_does_not_do(cluster, operator):
    answers = _can_i_all(cluster, FORBIDDEN_CALLS)
    assert [call for call, allowed in answers.items() if allowed] == []
    # Namespaced RBAC: nothing in a namespace it does not watch.
    assert not _can_i(cluster, ("list", "inferenceservices.kvpilot.io", None, None), namespace="default")
    assert not _can_i(cluster, ("get", "secrets", None, None), namespace="default")


def test_clients_need_the_api_key(guarded):
    base = f"http://{guarded['status']['podIP']}:{contract.ENGINE_PORT}"
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    response = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "guarded", "prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert response.status_code == 200, response.text
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200  # probes need no key


def test_the_key_is_in_neither_the_pod_spec_nor_the_command_line(kube, guarded):
    deployment = kube.get("apps/v1", "Deployment", NS, "guarded")
    assert API_KEY not in json.dumps(deployment) and API_KEY not in json.dumps(guarded)
    (container,) = guarded["spec"]["containers"]
    key_env = next(e for e in container["env"] if e["name"] == contract.API_KEY_ENV)
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "guarded-clients", "key": "api-key"}
    command_lines = [p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if _readable(p)]
    serving = [c for c in command_lines if b"serve" in c and b"--served-model-name\0guarded" in c]
    assert serving and not any(API_KEY.encode() in c for c in serving)


def _readable(path: Path) -> bool:
    try:
        path.read_bytes()
    except OSError:
        return False
    return True


def test_the_admin_api_is_on_its_own_port_which_the_service_does_not_expose(cluster, kube, guarded):
    token = builders.admin_token(kube.get("v1", "Secret", NS, builders.admin_secret_name("guarded")))
    headers = {"Authorization": f"Bearer {token}"}
    ip = guarded["status"]["podIP"]
    on_api_port = httpx.get(f"http://{ip}:{contract.ENGINE_PORT}{contract.ADMIN_SCHEDULER_PATH}", headers=headers)
    assert on_api_port.status_code == 404
    on_admin_port = httpx.get(f"http://{ip}:{contract.ADMIN_PORT}{contract.ADMIN_SCHEDULER_PATH}", headers=headers)
    assert on_admin_port.status_code == 200 and on_admin_port.json()["max_num_seqs"] == 16
    service = kube.get("v1", "Service", NS, "guarded")
    assert [p["port"] for p in service["spec"]["ports"]] == [contract.ENGINE_PORT]
    # The chart's NetworkPolicy, admitted by the API server (the local cluster does not enforce it).
    policy = json.loads(cluster.kubectl("get", "networkpolicy", f"{RELEASE}-kvpilot-engines", "-n", NS,
                                        "-o", "json").stdout)
    assert policy["spec"]["ingress"][1]["ports"] == [{"port": "admin", "protocol": "TCP"}]


def test_no_secret_in_logs_or_events(cluster, kube, guarded):
    token = builders.admin_token(kube.get("v1", "Secret", NS, builders.admin_secret_name("guarded")))
    secrets = {"API key": API_KEY, "admin token": token}
    secrets |= {f"{what} (base64)": base64.b64encode(value.encode()).decode() for what, value in list(secrets.items())}
    operators = kube.list("v1", "Pod", NS, label_selector=OPERATOR_SELECTOR)
    logs = {f"operator {p['metadata']['name']}": cluster.pod_log(NS, p["metadata"]["name"], "operator")
            for p in operators}
    logs[f"engine {guarded['metadata']['name']}"] = cluster.pod_log(NS, guarded["metadata"]["name"],
                                                                    builders.CONTAINER_NAME)
    logs["events"] = cluster.kubectl("get", "events", "-n", NS, "-o", "json").stdout
    assert all(logs.values()), {where: len(text) for where, text in logs.items()}  # something was read
    leaks = [(what, where) for what, value in secrets.items() for where, text in logs.items() if value in text]
    assert leaks == []
    # The operator's RBAC sufficed for everything it did.
    for where, text in logs.items():
        if where.startswith("operator"):
            assert "Forbidden" not in text and " 403" not in text, where
