"""What every end-to-end module shares: the session's local cluster, a Kube client on it, the chart's
operator installed in a namespace, the check that the operator made each child of a service at
most once, and the wait for a service to converge."""

from __future__ import annotations

import pytest

from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders, crd
from kvpilot.operator.kube import Kube
from kvpilot.kube_contract import pod_ready


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster


@pytest.fixture(scope="module")
def kube(cluster) -> Kube:
    return Kube(cluster.api_client())


@pytest.fixture(scope="module")
def chart_operator(cluster, kube):
    """``install(namespace, release, health_port, *settings)``: the chart installed as ``release`` in a
    new ``namespace`` (namespaced RBAC, pods on their IPs, short engine grace periods, a long startup
    allowance, the operator on ``health_port`` and the next port, plus ``settings`` as `--set`
    values), its operator pod Ready.
    At the module's end the services, the releases and the namespaces go."""
    installed: list[tuple[str, str]] = []

    def install(namespace: str, release: str, health_port: int, *settings: str) -> None:
        cluster.kubectl("create", "namespace", namespace)
        installed.append((namespace, release))
        base = ("rbac.scope=namespaced", "engine.bindPodIP=true", "bindPodIP=true", "engine.shutdownGraceSeconds=2",
                "engine.drainSeconds=1", "engine.startupSeconds=600", f"healthPort={health_port}",
                f"metricsPort={health_port + 1}")
        cluster.helm("install", release, str(crd.REPO_ROOT / "charts" / "kvpilot"), "--namespace", namespace,
                     *(arg for value in (*base, *settings) for arg in ("--set", value)))
        selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
        wait_until(lambda: [p for p in kube.list("v1", "Pod", namespace, label_selector=selector) if pod_ready(p)],
                   90, "the operator pod to be ready", interval=0.5)

    yield install
    for namespace, release in installed:
        cluster.kubectl("delete", "kvis", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
        cluster.helm("uninstall", release, "--namespace", namespace, "--wait", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def children_once(kube):
    """``check(namespace, name)``: the service's Deployment, Service, tuning ConfigMap and admin Secret
    (among the objects labeled for it, not being deleted) each there at most once; returns them by kind."""
    def check(namespace: str, name: str) -> dict[str, dict]:
        children = (("apps/v1", "Deployment", name), ("v1", "Service", name),
                    ("v1", "ConfigMap", builders.tuning_configmap_name(name)),
                    ("v1", "Secret", builders.admin_secret_name(name)))
        found = {}
        for api_version, kind, child in children:
            objects = [o for o in kube.list(api_version, kind, namespace,
                                            label_selector=f"{builders.INSTANCE_LABEL}={name}")
                       if not o["metadata"].get("deletionTimestamp")]
            assert [o["metadata"]["name"] for o in objects] in ([], [child]), f"duplicate {kind}: {objects}"
            if objects:
                found[kind] = objects[0]
        return found

    return check


def engine_arg(pod_or_template: dict, flag: str) -> str:
    """The value of one `kvpilot serve` flag in an engine pod's (or pod template's) arguments."""
    args = pod_or_template["spec"]["containers"][0]["args"]
    return args[args.index(flag) + 1]


def engine_pods(kube: Kube, namespace: str, name: str) -> list[dict]:
    """The service's engine pods that are not being deleted."""
    pods = kube.list("v1", "Pod", namespace, label_selector=builders.selector_string(name))
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


@pytest.fixture(scope="module")
def converged(cluster, kube, children_once):
    """``wait(namespace, name, flag, value, timeout)``: until the service serves its spec (Ready, neither
    Progressing nor Degraded, at its generation; each child there once; the Deployment, at one replica
    whose engine has ``flag value``, rolled out to one Ready pod of that template); returns the children.
    On a timeout the error carries `kubectl get` of the namespace."""
    def wait(namespace: str, name: str, flag: str, value: str, timeout: float) -> dict[str, dict]:
        def done() -> dict[str, dict] | None:
            kvis = kube.get_inference_service(namespace, name) or {}
            status = kvis.get("status") or {}
            children = children_once(namespace, name)
            if len(children) < 4 or not pod_ready(kvis):  # Deployment, Service, ConfigMap, Secret
                return None
            generation = kvis["metadata"]["generation"]
            conditions = {c["type"]: c["status"] for c in status.get("conditions", [])
                          if c.get("observedGeneration") == generation}
            if status.get("observedGeneration") != generation or status.get("readyReplicas") != 1 \
                    or conditions != {"Ready": "True", "Progressing": "False", "Degraded": "False"}:
                return None
            deployment = children["Deployment"]
            rollout = deployment.get("status") or {}
            if engine_arg(deployment["spec"]["template"], flag) != value or deployment["spec"]["replicas"] != 1:
                return None
            if (rollout.get("updatedReplicas"), rollout.get("readyReplicas"), rollout.get("replicas")) != (1, 1, 1):
                return None
            pods = engine_pods(kube, namespace, name)
            if len(pods) != 1 or not pod_ready(pods[0]) or engine_arg(pods[0], flag) != value:
                return None
            return children

        try:
            return wait_until(done, timeout, f"{name} converged at {flag} {value}", interval=0.5)
        except AssertionError as exc:
            state = cluster.kubectl("get", "kvis,deploy,rs,pods,svc,cm,secret", "-n", namespace, "-o", "wide",
                                    check=False)  # fmt: skip
            raise AssertionError(f"{exc}\n{state.stdout}") from None

    return wait
