"""One tuning interval of one InferenceService: scrape → tune → apply → autoscale → report.

``TuningLoop.run`` is a kopf daemon per service (a daemon, not a timer, so
the interval follows the spec and no "succeeded" Event is posted every
tick); each interval's ``tick`` reads the Ready engine pods'
/metrics, feeds the service's window to the tuner, and applies the decision:

- ``max_num_seqs`` (and ``max_num_batched_tokens``) go live to every Ready pod
  through the engine's admin endpoint (bearer token from the Secret the
  operator owns) and into the tuning ConfigMap the pods read at start, so a
  restarted pod keeps them. No rollout.
- a memory-fraction change is written to the same ConfigMap and the normal
  reconcile renders it into the pod template: the Deployment then replaces
  pods one at a time (maxUnavailable 1, as the PodDisruptionBudget allows).

Then the autoscaler sets ``spec.replicas`` through the scale subresource. What
happened goes to status (metrics, engine, tuning, autoscaling), to Events and
to the operator's own /metrics. The ConfigMap is the truth: a Ready pod whose
max_num_seqs differs from it (restarted before the file changed, or missed a
push) is brought back in line.

State that only helps the tuner learn (windows, history) lives in memory; an
operator restart starts learning afresh from the persisted parameters.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import ValidationError

from kvpilot import metric_names as names
from kvpilot.operator import builders, reconcile, spec as specs, status, telemetry, tuner
from kvpilot.operator.autoscaler import ReplicaState, ScaleDecision, ScalingHistory, ScalingPolicy, autoscale
from kvpilot.operator.kube import Kube
from kvpilot.operator.metrics import MetricsCollector, Observation, ServiceMetrics
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.tuning_state import TuningState

log = logging.getLogger("kvpilot.operator.tuning")

# The loop wakes this often; each service acts on its own interval.
TICK_SECONDS = 5.0
ADMIN_PATH = "/admin/v1/scheduler"
HISTORY_IN_STATUS = 10
HTTP_TIMEOUT_SECONDS = 5.0


class Stopped(Protocol):
    """kopf's DaemonStopped: true once the daemon should exit; ``wait`` sleeps until then."""

    def __bool__(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> object: ...


@dataclass
class ServiceLoopState:
    """What one service's loop remembers between intervals (in memory only)."""

    collector: MetricsCollector
    history: tuner.TuningHistory = field(default_factory=tuner.TuningHistory)
    scaling: ScalingHistory = field(default_factory=ScalingHistory)
    restarts_seen: dict[str, int] = field(default_factory=dict)  # pod uid → engine restarts accounted for
    unreachable: frozenset[str] = frozenset()
    last_run: float = -math.inf
    # After a new max_num_seqs the engines admit a burst of queued prompts whose prefill slows
    # a few steps; the next window starts once that has passed (see ``settle_seconds``).
    rebase_at: float | None = None
    rebase_expect: int | None = None


@dataclass
class TickResult:
    """What one interval did: the status fields to merge, and Events (type, reason, message)."""

    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)
    decision: tuner.Decision | None = None
    scale: ScaleDecision | None = None


def wants_loop(spec: dict[str, Any]) -> bool:
    """Whether a service's spec asks for tuning or autoscaling (the daemon's filter)."""
    tuning = spec.get("tuning") or {}
    autoscaling = spec.get("autoscaling") or {}
    return bool(tuning and tuning.get("enabled", True)) or bool(autoscaling and autoscaling.get("enabled", True))


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class TuningLoop:
    """Per-service loop state plus the tick; one per operator."""

    def __init__(self, kube: Kube, settings: OperatorSettings, config: tuner.TunerConfig = tuner.TunerConfig()) -> None:
        self.kube = kube
        self.settings = settings
        self.config = config
        self.states: dict[tuple[str, str], ServiceLoopState] = {}

    def run(self, current_body: Callable[[], dict[str, Any]], stopped: Stopped,
            post: Callable[[dict[str, Any], TickResult], None]) -> None:
        """One service's loop, for a kopf daemon: tick, report, sleep, until ``stopped``.

        A failed interval (API server hiccup) is logged and the loop goes on.
        """
        while not stopped:
            body = current_body()
            try:
                result = self.tick(body)
                if result is not None:
                    post(body, result)
            except Exception:
                log.exception("%s/%s: tuning interval failed", body["metadata"]["namespace"], body["metadata"]["name"])
            stopped.wait(TICK_SECONDS)
        self.states.pop((body["metadata"]["namespace"], body["metadata"]["name"]), None)

    def tick(self, body: dict[str, Any], now: float | None = None) -> TickResult | None:
        """Runs one interval for the service if it is due; None when not due or nothing to do."""
        now = time.time() if now is None else now
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        try:
            spec = specs.parse_spec(body.get("spec") or {})
        except ValidationError:
            return None  # the reconcile reports invalid specs
        tuning_on = spec.tuning is not None and spec.tuning.enabled
        scaling_on = spec.autoscaling is not None and spec.autoscaling.enabled
        if not (tuning_on or scaling_on):
            self.states.pop((namespace, name), None)
            return None
        interval = float((spec.tuning.interval_seconds if spec.tuning else None) or self.settings.tuning_interval_seconds)
        state = self.states.get((namespace, name))
        if state is None:
            state = self.states[(namespace, name)] = ServiceLoopState(MetricsCollector(window_seconds=2 * interval))
        if state.rebase_at is not None and now >= state.rebase_at:
            self._rebase(state, namespace, name)
        if now - state.last_run < interval - TICK_SECONDS / 2:
            return None
        state.last_run = now
        return self._run(body, spec, state, now, tuning_on, scaling_on)

    def _run(self, body: dict[str, Any], spec: specs.InferenceServiceSpec, state: ServiceLoopState, now: float,
             tuning_on: bool, scaling_on: bool) -> TickResult:
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        pods = self.kube.list("v1", "Pod", namespace, label_selector=builders.selector_string(name))
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = {p["metadata"]["name"]: p for p in live if status.pod_ready(p) and (p.get("status") or {}).get("podIP")}
        targets = {pod: _pod_url(p, "/metrics") for pod, p in ready.items()}
        scraped = asyncio.run(state.collector.collect(targets))
        result = TickResult(status={"metrics": metrics_status(scraped, now)})
        self._report_unreachable(scraped, state, namespace, name, result)

        params_state = reconcile.read_tuning_state(self.kube, name, namespace, spec)
        token = self._admin_token(namespace, name)
        if tuning_on:
            params_state = self._tune(body, spec, state, scraped, params_state, live, ready, token, now, result)
        if result.decision is None or not result.decision.changed:
            self._sync_pods(state, ready, params_state, token, namespace, name, result)
        result.status["engine"] = {
            "maxNumSeqs": params_state.max_num_seqs,
            "maxNumBatchedTokens": params_state.max_num_batched_tokens,
            "gpuMemoryUtilization": params_state.gpu_memory_utilization,
        }
        if scaling_on:
            self._autoscale(spec, state, scraped.service, live, ready, params_state, namespace, name, now, result)
        self.kube.patch_status(namespace, name, result.status)
        return result

    # --- tuning ---------------------------------------------------------------------

    def _tune(self, body: dict[str, Any], spec: specs.InferenceServiceSpec, state: ServiceLoopState,
              scraped: ServiceMetrics, current: TuningState, live: list[dict[str, Any]],
              ready: dict[str, dict[str, Any]], token: str | None, now: float, result: TickResult) -> TuningState:
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        assert spec.tuning is not None
        params = tuner.EngineParams(current.max_num_seqs, current.gpu_memory_utilization, current.max_num_batched_tokens)
        slo = tuner.Slo(spec.tuning.slo.itl_p99_seconds, spec.tuning.slo.ttft_p99_seconds)
        bounds = tuner.Bounds(spec.tuning.max_num_seqs.min, spec.tuning.max_num_seqs.max,
                              spec.tuning.gpu_memory_utilization.min, spec.tuning.gpu_memory_utilization.max)
        oom_kills = count_new_oom_kills(live, state.restarts_seen)
        decision = tuner.tune(scraped.service, params, slo, bounds, state.history, now, oom_kills, self.config)
        state.history = decision.history
        result.decision = decision
        telemetry.record_decision(namespace, name, decision)
        result.status["tuning"] = tuning_status(decision, now)
        if not decision.changed:
            return current

        new_state = TuningState(decision.params.max_num_seqs, decision.params.max_num_batched_tokens,
                                decision.params.gpu_memory_utilization)
        self.kube.apply(builders.build_tuning_configmap(name, namespace, spec, new_state), owner=body)
        if decision.num_seqs_changed or new_state.max_num_batched_tokens != current.max_num_batched_tokens:
            failed = asyncio.run(push_limits(ready, new_state, token))
            for pod, error in failed.items():
                result.events.append(("Warning", "TuningNotApplied",
                                      f"pod {pod} did not take maxNumSeqs {new_state.max_num_seqs}: {error}; "
                                      "retrying next interval"))
            state.collector.restart_windows(expect_max_num_seqs=new_state.max_num_seqs)
            state.rebase_at = now + settle_seconds(float(spec.tuning.interval_seconds
                                                         or self.settings.tuning_interval_seconds))
            state.rebase_expect = new_state.max_num_seqs
            result.events.append(("Normal", "Tuned", decision.reason))
        if decision.memory_changed:
            # The pod template carries the memory fraction: the reconcile renders it and the
            # Deployment replaces pods one at a time.
            outcome = reconcile.reconcile(self.kube, body, self.settings)
            result.events.append(("Normal", "TunedMemory", decision.reason + "; restarting pods one at a time"))
            result.events.extend(("Warning", reason, message) for reason, message in outcome.warnings)
        return new_state

    def _rebase(self, state: ServiceLoopState, namespace: str, name: str) -> None:
        """Starts every pod's window now that the admission burst after a change has passed."""
        pods = self.kube.list("v1", "Pod", namespace, label_selector=builders.selector_string(name))
        targets = {p["metadata"]["name"]: _pod_url(p, "/metrics") for p in pods
                   if not p["metadata"].get("deletionTimestamp") and status.pod_ready(p)
                   and (p.get("status") or {}).get("podIP")}
        asyncio.run(state.collector.collect(targets))
        state.collector.restart_windows(expect_max_num_seqs=state.rebase_expect)
        state.rebase_at = state.rebase_expect = None

    def _sync_pods(self, state: ServiceLoopState, ready: dict[str, dict[str, Any]], params: TuningState,
                   token: str | None, namespace: str, name: str, result: TickResult) -> None:
        """Pushes the persisted limits to Ready pods whose engines report others."""
        stale = {
            pod: body for pod, body in ready.items()
            if (seen := state.collector.latest_gauge(pod, names.MAX_NUM_SEQS)) is not None
            and int(seen) != params.max_num_seqs
        }
        if not stale:
            return
        failed = asyncio.run(push_limits(stale, params, token))
        for pod in stale:
            if pod in failed:
                result.events.append(("Warning", "TuningNotApplied",
                                      f"pod {pod} runs a different maxNumSeqs and did not take "
                                      f"{params.max_num_seqs}: {failed[pod]}"))
            else:
                state.collector.restart_pod_window(pod, expect_max_num_seqs=params.max_num_seqs)
                log.info("%s/%s: pod %s brought back to maxNumSeqs %d", namespace, name, pod, params.max_num_seqs)

    def _admin_token(self, namespace: str, name: str) -> str | None:
        secret = self.kube.get("v1", "Secret", namespace, builders.admin_secret_name(name))
        encoded = ((secret or {}).get("data") or {}).get(builders.ADMIN_TOKEN_KEY)
        return base64.b64decode(encoded).decode() if encoded else None

    def _report_unreachable(self, scraped: ServiceMetrics, state: ServiceLoopState, namespace: str, name: str,
                            result: TickResult) -> None:
        unreachable = frozenset(scraped.unreachable)
        for pod in sorted(unreachable - state.unreachable):
            result.events.append(("Warning", "MetricsUnavailable",
                                  f"cannot read /metrics of Ready pod {pod}: {scraped.pods[pod].error}; "
                                  "tuning goes on with the other pods"))
            telemetry.SCRAPE_ERRORS.labels(namespace, name).inc()
        for pod in sorted(unreachable & state.unreachable):
            telemetry.SCRAPE_ERRORS.labels(namespace, name).inc()
        state.unreachable = unreachable

    # --- autoscaling ----------------------------------------------------------------

    def _autoscale(self, spec: specs.InferenceServiceSpec, state: ServiceLoopState, observation: Observation | None,
                   live: list[dict[str, Any]], ready: dict[str, dict[str, Any]], params: TuningState,
                   namespace: str, name: str, now: float, result: TickResult) -> None:
        assert spec.autoscaling is not None
        pending_no_gpu = sum(1 for p in status.diagnose_pods(spec, live, []) if p.reason == status.INSUFFICIENT_GPU)
        replicas = ReplicaState(desired=spec.replicas, ready=len(ready), pending_no_gpu=pending_no_gpu)
        policy = ScalingPolicy(spec.autoscaling.min_replicas, spec.autoscaling.max_replicas,
                               scale_down_stabilization_seconds=self.settings.scale_down_stabilization_seconds)
        saturated = is_saturated(observation, params.max_num_seqs, len(ready), self.config)
        decision = autoscale(observation, replicas, policy, state.scaling, now, saturated)
        state.scaling = decision.history
        result.scale = decision
        result.status["autoscaling"] = {"desiredReplicas": decision.replicas, "reason": decision.reason,
                                        "time": rfc3339(now)}
        if decision.changed:
            self.kube.scale_inference_service(namespace, name, decision.replicas)
            telemetry.SCALE_DECISIONS.labels(namespace, name, "up" if decision.replicas > decision.previous else "down").inc()
            result.events.append(("Normal", "Scaled", decision.reason))


def settle_seconds(interval: float) -> float:
    """How long after a change the next window starts: a fifth of the interval, 2-10 s."""
    return min(max(interval / 5, 2.0), 10.0)


def post_events(body: dict[str, Any], result: TickResult) -> None:
    """Turns an interval's events into Kubernetes Events on the InferenceService."""
    import kopf

    for kind, reason, message in result.events:
        kopf.event(body, type=kind, reason=reason, message=message)


def is_saturated(observation: Observation | None, max_num_seqs: int, ready: int, config: tuner.TunerConfig) -> bool:
    """The Ready replicas ran full batches with a queue: their throughput is their capacity."""
    if observation is None or observation.mean_running_per_pod is None or ready <= 0:
        return False
    return observation.mean_running_per_pod >= config.saturation_fill * max_num_seqs and observation.waiting > 0


def count_new_oom_kills(pods: list[dict[str, Any]], restarts_seen: dict[str, int]) -> int:
    """Engine containers OOMKilled since the last interval (a pod seen for the first time sets the baseline)."""
    kills = 0
    for pod in pods:
        uid = pod["metadata"].get("uid") or pod["metadata"]["name"]
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            if container.get("name") != builders.CONTAINER_NAME:
                continue
            restarts = container.get("restartCount") or 0
            previous = restarts_seen.get(uid)
            restarts_seen[uid] = restarts
            last = (container.get("lastState") or {}).get("terminated") or {}
            if previous is not None and restarts > previous and last.get("reason") == "OOMKilled":
                kills += 1
    return kills


def _pod_url(pod: dict[str, Any], path: str) -> str:
    return f"http://{pod['status']['podIP']}:{builders.ENGINE_PORT}{path}"


async def push_limits(pods: dict[str, dict[str, Any]], params: TuningState, token: str | None) -> dict[str, str]:
    """POSTs the scheduler limits to each pod's admin endpoint; returns pod → error for the ones that failed."""
    import aiohttp

    if token is None:
        return {pod: "the admin token Secret is missing" for pod in pods}
    body: dict[str, int] = {"max_num_seqs": params.max_num_seqs}
    if params.max_num_batched_tokens is not None:
        body["max_num_batched_tokens"] = params.max_num_batched_tokens
    headers = {"Authorization": f"Bearer {token}"}

    async def post(session: aiohttp.ClientSession, pod: dict[str, Any]) -> str | None:
        try:
            async with session.post(_pod_url(pod, ADMIN_PATH), json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_SECONDS)) as response:
                if response.status != 200:
                    return f"HTTP {response.status}: {(await response.text())[:200]}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    async with aiohttp.ClientSession() as session:
        errors = await asyncio.gather(*(post(session, pod) for pod in pods.values()))
    return {pod: error for pod, error in zip(pods, errors) if error is not None}


# --- status ----------------------------------------------------------------------------


def metrics_status(scraped: ServiceMetrics, now: float) -> dict[str, Any]:
    """``status.metrics`` (field names as in spec.MetricsStatus)."""
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
            e2eP99Seconds=_rounded(obs.e2e_p99),
            kvCacheUsage=round(obs.kv_cache_usage, 3),
            requestsRunning=round(obs.running, 2),
            requestsWaiting=round(obs.waiting, 2),
            preemptionsPerSecond=round(obs.preemptions_per_second, 3),
            prefixCacheHitRate=_rounded(obs.prefix_cache_hit_rate),
        )
    return specs.MetricsStatus.model_validate(fields).model_dump(by_alias=True, exclude_none=True)


def tuning_status(decision: tuner.Decision, now: float) -> dict[str, Any]:
    """``status.tuning``: the last decision, its reason, and the recent changes."""
    p, before = decision.params, decision.previous
    if decision.changed:
        parts = []
        if p.max_num_seqs != before.max_num_seqs:
            parts.append(f"maxNumSeqs {before.max_num_seqs} → {p.max_num_seqs}")
        if p.max_num_batched_tokens != before.max_num_batched_tokens:
            parts.append(f"maxNumBatchedTokens {before.max_num_batched_tokens} → {p.max_num_batched_tokens}")
        if p.gpu_memory_utilization != before.gpu_memory_utilization:
            parts.append(f"gpuMemoryUtilization {before.gpu_memory_utilization:g} → {p.gpu_memory_utilization:g}")
        last = ", ".join(parts)
    else:
        last = f"hold maxNumSeqs {p.max_num_seqs}"
    # Walk back from the current values, undoing one change at a time.
    history = []
    seqs, memory = p.max_num_seqs, p.gpu_memory_utilization
    for change in reversed(decision.history.changes):
        history.append({"time": rfc3339(change.time), "maxNumSeqs": seqs, "gpuMemoryUtilization": memory,
                        "reason": change.reason})
        if change.parameter == "maxNumSeqs":
            seqs = int(change.old)
        else:
            memory = change.old
    history.reverse()
    fields = {"lastDecision": last, "reason": decision.reason, "time": rfc3339(now),
              "history": history[-HISTORY_IN_STATUS:]}
    return specs.TuningStatus.model_validate(fields).model_dump(by_alias=True, exclude_none=True)


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)
