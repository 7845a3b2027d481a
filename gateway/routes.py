"""Pure: InferenceServices and their engine pods -> where each served model name can go.

The gateway's whole view of the cluster is this table, rebuilt from what the
watches last saw (``discovery.py``). A model is routable as soon as its
InferenceService exists, even with no Ready pod (requests for it are held while
it starts or wakes from zero). Two services serving one name: the oldest wins,
so every gateway replica chooses the same one. Each LoRA adapter of a service
(spec.loras) is a model of its own, routed to that service's pods, less those
where the operator saw it fail to load (status.loras).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvpilot import kube_contract as kube
from kvpilot.kube_contract import pod_ready, pod_url


@dataclass(frozen=True)
class Backend:
    """One Ready engine pod."""

    key: str  # NAMESPACE/POD
    url: str  # http://POD_IP:PORT


@dataclass(frozen=True)
class Route:
    """Where requests naming ``model`` go."""

    model: str
    namespace: str
    service: str  # the InferenceService's name
    replicas: int  # its spec.replicas (0: scaled to zero)
    backends: tuple[Backend, ...]  # Ready and not terminating, sorted by key
    created: str  # metadata.creationTimestamp (RFC 3339)
    parent: str | None = None  # for a LoRA adapter: the served name of the model it runs on


def served_name(service: dict[str, Any]) -> str:
    """The model name clients send; the operator passes the same to `--served-model-name`."""
    model = (service.get("spec") or {}).get("model") or {}
    return model.get("servedName") or service["metadata"]["name"]


def backends_of(namespace: str, service: str, pods: Iterable[dict[str, Any]]) -> tuple[Backend, ...]:
    """The service's Ready engine pods that are not being deleted (a deleted pod drains: no new work)."""
    found = []
    for pod in pods:
        meta = pod["metadata"]
        if meta.get("namespace") != namespace or (meta.get("labels") or {}).get(kube.INSTANCE_LABEL) != service:
            continue
        ip = (pod.get("status") or {}).get("podIP")
        if ip and not meta.get("deletionTimestamp") and pod_ready(pod):
            found.append(Backend(f"{namespace}/{meta['name']}", pod_url(ip)))
    return tuple(sorted(found, key=lambda b: b.key))


def build_routes(services: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]]) -> dict[str, Route]:
    """Served model name -> its route, for every InferenceService not being deleted."""
    pods = list(pods)
    routes: dict[str, Route] = {}
    live = [s for s in services if not s["metadata"].get("deletionTimestamp")]
    # Oldest first, then by namespace/name: the first service to claim a name keeps it.
    live.sort(key=lambda s: (s["metadata"].get("creationTimestamp") or "", s["metadata"].get("namespace") or "",
                             s["metadata"]["name"]))
    for service in live:
        meta = service["metadata"]
        model = served_name(service)
        if model in routes:
            continue
        namespace, name = meta["namespace"], meta["name"]
        base = Route(
            model=model,
            namespace=namespace,
            service=name,
            replicas=int((service.get("spec") or {}).get("replicas", 1)),
            backends=backends_of(namespace, name, pods),
            created=meta.get("creationTimestamp") or "",
        )
        routes[model] = base
        failed = _failed_adapters(service)
        for lora in (service.get("spec") or {}).get("loras") or []:
            adapter = lora.get("name")
            if adapter and adapter not in routes:
                cannot = failed.get(adapter, set())
                routes[adapter] = replace(base, model=adapter, parent=model,
                                          backends=tuple(b for b in base.backends if b.key not in cannot))
    return routes


def _failed_adapters(service: dict[str, Any]) -> dict[str, set[str]]:
    """Adapter name -> the NAMESPACE/POD keys where the operator saw it fail to load."""
    namespace = service["metadata"]["namespace"]
    return {entry.get("name"): {f"{namespace}/{pod.get('pod')}" for pod in entry.get("pods") or []
                                if pod.get("state") == "Failed"}
            for entry in (service.get("status") or {}).get("loras") or []}


def engine_pod_selector() -> str:
    """Label selector of every engine pod the operator runs (all services)."""
    return ",".join(f"{k}={v}" for k, v in sorted(kube.ENGINE_LABELS.items()))
