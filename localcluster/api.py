"""A small JSON client for the local API server, authenticated by a client certificate.

The kubelet stand-in and `up`'s readiness checks speak plain JSON over one
thread-safe urllib3 pool: they need a handful of verbs, raw dicts and
streaming watches, not the generated client's models.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import urllib3


class ApiError(RuntimeError):
    """The API server refused a call (``status``: its HTTP status) or gave no answer (``status`` None:
    it is down or restarting, or the connection broke), which callers treat as a failed call to retry,
    as a kubelet keeps its pods running through an API server restart."""

    def __init__(self, status: int | None, method: str, path: str, body: str) -> None:
        try:
            message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            message = body
        answer = "no answer" if status is None else f"HTTP {status}"
        super().__init__(f"{method} {path}: {answer}: {message}")
        self.status = status


class KubeApi:
    def __init__(self, server: str, pki: Path, client_stem: str = "admin") -> None:
        self.server = server.rstrip("/")
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / f"{client_stem}.crt"), str(pki / f"{client_stem}.key"))
        self._pool = urllib3.PoolManager(ssl_context=context, maxsize=16, retries=False)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 10.0,
        ok_missing: bool = False,
    ) -> dict[str, Any] | None:
        """One call; returns the decoded body, or None for 404 when ``ok_missing``."""
        try:
            response = self._pool.request(
                method,
                self.server + path + _query_string(query),
                body=None if body is None else json.dumps(body),
                headers={"Content-Type": content_type, "Accept": "application/json"},
                timeout=timeout,
            )
        except urllib3.exceptions.HTTPError as exc:
            raise ApiError(None, method, path, str(exc)) from exc
        if response.status == 404 and ok_missing:
            return None
        if response.status >= 400:
            raise ApiError(response.status, method, path, response.data.decode(errors="replace"))
        return json.loads(response.data) if response.data else {}

    def get(self, path: str, **kwargs) -> dict[str, Any] | None:
        return self.request("GET", path, **kwargs)

    def merge_patch(self, path: str, body: dict[str, Any], **kwargs) -> dict[str, Any] | None:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json", **kwargs)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60,
              query: dict[str, str] | None = None) -> Iterator[dict]:  # fmt: skip
        """Yields watch events until the server closes the stream (after ``timeout_seconds``)."""
        response = self._pool.request(
            "GET",
            self.server + path,
            fields={
                **(query or {}),
                "watch": "1",
                "resourceVersion": resource_version,
                "timeoutSeconds": str(timeout_seconds),
                "allowWatchBookmarks": "true",
            },
            preload_content=False,
            timeout=urllib3.Timeout(connect=5, read=timeout_seconds + 10),
        )
        try:
            if response.status >= 400:
                raise ApiError(response.status, "WATCH", path, response.read().decode(errors="replace"))
            buffer = b""
            for chunk in response.stream(65536, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            response.release_conn()


def _query_string(query: dict[str, Any] | None) -> str:
    if not query:
        return ""
    from urllib.parse import urlencode

    return "?" + urlencode(query)
