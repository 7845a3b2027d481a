"""The chart's gateway: off by default; when on, its own Deployment, Service and least-privilege RBAC, and the
operator reports its URL as every service's status.url."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from kvpilot.operator import crd

CHART = crd.REPO_ROOT / "charts" / "kvpilot"
KUBE_VERSION = ("--kube-version", "1.37.2")


def _helm() -> str:
    from kvpilot.localcluster.build import BuildError, bin_dir

    try:
        candidate = bin_dir() / "helm"
    except BuildError:
        candidate = None
    if candidate is not None and candidate.exists():
        return str(candidate)
    found = shutil.which("helm")
    if found is None:
        pytest.skip("helm is not built yet: run `kvpilot local-cluster build` (scripts/setup.sh does)")
    return found


def _render(*sets: str) -> list[dict]:
    result = subprocess.run([_helm(), "template", "kv", str(CHART), "--namespace", "kvpilot-system", *KUBE_VERSION,
                             *sets], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _gateway_docs(docs: list[dict]) -> list[dict]:
    return [d for d in docs if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "gateway"]


def _operator_env(docs: list[dict]) -> dict:
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kv-kvpilot")
    return {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_gateway_is_off_by_default():
    docs = _render()
    assert _gateway_docs(docs) == [] and "KVPILOT_GATEWAY_URL" not in _operator_env(docs)


def test_enabled_it_gets_a_deployment_a_service_and_its_own_account():
    docs = _render("--set", "gateway.enabled=true", "--set", "gateway.replicaCount=3")
    gateway = {(d["kind"], d["metadata"]["name"]) for d in _gateway_docs(docs)}
    assert gateway == {("Deployment", "kv-kvpilot-gateway"), ("Service", "kv-kvpilot-gateway"),
                       ("ServiceAccount", "kv-kvpilot-gateway"), ("ClusterRole", "kv-kvpilot-gateway"),
                       ("ClusterRoleBinding", "kv-kvpilot-gateway")}
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kv-kvpilot-gateway")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3 and pod["serviceAccountName"] == "kv-kvpilot-gateway"
    (container,) = pod["containers"]
    assert container["args"][:2] == ["gateway", "--all-namespaces"] and "--port=8000" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert _operator_env(docs)["KVPILOT_GATEWAY_URL"] == "http://kv-kvpilot-gateway.kvpilot-system.svc.cluster.local:80"


def test_its_rbac_reads_services_and_pods_and_may_only_scale():
    role = next(d for d in _render("--set", "gateway.enabled=true")
                if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "kv-kvpilot-gateway")
    granted = {(rule["apiGroups"][0], resource, verb) for rule in role["rules"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    read = {"get", "list", "watch"}
    assert granted == {("kvpilot.io", "inferenceservices", v) for v in read} | {("", "pods", v) for v in read} \
        | {("kvpilot.io", "inferenceservices/scale", v) for v in ("get", "patch")}


def test_namespaced_scope_routes_only_to_the_watched_namespaces():
    docs = _render("--set", "gateway.enabled=true", "--set", "rbac.scope=namespaced",
                   "--set", "rbac.watchNamespaces={ml,research}")
    roles = [d for d in _gateway_docs(docs) if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    assert not [d for d in _gateway_docs(docs) if d["kind"].startswith("Cluster")]
    deployment = next(d for d in _gateway_docs(docs) if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=research" in args and "--all-namespaces" not in args


def test_local_cluster_settings_host_port_pod_ip_and_url():
    docs = _render("--set", "gateway.enabled=true", "--set", "gateway.hostPort=18000", "--set", "bindPodIP=true",
                   "--set", "gateway.url=http://127.0.0.1:18000/")
    deployment = next(d for d in _gateway_docs(docs) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["hostPort"] == 18000
    assert "--host=$(POD_IP)" in container["args"]
    assert container["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert _operator_env(docs)["KVPILOT_GATEWAY_URL"] == "http://127.0.0.1:18000"


def test_helm_lint_is_clean_with_the_gateway():
    result = subprocess.run([_helm(), "lint", "--strict", str(CHART), "--set", "gateway.enabled=true",
                             "--set", "gateway.hostPort=8000"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_engines_network_policy_admits_the_gateway():
    docs = _render("--set", "gateway.enabled=true", "--set", "networkPolicy.enabled=true",
                   "--set", "networkPolicy.namespaces={ml}",
                   "--set-json", 'networkPolicy.apiFrom=[{"podSelector":{"matchLabels":{"app":"prometheus"}}}]')
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    api_peers = policy["spec"]["ingress"][0]["from"]
    gateway = next(d for d in _gateway_docs(docs) if d["kind"] == "Deployment")
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpilot-system"}},
            "podSelector": deployment_selector(gateway)} in api_peers
    without = _render("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={ml}",
                      "--set-json", 'networkPolicy.apiFrom=[{"podSelector":{"matchLabels":{"app":"x"}}}]')
    (policy,) = [d for d in without if d["kind"] == "NetworkPolicy"]
    assert len(policy["spec"]["ingress"][0]["from"]) == 2  # apiFrom's peer and the operator


def deployment_selector(deployment: dict) -> dict:
    return {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}
