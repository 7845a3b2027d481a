"""The only module that calls the Kubernetes API.

It owns idempotence: children are written with server-side apply under the
field manager ``kvpilot`` (forcing conflicts: these fields are ours), and every
child gets a controller owner reference to its InferenceService, so deleting
the service lets the garbage collector remove them. Calls are synchronous
(kopf runs sync handlers in its thread pool) and return plain dicts.
"""

from __future__ import annotations

import json
import threading
from typing import Any
from urllib.parse import quote

import kopf
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from kvpilot import kube_contract

FIELD_MANAGER = "kvpilot"

# (apiVersion, kind) -> plural, for every kind the operator touches.
_PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "ReplicaSet"): "replicasets",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    (kube_contract.API_VERSION, kube_contract.KIND): kube_contract.PLURAL,
}


class KubeError(RuntimeError):
    """An API call failed; ``status`` is the HTTP status and the message is the API server's."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.api_message = message


def resource_path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None,
                  subresource: str | None = None) -> str:
    try:
        plural = _PLURALS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"kube: no path known for {api_version} {kind}") from None
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace is not None:
        path += f"/namespaces/{quote(namespace)}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{quote(name)}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> k8s_client.ApiClient:
    """In a pod: the service account. Elsewhere: the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    configuration = k8s_client.Configuration()
    if kubeconfig is None and context is None:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s_client.ApiClient(configuration)
        except k8s_config.ConfigException:
            pass
    k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    return k8s_client.ApiClient(configuration)


class Kube:
    def __init__(self, api_client: k8s_client.ApiClient) -> None:
        self._api = api_client
        self._lock = threading.Lock()  # the generated client's auth refresh is not thread-safe

    # --- raw calls -----------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, query: list[tuple[str, Any]] | None = None,
                content_type: str = "application/json") -> dict[str, Any]:
        with self._lock:
            serialized = self._api.param_serialize(
                method, path,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
            )
        try:
            response = self._api.call_api(*serialized, _request_timeout=30)
        except ApiException as exc:
            raise KubeError(exc.status or 0, method, path, str(exc)) from exc
        data = response.read()
        if response.status >= 400:
            raise KubeError(response.status, method, path, _api_message(data))
        return json.loads(data) if data else {}

    # --- objects ------------------------------------------------------------------

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", resource_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, *, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict[str, Any]]:
        query = []
        if label_selector:
            query.append(("labelSelector", label_selector))
        if field_selector:
            query.append(("fieldSelector", field_selector))
        return self.request("GET", resource_path(api_version, kind, namespace), query=query).get("items") or []

    def apply(self, manifest: dict[str, Any], *, owner: dict[str, Any] | None = None) -> dict[str, Any]:
        """Server-side apply: creates or updates to exactly ``manifest``'s fields, idempotently."""
        if owner is not None:
            manifest = json.loads(json.dumps(manifest))
            kopf.append_owner_reference(manifest, owner=owner)
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        return self.request(
            "PATCH", path, manifest,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def create_if_missing(self, manifest: dict[str, Any], *, owner: dict[str, Any] | None = None) -> bool:
        """Creates ``manifest`` unless an object of that name exists (never overwrites it). True if created."""
        if owner is not None:
            manifest = json.loads(json.dumps(manifest))
            kopf.append_owner_reference(manifest, owner=owner)
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"))
        try:
            self.request("POST", path, manifest, query=[("fieldManager", FIELD_MANAGER)])
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Deletes the object (its dependents in the background). False if it did not exist."""
        try:
            self.request("DELETE", resource_path(api_version, kind, namespace, name),
                         body={"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    # --- InferenceService --------------------------------------------------------------

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(kube_contract.API_VERSION, kube_contract.KIND, namespace, name)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch of the status subresource: only the given fields change, so other writers'
        fields (the tuner's ``metrics`` and ``tuning``) stay; a None value removes a field."""
        return self.request(
            "PATCH", resource_path(kube_contract.API_VERSION, kube_contract.KIND, namespace, name, "status"),
            {"status": status}, content_type="application/merge-patch+json",
        )

    def pod_events(self, namespace: str, pod_names: set[str]) -> list[dict[str, Any]]:
        """Events about the given pods, oldest first (one list call, filtered here)."""
        if not pod_names:
            return []
        events = self.list("v1", "Event", namespace, field_selector="involvedObject.kind=Pod")
        mine = [e for e in events if (e.get("involvedObject") or {}).get("name") in pod_names]
        return sorted(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def crd_installed(self) -> bool:
        """Whether the API server serves InferenceServices (discovery needs no RBAC beyond being authenticated)."""
        try:
            group = self.request("GET", f"/apis/{kube_contract.API_VERSION}")
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == kube_contract.PLURAL for r in group.get("resources") or [])

    # --- autoscaling (operator/control_loop.py) ------------------------------------------

    def scale_inference_service(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Sets spec.replicas through the scale subresource (the same door HPA and KEDA use)."""
        return self.request(
            "PATCH", resource_path(kube_contract.API_VERSION, kube_contract.KIND, namespace, name, "scale"),
            {"spec": {"replicas": replicas}}, content_type="application/merge-patch+json",
        )


def _api_message(data: bytes) -> str:
    try:
        return json.loads(data).get("message") or data.decode(errors="replace")
    except (ValueError, AttributeError):
        return data.decode(errors="replace")
