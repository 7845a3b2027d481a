"""The gateway's names that other parts read: its port, its headers and its Prometheus metrics.

The chart, the docs, the benchmarks and the tests read these; the module imports
nothing, like ``engine_contract``. Metric names follow the engine's conventions
(``kvpilot_`` prefix, base units, ``_total`` on counters as exposed).
"""

from __future__ import annotations

GATEWAY_PORT = 8000  # `kvpilot gateway --port` default; the chart's containerPort
HEALTH_PATH = "/health"  # 200 once the first listing of services and pods is in, 503 before
METRICS_PATH = "/metrics"

# Response headers the gateway adds: which engine pod answered and why it was chosen.
POD_HEADER = "x-kvpilot-pod"  # NAMESPACE/POD
ROUTE_REASON_HEADER = "x-kvpilot-route-reason"  # one of the REASON_* values below

# Label values of ROUTING_DECISIONS' `reason`.
REASON_PREFIX_AFFINITY = "prefix_affinity"  # the prompt's prefix owner took it
REASON_PREFIX_SPILL = "prefix_spill"  # the prefix owner was over its share: the next in its ranking
REASON_LEAST_LOADED = "least_loaded"  # no prefix to follow, or a new one its owner had no room for: the least loaded pod
REASON_RETRY = "retry"  # the first pod refused before any byte: another one

# Metrics (exposed names).
REQUESTS = "kvpilot_gateway_requests_total"  # labels: model, code
UPSTREAM_LATENCY = "kvpilot_gateway_upstream_latency_seconds"  # request sent -> response headers; label: model
RETRIES = "kvpilot_gateway_retries_total"  # labels: model, reason (status_429, status_503, connect_error, ...)
HELD_REQUESTS = "kvpilot_gateway_held_requests"  # gauge: waiting for a Ready pod; label: model
ROUTING_DECISIONS = "kvpilot_gateway_routing_decisions_total"  # labels: model, reason
IN_FLIGHT = "kvpilot_gateway_in_flight_requests"  # gauge: sent upstream, not finished; label: model

MODEL_LABEL = "model"
CODE_LABEL = "code"
REASON_LABEL = "reason"
