"""The control loop of each InferenceService that tunes or autoscales: read → plan → write.

A kopf daemon per service runs ``ControlLoop.run`` (a daemon, not a timer, so the
interval follows the spec and no "succeeded" Event is posted every tick). Every
interval:

1. **read** the engine pods and the settings in effect (``kube``), the Ready
   engines' /metrics (``engine_client``) into the service's metric windows, and
   the requests the gateway holds for the service (``gateway_demand``);
2. **plan** (``plan.plan``, pure: the tuner and the autoscaler decide there);
3. **write** new settings to the tuning ConfigMap (``kube``) and live to the
   Ready engines' admin API (``engine_client``, which the engine's scheduler
   applies from its next step), replicas through the scale subresource, then
   status, Events and the operator's own metrics.

The ConfigMap is the truth. Its change triggers the ordinary reconcile
(``handlers.py``), which renders a new memory fraction into the pod template (the
Deployment then replaces pods one at a time) and reports ``status.engine``.

What only helps the tuner learn (metric windows, histories) lives in memory; an
operator restart starts learning afresh from the persisted settings.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from kvpilot import engine_contract as contract
from kvpilot.kube_contract import pod_ready, pod_url
from kvpilot.operator import builders, operator_metrics, reconcile
from kvpilot.operator.engine_client import EngineClient, admin_url
from kvpilot.operator.engine_metrics import MetricsCollector
from kvpilot.operator.gateway_demand import GatewayDemand
from kvpilot.operator.kube import Kube
from kvpilot.operator.plan import Event, Memory, Plan, Reading, interval_seconds, plan
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import InferenceServiceSpec, parse_spec
from kvpilot.operator.tuner import TunerConfig

log = logging.getLogger("kvpilot.operator.control_loop")

# The loop wakes this often; each service acts on its own interval.
TICK_SECONDS = 5.0


class Stopped(Protocol):
    """kopf's DaemonStopped: true once the daemon should exit; ``wait`` sleeps until then."""

    def __bool__(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> object: ...


@dataclass
class ServiceLoop:
    """One service's loop state: its metric windows, its memory, and when it runs next."""

    collector: MetricsCollector
    memory: Memory = field(default_factory=Memory)
    last_run: float = -math.inf
    # After new live settings the engines admit a burst of queued prompts whose prefill slows
    # a few steps; every window restarts once that has passed (``plan.settle_seconds``).
    restart_windows_at: float | None = None
    expect_max_num_seqs: int | None = None


def wants_loop(spec: dict[str, Any]) -> bool:
    """Whether a service's spec asks for tuning or autoscaling (the daemon's filter)."""
    tuning = spec.get("tuning") or {}
    autoscaling = spec.get("autoscaling") or {}
    return bool(tuning and tuning.get("enabled", True)) or bool(autoscaling and autoscaling.get("enabled", True))


class ControlLoop:
    """Every service's loop state plus the tick; one per operator."""

    def __init__(self, kube: Kube, engines: EngineClient, settings: OperatorSettings,
                 config: TunerConfig = TunerConfig()) -> None:
        self.kube = kube
        self.engines = engines
        self.settings = settings
        self.config = config
        self.services: dict[tuple[str, str], ServiceLoop] = {}
        self.gateways = GatewayDemand(kube, *settings.gateway_pods) if settings.gateway_pods is not None else None

    def run(self, current_body: Callable[[], dict[str, Any]], stopped: Stopped,
            post: Callable[[dict[str, Any], Event], None]) -> None:
        """One service's loop, for a kopf daemon: tick, post Events, sleep, until ``stopped``.

        A failed interval (API server hiccup) is logged and the loop goes on.
        """
        while not stopped:
            body = current_body()
            try:
                result = self.tick(body)
                for event in result.events if result is not None else ():
                    post(body, event)
            except Exception:
                log.exception("%s/%s: control interval failed", body["metadata"]["namespace"], body["metadata"]["name"])
            stopped.wait(TICK_SECONDS)
        self.services.pop((body["metadata"]["namespace"], body["metadata"]["name"]), None)

    def tick(self, body: dict[str, Any], now: float | None = None) -> Plan | None:
        """Runs one interval for the service if it is due; None when not due or nothing to do."""
        now = time.time() if now is None else now
        name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
        try:
            spec = parse_spec(body.get("spec") or {})
        except ValidationError:
            return None  # the reconcile reports invalid specs
        if not wants_loop(body.get("spec") or {}):
            self.services.pop((namespace, name), None)
            return None
        interval = interval_seconds(spec, self.settings.tuning_interval_seconds)
        service = self.services.get((namespace, name))
        if service is None:
            service = self.services[(namespace, name)] = ServiceLoop(MetricsCollector(window_seconds=2 * interval))
        if service.restart_windows_at is not None and now >= service.restart_windows_at:
            self._restart_windows(service, namespace, name)
        if now - service.last_run < interval - TICK_SECONDS / 2:
            return None
        service.last_run = now
        reading = self._read(name, namespace, spec, service, now)
        result = plan(reading, service.memory, interval=interval, config=self.config,
                      scale_down_stabilization_seconds=self.settings.scale_down_stabilization_seconds)
        failures = self._write(body, reading, result, service)
        return dataclasses.replace(result, events=result.events + failures)

    # --- read ---------------------------------------------------------------------------

    def _read(self, name: str, namespace: str, spec: InferenceServiceSpec, service: ServiceLoop,
              now: float) -> Reading:
        pods, ready = self._pods(name, namespace)
        metrics = service.collector.ingest(self.engines.scrape(ready), time.time())
        reported = {pod: int(value) for pod in ready
                    if (value := service.collector.latest_gauge(pod, contract.MAX_NUM_SEQS)) is not None}
        held = self._held_at_gateway(name, namespace, spec)
        return Reading(name=name, namespace=namespace, spec=spec, pods=pods, ready=ready,
                       metrics=metrics, engine_max_num_seqs=reported,
                       in_effect=reconcile.read_settings_in_effect(self.kube, name, namespace, spec), now=now,
                       held_at_gateway=held)

    def _held_at_gateway(self, name: str, namespace: str, spec: InferenceServiceSpec) -> int:
        """Requests the gateway replicas hold for the service; only the autoscaler reads them."""
        if self.gateways is None or spec.autoscaling is None or not spec.autoscaling.enabled:
            return 0
        held = self.gateways.held().get((namespace, name), 0)
        if held:
            log.info("%s/%s: %d request(s) held at the gateway count as queued demand", namespace, name, held)
        return held

    def _pods(self, name: str, namespace: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """The live engine pods, and the Ready ones' base URLs by pod name."""
        pods = self.kube.list("v1", "Pod", namespace, label_selector=builders.selector_string(name))
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = {p["metadata"]["name"]: pod_url(p["status"]["podIP"]) for p in live
                 if pod_ready(p) and (p.get("status") or {}).get("podIP")}
        return live, ready

    def _restart_windows(self, service: ServiceLoop, namespace: str, name: str) -> None:
        """Starts every pod's window now that the admission burst after a change has passed."""
        _, ready = self._pods(name, namespace)
        service.collector.ingest(self.engines.scrape(ready), time.time())
        service.collector.restart_windows(expect_max_num_seqs=service.expect_max_num_seqs)
        service.restart_windows_at = service.expect_max_num_seqs = None

    # --- write --------------------------------------------------------------------------

    def _write(self, body: dict[str, Any], reading: Reading, result: Plan, service: ServiceLoop) -> tuple[Event, ...]:
        """Carries out the plan; returns Events about what did not work."""
        name, namespace, spec = reading.name, reading.namespace, reading.spec
        failures: list[Event] = []
        if result.new_settings is not None:
            self.kube.apply(builders.build_tuning_configmap(name, namespace, spec, result.new_settings), owner=body)
        if result.push:
            token = builders.admin_token(self.kube.get("v1", "Secret", namespace, builders.admin_secret_name(name)))
            pod_ips = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in reading.pods}
            targets = {pod: admin_url(pod_ips[pod]) for pod in result.push}
            failed = self.engines.set_scheduler_limits(targets, result.live, token)
            seqs = result.live.max_num_seqs
            for pod in targets:
                if pod in failed:
                    failures.append(Event("Warning", "TuningNotApplied",
                                        f"pod {pod} did not take maxNumSeqs {seqs}: {failed[pod]}; "
                                        "retrying next interval"))
                elif result.restart_windows_at is None:
                    service.collector.restart_pod_window(pod, expect_max_num_seqs=seqs)
                    log.info("%s/%s: pod %s brought back to maxNumSeqs %d", namespace, name, pod, seqs)
        if result.restart_windows_at is not None:
            service.collector.restart_windows(expect_max_num_seqs=result.live.max_num_seqs)
            service.restart_windows_at = result.restart_windows_at
            service.expect_max_num_seqs = result.live.max_num_seqs
        if result.replicas is not None:
            self.kube.scale_inference_service(namespace, name, result.replicas)
        service.memory = result.memory
        self.kube.patch_status(namespace, name, result.status)
        self._record(reading, result)
        return tuple(failures)

    def _record(self, reading: Reading, result: Plan) -> None:
        namespace, name = reading.namespace, reading.name
        if result.decision is not None:
            operator_metrics.record_decision(namespace, name, result.decision)
        if result.scale is not None:
            operator_metrics.record_scale(namespace, name, result.scale)
        operator_metrics.record_slo(namespace, name, reading.spec.tuning.slo if reading.spec.tuning else None)
        operator_metrics.SCRAPE_ERRORS.labels(namespace, name).inc(len(reading.metrics.unreachable))


def post_event(body: dict[str, Any], event: Event) -> None:
    """Posts an interval's Event on the InferenceService."""
    import kopf

    kopf.event(body, type=event.type, reason=event.reason, message=event.message)
