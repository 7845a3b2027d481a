"""The gateway's only code that calls the Kubernetes API: list, watch, and ask for a replica.

Credentials come from the Kubernetes client's own loaders (the service account
in a pod, else the kubeconfig), read into one aiohttp session, so the gateway's
event loop never blocks on the API server. The token is read again for each
call, so a rotated service-account token is picked up.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import aiohttp
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from kvpilot import kube_contract

WATCH_SECONDS = 60  # the API server ends each watch after this long; the watcher resumes from its version


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


def load_configuration(kubeconfig: str | None = None, context: str | None = None) -> k8s_client.Configuration:
    """In a pod: the service account. Elsewhere: the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    configuration = k8s_client.Configuration()
    if kubeconfig is None and context is None:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
            return configuration
        except k8s_config.ConfigException:
            pass
    k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    return configuration


def collection_path(api_version: str, plural: str, namespace: str | None) -> str:
    """The path of a collection, in one namespace or (None) all of them."""
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace is not None:
        path += f"/namespaces/{quote(namespace)}"
    return f"{path}/{plural}"


def inference_services_path(namespace: str | None) -> str:
    return collection_path(kube_contract.API_VERSION, kube_contract.PLURAL, namespace)


def pods_path(namespace: str | None) -> str:
    return collection_path("v1", "pods", namespace)


class Kube:
    def __init__(self, configuration: k8s_client.Configuration) -> None:
        self._configuration = configuration
        self._session: aiohttp.ClientSession | None = None

    def _ssl(self) -> ssl.SSLContext | bool:
        config = self._configuration
        if not config.verify_ssl:
            return False
        context = ssl.create_default_context(cafile=config.ssl_ca_cert)
        if config.cert_file:
            context.load_cert_chain(config.cert_file, config.key_file)
        return context

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._configuration.get_api_key_with_prefix("BearerToken") or \
            self._configuration.get_api_key_with_prefix("authorization")
        if token:
            headers["Authorization"] = token if " " in token else f"Bearer {token}"
        return headers

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self._configuration.host.rstrip("/") + "/",
                connector=aiohttp.TCPConnector(ssl=self._ssl()),
                read_bufsize=1 << 20,  # one watch event per line; an object may be large
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, query: dict[str, str] | None = None, body: Any = None,
                      content_type: str = "application/json", timeout: float = 30.0) -> dict[str, Any]:
        headers = self._headers()
        if body is not None:
            headers["Content-Type"] = content_type
        async with self._open().request(
            method, path.lstrip("/"), params=query, headers=headers,
            data=None if body is None else json.dumps(body), timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            text = await response.text()
            if response.status >= 400:
                raise KubeError(response.status, method, path, _message(text))
            return json.loads(text) if text else {}

    async def list(self, path: str, label_selector: str | None = None) -> tuple[list[dict[str, Any]], str]:
        """The collection's items and its resourceVersion (to watch from)."""
        query = {"labelSelector": label_selector} if label_selector else None
        listing = await self.request("GET", path, query=query)
        return listing.get("items") or [], listing["metadata"]["resourceVersion"]

    async def watch(self, path: str, resource_version: str,
                    label_selector: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Watch events after ``resource_version`` until the server ends the watch (``WATCH_SECONDS``)."""
        query = {"watch": "true", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(WATCH_SECONDS)}
        if label_selector:
            query["labelSelector"] = label_selector
        timeout = aiohttp.ClientTimeout(total=WATCH_SECONDS + 15, sock_connect=10)
        async with self._open().get(path.lstrip("/"), params=query, headers=self._headers(),
                                    timeout=timeout) as response:
            if response.status >= 400:
                raise KubeError(response.status, "WATCH", path, _message(await response.text()))
            async for line in response.content:  # one JSON event per line
                if line.strip():
                    yield json.loads(line)

    async def request_replica(self, namespace: str, name: str) -> bool:
        """Scale subresource 0 -> 1, only if it is still 0 (the write names the resourceVersion it read), so
        gateway replicas and the autoscaler never undo each other. True if this call changed it."""
        path = collection_path(kube_contract.API_VERSION, kube_contract.PLURAL, namespace) + f"/{quote(name)}/scale"
        scale = await self.request("GET", path)
        if (scale.get("spec") or {}).get("replicas", 0) != 0:  # omitted when 0
            return False
        patch = {"metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]}, "spec": {"replicas": 1}}
        try:
            await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")
        except KubeError as exc:
            if exc.status == 409:  # changed since it was read: someone else scaled it
                return False
            raise
        return True


def _message(text: str) -> str:
    try:
        return json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        return text
