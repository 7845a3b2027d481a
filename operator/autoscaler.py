"""The autoscaler: desired replicas from demand against measured capacity.

A pure function. Demand is the output-token rate the service is asked for:
what it served in the window plus its queue, spread over the time a queue
may take to drain, plus the requests its pods turned away (429: the waiting
queue full, or --max-waiting-seconds). Capacity is what one Ready replica
delivered while it was saturated at its tuned ``max_num_seqs`` (the tuner
moves it, so it is re-measured continuously). Replicas plan to run at ``target_utilization`` of
that capacity. Until a replica has been saturated once, batch slots stand in
for tokens: requests running or queued against ``max_num_seqs`` per replica.

Queueing shows up as time to first token: when the TTFT P99 breaks the SLO,
mostly from waiting for a batch slot, while the inter-token latency meets its
SLO, the service needs capacity that the batch size cannot give without
slowing every stream, so the autoscaler asks for at least one more replica.

Up is fast: straight to the replicas the demand needs. Down is slow: the
highest recommendation of the stabilization window wins, one replica per
step, and never with a queue. Pods that are Pending because no node has a
free GPU are no capacity; while any exist the autoscaler asks for no more,
and says why.

Requests the kvpilot gateway holds for the service (no Ready pod yet:
starting, or at zero replicas) are demand the engines cannot see: they count
as queued requests, and as activity. While any are held the service keeps at
least one replica (a service at zero gets the replicas their batch slots
need), no replica goes, and the idle clock of scale-to-zero stands still.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvpilot.operator.engine_metrics import Observation
from kvpilot.operator.spec import Slo


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int
    max_replicas: int
    target_utilization: float = 0.8
    queue_drain_seconds: float = 60.0
    scale_down_stabilization_seconds: float = 300.0
    scale_down_step: int = 1
    capacity_smoothing: float = 0.5  # weight of the newest capacity measurement
    slo: Slo | None = None  # the service's latency SLO: a TTFT over it from queueing adds a replica
    # With min_replicas 0: idle seconds before the last replica goes (None: the stabilization window).
    scale_to_zero_after_seconds: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"autoscaling needs 0 <= minReplicas <= maxReplicas, got {self.min_replicas}..{self.max_replicas}"
            )
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be within (0, 1], got {self.target_utilization}")
        if self.queue_drain_seconds <= 0 or self.scale_down_stabilization_seconds < 0:
            raise ValueError("queue_drain_seconds must be positive and the stabilization window non-negative")


@dataclass(frozen=True)
class ReplicaState:
    desired: int  # spec.replicas now
    ready: int
    pending_no_gpu: int = 0  # Pending because no node has a free GPU
    slots_per_replica: int | None = None  # max_num_seqs in effect: requests one replica runs at once


@dataclass(frozen=True)
class ScalingHistory:
    recommendations: tuple[tuple[float, int], ...] = ()  # (time, replicas) within the stabilization window
    capacity_per_replica: float | None = None  # output tokens/s of one saturated Ready replica
    observed_since: float | None = None  # first recommendation: scale-down waits a full window after it
    last_active: float | None = None  # the last window with requests served, running or queued

    def to_dict(self) -> dict:
        return {
            "recommendations": [list(r) for r in self.recommendations],
            "capacityPerReplica": self.capacity_per_replica,
            "observedSince": self.observed_since,
            "lastActive": self.last_active,
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> ScalingHistory:
        if not data:
            return cls()
        return cls(
            tuple((float(t), int(r)) for t, r in data.get("recommendations", ())),
            data.get("capacityPerReplica"),
            data.get("observedSince"),
            data.get("lastActive"),
        )


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    reason: str
    history: ScalingHistory
    previous: int
    demand: float | None = None  # output tokens/s the decision planned for; None without metrics
    held: int = 0  # requests the gateway held for the service, counted as queued

    @property
    def changed(self) -> bool:
        return self.replicas != self.previous


def measure_capacity(
    observation: Observation, ready: int, saturated: bool, previous: float | None, smoothing: float
) -> float | None:
    """Per-replica capacity: smoothed over saturated windows, never below what a replica just served.

    Only a saturated window measures capacity; an unsaturated one only shows a lower bound, and
    planning replicas from a lower bound would over-provision.
    """
    if ready <= 0 or observation.output_tokens_per_second <= 0:
        return previous
    per_replica = observation.output_tokens_per_second / ready
    if saturated:
        if previous is None:
            return per_replica
        return smoothing * per_replica + (1 - smoothing) * previous
    return per_replica if previous is not None and per_replica > previous else previous


def autoscale(
    observation: Observation | None,
    replicas: ReplicaState,
    policy: ScalingPolicy,
    history: ScalingHistory,
    now: float,
    saturated: bool,
    held: int = 0,
) -> ScaleDecision:
    """Replicas for the next interval; ``saturated`` says the Ready replicas ran at their max_num_seqs,
    ``held`` counts the requests the gateway holds for the service (waiting for a Ready pod)."""
    if held < 0:
        raise ValueError(f"held requests cannot be negative, got {held}")
    current = replicas.desired
    demand: float | None = None  # set once the metrics give it; every decision after reports it

    def decide(target: int, reason: str, hist: ScalingHistory) -> ScaleDecision:
        return ScaleDecision(target, reason, hist, current, demand, held)

    bounded = min(max(current, policy.min_replicas), policy.max_replicas)
    if bounded != current:
        return decide(
            bounded,
            f"replicas {current} outside {policy.min_replicas}..{policy.max_replicas}: scaling to {bounded}",
            history,
        )
    if observation is None:
        # No Ready pod (at zero, or starting after a wake-up) is no evidence of idleness: the idle
        # clock of scaleToZeroAfterSeconds starts again once a pod serves.
        history = replace(history, last_active=now)
        if held and current == 0:
            target = replicas_for_held(held, replicas.slots_per_replica, policy)
            return decide(target, f"{held} request(s) held at the gateway and no replica: scaling up 0 → {target}",
                          history)
        waiting = f"; {held} request(s) held at the gateway wait for it" if held else ""
        return decide(current, f"no metrics from any Ready pod{waiting}: holding", history)

    capacity = measure_capacity(
        observation, replicas.ready, saturated, history.capacity_per_replica, policy.capacity_smoothing
    )
    history = replace(history, capacity_per_replica=capacity)
    tokens_per_request = observation.mean_output_tokens_per_request or 0.0
    queued = observation.waiting_now + held
    backlog = queued * tokens_per_request / policy.queue_drain_seconds
    # Requests the pods turned away (the queue full, or --max-waiting-seconds) are demand as much as
    # those served: without them a pod that sheds half its load would look like enough.
    turned_away = observation.rejected_per_second * tokens_per_request
    demand = observation.output_tokens_per_second + backlog + turned_away
    demand_text = f"demand {demand:.0f} tok/s ({observation.output_tokens_per_second:.0f} served"
    if queued:
        demand_text += f" + queue of {observation.waiting_now:.0f}"
        demand_text += f" and {held} held at the gateway" if held else ""
    if turned_away:
        demand_text += f" + {observation.rejected_per_second:.1f} req/s turned away"
    demand_text += ")"

    if demand <= 0 and not queued:
        raw = policy.min_replicas
        basis = "no demand in the window"
    elif capacity is None or capacity <= 0:
        # Never saturated yet: plan by batch slots in use instead of tokens.
        slots = observation.max_num_seqs
        if slots:
            in_use = observation.running + queued
            raw = math.ceil(in_use / (slots * policy.target_utilization) - 1e-9)
            of_them_held = f" ({held} held at the gateway)" if held else ""
            basis = (
                f"{in_use:.1f} requests running or queued{of_them_held} vs {slots} slots per replica at "
                f"{policy.target_utilization:.0%} (token capacity not measured yet) → {raw} replica(s)"
            )
        elif queued > 0 and replicas.pending_no_gpu == 0:
            raw = current + 1
            basis = f"{demand_text}, capacity not measured yet, requests queued"
        else:
            raw, basis = current, f"{demand_text}; capacity not measured yet"
    else:
        raw = math.ceil(demand / (capacity * policy.target_utilization) - 1e-9)
        basis = (
            f"{demand_text} vs {capacity:.0f} tok/s per replica at {policy.target_utilization:.0%} "
            f"→ {raw} replica(s)"
        )
    queueing = ttft_breach(observation, policy.slo)
    if queueing is not None:
        raw, basis = max(raw, current + 1), f"{basis}; {queueing}"
    if held and raw < 1:
        raw, basis = 1, f"{basis}; {held} request(s) held at the gateway need a replica"
    raw = min(max(raw, policy.min_replicas), policy.max_replicas)
    active = demand > 0 or observation.running > 0 or queued > 0
    history = replace(history, last_active=now if active else history.last_active)
    zero_after = policy.scale_to_zero_after_seconds
    if raw == 0 and zero_after is not None:
        since = history.last_active if history.last_active is not None else history.observed_since
        idle = now - (since if since is not None else now)
        if idle < zero_after:
            raw, basis = 1, f"{basis}; idle {idle:.0f} s of the {zero_after:.0f} s before scaling to zero"
        elif current == 1:
            return decide(0, f"{basis}: no requests for {idle:.0f} s (scaleToZeroAfterSeconds {zero_after:.0f}): "
                             "scaling to zero; a request through the gateway brings a replica back", history)

    window_start = now - policy.scale_down_stabilization_seconds
    recommendations = tuple(r for r in history.recommendations if r[0] >= window_start) + ((now, raw),)
    observed_since = history.observed_since if history.observed_since is not None else now
    history = replace(history, recommendations=recommendations, observed_since=observed_since)

    if raw > current:
        if replicas.pending_no_gpu > 0:
            return decide(
                current,
                f"{basis}; {replicas.pending_no_gpu} pod(s) Pending because no node has a free GPU "
                f"(only {replicas.ready} Ready count as capacity): not adding more",
                history,
            )
        starting = current - replicas.ready - replicas.pending_no_gpu
        if starting > 0:
            return decide(current, f"{basis}; waiting for {starting} starting replica(s)", history)
        return decide(raw, f"{basis}: scaling up {current} → {raw}", history)

    if raw < current:
        if queued > 0:
            return decide(current, f"{basis}, but requests are queued: holding", history)
        stabilized = max(r for _, r in recommendations)
        target = max(stabilized, current - policy.scale_down_step)
        if target >= current or now - observed_since < policy.scale_down_stabilization_seconds:
            return decide(
                current,
                f"{basis}; waiting out the {policy.scale_down_stabilization_seconds:.0f} s "
                "stabilization window before scaling down",
                history,
            )
        return decide(target, f"{basis}: scaling down {current} → {target}", history)

    return decide(current, f"{basis}: holding", history)


def replicas_for_held(held: int, slots_per_replica: int | None, policy: ScalingPolicy) -> int:
    """Replicas that wake for ``held`` requests: enough batch slots at the target utilization, at least one."""
    if not slots_per_replica:
        return 1
    needed = math.ceil(held / (slots_per_replica * policy.target_utilization) - 1e-9)
    return min(max(needed, 1, policy.min_replicas), policy.max_replicas)


def ttft_breach(observation: Observation, slo: Slo | None) -> str | None:
    """Why the TTFT asks for another replica, or None: over its SLO, mostly from queueing, while
    the per-token latency (ITL or TPOT) meets its SLO (when it does not, the tuner shrinks the batch first)."""
    if slo is None or slo.ttft_p99_seconds is None or observation.ttft_p99 is None:
        return None
    if observation.ttft_p99 <= slo.ttft_p99_seconds or not observation.ttft_from_queueing:
        return None
    kind, seconds = slo.token_latency or ("ITL", math.inf)
    token_p99 = observation.token_latency_p99(kind)
    if math.isfinite(seconds) and (token_p99 is None or token_p99 > seconds):
        return None
    return (f"TTFT P99 {observation.ttft_p99:.2f} s > SLO {slo.ttft_p99_seconds:g} s, "
            f"{observation.ttft_queue_share:.0%} of it queueing, with {kind} within its SLO: one more replica")
