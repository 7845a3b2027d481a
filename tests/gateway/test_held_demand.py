"""What the operator's autoscaler reads from real gateway replicas: the requests each holds for a service
with no Ready pod, summed over the replicas (``operator/gateway_demand.py`` against ``gateway/server.py``)."""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

import httpx

from kvpilot import gateway_contract as contract
from kvpilot.operator.gateway_demand import GatewayDemand


class _GatewayPods:
    """The Kube call GatewayDemand makes, answered with running pods at the harnesses' ports."""

    def __init__(self, urls: list[str]) -> None:
        self.pods = [{"metadata": {"name": f"gateway-{i}"},
                      "spec": {"containers": [{"name": "gateway",
                                               "ports": [{"name": "http", "containerPort": urlsplit(url).port}]}]},
                      "status": {"phase": "Running", "podIP": urlsplit(url).hostname}}
                     for i, url in enumerate(urls)]

    def list(self, *_: object, **__: object) -> list[dict]:
        return self.pods


def test_the_operator_reads_the_requests_every_gateway_replica_holds(harness):
    first, second = harness(["a"]), harness(["b"])
    for gateway in (first, second):
        gateway.set_routes({"alpha": (0, []), "beta": (1, [])})
    held = [(first, "alpha"), (first, "alpha"), (second, "alpha"), (second, "beta")]
    results: list[int] = []

    def send(gateway, model: str) -> None:
        response = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                              json={"model": model, "prompt": "Hello", "max_tokens": 4})
        results.append(response.status_code)

    threads = [threading.Thread(target=send, args=pair) for pair in held]
    for thread in threads:
        thread.start()
    pods = _GatewayPods([first.url, second.url])
    demand = GatewayDemand(pods, "kvpilot-system", "c=gateway", max_age_seconds=0)  # type: ignore[arg-type]
    expected = {("ns", "alpha"): 3, ("ns", "beta"): 1}  # alpha: 2 on the first replica, 1 on the second
    deadline = time.monotonic() + 10
    while demand.held() != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert demand.held() == expected
    assert first.metric(contract.HELD_REQUESTS, model="alpha") == 2

    # A pod became Ready: the held requests go out, and nothing is held any more.
    first.set_routes({"alpha": (1, ["a"]), "beta": (1, ["a"])})
    second.set_routes({"alpha": (1, ["b"]), "beta": (1, ["b"])})
    for thread in threads:
        thread.join(10)
    assert results == [200] * 4
    assert demand.held() == {}
