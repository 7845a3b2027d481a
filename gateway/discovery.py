"""Keeps the routing table current: watches InferenceServices and engine pods, rebuilds the routes.

One list-then-watch loop per kind and namespace (or one per kind for all
namespaces), each resuming from the last resourceVersion it saw and listing
afresh when the API server says that version is gone. Every change rebuilds the
table from what the watches hold (``routes.build_routes``, pure) and wakes the
requests held for a model that had no Ready pod. Each gateway replica keeps its
own copy; none needs another's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvpilot.gateway.kube import Kube, KubeError, inference_services_path, pods_path
from kvpilot.gateway.routes import Route, build_routes, engine_pod_selector

log = logging.getLogger("kvpilot.gateway.discovery")

RELIST_DELAY_SECONDS = 1.0


class RouteTable:
    """The current routes, and a way to wait for the next change. Also what tests fill by hand."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.synced = False  # every watch has listed once
        self._changed = asyncio.Event()

    def set(self, routes: dict[str, Route]) -> None:
        self.routes = routes
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_for_change(self, timeout: float) -> None:
        """Returns at the next change, or after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass


class Discovery:
    """Runs the watches that feed a RouteTable."""

    def __init__(self, kube: Kube, namespaces: list[str] | None, table: RouteTable) -> None:
        self.kube = kube
        self.table = table
        scopes: list[str | None] = list(namespaces) if namespaces is not None else [None]
        selector = engine_pod_selector()
        # (path, label selector, store): each store maps uid -> object for one watch.
        self._watches: list[tuple[str, str | None, dict[str, dict[str, Any]]]] = []
        self._services: list[dict[str, dict[str, Any]]] = []
        self._pods: list[dict[str, dict[str, Any]]] = []
        for scope in scopes:
            services: dict[str, dict[str, Any]] = {}
            pods: dict[str, dict[str, Any]] = {}
            self._services.append(services)
            self._pods.append(pods)
            self._watches.append((inference_services_path(scope), None, services))
            self._watches.append((pods_path(scope), selector, pods))
        self._listed: set[int] = set()

    async def run(self) -> None:
        await asyncio.gather(*(self._watch(i, *watch) for i, watch in enumerate(self._watches)))

    def _rebuild(self) -> None:
        services = [s for store in self._services for s in store.values()]
        pods = [p for store in self._pods for p in store.values()]
        self.table.synced = len(self._listed) == len(self._watches)
        self.table.set(build_routes(services, pods))

    async def _watch(self, index: int, path: str, selector: str | None, store: dict[str, dict[str, Any]]) -> None:
        while True:
            try:
                items, version = await self.kube.list(path, selector)
                store.clear()
                store.update({item["metadata"]["uid"]: item for item in items})
                self._listed.add(index)
                self._rebuild()
                version = await self._follow(path, selector, store, version)
            except asyncio.CancelledError:
                raise
            except (KubeError, OSError, ValueError, asyncio.TimeoutError) as exc:
                log.warning("watch of %s failed (%s); listing again in %.0f s", path, exc, RELIST_DELAY_SECONDS)
                await asyncio.sleep(RELIST_DELAY_SECONDS)
            except Exception:  # aiohttp's errors and anything else: the watch must outlive them
                log.exception("watch of %s failed; listing again", path)
                await asyncio.sleep(RELIST_DELAY_SECONDS)

    async def _follow(self, path: str, selector: str | None, store: dict[str, dict[str, Any]], version: str) -> str:
        """Applies watch events until the API server says the version is gone (then the caller relists)."""
        while True:
            expired = False
            async for event in self.kube.watch(path, version, selector):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    expired = True  # 410 Gone: too old to resume
                    break
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if kind == "BOOKMARK":
                    continue
                apply_event(store, kind, obj)
                self._rebuild()
            if expired:
                return version


def apply_event(store: dict[str, dict[str, Any]], kind: str | None, obj: dict[str, Any]) -> None:
    uid = obj["metadata"]["uid"]
    if kind == "DELETED":
        store.pop(uid, None)
    else:
        store[uid] = obj

