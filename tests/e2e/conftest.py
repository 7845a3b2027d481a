"""What every end-to-end module shares: the session's local cluster, a Kube client on it, the chart's
operator installed in a namespace, the check that the operator made each child of a service at
most once, the wait for a service to converge, and client threads loading a service's engine pods."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders, crd
from kvpilot.operator.kube import Kube
from kvpilot.kube_contract import pod_ready, pod_url

from .service_reads import engine_arg, engine_pods


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


class EngineLoad:
    """Client threads posting completions to a service's Ready engine pods; counts what failed.
    ``body(n)`` is the n-th request's body (n counts every request sent, from 0)."""

    def __init__(self, kube: Kube, namespace: str, name: str, clients: int, body: Callable[[int], dict[str, Any]]):
        self.kube, self.namespace, self.name, self.body = kube, namespace, name, body
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.ok = 0
        self.not_routed = 0  # turned away before any work: a pod that just went away or is draining
        self.failures: list[str] = []
        self.targets: list[str] = []
        self.active = clients
        self.pause = 0.0  # seconds each client waits between requests
        self._numbers = itertools.count()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        self._refresh = threading.Thread(target=self._refresh_targets, daemon=True)

    def __enter__(self) -> EngineLoad:
        self._refresh_once()
        self._refresh.start()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def resize(self, clients: int, pause: float = 0.0) -> None:
        """Keeps only the first ``clients`` threads sending, each waiting ``pause`` s between requests."""
        self.active, self.pause = clients, pause

    def _refresh_once(self) -> None:
        pods = engine_pods(self.kube, self.namespace, self.name)
        self.targets = [pod_url(p["status"]["podIP"]) for p in pods if pod_ready(p) and p["status"].get("podIP")]

    def _refresh_targets(self) -> None:
        while not self.stop_event.wait(0.5):
            self._refresh_once()

    def _client(self, index: int) -> None:
        # A new connection per request: a request written on a kept-alive connection just as a
        # drained pod's server closes it is reset (ReadError) though the pod drained correctly; a
        # new connection to a closed server is refused instead (not routed), and a request the pod
        # accepted and then dropped still fails the test.
        with httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not self.stop_event.is_set():
                if index >= self.active or not self.targets:
                    time.sleep(0.5)
                    continue
                time.sleep(self.pause)
                target = self.targets[index % len(self.targets)]
                try:
                    response = client.post(f"{target}/v1/completions", json=self.body(next(self._numbers)))
                except httpx.ConnectError:
                    with self.lock:
                        self.not_routed += 1
                    continue
                except httpx.HTTPError as exc:
                    with self.lock:
                        self.failures.append(f"{target}: {type(exc).__name__}: {exc}")
                    continue
                with self.lock:
                    if response.status_code == 200:
                        self.ok += 1
                    elif response.status_code == 503 and "shutting_down" in response.text:
                        # A draining pod turns new requests away for another replica, as a
                        # load balancer would retry (rare: the preStop sleep lets this client's
                        # target list drop the pod before the engine drains).
                        self.not_routed += 1
                    else:
                        self.failures.append(f"{target}: HTTP {response.status_code}: {response.text[:200]}")


@pytest.fixture(scope="module")
def engine_load(kube):
    """``engine_load(namespace, name, clients, body)``: an :class:`EngineLoad` on the service's pods, to
    run in a ``with`` block."""
    def make(namespace: str, name: str, clients: int, body: Callable[[int], dict[str, Any]]) -> EngineLoad:
        return EngineLoad(kube, namespace, name, clients, body)

    return make
