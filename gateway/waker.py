"""Asks for a replica of a service at zero replicas, for the requests held for it.

Through the scale subresource, 0 -> 1 only if it is still 0 (``Kube.request_replica``),
the same door ``kubectl scale`` and the operator's autoscaler use; so any number of
gateway replicas may ask at once and the autoscaler's later decisions stand. One
call per service per ``interval_seconds`` however many requests are held.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from kvpilot.gateway.kube import Kube, KubeError
from kvpilot.gateway.routes import Route

log = logging.getLogger("kvpilot.gateway.waker")


class Waker:
    def __init__(self, kube: Kube, interval_seconds: float = 5.0) -> None:
        self.kube = kube
        self.interval_seconds = interval_seconds
        self._last_asked: dict[tuple[str, str], float] = {}

    async def wake(self, route: Route) -> None:
        key = (route.namespace, route.service)
        now = time.monotonic()
        if now - self._last_asked.get(key, -self.interval_seconds) < self.interval_seconds:
            return
        self._last_asked[key] = now
        try:
            if await self.kube.request_replica(route.namespace, route.service):
                log.info("%s/%s: scaled from zero for model %s (requests are waiting)",
                         route.namespace, route.service, route.model)
        except (KubeError, aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            log.warning("%s/%s: could not ask for a replica: %s", route.namespace, route.service, exc)
