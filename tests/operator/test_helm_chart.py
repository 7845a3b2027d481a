"""The Helm chart: every value documented, CRDs in sync, `helm lint` clean, RBAC as narrow as promised,
leader election for more than one replica, monitors only where they can exist, the dashboard shipped,
and the gateway: off by default; when on, its own Deployment, Service and least-privilege RBAC, and the
operator reports its URL as every service's status.url."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from kvpilot.operator import crd

CHART = crd.REPO_ROOT / "charts" / "kvpilot"
# `helm template` renders for a pretend cluster; the chart requires a recent one.
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


def _undocumented_keys(text: str) -> list[str]:
    """helm-docs' rule: a key is documented by a `# --` comment above it, or by a documented ancestor."""
    missing = []
    open_keys: list[tuple[int, bool]] = []  # (indent, documented) of the keys enclosing this line
    comment_pending = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment_pending = True
            continue
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        open_keys = [(i, doc) for i, doc in open_keys if i < indent]
        documented = comment_pending or any(doc for _, doc in open_keys)
        has_inline_value = bool(line.split(":", 1)[1].split("#", 1)[0].strip())
        if not documented and has_inline_value:  # a bare parent is documented through its children
            missing.append(match.group(2))
        open_keys.append((indent, documented))
        comment_pending = False
    return missing


def test_every_value_has_a_doc_comment():
    assert _undocumented_keys((CHART / "values.yaml").read_text()) == []


def test_doc_check_catches_an_undocumented_value():
    assert _undocumented_keys("# -- documented\na: 1\nb: 2\nc:\n  d: 3\n# -- whole map\ne:\n  f: 4\n") == ["b", "d"]


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / crd.CRD_FILE_NAME).read_text() == crd.render_crd()


def test_helm_lint_is_clean():
    helm = _helm()
    for scope in ("cluster", "namespaced"):
        result = subprocess.run([helm, "lint", "--strict", str(CHART), "--set", f"rbac.scope={scope}"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def _render(*sets: str) -> list[dict]:
    result = subprocess.run([_helm(), "template", "kv", str(CHART), "--namespace", "kvpilot-system", *KUBE_VERSION, *sets],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_cluster_scope_renders_a_cluster_role_and_watches_everything():
    docs = _render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "Role", "RoleBinding",
                     "ServiceAccount"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVPILOT_NAMESPACES"] == "*" and container["args"] == ["operator"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_namespaced_scope_renders_a_role_per_namespace():
    docs = _render("--set", "rbac.scope=namespaced", "--set", "rbac.watchNamespaces={ml,research}")
    roles = [d for d in docs if d["kind"] == "Role" and not d["metadata"]["name"].endswith("-leader-election")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    assert not [d for d in docs if d["kind"].startswith("Cluster")]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVPILOT_NAMESPACES"] == "ml,research"


@pytest.mark.parametrize("scope, operator_roles", [
    ("cluster", {("ClusterRole", None)}),
    ("namespaced", {("Role", "ml"), ("Role", "research")}),
])
def test_rbac_grants_no_wildcards_and_no_secret_reads_beyond_get(scope, operator_roles):
    docs = _render("--set", f"rbac.scope={scope}", "--set", "rbac.watchNamespaces={ml,research}",
                   "--set", "gateway.enabled=true", "--set", "replicaCount=2")
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    secrets = []
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            if "secrets" in rule["resources"]:
                secrets.append((role["kind"], role["metadata"]["name"], role["metadata"].get("namespace"),
                                sorted(rule["verbs"])))
    # The operator creates each service's admin-token Secret and reads it back by name; nothing more
    # (list or watch would read every Secret of the namespace), and no other role touches Secrets.
    assert sorted(secrets) == sorted((kind, "kv-kvpilot", namespace, ["create", "get"])
                                     for kind, namespace in operator_roles)


def _env(docs: list[dict]) -> dict:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_two_replicas_elect_a_leader_through_a_lease_they_alone_may_write():
    docs = _render("--set", "replicaCount=2")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    env = _env(docs)
    assert env["KVPILOT_LEADER_ELECTION_LEASE"] == "kvpilot-system/kv-kvpilot"
    assert env["KVPILOT_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kv-kvpilot-leader-election")
    assert role["metadata"]["namespace"] == "kvpilot-system"
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kv-kvpilot"],
                      "verbs": ["get", "patch"]}]


def test_more_than_one_replica_without_leader_election_is_refused():
    result = subprocess.run([_helm(), "template", "kv", str(CHART), *KUBE_VERSION, "--set", "replicaCount=2",
                             "--set", "leaderElection.enabled=false"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "replicaCount > 1 needs leaderElection.enabled" in result.stderr
    single = _render("--set", "leaderElection.enabled=false")
    assert "KVPILOT_LEADER_ELECTION_LEASE" not in _env(single)
    assert next(d for d in single if d["kind"] == "Deployment")["spec"]["strategy"] == {"type": "Recreate"}


def test_bind_pod_ip_makes_the_operator_listen_on_it():
    env = _env(_render("--set", "bindPodIP=true"))
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}} and env["KVPILOT_LISTEN_ADDRESS"] == "$(POD_IP)"
    assert "KVPILOT_LISTEN_ADDRESS" not in _env(_render())


def _pod_monitors(*sets: str) -> list[dict]:
    return [d for d in _render(*sets) if d["kind"] == "PodMonitor"]


def test_pod_monitors_only_where_the_prometheus_operator_is_or_when_asked():
    assert _pod_monitors() == []  # auto, and the cluster does not serve PodMonitors
    assert _pod_monitors("--set", "monitoring.podMonitor.enabled=false",
                         "--api-versions", "monitoring.coreos.com/v1/PodMonitor") == []
    engines, operator = _pod_monitors("--api-versions", "monitoring.coreos.com/v1/PodMonitor")
    assert engines["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert engines["spec"]["namespaceSelector"] == {"any": True}
    endpoint = engines["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "http" and endpoint["relabelings"][0]["targetLabel"] == "service"
    assert operator["spec"]["podMetricsEndpoints"][0] == {"port": "metrics", "path": "/metrics", "interval": "15s",
                                                          "honorLabels": True}
    asked = _pod_monitors("--set", "monitoring.podMonitor.enabled=true", "--set", "rbac.scope=namespaced",
                          "--set", "rbac.watchNamespaces={ml}", "--set", "monitoring.podMonitor.labels.release=prom")
    assert asked[0]["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    assert asked[0]["metadata"]["labels"]["release"] == "prom"


def test_a_bad_pod_monitor_setting_fails_with_a_message():
    result = subprocess.run([_helm(), "template", "kv", str(CHART), *KUBE_VERSION,
                             "--set", "monitoring.podMonitor.enabled=sometimes"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "monitoring.podMonitor.enabled must be auto, true or false" in result.stderr


def test_the_dashboard_ships_for_grafanas_sidecar():
    (configmap,) = [d for d in _render() if d["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["kvpilot.json"]) == json.loads((CHART / "dashboards" / "kvpilot.json").read_text())
    assert not [d for d in _render("--set", "monitoring.grafanaDashboard.enabled=false") if d["kind"] == "ConfigMap"]


def test_bad_scope_fails_with_a_message():
    result = subprocess.run([_helm(), "template", "kv", str(CHART), *KUBE_VERSION, "--set", "rbac.scope=everything"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "rbac.scope must be cluster or namespaced" in result.stderr


def test_network_policy_is_off_by_default_and_keeps_the_admin_port_to_the_operator():
    assert not [d for d in _render() if d["kind"] == "NetworkPolicy"]
    docs = _render("--set", "networkPolicy.enabled=true", "--set", "rbac.scope=namespaced",
                   "--set", "rbac.watchNamespaces={ml,research}")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["ml", "research"]
    policy = policies[0]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kvpilot",
                                                    "app.kubernetes.io/component": "engine"}
    api, admin = policy["ingress"]
    assert api == {"ports": [{"port": "http", "protocol": "TCP"}]}  # no apiFrom: open to all
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpilot-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/instance": "kv",
                                                "app.kubernetes.io/component": "operator"}}}
    assert admin == {"ports": [{"port": "admin", "protocol": "TCP"}], "from": [operator]}


def test_network_policy_api_peers_keep_the_operator_able_to_scrape():
    docs = _render("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.namespaces={ml}",
                   "--set-json", 'networkPolicy.apiFrom=[{"podSelector":{"matchLabels":{"app":"gateway"}}}]')
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["namespace"] == "ml"
    api_peers = policy["spec"]["ingress"][0]["from"]
    assert api_peers[0] == {"podSelector": {"matchLabels": {"app": "gateway"}}}
    assert api_peers[1]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"


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


def test_the_operator_finds_the_gateway_pods_to_read_their_held_requests():
    docs = _render("--set", "gateway.enabled=true")
    env = _operator_env(docs)
    gateway = next(d for d in _gateway_docs(docs) if d["kind"] == "Deployment")
    labels = gateway["spec"]["selector"]["matchLabels"]
    assert env["KVPILOT_GATEWAY_NAMESPACE"] == "kvpilot-system"
    assert dict(pair.split("=") for pair in env["KVPILOT_GATEWAY_SELECTOR"].split(",")) == labels
    assert "KVPILOT_GATEWAY_SELECTOR" not in _operator_env(_render())
    # Cluster scope lists pods everywhere; a watched release namespace has the operator's Role already.
    for sets in ((), ("--set", "rbac.scope=namespaced")):
        assert not [d for d in _render("--set", "gateway.enabled=true", *sets)
                    if d["metadata"]["name"] == "kv-kvpilot-gateway-demand"]
    # Watching other namespaces only: a Role to list pods in the release's namespace, nothing more.
    docs = _render("--set", "gateway.enabled=true", "--set", "rbac.scope=namespaced",
                   "--set", "rbac.watchNamespaces={ml}")
    role, binding = (next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == "kv-kvpilot-gateway-demand")
                     for kind in ("Role", "RoleBinding"))
    assert role["metadata"]["namespace"] == "kvpilot-system"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kv-kvpilot", "namespace": "kvpilot-system"}]
