"""The gateway end to end, on the local control plane: one URL in front of two InferenceServices.

The chart runs the operator and the gateway (namespaced RBAC, their own namespace and
ports); the gateway's hostPort is forwarded from 127.0.0.1 by the local kubelet, so the
tests reach it as a user on the host would. Two services, `alpha` and `beta`, serve a
generated tiny model from real `kvpilot serve` processes on the CPU. The tests run in
file order and share the services: routing by model (plain and streamed, through the
official openai client), then a pod killed under load and a scale-down under load, with
no failed request that had not started streaming; a service at zero replicas woken by its first
request; the autoscaler taking an idle service to zero, which a request wakes again; and a request
held for a service whose replica cannot start, which the autoscaler counts as demand while it waits.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from kvpilot import gateway_contract as gateway
from kvpilot.kube_contract import pod_ready
from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders, crd
from kvpilot.operator.kube import Kube

from .service_reads import engine_pods

pytestmark = pytest.mark.e2e

NS = "kvpilot-gateway-e2e"
RELEASE = "kvg"
OPERATOR_HEALTH_PORT = 18501  # pods share the host's network: clear of the other e2e suites' ports
ENGINE_READY_S = 300  # two engines import torch and load the model on 2 shared cores
SERVICES = {"alpha": "alpha", "beta": "beta-model"}  # InferenceService -> servedName


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def gateway_url(cluster, kube, tiny_model_dir) -> str:
    """The chart with its gateway on a hostPort, and both services applied; the gateway's base URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cluster.kubectl("create", "namespace", NS)
    cluster.helm(
        "install", RELEASE, str(crd.REPO_ROOT / "charts" / "kvpilot"), "--namespace", NS,
        "--set", "rbac.scope=namespaced",
        "--set", "engine.bindPodIP=true",
        "--set", "engine.shutdownGraceSeconds=10",
        "--set", "engine.drainSeconds=2",
        "--set", "bindPodIP=true",
        "--set", f"healthPort={OPERATOR_HEALTH_PORT}",
        "--set", f"metricsPort={OPERATOR_HEALTH_PORT + 1}",
        "--set", "resyncSeconds=5",
        "--set", "tuning.intervalSeconds=5",  # the autoscaler's interval for services that name none
        "--set", "gateway.enabled=true",
        "--set", f"gateway.hostPort={port}",
        "--set", f"gateway.url={url}",
        "--set", "gateway.drainSeconds=1",
    )
    for name, served in SERVICES.items():
        _apply(cluster, _service(name, served, tiny_model_dir))
    _wait(cluster, lambda: _get(url + gateway.HEALTH_PATH).status_code == 200, 120, "the gateway to be healthy")
    yield url
    for name in SERVICES:
        cluster.kubectl("delete", "kvis", name, "-n", NS, "--wait=true", "--timeout=60s", check=False)
    cluster.helm("uninstall", RELEASE, "--namespace", NS, "--wait", check=False)
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _service(name: str, served: str, model_dir) -> dict:
    return {
        "apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"uri": f"file://{Path(model_dir).resolve()}", "servedName": served},
            "resources": {"gpus": 1},
            "engine": {"maxNumSeqs": 8, "maxModelLen": 512,
                       "extraArgs": ["--device", "cpu", "--kv-cache-memory", "64MiB"]},
        },
    }


def _apply(cluster, manifest: dict) -> None:
    cluster.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(manifest))


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=10)


def _diagnostics(cluster, kube) -> str:
    parts = [cluster.kubectl("get", "kvis,pods", "-n", NS, "-o", "wide", check=False).stdout]
    for pod in kube.list("v1", "Pod", NS, label_selector="app.kubernetes.io/component=gateway"):
        parts.append(f"--- gateway {pod['metadata']['name']} log tail:\n"
                     + cluster.pod_log(NS, pod["metadata"]["name"], "gateway")[-4000:])
    return "\n".join(parts)


def _wait(cluster, predicate, timeout: float, what: str):
    try:
        return wait_until(predicate, timeout, what, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diagnostics(cluster, Kube(cluster.api_client()))}") from None


def _ready_pods(kube, name: str) -> list[str]:
    return sorted(f"{NS}/{p['metadata']['name']}" for p in engine_pods(kube, NS, name) if pod_ready(p))


def _routable(url: str, model: str, ready: int) -> bool:
    models = {m["id"]: m for m in _get(url + "/v1/models").json()["data"]}
    return model in models and models[model]["ready_replicas"] == ready


def _complete(url: str, model: str, prompt: str, max_tokens: int = 4, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


def test_two_services_behind_one_gateway_are_routed_by_model(cluster, kube, gateway_url):
    for name, served in SERVICES.items():
        _wait(cluster, lambda s=served: _routable(gateway_url, s, 1), ENGINE_READY_S, f"{name} routable and Ready")
    listed = sorted(m["id"] for m in _get(gateway_url + "/v1/models").json()["data"])
    assert listed == sorted(SERVICES.values())

    for name, served in SERVICES.items():
        response = _complete(gateway_url, served, "Hello")
        assert response.status_code == 200, response.text
        assert response.json()["model"] == served and response.json()["usage"]["completion_tokens"] == 4
        assert response.headers[gateway.POD_HEADER] in _ready_pods(kube, name)
        status = kube.get_inference_service(NS, name)["status"]
        assert status["url"] == f"{gateway_url}/v1"

    import openai

    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="beta-model", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, stream=True)
    chunks = [c for c in stream]
    assert len(chunks) >= 2 and all(c.model == "beta-model" for c in chunks)
    with pytest.raises(openai.NotFoundError, match="Available models: alpha, beta-model"):
        client.completions.create(model="gamma", prompt="x", max_tokens=1)


def _load(url: str, model: str, requests: int, results: list, max_tokens: int = 24) -> list[threading.Thread]:
    """Non-streamed requests from client threads, each with its own prompt; results collect (status, text)."""
    def one(i: int) -> None:
        try:
            response = _complete(url, model, f"request {i}: " + "tell me more " * (i % 5), max_tokens)
            results.append((response.status_code, response.text[:300]))
        except httpx.HTTPError as exc:
            results.append((0, repr(exc)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for thread in threads:
        thread.start()
    return threads


def _retries(url: str, model: str) -> float:
    """The gateway's kvpilot_gateway_retries_total for ``model``, all reasons."""
    total = 0.0
    for line in _get(url + gateway.METRICS_PATH).text.splitlines():
        if line.startswith(gateway.RETRIES + "{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _in_flight(url: str, model: str) -> float:
    for line in _get(url + gateway.METRICS_PATH).text.splitlines():
        if line.startswith(gateway.IN_FLIGHT + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_pod_killed_under_load_fails_no_request(cluster, kube, gateway_url):
    cluster.kubectl("scale", "kvis/alpha", "-n", NS, "--replicas=2")
    _wait(cluster, lambda: _routable(gateway_url, "alpha", 2), ENGINE_READY_S, "alpha with 2 Ready replicas")
    retries_before = _retries(gateway_url, "alpha")
    results: list = []
    threads = _load(gateway_url, "alpha", 16, results, max_tokens=400)
    wait_until(lambda: _in_flight(gateway_url, "alpha") >= 12, 30, "requests in flight on both pods", interval=0.05)
    victim = _ready_pods(kube, "alpha")[0].split("/")[1]
    cluster.kubectl("delete", "pod", victim, "-n", NS, "--grace-period=0", "--force")
    for thread in threads:
        thread.join(180)
    assert [r for r in results if r[0] != 200] == [] and len(results) == 16
    # The killed pod's requests were in flight, none streaming: each went to the other pod.
    assert _retries(gateway_url, "alpha") > retries_before


def test_scaling_down_under_load_fails_no_request(cluster, kube, gateway_url):
    _wait(cluster, lambda: _routable(gateway_url, "alpha", 2), ENGINE_READY_S, "alpha back to 2 Ready replicas")
    results: list = []
    threads = _load(gateway_url, "alpha", 16, results, max_tokens=400)
    wait_until(lambda: _in_flight(gateway_url, "alpha") >= 12, 30, "requests in flight on both pods", interval=0.05)
    cluster.kubectl("scale", "kvis/alpha", "-n", NS, "--replicas=1")
    for thread in threads:
        thread.join(180)
    assert [r for r in results if r[0] != 200] == [] and len(results) == 16
    _wait(cluster, lambda: _routable(gateway_url, "alpha", 1), 60, "alpha down to 1 Ready replica")
    assert _complete(gateway_url, "alpha", "after").status_code == 200


def test_a_service_at_zero_replicas_answers_its_first_request_after_the_cold_start(cluster, kube, gateway_url,
                                                                                   smollm2_gguf):
    for name, served in SERVICES.items():  # the node's other engines up and idle, as after the tests before
        _wait(cluster, lambda s=served: _routable(gateway_url, s, 1), ENGINE_READY_S, f"{name} routable and Ready")
    cold = _service("cold", "cold", smollm2_gguf)  # the demo's real model file: the cold start a user sees
    cold["spec"]["replicas"] = 0
    _apply(cluster, cold)
    _wait(cluster, lambda: _routable(gateway_url, "cold", 0), 60, "cold listed by the gateway at zero replicas")
    assert kube.get_inference_service(NS, "cold")["spec"]["replicas"] == 0
    started = time.monotonic()
    response = _complete(gateway_url, "cold", "Wake up", timeout=ENGINE_READY_S)  # held while a replica starts
    cold_start = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert kube.get_inference_service(NS, "cold")["spec"]["replicas"] == 1  # the gateway asked for it
    metrics = _get(gateway_url + gateway.METRICS_PATH).text
    assert f'{gateway.HELD_REQUESTS}{{model="cold"}} 0.0' in metrics
    pod = kube.list("v1", "Pod", NS, label_selector=builders.selector_string("cold"))[0]
    ready = next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c["type"] == "Ready")
    created_to_ready = (datetime.fromisoformat(ready) - datetime.fromisoformat(pod["metadata"]["creationTimestamp"]))
    print(f"\ncold start from zero replicas to the first completion through the gateway: {cold_start:.1f} s "
          f"(SmolLM2 GGUF; the pod created -> Ready: {created_to_ready.total_seconds():.0f} s, to the second)")
    cluster.kubectl("delete", "kvis", "cold", "-n", NS, "--wait=true", "--timeout=60s")


def test_autoscaling_takes_an_idle_service_to_zero_and_a_request_wakes_it(cluster, kube, gateway_url,
                                                                          tiny_model_dir):
    idle = _service("idle", "idle", tiny_model_dir)
    idle["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": 30}
    _apply(cluster, idle)
    _wait(cluster, lambda: _routable(gateway_url, "idle", 1), ENGINE_READY_S, "idle Ready with 1 replica")
    assert _complete(gateway_url, "idle", "Hello").status_code == 200
    _wait(cluster, lambda: kube.get_inference_service(NS, "idle")["spec"]["replicas"] == 0, 180,
          "the autoscaler to take the idle service to zero")
    events = cluster.kubectl("get", "events", "-n", NS, "--field-selector",
                             "involvedObject.kind=InferenceService,involvedObject.name=idle").stdout
    assert "scaleToZeroAfterSeconds 30" in events
    _wait(cluster, lambda: _routable(gateway_url, "idle", 0), 60, "the idle service's pod to go")
    response = _complete(gateway_url, "idle", "Wake up", timeout=ENGINE_READY_S)  # held while it wakes
    assert response.status_code == 200, response.text
    assert kube.get_inference_service(NS, "idle")["spec"]["replicas"] == 1
    cluster.kubectl("delete", "kvis", "idle", "-n", NS, "--wait=true", "--timeout=60s")


def _autoscaling(kube, name: str) -> dict:
    return ((kube.get_inference_service(NS, name) or {}).get("status") or {}).get("autoscaling") or {}


def test_the_autoscaler_counts_a_request_held_at_the_gateway_as_demand(cluster, kube, gateway_url, tiny_model_dir):
    """Its replica stays Pending (no node has 8 GPUs), so the request is held for as long as the client
    waits: the operator reads it from the gateway every interval (5 s here) and stops counting it once
    the client gives up."""
    stuck = _service("stuck", "stuck", tiny_model_dir)
    stuck["spec"]["replicas"] = 0
    stuck["spec"]["resources"] = {"gpus": 8}
    stuck["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": 30}
    _apply(cluster, stuck)
    _wait(cluster, lambda: _routable(gateway_url, "stuck", 0), 60, "stuck listed by the gateway at zero replicas")
    _wait(cluster, lambda: _autoscaling(kube, "stuck").get("heldRequests") == 0, 60, "the autoscaler's first look")
    outcome: list = []

    def held_request() -> None:
        try:
            outcome.append(_complete(gateway_url, "stuck", "Hello", timeout=30))
        except httpx.TimeoutException as exc:
            outcome.append(exc)

    client = threading.Thread(target=held_request)
    client.start()
    counted = _wait(cluster, lambda: (s := _autoscaling(kube, "stuck")).get("heldRequests") == 1 and s, 25,
                    "the autoscaler to count the held request")
    assert "1 request(s) held at the gateway" in counted["reason"], counted
    assert kube.get_inference_service(NS, "stuck")["spec"]["replicas"] == 1
    client.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], httpx.TimeoutException), outcome  # still held at 30 s
    _wait(cluster, lambda: _autoscaling(kube, "stuck").get("heldRequests") == 0, 30,
          "the request the client gave up on to leave the autoscaler's count")
    print(f"\nthe autoscaler's decision while a request was held: {counted}")
    cluster.kubectl("delete", "kvis", "stuck", "-n", NS, "--wait=true", "--timeout=60s")
