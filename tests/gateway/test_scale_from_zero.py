"""What the gateway's wake-up relies on in the operator's autoscaler (minReplicas 0): an idle service goes to
zero after the scale-down stabilization window and stays there with no pod to read; once the gateway has
asked for a replica, the autoscaler keeps it while the pod starts."""

from __future__ import annotations

from kvpilot.operator.autoscaler import ReplicaState, ScalingHistory, ScalingPolicy, autoscale
from kvpilot.operator.engine_metrics import Observation

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
