"""The gateway's Prometheus metrics (names in kvpilot/gateway_contract.py), on their own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot import gateway_contract as names
from kvpilot.engine_contract import TIME_TO_FIRST_TOKEN_BUCKETS, counter_base_name

UNKNOWN_MODEL = "unknown"  # the model label of requests that name no routable model


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        model, code, reason = names.MODEL_LABEL, names.CODE_LABEL, names.REASON_LABEL
        self.requests = Counter(counter_base_name(names.REQUESTS), "Requests answered, by model and HTTP status "
                                "(499: the client went away first).", [model, code], registry=self.registry)
        self.upstream_latency = Histogram(
            names.UPSTREAM_LATENCY, "Seconds from sending a request to an engine to its response headers "
            "(for a stream: about the time to first token).", [model],
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS, registry=self.registry)
        self.retries = Counter(counter_base_name(names.RETRIES), "Requests sent to a second pod after the first "
                               "refused before any byte, by reason.", [model, reason], registry=self.registry)
        self.held = Gauge(names.HELD_REQUESTS, "Requests waiting for a Ready engine pod (starting, or waking "
                          "from zero replicas).", [model], registry=self.registry)
        self.decisions = Counter(counter_base_name(names.ROUTING_DECISIONS), "Pods chosen, by reason.",
                                 [model, reason], registry=self.registry)
        self.in_flight = Gauge(names.IN_FLIGHT, "Requests sent to an engine and not finished.", [model],
                               registry=self.registry)
