"""The operator's read of the requests the gateway holds: per service, summed over gateway replicas,
a gateway that cannot be read counted as none; and the settings that say where the gateway runs."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import generate_latest

from kvpilot import gateway_contract as contract
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.operator.gateway_demand import GatewayDemand, gateway_url, held_per_service
from kvpilot.operator.kube import KubeError
from kvpilot.operator.settings import OperatorSettings, SettingsError


def _models(*routes: tuple[str, str, str]) -> dict:
    """The gateway's /v1/models answer: (model, namespace, service) per route."""
    return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "kvpilot", "namespace": ns,
                                        "service": service, "replicas": 0, "ready_replicas": 0}
                                       for model, ns, service in routes]}


def _metrics(**held: int) -> str:
    """A gateway's real exposition with ``held`` requests per model (and other series beside them)."""
    metrics = GatewayMetrics()
    for model, count in held.items():
        metrics.held.labels(model).set(count)
        metrics.in_flight.labels(model).set(7)
        metrics.requests.labels(model, "200").inc(3)
    return generate_latest(metrics.registry).decode()


def test_held_requests_are_counted_for_the_service_the_gateway_routes_the_model_to():
    models = _models(("llama", "ml", "llama-8b"), ("beta", "ml", "beta"), ("idle", "ml", "idle"))
    text = _metrics(llama=3, beta=1, idle=0, gone=5)
    # idle holds none; "gone" is no longer routed (its service was deleted): neither is anyone's demand.
    assert held_per_service(models, text) == {("ml", "llama-8b"): 3, ("ml", "beta"): 1}
    assert held_per_service(_models(), text) == {}


def _pod(name: str, port: int | None, phase: str = "Running", ip: str | None = "127.0.0.1") -> dict:
    ports = [{"name": "http", "containerPort": port, "protocol": "TCP"}] if port is not None else []
    status = {"phase": phase} | ({"podIP": ip} if ip else {})
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "gateway", "ports": ports}]},
            "status": status}


def test_a_gateway_pod_is_read_on_its_ip_and_http_port_once_running():
    assert gateway_url(_pod("g", 18000)) == "http://127.0.0.1:18000"
    assert gateway_url(_pod("g", None)) == f"http://127.0.0.1:{contract.GATEWAY_PORT}"
    assert gateway_url(_pod("g", 18000, phase="Pending", ip=None)) is None
    assert gateway_url(_pod("g", 18000, phase="Succeeded")) is None


class _Gateway(BaseHTTPRequestHandler):
    """Serves the /v1/models and /metrics its server was given."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.server.pages.get(self.path)  # type: ignore[attr-defined]
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write((body or "").encode())

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture()
def gateways() -> Iterator[list[int]]:
    """Two gateway stand-ins holding requests for ml/llama-8b (3 and 2) and ml/beta (1 on the second)."""
    models = json.dumps(_models(("llama", "ml", "llama-8b"), ("beta", "ml", "beta")))
    servers = []
    for held in ({"llama": 3}, {"llama": 2, "beta": 1}):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
        server.pages = {"/v1/models": models, contract.METRICS_PATH: _metrics(**held)}  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [s.server_address[1] for s in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


class _Kube:
    def __init__(self, pods: list[dict] | KubeError) -> None:
        self.pods = pods
        self.calls: list[tuple] = []

    def list(self, api_version: str, kind: str, namespace: str, *, label_selector: str | None = None) -> list[dict]:
        self.calls.append((api_version, kind, namespace, label_selector))
        if isinstance(self.pods, KubeError):
            raise self.pods
        return self.pods


def _dead_port() -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    port = server.server_address[1]
    server.server_close()
    return port


def test_held_requests_are_summed_over_every_gateway_replica(gateways):
    kube = _Kube([_pod("gw-a", gateways[0]), _pod("gw-b", gateways[1]), _pod("gw-new", 1, phase="Pending", ip=None)])
    demand = GatewayDemand(kube, "kvpilot-system", "app.kubernetes.io/component=gateway")  # type: ignore[arg-type]
    assert demand.held() == {("ml", "llama-8b"): 5, ("ml", "beta"): 1}
    assert kube.calls == [("v1", "Pod", "kvpilot-system", "app.kubernetes.io/component=gateway")]


def test_one_reading_answers_every_service_for_max_age_seconds(gateways):
    kube = _Kube([_pod("gw-a", gateways[0])])
    demand = GatewayDemand(kube, "kvpilot-system", "c=gateway", max_age_seconds=60)  # type: ignore[arg-type]
    assert demand.held() == demand.held() == {("ml", "llama-8b"): 3}
    assert len(kube.calls) == 1  # the second service's ask was answered from the first reading
    demand.max_age_seconds = 0
    demand.held()
    assert len(kube.calls) == 2


def test_a_gateway_that_cannot_be_read_counts_as_none_and_is_logged(gateways, caplog):
    kube = _Kube([_pod("gw-a", gateways[0]), _pod("gw-dead", _dead_port())])
    demand = GatewayDemand(kube, "kvpilot-system", "c=gateway", timeout_seconds=1.0)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kvpilot.operator.gateway_demand"):
        assert demand.held() == {("ml", "llama-8b"): 3}
    assert "gateway pod kvpilot-system/gw-dead" in caplog.text and "counting none from it" in caplog.text


def test_a_failed_listing_counts_no_held_requests_and_is_logged(caplog):
    kube = _Kube(KubeError(403, "GET", "/api/v1/namespaces/kvpilot-system/pods", "forbidden"))
    demand = GatewayDemand(kube, "kvpilot-system", "c=gateway")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kvpilot.operator.gateway_demand"):
        assert demand.held() == {}
    assert "cannot list the gateway's pods in kvpilot-system" in caplog.text


def test_the_settings_name_the_gateway_pods_or_none():
    assert OperatorSettings.from_env({}).gateway_pods is None
    env = {"KVPILOT_GATEWAY_NAMESPACE": "kvpilot-system", "KVPILOT_GATEWAY_SELECTOR": "a=b,c=gateway"}
    assert OperatorSettings.from_env(env).gateway_pods == ("kvpilot-system", "a=b,c=gateway")
    with pytest.raises(SettingsError, match="KVPILOT_GATEWAY_SELECTOR is empty"):
        OperatorSettings.from_env({"KVPILOT_GATEWAY_NAMESPACE": "kvpilot-system"})
