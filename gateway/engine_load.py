"""How loaded each engine pod is: what the engines report, and what this gateway sent them.

Every ``interval`` the board scrapes each known pod's /metrics (the engine
contract's gauges: requests running and waiting, KV-cache usage) with a short
timeout; a pod that does not answer keeps its last reading. The board also
counts the requests this gateway has in flight to each pod, which it knows at
once. A pod's load is this gateway's count now plus what the engine reported
beyond this gateway's count at that moment (other gateway replicas' requests):
the engine's figure lags by up to one interval, and taking it whole would count
a request that just finished here as still running, turning a pod away from
the very prefixes it has just cached. The picker compares these loads
(``picker.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as names
from kvpilot.gateway.picker import Candidate
from kvpilot.gateway.routes import Backend

log = logging.getLogger("kvpilot.gateway.engine_load")

SCRAPE_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class EngineLoad:
    """One scrape of one engine's gauges."""

    running: float
    waiting: float
    kv_cache_usage: float | None
    at: float  # time.monotonic() of the scrape


def parse_load(text: str, at: float) -> EngineLoad:
    """The load gauges from an engine's Prometheus exposition (summed over label sets)."""
    values = {names.REQUESTS_RUNNING: 0.0, names.REQUESTS_WAITING: 0.0}
    usage: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
            elif sample.name == names.KV_CACHE_USAGE:
                usage = sample.value if usage is None else max(usage, sample.value)
    return EngineLoad(values[names.REQUESTS_RUNNING], values[names.REQUESTS_WAITING], usage, at)


class LoadBoard:
    """Per pod: the last scrape and this gateway's requests in flight."""

    def __init__(self) -> None:
        self.scraped: dict[str, EngineLoad] = {}
        self.in_flight: dict[str, int] = {}
        self.in_flight_at_scrape: dict[str, int] = {}

    def load(self, key: str) -> float:
        own = float(self.in_flight.get(key, 0))
        scraped = self.scraped.get(key)
        if scraped is None:
            return own
        others = scraped.running + scraped.waiting - self.in_flight_at_scrape.get(key, 0)
        return own + max(0.0, others)

    def record(self, key: str, load: EngineLoad) -> None:
        self.scraped[key] = load
        self.in_flight_at_scrape[key] = self.in_flight.get(key, 0)

    def candidates(self, backends: Iterable[Backend], exclude: frozenset[str] = frozenset()) -> list[Candidate]:
        return [Candidate(b.key, self.load(b.key), self._kv_cache_usage(b.key))
                for b in backends if b.key not in exclude]

    def _kv_cache_usage(self, key: str) -> float | None:
        scraped = self.scraped.get(key)
        return None if scraped is None else scraped.kv_cache_usage

    def started(self, key: str) -> None:
        self.in_flight[key] = self.in_flight.get(key, 0) + 1

    def finished(self, key: str) -> None:
        left = self.in_flight.get(key, 0) - 1
        if left > 0:
            self.in_flight[key] = left
        else:
            self.in_flight.pop(key, None)

    def forget_all_but(self, keys: set[str]) -> None:
        """Drops the readings of pods that are gone (their in-flight counts end with their requests)."""
        for key in [k for k in self.scraped if k not in keys]:
            del self.scraped[key]
            self.in_flight_at_scrape.pop(key, None)

    async def scrape(self, session: aiohttp.ClientSession, backends: Iterable[Backend]) -> None:
        """Reads every backend's gauges at once; failures keep the previous reading."""
        backends = list(backends)
        results = await asyncio.gather(*(self._scrape_one(session, b) for b in backends), return_exceptions=True)
        for backend, result in zip(backends, results):
            if isinstance(result, EngineLoad):
                self.record(backend.key, result)
            else:
                log.debug("scraping %s failed: %r", backend.key, result)
        self.forget_all_but({b.key for b in backends})

    async def _scrape_one(self, session: aiohttp.ClientSession, backend: Backend) -> EngineLoad:
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)
        async with session.get(backend.url + names.METRICS_PATH, timeout=timeout) as response:
            response.raise_for_status()
            return parse_load(await response.text(), time.monotonic())
