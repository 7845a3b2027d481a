"""One control interval of one InferenceService, decided: what was read in, what to write out.

``plan`` is a pure function of a ``Reading`` (the spec, the engine pods, the
engines' metrics, the settings in effect) and the service's ``Memory`` (what
earlier intervals learned). The tuner and the autoscaler decide inside it; the
``Plan`` says what the control loop writes: new settings (to the tuning
ConfigMap and live to the Ready engines), the replicas, the status sections and
the Events. ``control_loop.py`` does the reading and the writing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvpilot.operator import builders, status
from kvpilot.operator.autoscaler import ReplicaState, ScaleDecision, ScalingHistory, ScalingPolicy, autoscale
from kvpilot.operator.engine_metrics import Observation, ServiceMetrics
from kvpilot.operator.spec import EngineSettings, InferenceServiceSpec
from kvpilot.operator.tuner import Decision, TunerConfig, TuningHistory, tune


@dataclass(frozen=True)
class Reading:
    """What the control loop read at the start of an interval."""

    name: str
    namespace: str
    spec: InferenceServiceSpec
    pods: list[dict[str, Any]]  # the service's engine pods, terminating ones left out
    ready: Mapping[str, str]  # Ready pods with an IP (the ones scraped and pushed to) → base URL
    metrics: ServiceMetrics
    engine_max_num_seqs: Mapping[str, int]  # what each Ready engine last reported
    in_effect: EngineSettings  # from the tuning ConfigMap
    now: float
    held_at_gateway: int = 0  # requests the kvpilot gateway holds for the service (no Ready pod), all replicas


@dataclass(frozen=True)
class Memory:
    """What a service's loop carries from one interval to the next (in memory only)."""

    tuning: TuningHistory = TuningHistory()
    scaling: ScalingHistory = ScalingHistory()
    restarts_seen: Mapping[str, int] = field(default_factory=dict)  # pod uid → engine restarts accounted for
    unreachable: frozenset[str] = frozenset()  # pods whose /metrics failed last interval


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    """What to write. ``push`` lists the Ready pods to send ``live`` to (all of them after a change;
    after none, those whose engines report other values); their windows restart once they took it,
    and everyone's at ``restart_windows_at`` after a change (when its admission burst has passed)."""

    memory: Memory
    status: dict[str, Any]
    live: EngineSettings  # the settings the engines should run: the new ones, or those in effect
    events: tuple[Event, ...] = ()
    new_settings: EngineSettings | None = None  # for the tuning ConfigMap; None: unchanged
    push: tuple[str, ...] = ()
    restart_windows_at: float | None = None
    replicas: int | None = None  # for the scale subresource; None: unchanged
    decision: Decision | None = None
    scale: ScaleDecision | None = None


def interval_seconds(spec: InferenceServiceSpec, default: float) -> float:
    return float((spec.tuning.interval_seconds if spec.tuning else None) or default)


def settle_seconds(interval: float) -> float:
    """How long after a change the next window starts: a fifth of the interval, 2-10 s."""
    return min(max(interval / 5, 2.0), 10.0)


def plan(reading: Reading, memory: Memory, *, interval: float, scale_down_stabilization_seconds: float,
         config: TunerConfig = TunerConfig()) -> Plan:
    spec, now, observation = reading.spec, reading.now, reading.metrics.service
    events: list[Event] = []
    report: dict[str, Any] = {"metrics": status.metrics_status(reading.metrics, now)}
    unreachable = frozenset(reading.metrics.unreachable)
    for pod in sorted(unreachable - memory.unreachable):
        events.append(Event("Warning", "MetricsUnavailable",
                            f"cannot read /metrics of Ready pod {pod}: {reading.metrics.pods[pod].error}; "
                            "tuning goes on with the other pods"))
    memory = Memory(memory.tuning, memory.scaling, memory.restarts_seen, unreachable)

    decision = None
    if spec.tuning is not None and spec.tuning.enabled:
        oom_kills, restarts_seen = count_new_oom_kills(reading.pods, memory.restarts_seen)
        # A queue is the autoscaler's to relieve only while it can add a replica.
        scaling = spec.autoscaling
        replicas_can_grow = scaling is not None and scaling.enabled and spec.replicas < scaling.max_replicas
        decision = tune(observation, reading.in_effect, spec.tuning, memory.tuning, now, oom_kills, config,
                        replicas_can_grow=replicas_can_grow)
        last_unreachable = memory.tuning.unreachable_at
        if decision.slo_unreachable and (last_unreachable is None or now - last_unreachable > 1.5 * interval):
            events.append(Event("Warning", "SLOUnreachable", decision.reason))
        memory = Memory(decision.history, memory.scaling, restarts_seen, unreachable)
        report["tuning"] = status.tuning_status(decision, now)
    live = decision.settings if decision is not None else reading.in_effect
    changes = _apply_decision(decision, reading, interval, events)

    scale = None
    if spec.autoscaling is not None and spec.autoscaling.enabled:
        pending_no_gpu = sum(1 for p in status.diagnose_pods(spec, reading.pods, [])
                             if p.reason == status.INSUFFICIENT_GPU)
        replicas = ReplicaState(desired=spec.replicas, ready=len(reading.ready), pending_no_gpu=pending_no_gpu,
                                slots_per_replica=live.max_num_seqs)
        policy = ScalingPolicy(spec.autoscaling.min_replicas, spec.autoscaling.max_replicas,
                               scale_down_stabilization_seconds=scale_down_stabilization_seconds,
                               scale_to_zero_after_seconds=spec.autoscaling.scale_to_zero_after_seconds,
                               slo=spec.tuning.slo if spec.tuning is not None else None)
        saturated = is_saturated(observation, live.max_num_seqs, len(reading.ready), config)
        scale = autoscale(observation, replicas, policy, memory.scaling, now, saturated, held=reading.held_at_gateway)
        memory = Memory(memory.tuning, scale.history, memory.restarts_seen, unreachable)
        report["autoscaling"] = status.autoscaling_status(scale, now)
        if scale.changed:
            events.append(Event("Normal", "Scaled", scale.reason))

    return Plan(memory=memory, status=report, events=tuple(events), live=live,
                replicas=scale.replicas if scale is not None and scale.changed else None,
                decision=decision, scale=scale, **changes)


def _apply_decision(decision: Decision | None, reading: Reading, interval: float,
                    events: list[Event]) -> dict[str, Any]:
    """Where the tuner's decision goes: the ConfigMap, the engines, and when windows restart."""
    if decision is None or not decision.changed:
        # The ConfigMap is the truth: a Ready engine that runs another value (it restarted before
        # the file changed, or missed a push) is brought back in line.
        stale = tuple(sorted(pod for pod in reading.ready
                             if pod in reading.engine_max_num_seqs
                             and reading.engine_max_num_seqs[pod] != reading.in_effect.max_num_seqs))
        return {"push": stale}
    changes: dict[str, Any] = {"new_settings": decision.settings}
    if decision.live_settings_changed:
        changes.update(push=tuple(sorted(reading.ready)), restart_windows_at=reading.now + settle_seconds(interval))
        events.append(Event("Normal", "Tuned", decision.reason))
    if decision.memory_changed:
        # The pod template carries the memory fraction: the ConfigMap change triggers the reconcile
        # that renders it, and the Deployment replaces pods one at a time.
        events.append(Event("Normal", "TunedMemory", decision.reason + "; " + _restart_cost(reading)))
    return changes


def _restart_cost(reading: Reading) -> str:
    """What the rollout a new memory fraction starts costs: each pod replaced in turn, each new one taking
    about what this service's newest Ready engine took from start to Ready (its first Ready, most likely:
    an older pod's Ready condition may have changed since)."""
    starts = [(pod["status"]["startTime"], seconds) for pod in reading.pods
              if (seconds := _start_to_ready_seconds(pod)) is not None]  # RFC 3339 times sort as they read
    took = f" (the newest engine took {max(starts)[1]:.0f} s from start to Ready)" if starts else ""
    if reading.spec.resources.gpus > 0:  # no spare GPU for a surge pod: each one is out of service meanwhile
        return f"restarting {len(reading.pods)} pod(s) one at a time, each out of service until Ready{took}"
    return f"replacing {len(reading.pods)} pod(s) one at a time, each new one beside the old until Ready{took}"


def _start_to_ready_seconds(pod: Mapping[str, Any]) -> float | None:
    pod_status = pod.get("status") or {}
    ready = next((c.get("lastTransitionTime") for c in pod_status.get("conditions") or []
                  if c.get("type") == "Ready" and c.get("status") == "True"), None)
    if not ready or not pod_status.get("startTime"):
        return None
    return (datetime.fromisoformat(ready) - datetime.fromisoformat(pod_status["startTime"])).total_seconds()


def is_saturated(observation: Observation | None, max_num_seqs: int, ready: int, config: TunerConfig) -> bool:
    """The Ready replicas ran full batches with a queue: their throughput is their capacity."""
    if observation is None or observation.mean_running_per_pod is None or ready <= 0:
        return False
    return observation.mean_running_per_pod >= config.saturation_fill * max_num_seqs and observation.waiting > 0


def count_new_oom_kills(pods: list[dict[str, Any]], restarts_seen: Mapping[str, int]) -> tuple[int, dict[str, int]]:
    """Engine containers OOMKilled since the last interval, and the restart counts now seen
    (a pod seen for the first time sets its baseline)."""
    kills, seen = 0, dict(restarts_seen)
    for pod in pods:
        uid = pod["metadata"].get("uid") or pod["metadata"]["name"]
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            if container.get("name") != builders.CONTAINER_NAME:
                continue
            restarts = container.get("restartCount") or 0
            previous = seen.get(uid)
            seen[uid] = restarts
            last = (container.get("lastState") or {}).get("terminated") or {}
            if previous is not None and restarts > previous and last.get("reason") == "OOMKilled":
                kills += 1
    return kills, seen
