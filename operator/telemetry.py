"""The operator's own Prometheus metrics: tuning decisions, scrape errors, scaling.

Kept in a private registry and served by ``serve`` on the operator's metrics
port, so a Prometheus that already scrapes the engines can watch the tuner too
(``rate(kvpilot_operator_tuning_decisions_total{action!="hold"}[10m])`` shows
how often it moves).
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvpilot.operator.tuner import Decision

log = logging.getLogger("kvpilot.operator.telemetry")

REGISTRY = CollectorRegistry()
_SERVICE = ["namespace", "service"]

TUNING_DECISIONS = Counter(
    "kvpilot_operator_tuning_decisions",
    "Tuning intervals by outcome: a parameter raised or lowered, or held.",
    _SERVICE + ["parameter", "action"],
    registry=REGISTRY,
)
SCRAPE_ERRORS = Counter(
    "kvpilot_operator_scrape_errors",
    "Ready engine pods whose /metrics could not be read, per tuning interval.",
    _SERVICE,
    registry=REGISTRY,
)
SCALE_DECISIONS = Counter(
    "kvpilot_operator_scale_decisions",
    "Replica changes the autoscaler made.",
    _SERVICE + ["direction"],
    registry=REGISTRY,
)
MAX_NUM_SEQS = Gauge(
    "kvpilot_operator_max_num_seqs", "maxNumSeqs the tuner last chose.", _SERVICE, registry=REGISTRY
)
GPU_MEMORY_UTILIZATION = Gauge(
    "kvpilot_operator_gpu_memory_utilization",
    "gpuMemoryUtilization the tuner last chose.",
    _SERVICE,
    registry=REGISTRY,
)


def record_decision(namespace: str, service: str, decision: Decision) -> None:
    before, after = decision.previous, decision.params
    moves = (
        ("maxNumSeqs", before.max_num_seqs, after.max_num_seqs),
        ("gpuMemoryUtilization", before.gpu_memory_utilization, after.gpu_memory_utilization),
    )
    for parameter, old, new in moves:
        action = "hold" if new == old else ("raise" if new > old else "lower")
        TUNING_DECISIONS.labels(namespace, service, parameter, action).inc()
    MAX_NUM_SEQS.labels(namespace, service).set(after.max_num_seqs)
    GPU_MEMORY_UTILIZATION.labels(namespace, service).set(after.gpu_memory_utilization)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serves /metrics on ``port`` in a daemon thread (0 disables it)."""
    if port <= 0:
        return
    start_http_server(port, addr=addr, registry=REGISTRY)
    log.info("operator metrics on http://%s:%d/metrics", addr, port)
