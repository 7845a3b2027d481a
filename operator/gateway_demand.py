"""Requests the kvpilot gateway holds for each InferenceService: demand the engines cannot see yet.

The gateway holds a request for a model with no Ready pod (its service is starting,
or at zero replicas) and exports how many it holds per model
(``kvpilot_gateway_held_requests``). Every gateway replica holds its own and knows
nothing of the others, so the operator reads them all: it lists the gateway's pods
(the chart names their namespace and labels: ``KVPILOT_GATEWAY_NAMESPACE``,
``KVPILOT_GATEWAY_SELECTOR``), reads each one's ``/v1/models`` (which
InferenceService each model name routes to: the gateway's own choice when two
services serve one name) and ``/metrics``, and sums per service. Every service's
control loop asks each interval; one reading of the gateways, shared for
``max_age_seconds``, answers them all. Nothing else is kept between reads: a
gateway replica that goes away takes its held requests with it.

A gateway that cannot be read counts as holding none, with a log line: demand the
autoscaler misses for one interval, never a control loop held up.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpilot import gateway_contract as contract
from kvpilot.operator.kube import Kube, KubeError

log = logging.getLogger("kvpilot.operator.gateway_demand")

MODELS_PATH = "/v1/models"  # the gateway's OpenAI model list, with each model's namespace and service
GATEWAY_CONTAINER = "gateway"  # the chart's container name; its port named "http" serves the gateway

ServiceKey = tuple[str, str]  # (namespace, InferenceService name)


def held_per_service(models: Mapping[str, Any], metrics_text: str) -> dict[ServiceKey, int]:
    """One gateway's held requests by service, from its /v1/models answer and its /metrics text."""
    owners = {m["id"]: (m["namespace"], m["service"]) for m in models.get("data") or ()}
    held: dict[ServiceKey, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name != contract.HELD_REQUESTS or sample.value <= 0:
                continue
            owner = owners.get(sample.labels.get(contract.MODEL_LABEL, ""))
            if owner is not None:  # a model no longer routed: its requests are not this operator's to count
                held[owner] = held.get(owner, 0) + int(round(sample.value))
    return held


def gateway_url(pod: dict[str, Any]) -> str | None:
    """A running gateway pod's base URL (its IP and the gateway container's "http" port), or None."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return None
    port = contract.GATEWAY_PORT
    for container in (pod.get("spec") or {}).get("containers") or ():
        if container.get("name") == GATEWAY_CONTAINER:
            port = next((p["containerPort"] for p in container.get("ports") or () if p.get("name") == "http"), port)
    return f"http://{status['podIP']}:{port}"


class GatewayDemand:
    """Reads every gateway replica's held requests, ``timeout_seconds`` per request; a reading younger
    than ``max_age_seconds`` is answered again instead of read anew."""

    def __init__(self, kube: Kube, namespace: str, selector: str, timeout_seconds: float = 2.0,
                 max_parallel: int = 8, max_age_seconds: float = 2.0) -> None:
        self.kube = kube
        self.namespace = namespace
        self.selector = selector
        self.timeout_seconds = timeout_seconds
        self.max_parallel = max_parallel
        self.max_age_seconds = max_age_seconds
        self._lock = threading.Lock()  # the services' control loops are threads
        self._last: tuple[float, dict[ServiceKey, int]] | None = None  # (time.monotonic() of the read, totals)

    def held(self) -> dict[ServiceKey, int]:
        """Held requests by service, summed over the gateway replicas that answered."""
        with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= self.max_age_seconds:
                self._last = (now, self._read_all())
            return self._last[1]

    def _read_all(self) -> dict[ServiceKey, int]:
        try:
            pods = self.kube.list("v1", "Pod", self.namespace, label_selector=self.selector)
        except (KubeError, OSError) as exc:
            log.warning("cannot list the gateway's pods in %s (%s): counting no held requests", self.namespace, exc)
            return {}
        urls = {pod["metadata"]["name"]: url for pod in pods if (url := gateway_url(pod)) is not None}
        if not urls:
            return {}
        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(urls))) as pool:
            answers = list(pool.map(self._read, urls.values()))
        totals: dict[ServiceKey, int] = {}
        for pod, answer in zip(urls, answers):
            if isinstance(answer, Exception):
                log.warning("cannot read held requests from gateway pod %s/%s (%s: %s): counting none from it",
                            self.namespace, pod, type(answer).__name__, answer)
                continue
            for service, count in answer.items():
                totals[service] = totals.get(service, 0) + count
        return totals

    def _read(self, url: str) -> dict[ServiceKey, int] | Exception:
        try:
            models = json.loads(self._get(url + MODELS_PATH))
            return held_per_service(models, self._get(url + contract.METRICS_PATH))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # URLError, timeouts, refused, bad answers
            return exc

    def _get(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=self.timeout_seconds) as response:
            return response.read().decode()
