"""The only code that speaks HTTP to engine pods: the twin of ``kube.py``.

Three calls, each fanned out over a service's pods at once and answering per
pod, so one slow or dead pod never holds up or fails the others:

- ``scrape``: each pod's Prometheus exposition (``GET /metrics``);
- ``set_scheduler_limits``: the live settings (``POST /admin/v1/scheduler`` on the
  engine's admin port, bearer admin token), which the engine's scheduler applies
  from its next step;
- ``sync_loras``: each pod's LoRA adapters brought to spec.loras (listed, then
  unloaded and loaded one by one on the admin port).

Paths, port and keys come from the engine contract. The standard library is
enough: a few pods per service, a few requests each interval.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvpilot import engine_contract as contract
from kvpilot.operator.spec import EngineSettings

T = TypeVar("T")


def admin_url(pod_ip: str) -> str:
    """The base URL of an engine pod's admin API: its own port, which the Service does not expose."""
    return f"http://{pod_ip}:{contract.ADMIN_PORT}"


class EngineClient:
    """Calls engines by base URL (``pod_url``), ``timeout_seconds`` per request."""

    def __init__(self, timeout_seconds: float = 5.0, max_parallel: int = 16) -> None:
        self.timeout_seconds = timeout_seconds
        self.max_parallel = max_parallel

    def scrape(self, engines: Mapping[str, str]) -> dict[str, str | Exception]:
        """Each engine's /metrics text, or the exception that stopped it; ``engines`` maps a key to a base URL."""

        def get(url: str) -> str:
            with urllib.request.urlopen(url + contract.METRICS_PATH, timeout=self.timeout_seconds) as response:
                return response.read().decode()

        return self._each(engines, get)

    def set_scheduler_limits(self, engines: Mapping[str, str], settings: EngineSettings,
                             token: str | None) -> dict[str, str]:
        """Sends the live settings to each engine (``engines`` maps a key to an ``admin_url``); returns
        key → error for those that did not take them."""
        if token is None:
            return {key: "the admin token Secret is missing" for key in engines}
        body = {name: getattr(settings, name) for name in contract.LIVE_SETTINGS
                if getattr(settings, name) is not None}
        data = json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

        def post(url: str) -> None:
            request = urllib.request.Request(url + contract.ADMIN_SCHEDULER_PATH, data, headers, method="POST")
            with urllib.request.urlopen(request, timeout=self.timeout_seconds):
                pass

        return {key: _describe(outcome) for key, outcome in self._each(engines, post).items()
                if isinstance(outcome, Exception)}

    def sync_loras(self, engines: Mapping[str, str], desired: Mapping[str, str],
                   token: str | None) -> dict[str, dict[str, str | None]]:
        """Loads and unloads adapters on each engine (``engines`` maps a key to an ``admin_url``) until
        it holds ``desired`` (name -> folder in the pod); returns key -> adapter name -> None when the
        engine holds it, else why not. An engine that cannot be listed reports every desired adapter
        with that error; one started without LoRA (a pod of the template before spec.loras, about
        to be replaced) reports nothing."""
        if token is None:
            return {key: {name: "the admin token Secret is missing" for name in desired} for key in engines}
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

        def call(url: str, path: str, body: dict[str, str] | None = None) -> bytes:
            data = None if body is None else json.dumps(body).encode()
            request = urllib.request.Request(url + path, data, headers, method="GET" if body is None else "POST")
            with urllib.request.urlopen(request, timeout=self.timeout_seconds) as response:
                return response.read()  # a list as JSON; vLLM's load and unload answer a line of text

        def sync(url: str) -> dict[str, str | None]:
            listed = json.loads(call(url, contract.ADMIN_LORA_ADAPTERS_PATH))
            if not listed["enabled"]:
                return {}
            loaded = {adapter["name"]: adapter["path"] for adapter in listed["data"]}
            unload, load = lora_changes(loaded, desired)
            states: dict[str, str | None] = {}
            for name in unload:
                call(url, contract.ADMIN_UNLOAD_LORA_PATH, {"lora_name": name})
            for name in desired:
                if name not in load:
                    states[name] = None
                    continue
                try:
                    call(url, contract.ADMIN_LOAD_LORA_PATH, {"lora_name": name, "lora_path": desired[name]})
                    states[name] = None
                except (OSError, ValueError) as exc:
                    states[name] = _describe(exc)
            return states

        return {key: outcome if isinstance(outcome, dict) else {name: _describe(outcome) for name in desired}
                for key, outcome in self._each(engines, sync).items()}

    def _each(self, engines: Mapping[str, str], call: Callable[[str], T]) -> dict[str, T | Exception]:
        if not engines:
            return {}

        def guarded(url: str) -> T | Exception:
            try:
                return call(url)
            except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, refused connections
                return exc

        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(engines))) as pool:
            outcomes = list(pool.map(guarded, engines.values()))
        return dict(zip(engines, outcomes))


def lora_changes(loaded: Mapping[str, str], desired: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(adapters to unload, adapters to load) to take an engine from ``loaded`` to ``desired`` (both
    name -> folder): one whose folder changed is unloaded and loaded again."""
    unload = [name for name, path in loaded.items() if desired.get(name) != path]
    load = [name for name, path in desired.items() if loaded.get(name) != path]
    return unload, load


def _describe(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code}: {error.read().decode(errors='replace')[:200]}"
    if isinstance(error, urllib.error.URLError):
        return f"{type(error.reason).__name__}: {error.reason}"
    return f"{type(error).__name__}: {error}"
