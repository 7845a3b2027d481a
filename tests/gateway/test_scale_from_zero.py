"""What the gateway's wake-up relies on in the operator's autoscaler (minReplicas 0): an idle service goes to
zero (after scaleToZeroAfterSeconds without requests, else the scale-down stabilization window) and stays
there with no pod to read; once the gateway has asked for a replica, the autoscaler keeps it while the pod
starts."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from kvpilot.operator.autoscaler import ReplicaState, ScalingHistory, ScalingPolicy, autoscale
from kvpilot.operator.engine_metrics import Observation
from kvpilot.operator.spec import parse_spec

POLICY = ScalingPolicy(min_replicas=0, max_replicas=2, scale_down_stabilization_seconds=300.0)
INTERVAL = 30.0


def _idle(pods: int) -> Observation:
    return Observation(
        window_seconds=INTERVAL, pods=pods, output_tokens_per_second=0.0, prompt_tokens_per_second=0.0,
        requests_per_second=0.0, requests_finished=0.0, itl_samples=0.0, ttft_p50=None, ttft_p99=None,
        itl_p50=None, itl_p99=None, e2e_p50=None, e2e_p99=None, queue_time_p99=None, mean_running_per_pod=0.0,
        running=0.0, waiting=0.0, waiting_now=0.0, kv_cache_usage=0.0, kv_cache_blocks=1000.0,
        preemptions_per_second=0.0, prefix_cache_hit_rate=None, mean_output_tokens_per_request=None,
        max_num_seqs=16, max_num_batched_tokens=2048, gpu_memory_utilization=0.9,
    )


def test_an_idle_service_goes_to_zero_after_the_stabilization_window_and_stays_there():
    replicas, history, times = 1, ScalingHistory(), []
    for tick in range(20):
        now = tick * INTERVAL
        observation = _idle(replicas) if replicas else None  # at zero no pod is scraped
        decision = autoscale(observation, ReplicaState(replicas, replicas), POLICY, history, now, saturated=False)
        history, replicas = decision.history, decision.replicas
        times.append((now, replicas, decision.reason))
    went = next(now for now, r, _ in times if r == 0)
    assert went >= POLICY.scale_down_stabilization_seconds
    assert all(r == 0 for now, r, _ in times if now >= went)
    assert "no metrics" in times[-1][2]


def test_a_replica_the_gateway_asked_for_is_kept_while_it_starts():
    """The gateway moved spec.replicas 0 -> 1; no pod is Ready yet, so there is nothing to read."""
    history = ScalingHistory(recommendations=((0.0, 0),), observed_since=-600.0)
    decision = autoscale(None, ReplicaState(desired=1, ready=0), POLICY, history, 30.0, saturated=False)
    assert decision.replicas == 1 and not decision.changed


def test_scale_to_zero_after_seconds_takes_the_last_replica_that_long_after_the_last_request():
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, scale_down_stabilization_seconds=300.0,
                           scale_to_zero_after_seconds=90.0)
    replicas, history, seen = 1, ScalingHistory(), []
    for tick in range(10):
        now = tick * INTERVAL
        observation = (replace(_idle(1), running=1.0, output_tokens_per_second=50.0) if tick < 2
                       else _idle(replicas) if replicas else None)
        decision = autoscale(observation, ReplicaState(replicas, replicas), policy, history, now, saturated=False)
        history, replicas = decision.history, decision.replicas
        seen.append((now, replicas, decision.reason))
    went = next(now for now, r, _ in seen if r == 0)
    assert went == INTERVAL + 90.0  # 90 s after the last window with a request, before the 300 s window
    assert "scaleToZeroAfterSeconds 90" in next(reason for now, _, reason in seen if now == went)
    assert "idle 30 s of the 90 s before scaling to zero" in seen[2][2]


def test_scale_to_zero_after_seconds_needs_min_replicas_zero():
    with pytest.raises(ValidationError, match="scaleToZeroAfterSeconds needs autoscaling.minReplicas: 0"):
        parse_spec({"model": {"uri": "pvc://m"}, "autoscaling": {"minReplicas": 1, "maxReplicas": 2,
                                                                 "scaleToZeroAfterSeconds": 60}})
    spec = parse_spec({"model": {"uri": "pvc://m"}, "autoscaling": {"minReplicas": 0, "maxReplicas": 2,
                                                                    "scaleToZeroAfterSeconds": 60}})
    assert spec.autoscaling.scale_to_zero_after_seconds == 60


def test_a_woken_replica_gets_the_whole_idle_time_before_it_goes_again():
    """Idle long before it went to zero; the gateway woke it; its first windows show no request yet."""
    policy = ScalingPolicy(min_replicas=0, max_replicas=2, scale_to_zero_after_seconds=90.0)
    history = ScalingHistory(observed_since=0.0, last_active=0.0)
    at_zero = autoscale(None, ReplicaState(0, 0), policy, history, 600.0, saturated=False)
    woken = autoscale(None, ReplicaState(1, 0), policy, at_zero.history, 630.0, saturated=False)  # starting
    first_window = autoscale(_idle(1), ReplicaState(1, 1), policy, woken.history, 660.0, saturated=False)
    assert first_window.replicas == 1 and "idle 30 s of the 90 s" in first_window.reason
