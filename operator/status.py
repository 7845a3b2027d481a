"""Pure status computation: every field of an InferenceService's status is built here.

The reconcile's part (``compute_status``) reads the Deployment's status, the
engine pods and their events, and turns them into Kubernetes-style conditions
(Ready, Progressing, Degraded) whose reasons a user can act on: a pod the
scheduler cannot place for lack of GPUs, an image that does not pull, an engine
that keeps crashing, a model volume that does not exist; and ``engine``, the
settings in effect. The control loop's part reports its interval:
``metrics_status``, ``tuning_status`` and ``autoscaling_status``. Field names
are the spec models'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvpilot.kube_contract import pod_ready
from kvpilot.operator import builders
from kvpilot.operator.autoscaler import ScaleDecision
from kvpilot.operator.engine_metrics import ServiceMetrics
from kvpilot.operator.spec import (
    AutoscalingStatus,
    ConditionType,
    EngineSettings,
    InferenceServiceSpec,
    MetricsStatus,
    Phase,
    TuningStatus,
)
from kvpilot.operator.tuner import GPU_MEMORY_UTILIZATION, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, Decision

HISTORY_IN_STATUS = 10  # tuning changes listed in status.tuning.history

# Degraded reasons, most urgent first: the condition names the first one found.
INVALID_SPEC = "InvalidSpec"
INSUFFICIENT_GPU = "InsufficientGPU"
MODEL_VOLUME_MISSING = "ModelVolumeMissing"
IMAGE_PULL_FAILED = "ImagePullFailed"
CONTAINER_CONFIG_ERROR = "ContainerConfigError"
MODEL_DOWNLOAD_FAILED = "ModelDownloadFailed"
CRASH_LOOP = "CrashLoop"
UNSCHEDULABLE = "Unschedulable"
VOLUME_MOUNT_FAILED = "VolumeMountFailed"
ROLLOUT_STUCK = "RolloutStuck"
REASON_PRIORITY = (
    INVALID_SPEC, INSUFFICIENT_GPU, MODEL_VOLUME_MISSING, IMAGE_PULL_FAILED, CONTAINER_CONFIG_ERROR,
    MODEL_DOWNLOAD_FAILED, CRASH_LOOP, UNSCHEDULABLE, VOLUME_MOUNT_FAILED, ROLLOUT_STUCK,
)

_IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
_CONFIG_REASONS = {"CreateContainerConfigError", "CreateContainerError"}


@dataclass(frozen=True)
class Problem:
    reason: str
    pod: str
    message: str


def diagnose_pods(spec: InferenceServiceSpec, pods: list[dict[str, Any]],
                  events: list[dict[str, Any]]) -> list[Problem]:
    """Problems of pods that are not ready, most urgent first."""
    problems: list[Problem] = []
    events_by_pod: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        events_by_pod.setdefault((event.get("involvedObject") or {}).get("name", ""), []).append(event)
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp") or pod_ready(pod):
            continue
        problem = _diagnose_pod(spec, pod, events_by_pod.get(pod["metadata"]["name"], []))
        if problem is not None:
            problems.append(problem)
    return sorted(problems, key=lambda p: (REASON_PRIORITY.index(p.reason), p.pod))


def _diagnose_pod(spec: InferenceServiceSpec, pod: dict[str, Any], events: list[dict[str, Any]]) -> Problem | None:
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") == "Unschedulable":
            return _unschedulable(spec, name, condition.get("message") or "")
    for container in status.get("initContainerStatuses") or []:
        problem = _container_problem(spec, name, container, init=True)
        if problem is not None:
            return problem
    for container in status.get("containerStatuses") or []:
        problem = _container_problem(spec, name, container, init=False)
        if problem is not None:
            return problem
    for event in reversed(events):
        if event.get("reason") == "FailedScheduling" and status.get("phase") == "Pending" \
                and not (status.get("conditions") or []):
            return _unschedulable(spec, name, event.get("message") or "")
        if event.get("reason") == "FailedMount":
            message = event.get("message") or ""
            if '"model"' in message or "volume model" in message or "persistentvolumeclaim" in message.lower():
                return Problem(MODEL_VOLUME_MISSING, name, (
                    f"pod {name} cannot mount the model volume for {spec.model.uri}: {message}. "
                    "Check that the path or PersistentVolumeClaim in spec.model.uri exists."
                ))
            return Problem(VOLUME_MOUNT_FAILED, name, f"pod {name} cannot mount a volume: {message}")
    return None


def _unschedulable(spec: InferenceServiceSpec, pod: str, message: str) -> Problem:
    gpu = spec.resources.gpu_resource_name
    if spec.resources.gpus > 0 and re.search(rf"Insufficient {re.escape(gpu)}\b", message):
        return Problem(INSUFFICIENT_GPU, pod, (
            f"pod {pod} is Pending: no node has {spec.resources.gpus} free {gpu} "
            f"(scheduler: {message.strip()}). Free or add GPUs, or lower spec.resources.gpus or spec.replicas."
        ))
    match = re.search(r'persistentvolumeclaim "([^"]+)" not found', message)
    if match:
        return Problem(MODEL_VOLUME_MISSING, pod, (
            f"pod {pod} is Pending: PersistentVolumeClaim {match.group(1)!r} from spec.model.uri does not exist "
            "in this namespace. Create it or fix spec.model.uri."
        ))
    return Problem(UNSCHEDULABLE, pod, (
        f"pod {pod} is Pending: the scheduler cannot place it ({message.strip()}). "
        "Check spec.resources, spec.nodeSelector, spec.tolerations and spec.affinity."
    ))


def _container_problem(spec: InferenceServiceSpec, pod: str, container: dict[str, Any], *, init: bool) -> Problem | None:
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason") or ""
    detail = waiting.get("message") or ""
    if reason in _IMAGE_PULL_REASONS:
        return Problem(IMAGE_PULL_FAILED, pod, (
            f"pod {pod} cannot pull image {container.get('image')}: {reason} {detail}".rstrip()
            + ". Check spec.image (or the operator's default engine image) and the image pull secrets."
        ))
    if reason in _CONFIG_REASONS:
        return Problem(CONTAINER_CONFIG_ERROR, pod, f"pod {pod} container {container.get('name')}: {reason}: {detail}")
    last = (container.get("lastState") or {}).get("terminated") or {}
    restarts = container.get("restartCount") or 0
    if reason == "CrashLoopBackOff" or (restarts > 0 and last):
        exit_info = f"exit code {last.get('exitCode')}" if last else "no exit code recorded"
        if last.get("reason"):
            exit_info += f" ({last['reason']})"
        message = (last.get("message") or "").strip()
        tail = f": {message[-300:]}" if message else ""
        if init:
            source, field = spec.model, "spec.model"
            draft = spec.engine.speculative.model if spec.engine.speculative is not None else None
            if draft is not None and container.get("name") == builders.download_container_name(builders.DRAFT_MODEL_VOLUME):
                source, field = draft, "spec.engine.speculative.model"
            return Problem(MODEL_DOWNLOAD_FAILED, pod, (
                f"pod {pod} cannot download {source.uri} ({exit_info}){tail}. Check the repository name, "
                f"{field}.revision and {field}.tokenSecret; see `kubectl logs {pod} -c {container.get('name')}`."
            ))
        return Problem(CRASH_LOOP, pod, (
            f"pod {pod}: the engine restarted {restarts} times, last {exit_info}{tail}. "
            f"See `kubectl logs {pod} --previous`."
        ))
    return None


def _stuck_rollout(name: str, deployment: dict[str, Any] | None) -> list[Problem]:
    """The Deployment gave up waiting (progressDeadlineSeconds) for a reason no pod shows."""
    for condition in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
            return [Problem(ROLLOUT_STUCK, "", (
                f"the rollout of Deployment {name} made no progress: {condition.get('message', '')}. "
                f"See `kubectl describe deployment {name}` and the engine pods' logs."
            ))]
    return []


def _condition(kind: ConditionType, ok: bool, reason: str, message: str, generation: int | None,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = previous.get(kind.value) or {}
    since = old.get("lastTransitionTime") if old.get("status") == status else None
    return {
        "type": kind.value,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now,
        "observedGeneration": generation,
    }


def compute_status(
    *,
    name: str,
    namespace: str,
    generation: int | None,
    spec: InferenceServiceSpec,
    settings: EngineSettings,
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    events: list[dict[str, Any]],
    previous_conditions: list[dict[str, Any]],
    now: str,
    url: str | None = None,
    loras: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The status fields the reconcile owns (the tuner writes metrics, tuning and autoscaling); ``url``:
    the base URL to report (default: the service's own)."""
    previous = {c.get("type"): c for c in previous_conditions}
    desired = spec.replicas
    dep_status = (deployment or {}).get("status") or {}
    replicas = dep_status.get("replicas") or 0
    ready = dep_status.get("readyReplicas") or 0
    updated = dep_status.get("updatedReplicas") or 0
    dep_current = deployment is not None and \
        (dep_status.get("observedGeneration") or 0) >= (deployment.get("metadata") or {}).get("generation", 0)
    problems = diagnose_pods(spec, pods, events) or _stuck_rollout(name, deployment)

    if deployment is None:
        progressing, progress_reason, progress_message = True, "Creating", "creating the engine Deployment"
    elif not dep_current:
        progressing, progress_reason = True, "RollingOut"
        progress_message = "the Deployment controller has not acted on the new spec yet"
    elif replicas > updated:
        progressing, progress_reason = True, "RollingOut"
        progress_message = f"{updated}/{desired} pods run the current spec; {replicas - updated} old pods remain"
    elif ready < desired:
        progressing, progress_reason = True, "WaitingForPods"
        progress_message = f"{ready}/{desired} pods ready"
    else:
        progressing, progress_reason, progress_message = False, "Stable", f"{ready}/{desired} pods run the current spec"

    if problems:
        first = problems[0]
        others = len(problems) - 1
        degraded_message = first.message + (f" ({others} more pods have problems)" if others else "")
        degraded = _condition(ConditionType.DEGRADED, True, first.reason, degraded_message, generation, previous, now)
    else:
        degraded = _condition(ConditionType.DEGRADED, False, "AsExpected", "", generation, previous, now)

    url = url or builders.service_url(name, namespace)
    if desired == 0:
        ready_cond = _condition(ConditionType.READY, False, "ScaledToZero", "spec.replicas is 0", generation,
                                previous, now)
    elif ready >= desired:
        ready_cond = _condition(ConditionType.READY, True, "AllReplicasReady",
                                f"{ready}/{desired} replicas ready at {url}", generation, previous, now)
    else:
        ready_cond = _condition(ConditionType.READY, False, "ReplicasNotReady",
                                f"{ready}/{desired} replicas ready", generation, previous, now)

    if desired == 0:
        phase = Phase.STOPPED
    elif problems:
        phase = Phase.DEGRADED
    elif ready >= desired and not progressing:
        phase = Phase.READY
    elif deployment is None or (replicas == 0 and not pods):
        phase = Phase.PENDING
    else:
        phase = Phase.PROGRESSING

    conditions = [
        ready_cond,
        _condition(ConditionType.PROGRESSING, progressing, progress_reason, progress_message, generation,
                   previous, now),
        degraded,
    ]
    if spec.loras:
        conditions.append(_adapters_condition(spec, loras, generation, previous, now))
    return {
        "observedGeneration": generation,
        "phase": phase.value,
        "conditions": conditions,
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": builders.selector_string(name),
        "url": url,
        "engine": settings.resource(),
    }


LORA_FAILED = "LoRAAdapterFailed"  # the reason of AdaptersReady=False and of the Event: an adapter did not load


def _adapters_condition(spec: InferenceServiceSpec, loras: list[dict[str, Any]] | None, generation: int | None,
                        previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    """AdaptersReady from status.loras (the last sync): a failing adapter is named here while the base
    model keeps serving (Ready and Degraded are about the pods)."""
    synced = {entry["name"]: entry for entry in loras or []}
    for source in spec.loras:
        entry = synced.get(source.name)
        if entry is None:
            return _condition(ConditionType.ADAPTERS_READY, False, "Syncing",
                              f"adapter {source.name} is not loaded on the Ready pods yet", generation, previous, now)
        failed = [p for p in entry.get("pods") or [] if p.get("state") == "Failed"]
        if failed:
            return _condition(ConditionType.ADAPTERS_READY, False, LORA_FAILED,
                              f"adapter {source.name} failed on pod {failed[0]['pod']}: {failed[0].get('message')}",
                              generation, previous, now)
    return _condition(ConditionType.ADAPTERS_READY, True, "AllLoaded",
                      f"{len(spec.loras)} adapters loaded on every Ready pod", generation, previous, now)


def invalid_spec_status(generation: int | None, message: str, previous_conditions: list[dict[str, Any]],
                        now: str) -> dict[str, Any]:
    """Status for a spec the operator cannot parse (the CRD's rules normally stop these first)."""
    previous = {c.get("type"): c for c in previous_conditions}
    return {
        "observedGeneration": generation,
        "phase": Phase.DEGRADED.value,
        "conditions": [
            _condition(ConditionType.READY, False, INVALID_SPEC, "the spec is invalid", generation, previous, now),
            _condition(ConditionType.PROGRESSING, False, INVALID_SPEC, "nothing applied", generation, previous, now),
            _condition(ConditionType.DEGRADED, True, INVALID_SPEC, message, generation, previous, now),
        ],
    }


# --- the control loop's status ---------------------------------------------------------


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def metrics_status(scraped: ServiceMetrics, now: float) -> dict[str, Any]:
    """``status.metrics``: the service's load and latency over the window."""
    obs = scraped.service
    scraped_pods = sum(1 for r in scraped.pods.values() if r.error is None)
    fields: dict[str, Any] = {"time": rfc3339(now), "scrapedPods": scraped_pods,
                              "unscrapedPods": scraped.unreachable}
    if obs is not None:
        fields.update(
            windowSeconds=round(obs.window_seconds, 1),
            outputTokensPerSecond=round(obs.output_tokens_per_second, 1),
            requestsPerSecond=round(obs.requests_per_second, 3),
            ttftP99Seconds=_rounded(obs.ttft_p99),
            itlP99Seconds=_rounded(obs.itl_p99),
            tpotP99Seconds=_rounded(obs.tpot_p99),
            e2eP99Seconds=_rounded(obs.e2e_p99),
            kvCacheUsage=round(obs.kv_cache_usage, 3),
            requestsRunning=round(obs.running, 2),
            requestsWaiting=round(obs.waiting, 2),
            preemptionsPerSecond=round(obs.preemptions_per_second, 3),
            rejectedPerSecond=round(obs.rejected_per_second, 3),
            prefixCacheHitRate=_rounded(obs.prefix_cache_hit_rate),
        )
    return MetricsStatus.model_validate(fields).model_dump(by_alias=True, exclude_none=True)


def tuning_status(decision: Decision, now: float) -> dict[str, Any]:
    """``status.tuning``: the last decision, its reason, and the recent changes."""
    new, before = decision.settings, decision.previous
    if decision.changed:
        parts = []
        if new.max_num_seqs != before.max_num_seqs:
            parts.append(f"maxNumSeqs {before.max_num_seqs} → {new.max_num_seqs}")
        if new.max_num_batched_tokens != before.max_num_batched_tokens:
            parts.append(f"maxNumBatchedTokens {before.max_num_batched_tokens} → {new.max_num_batched_tokens}")
        if new.gpu_memory_utilization != before.gpu_memory_utilization:
            parts.append(f"gpuMemoryUtilization {before.gpu_memory_utilization:g} → {new.gpu_memory_utilization:g}")
        last = ", ".join(parts)
    else:
        last = f"hold maxNumSeqs {new.max_num_seqs}"
    # Walk back from the current values, undoing one change at a time.
    history = []
    values = {MAX_NUM_SEQS: new.max_num_seqs, MAX_NUM_BATCHED_TOKENS: new.max_num_batched_tokens,
              GPU_MEMORY_UTILIZATION: new.gpu_memory_utilization}
    for change in reversed(decision.history.changes):
        history.append({"time": rfc3339(change.time), "reason": change.reason, **values})
        values[change.parameter] = change.old
    history.reverse()
    fields = {"lastDecision": last, "reason": decision.reason, "time": rfc3339(now),
              "history": history[-HISTORY_IN_STATUS:]}
    return TuningStatus.model_validate(fields).model_dump(by_alias=True, exclude_none=True)


def autoscaling_status(decision: ScaleDecision, now: float) -> dict[str, Any]:
    """``status.autoscaling``: the replicas the autoscaler wants and why."""
    fields = {"desiredReplicas": decision.replicas, "reason": decision.reason, "time": rfc3339(now),
              "demandTokensPerSecond": _rounded(decision.demand, 1),
              "capacityPerReplica": _rounded(decision.history.capacity_per_replica, 1),
              "heldRequests": decision.held}
    return AutoscalingStatus.model_validate(fields).model_dump(by_alias=True, exclude_none=True)


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
