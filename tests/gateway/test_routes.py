"""The routing table from InferenceServices and their pods, as the watches see them."""

from __future__ import annotations

from kvpilot.gateway.discovery import apply_event
from kvpilot.gateway.routes import build_routes, engine_pod_selector
from kvpilot.operator import builders


def _service(name: str, namespace: str = "ml", served: str | None = None, replicas: int = 1,
             created: str = "2026-01-01T00:00:00Z", deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": namespace, "uid": f"{namespace}-{name}", "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    model = {"uri": "pvc://models/x", **({"servedName": served} if served else {})}
    return {"metadata": meta, "spec": {"model": model, "replicas": replicas}}


def _pod(name: str, service: str, ip: str | None, ready: bool = True, namespace: str = "ml",
         deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": namespace, "uid": name, "labels": builders.labels(service)}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_each_served_name_routes_to_its_ready_pods():
    routes = build_routes(
        [_service("llama", served="llama3"), _service("qwen")],
        [_pod("llama-1", "llama", "10.0.0.1"), _pod("llama-2", "llama", "10.0.0.2", ready=False),
         _pod("qwen-1", "qwen", "10.0.0.3"), _pod("qwen-2", "qwen", "10.0.0.4", deleting=True),
         _pod("qwen-3", "qwen", None)],
    )
    assert sorted(routes) == ["llama3", "qwen"]
    assert [b.key for b in routes["llama3"].backends] == ["ml/llama-1"]
    assert routes["llama3"].backends[0].url == "http://10.0.0.1:8000"
    assert [b.key for b in routes["qwen"].backends] == ["ml/qwen-1"]
    assert routes["qwen"].service == "qwen" and routes["qwen"].namespace == "ml"


def test_a_service_at_zero_replicas_is_routable_with_no_backends():
    route = build_routes([_service("cold", replicas=0)], [])["cold"]
    assert route.replicas == 0 and route.backends == ()


def test_pods_of_a_same_named_service_in_another_namespace_are_not_mixed_in():
    routes = build_routes([_service("m", namespace="a")], [_pod("m-1", "m", "10.0.0.1", namespace="b")])
    assert routes["m"].backends == ()


def test_the_oldest_service_keeps_a_contested_name_and_deleted_ones_route_nowhere():
    routes = build_routes(
        [_service("new", namespace="b", served="shared", created="2026-02-01T00:00:00Z"),
         _service("old", namespace="a", served="shared", created="2026-01-01T00:00:00Z"),
         _service("gone", deleting=True)],
        [],
    )
    assert routes["shared"].namespace == "a" and "gone" not in routes


def test_watch_events_add_replace_and_remove():
    store: dict = {}
    pod = _pod("p", "s", "10.0.0.1")
    apply_event(store, "ADDED", pod)
    apply_event(store, "MODIFIED", {**pod, "status": {}})
    assert store == {"p": {**pod, "status": {}}}
    apply_event(store, "DELETED", pod)
    assert store == {}


def test_the_pod_selector_matches_the_operators_engine_pods():
    labels = builders.labels("anything")
    for term in engine_pod_selector().split(","):
        key, value = term.split("=")
        assert labels[key] == value


def test_each_lora_adapter_routes_to_its_base_services_pods_less_those_it_failed_on():
    service = _service("llama", served="llama3")
    service["spec"]["loras"] = [{"name": "sql", "uri": "pvc://a/sql"}, {"name": "chat", "uri": "pvc://a/chat"},
                                {"name": "qwen", "uri": "pvc://a/qwen"}]
    service["status"] = {"loras": [{"name": "sql", "pods": [{"pod": "llama-1", "state": "Loaded"},
                                                            {"pod": "llama-2", "state": "Failed", "message": "r=64"}]}]}
    routes = build_routes([service, _service("qwen", created="2026-01-02T00:00:00Z")],
                          [_pod("llama-1", "llama", "10.0.0.1"), _pod("llama-2", "llama", "10.0.0.2"),
                           _pod("qwen-1", "qwen", "10.0.0.3")])
    assert routes["sql"].service == "llama" and routes["sql"].parent == "llama3"
    assert [b.key for b in routes["sql"].backends] == ["ml/llama-1"]
    assert [b.key for b in routes["chat"].backends] == ["ml/llama-1", "ml/llama-2"]
    assert routes["qwen"].parent == "llama3"  # the older service's adapter keeps the contested name
    assert routes["llama3"].parent is None
