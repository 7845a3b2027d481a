"""An in-memory stand-in for operator/kube.py's Kube, for the operator's write path without an API server.

It keeps objects by (apiVersion, kind, namespace, name) and answers Kube's methods as the API server
would in the ways the reconcile and the control loop rely on: server-side apply replaces the fields it
is given and bumps resourceVersion only when something changed, a stale resourceVersion is a 409,
stringData becomes base64 data, status is a merge patch. Every write is recorded in ``writes``.
tests/e2e runs the same code against a real API server.
"""

from __future__ import annotations

import base64
import copy
import itertools
from typing import Any

import kopf

from kvpilot import kube_contract
from kvpilot.operator.kube import KubeError

Key = tuple[str, str, str, str]  # apiVersion, kind, namespace, name


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str]] = []  # (verb, kind, name)
        self._versions = itertools.count(1)

    # --- test set-up and reading back ---------------------------------------------------

    def put(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Stores an object as another writer would (not recorded in ``writes``)."""
        stored = copy.deepcopy(manifest)
        stored["metadata"]["resourceVersion"] = str(next(self._versions))
        stored["metadata"].setdefault("uid", f"uid-{stored['metadata']['name']}")
        self.objects[self._key(stored)] = stored
        return copy.deepcopy(stored)

    def object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = [o for (_, k, ns, n), o in self.objects.items() if (k, ns, n) == (kind, namespace, name)]
        return copy.deepcopy(found[0]) if found else None

    # --- Kube's methods -------------------------------------------------------------------

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        found = self.objects.get((api_version, kind, namespace or "", name))
        return copy.deepcopy(found)

    def list(self, api_version: str, kind: str, namespace: str, *, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict[str, Any]]:
        wanted = dict(term.split("=", 1) for term in label_selector.split(",")) if label_selector else {}
        return [copy.deepcopy(o) for (v, k, ns, _), o in self.objects.items()
                if (v, k, ns) == (api_version, kind, namespace)
                and wanted.items() <= (o["metadata"].get("labels") or {}).items()]

    def apply(self, manifest: dict[str, Any], *, owner: dict[str, Any] | None = None) -> dict[str, Any]:
        manifest = copy.deepcopy(manifest)
        if owner is not None:
            kopf.append_owner_reference(manifest, owner=owner)
        key = self._key(manifest)
        before = self.objects.get(key)
        expected = manifest["metadata"].pop("resourceVersion", None)
        if expected is not None and (before is None or before["metadata"]["resourceVersion"] != expected):
            raise KubeError(409, "PATCH", "/".join(key), "the object has been modified")
        after = self._stored_form(manifest, before)
        if before is not None and _content(after) == _content(before):
            return copy.deepcopy(before)
        self.writes.append(("apply", manifest["kind"], manifest["metadata"]["name"]))
        after["metadata"]["resourceVersion"] = str(next(self._versions))
        self.objects[key] = after
        return copy.deepcopy(after)

    def create_if_missing(self, manifest: dict[str, Any], *, owner: dict[str, Any] | None = None) -> bool:
        if self.objects.get(self._key(manifest)) is not None:
            return False
        manifest = copy.deepcopy(manifest)
        if owner is not None:
            kopf.append_owner_reference(manifest, owner=owner)
        self.writes.append(("create", manifest["kind"], manifest["metadata"]["name"]))
        stored = self._stored_form(manifest, None)
        stored["metadata"]["resourceVersion"] = str(next(self._versions))
        self.objects[self._key(stored)] = stored
        return True

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        if self.objects.pop((api_version, kind, namespace, name), None) is None:
            return False
        self.writes.append(("delete", kind, name))
        return True

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(kube_contract.API_VERSION, kube_contract.KIND, namespace, name)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        service = self.objects[(kube_contract.API_VERSION, kube_contract.KIND, namespace, name)]
        service["status"] = merge_patch(service.get("status") or {}, status)
        self.writes.append(("status", kube_contract.KIND, name))
        return copy.deepcopy(service)

    def pod_events(self, namespace: str, pod_names: set[str]) -> list[dict[str, Any]]:
        return []

    def scale_inference_service(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        service = self.objects[(kube_contract.API_VERSION, kube_contract.KIND, namespace, name)]
        service["spec"]["replicas"] = replicas
        self.writes.append(("scale", kube_contract.KIND, name))
        return {"spec": {"replicas": replicas}}

    # --- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _key(manifest: dict[str, Any]) -> Key:
        meta = manifest["metadata"]
        return manifest["apiVersion"], manifest["kind"], meta.get("namespace") or "", meta["name"]

    @staticmethod
    def _stored_form(manifest: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
        stored = copy.deepcopy(manifest)
        if "stringData" in stored:
            string_data = stored.pop("stringData")
            stored["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in string_data.items()}
        stored["metadata"]["uid"] = (before or {}).get("metadata", {}).get("uid") or f"uid-{stored['metadata']['name']}"
        return stored


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    """An object without its resourceVersion: what a write may or may not change."""
    content = copy.deepcopy(obj)
    content["metadata"].pop("resourceVersion", None)
    return content


def merge_patch(old: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386): None removes a key, dicts merge, anything else replaces."""
    merged = dict(old)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict):
            merged[key] = merge_patch(merged[key] if isinstance(merged.get(key), dict) else {}, value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
