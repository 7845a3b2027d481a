"""The operator's own Prometheus metrics: its decisions, the SLOs they aim at, replicas, scrape errors.

Kept in a private registry and served by ``serve`` on the operator's metrics
port, so a Prometheus that already scrapes the engines can watch the tuner too
(``rate(kvpilot_operator_tuning_decisions_total{action!="hold"}[10m])`` shows
how often it moves). Every series carries ``namespace`` and ``service`` (the
InferenceService); the chart's Grafana dashboard plots them next to the engines'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvpilot.operator.autoscaler import ScaleDecision
from kvpilot.operator.spec import Slo
from kvpilot.operator.tuner import Decision

log = logging.getLogger("kvpilot.operator.metrics")

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
SLO_SECONDS = Gauge(
    "kvpilot_operator_slo_seconds",
    "The service's latency SLO (spec.tuning.slo): ttft_p99, itl_p99 or tpot_p99.",
    _SERVICE + ["slo"],
    registry=REGISTRY,
)
DESIRED_REPLICAS = Gauge(
    "kvpilot_operator_desired_replicas", "spec.replicas of the InferenceService.", _SERVICE, registry=REGISTRY
)
READY_REPLICAS = Gauge(
    "kvpilot_operator_ready_replicas", "Engine pods ready to serve.", _SERVICE, registry=REGISTRY
)
_PER_SERVICE = (TUNING_DECISIONS, SCRAPE_ERRORS, SCALE_DECISIONS, MAX_NUM_SEQS, GPU_MEMORY_UTILIZATION, SLO_SECONDS,
                DESIRED_REPLICAS, READY_REPLICAS)


def record_decision(namespace: str, service: str, decision: Decision) -> None:
    before, after = decision.previous, decision.settings
    moves = (
        ("maxNumSeqs", before.max_num_seqs, after.max_num_seqs),
        ("gpuMemoryUtilization", before.gpu_memory_utilization, after.gpu_memory_utilization),
    )
    for parameter, old, new in moves:
        action = "hold" if new == old else ("raise" if new > old else "lower")
        TUNING_DECISIONS.labels(namespace, service, parameter, action).inc()
    MAX_NUM_SEQS.labels(namespace, service).set(after.max_num_seqs)
    GPU_MEMORY_UTILIZATION.labels(namespace, service).set(after.gpu_memory_utilization)


def record_scale(namespace: str, service: str, decision: ScaleDecision) -> None:
    if decision.changed:
        direction = "up" if decision.replicas > decision.previous else "down"
        SCALE_DECISIONS.labels(namespace, service, direction).inc()


def record_slo(namespace: str, service: str, slo: Slo | None) -> None:
    targets = {"ttft_p99": slo.ttft_p99_seconds, "itl_p99": slo.itl_p99_seconds,
               "tpot_p99": slo.tpot_p99_seconds} if slo else {}
    _remove_where(SLO_SECONDS, lambda labels: labels[:2] == (namespace, service) and not targets.get(labels[2]))
    for name, seconds in targets.items():
        if seconds is not None:
            SLO_SECONDS.labels(namespace, service, name).set(seconds)


def record_replicas(namespace: str, service: str, desired: int, ready: int) -> None:
    DESIRED_REPLICAS.labels(namespace, service).set(desired)
    READY_REPLICAS.labels(namespace, service).set(ready)


def forget(namespace: str, service: str) -> None:
    """Drops a deleted service's series."""
    for metric in _PER_SERVICE:
        _remove_where(metric, lambda labels: labels[:2] == (namespace, service))


def _remove_where(metric: Counter | Gauge, condition: Callable[[tuple[str, ...]], bool]) -> None:
    """Removes the label sets (values in label-name order) that meet ``condition``."""
    label_sets = {tuple(sample.labels.values()) for family in metric.collect() for sample in family.samples}
    for labels in label_sets:
        if condition(labels):
            metric.remove(*labels)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serves /metrics on ``port`` in a daemon thread (0 disables it)."""
    if port <= 0:
        return
    start_http_server(port, addr=addr, registry=REGISTRY)
    log.info("operator metrics on http://%s:%d/metrics", addr, port)
