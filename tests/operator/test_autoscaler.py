"""The autoscaler on synthetic load steps."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from kvpilot.operator.autoscaler import (
    ReplicaState,
    ScalingHistory,
    ScalingPolicy,
    autoscale,
    measure_capacity,
)
from kvpilot.operator.engine_metrics import Observation
from kvpilot.operator.spec import Slo

CAPACITY = 400.0  # tokens/s one saturated replica serves
POLICY = ScalingPolicy(min_replicas=1, max_replicas=6, scale_down_stabilization_seconds=300.0)
INTERVAL = 30.0


def load(demand: float, replicas: int, tokens_per_request: float = 100.0) -> tuple[Observation, bool]:
    """A window of a service offered ``demand`` tok/s on ``replicas`` Ready replicas.

    Beyond capacity the surplus queues up (waiting requests), as in a real engine.
    """
    served = min(demand, CAPACITY * replicas)
    backlog = (demand - served) * INTERVAL / tokens_per_request
    saturated = demand >= CAPACITY * replicas
    obs = Observation(
        window_seconds=INTERVAL, pods=replicas, output_tokens_per_second=served, prompt_tokens_per_second=served,
        requests_per_second=served / tokens_per_request, requests_finished=served * INTERVAL / tokens_per_request,
        itl_samples=served * INTERVAL, ttft_p50=0.1, ttft_p99=0.5, itl_p50=0.05, itl_p99=0.08, e2e_p50=4.0,
        e2e_p99=8.0, queue_time_p99=0.5, mean_running_per_pod=16.0 * served / (CAPACITY * replicas),
        running=16.0 * served / CAPACITY, waiting=backlog,
        waiting_now=backlog, kv_cache_usage=0.4, kv_cache_blocks=1000.0 * replicas, preemptions_per_second=0.0,
        prefix_cache_hit_rate=None, mean_output_tokens_per_request=tokens_per_request, max_num_seqs=16,
        max_num_batched_tokens=2048, gpu_memory_utilization=0.9,
    )
    return obs, saturated


def simulate(demands: list[float], start: int = 1, policy: ScalingPolicy = POLICY):
    replicas, history, seen = start, ScalingHistory(), []
    for i, demand in enumerate(demands):
        obs, saturated = load(demand, replicas)
        decision = autoscale(obs, ReplicaState(replicas, replicas), policy, history, i * INTERVAL, saturated)
        history = decision.history
        replicas = decision.replicas  # new replicas are Ready by the next window
        seen.append((replicas, decision.reason))
    return seen


def test_scales_up_fast():
    seen = simulate([300.0] * 3 + [1500.0] * 6)
    replicas = [r for r, _ in seen]
    assert replicas[:3] == [1, 1, 1]
    assert replicas[3] >= 3 and "scaling up 1 →" in seen[3][1]  # several replicas in the first surge window
    needed = math.ceil(1500 / (CAPACITY * POLICY.target_utilization))
    assert max(replicas[3:6]) >= needed  # what the demand needs within three windows


def test_requests_turned_away_count_as_demand():
    # One replica offered 1,200 tok/s under --max-waiting-seconds: it serves its 400 and keeps a short queue,
    # turning the rest away (8 requests/s of 100 tokens) instead of queueing them.
    shedding, saturated = load(400.0, 1)
    shedding = replace(shedding, waiting=10.0, waiting_now=10.0, rejected_per_second=8.0)
    decision = autoscale(shedding, ReplicaState(1, 1), POLICY, ScalingHistory(), 0.0, True)
    assert decision.replicas >= math.ceil(1200 / (CAPACITY * POLICY.target_utilization)), decision.reason
    assert "8.0 req/s turned away" in decision.reason, decision.reason
    unseen = autoscale(replace(shedding, rejected_per_second=0.0), ReplicaState(1, 1), POLICY, ScalingHistory(),
                       0.0, True)
    assert unseen.replicas < decision.replicas, unseen.reason


def test_scales_down_slowly_one_replica_after_the_stabilization_window():
    seen = simulate([1500.0] * 12 + [200.0] * 30, start=5)
    replicas = [r for r, _ in seen]
    peak = replicas[11]
    after_drop = replicas[12:]
    windows = int(POLICY.scale_down_stabilization_seconds / INTERVAL)
    assert all(r == peak for r in after_drop[:windows - 1])
    assert all(b - a >= -1 for a, b in zip(replicas, replicas[1:]))  # one at a time
    assert replicas[-1] == 1
    assert any("stabilization" in reason for _, reason in seen[12:20])


def recommended(reason: str) -> int:
    """The replicas one window's demand asks for, before stabilization: "→ N replica(s)" in its reason."""
    return int(re.search(r"→ (\d+) replica\(s\)", reason).group(1))


def test_noise_does_not_flap():
    # 640 and 760 tok/s in turn: alone, every other window asks for 2 replicas and the next for 3.
    demands = [700.0 + (60 if i % 2 else -60) for i in range(40)]
    seen = simulate(demands, start=2)
    assert {recommended(reason) for _, reason in seen} == {2, 3}  # the noise crosses a replica boundary
    replicas = [r for r, _ in seen]
    # Up to what the peaks need within two windows, then held there: no step down in a trough.
    assert replicas[2:] == [3] * (len(demands) - 2)


def test_respects_min_and_max():
    policy = ScalingPolicy(min_replicas=2, max_replicas=3, scale_down_stabilization_seconds=0.0)
    assert max(r for r, _ in simulate([10_000.0] * 5, start=2, policy=policy)) == 3
    assert min(r for r, _ in simulate([0.0] * 20, start=3, policy=policy)) == 2
    decision = autoscale(None, ReplicaState(9, 9), policy, ScalingHistory(), 0.0, False)
    assert decision.replicas == 3 and "outside" in decision.reason


def test_pending_pods_are_not_capacity_and_block_more_scale_up():
    obs, saturated = load(2000.0, 2)
    history = ScalingHistory(capacity_per_replica=CAPACITY)
    decision = autoscale(obs, ReplicaState(desired=3, ready=2, pending_no_gpu=1), POLICY, history, 0.0, saturated)
    assert decision.replicas == 3
    assert "Pending" in decision.reason and "free GPU" in decision.reason
    # Capacity is measured over the two Ready replicas only.
    assert decision.history.capacity_per_replica == pytest.approx(CAPACITY)


def test_waits_for_starting_replicas_before_asking_for_more():
    obs, saturated = load(2000.0, 2)
    history = ScalingHistory(capacity_per_replica=CAPACITY)
    decision = autoscale(obs, ReplicaState(desired=4, ready=2), POLICY, history, 0.0, saturated)
    assert decision.replicas == 4 and "starting" in decision.reason


def test_no_scale_down_with_a_queue_or_before_a_full_window():
    obs, _ = load(100.0, 3)
    fresh = autoscale(obs, ReplicaState(3, 3), POLICY, ScalingHistory(capacity_per_replica=CAPACITY), 0.0, False)
    assert fresh.replicas == 3  # an operator that just started has not watched a full window
    queued = obs.__class__(**{**obs.__dict__, "waiting_now": 5.0})
    history = ScalingHistory(capacity_per_replica=CAPACITY, observed_since=-1000.0)
    assert autoscale(queued, ReplicaState(3, 3), POLICY, history, 0.0, False).replicas == 3


def test_unknown_capacity_plans_by_batch_slots():
    obs, _ = load(100.0, 3)  # 4 of 48 slots busy
    history = ScalingHistory(observed_since=-1000.0)
    decision = autoscale(obs, ReplicaState(3, 3), POLICY, history, 0.0, False)
    assert decision.history.capacity_per_replica is None
    assert decision.replicas == 2 and "slots" in decision.reason
    crowded = obs.__class__(**{**obs.__dict__, "running": 48.0, "waiting_now": 20.0})
    assert autoscale(crowded, ReplicaState(3, 3), POLICY, history, 0.0, False).replicas == 6


def test_unknown_capacity_and_slots_adds_one_replica_only_when_requests_queue():
    obs, _ = load(100.0, 1)
    blind = obs.__class__(**{**obs.__dict__, "max_num_seqs": None})
    idle = blind.__class__(**{**blind.__dict__, "output_tokens_per_second": 0.0})
    assert autoscale(idle, ReplicaState(1, 1), POLICY, ScalingHistory(), 0.0, False).replicas == 1
    queued = blind.__class__(**{**blind.__dict__, "waiting_now": 4.0})
    assert autoscale(queued, ReplicaState(1, 1), POLICY, ScalingHistory(), 0.0, False).replicas == 2
    assert autoscale(blind, ReplicaState(1, 1), POLICY, ScalingHistory(), 0.0, False).replicas == 1


def test_capacity_is_smoothed_over_saturated_windows_and_floored_by_unsaturated_ones():
    obs, _ = load(800.0, 2)
    assert measure_capacity(obs, 2, True, None, 0.5) == pytest.approx(400.0)
    assert measure_capacity(obs, 2, True, 600.0, 0.5) == pytest.approx(500.0)
    assert measure_capacity(obs, 2, False, 300.0, 0.5) == pytest.approx(400.0)
    assert measure_capacity(obs, 2, False, 600.0, 0.5) == pytest.approx(600.0)
    assert measure_capacity(obs, 2, False, None, 0.5) is None  # a lower bound is not a capacity


def test_history_round_trip_and_policy_validation():
    seen_history = ScalingHistory(((1.0, 2), (31.0, 3)), 412.5, 1.0)
    assert ScalingHistory.from_dict(seen_history.to_dict()) == seen_history
    with pytest.raises(ValueError, match="minReplicas"):
        ScalingPolicy(min_replicas=3, max_replicas=2)


# --- the TTFT SLO -------------------------------------------------------------------------

SLO = Slo(ttft_p99_seconds=2.0, itl_p99_seconds=0.1)
WITH_SLO = ScalingPolicy(min_replicas=1, max_replicas=6, scale_down_stabilization_seconds=300.0, slo=SLO)


def queueing(demand: float, replicas: int, **fields) -> tuple[Observation, bool]:
    """A window whose requests wait 3 s for a batch slot before a 0.5 s prefill, ITL within its SLO.

    Token demand alone does not ask for more replicas: the load is bursty (the queue forms and
    drains within the window), so the mean throughput looks well within capacity.
    """
    obs, saturated = load(demand, replicas)
    return replace(obs, ttft_p99=3.5, queue_time_p99=3.0, ttft_queue_share=3.0 / 3.5, **fields), saturated


def test_ttft_over_the_slo_from_queueing_scales_out_while_itl_is_fine():
    obs, saturated = queueing(300.0, 1)
    history = ScalingHistory(capacity_per_replica=CAPACITY)
    without_slo = autoscale(obs, ReplicaState(1, 1), POLICY, history, 0.0, saturated)
    assert without_slo.replicas == 1  # by tokens, one replica is enough
    decision = autoscale(obs, ReplicaState(1, 1), WITH_SLO, history, 0.0, saturated)
    assert decision.replicas == 2 and "TTFT P99 3.50 s > SLO 2 s, 86% of it queueing" in decision.reason
    # Window after window, until the TTFT meets its SLO (new replicas first have to be Ready).
    starting = autoscale(obs, ReplicaState(2, 1), WITH_SLO, decision.history, 30.0, saturated)
    assert starting.replicas == 2 and "waiting for 1 starting replica" in starting.reason
    obs, saturated = queueing(300.0, 2)
    assert autoscale(obs, ReplicaState(2, 2), WITH_SLO, starting.history, 60.0, saturated).replicas == 3


def test_ttft_over_the_slo_does_not_scale_out_when_itl_breaks_too_or_prefill_makes_it():
    history = ScalingHistory(capacity_per_replica=CAPACITY)
    slow_steps, saturated = queueing(300.0, 1, itl_p99=0.15)  # the tuner shrinks the batch first
    assert autoscale(slow_steps, ReplicaState(1, 1), WITH_SLO, history, 0.0, saturated).replicas == 1
    obs, saturated = load(300.0, 1)
    long_prompts = replace(obs, ttft_p99=3.5, ttft_queue_share=0.1)  # more replicas would not shorten a prefill
    assert autoscale(long_prompts, ReplicaState(1, 1), WITH_SLO, history, 0.0, saturated).replicas == 1


def test_with_a_tpot_slo_the_requests_tpot_decides_whether_the_steps_are_to_blame():
    by_tpot = replace(WITH_SLO, slo=Slo(ttft_p99_seconds=2.0, tpot_p99_seconds=0.1))
    history = ScalingHistory(capacity_per_replica=CAPACITY)
    # Gaps spiking over 0.1 s (prefill chunks) while requests' TPOT meets it: queueing is capacity's.
    spiky, saturated = queueing(300.0, 1, itl_p99=0.15, tpot_samples=40.0, tpot_p99=0.08)
    decision = autoscale(spiky, ReplicaState(1, 1), by_tpot, history, 0.0, saturated)
    assert decision.replicas == 2 and "with TPOT within its SLO" in decision.reason, decision.reason
    slow, saturated = queueing(300.0, 1, itl_p99=0.08, tpot_samples=40.0, tpot_p99=0.15)  # the tuner's to fix
    assert autoscale(slow, ReplicaState(1, 1), by_tpot, history, 0.0, saturated).replicas == 1


def test_a_ttft_breaking_the_slo_from_queueing_asks_for_more_replicas_not_fewer():
    obs, saturated = queueing(100.0, 3)
    history = ScalingHistory(capacity_per_replica=CAPACITY, observed_since=-1000.0)
    assert autoscale(obs, ReplicaState(3, 3), POLICY, history, 0.0, saturated).replicas == 2
    assert autoscale(obs, ReplicaState(3, 3), WITH_SLO, history, 0.0, saturated).replicas == 4


# --- requests held at the gateway ---------------------------------------------------------

AT_ZERO = ScalingPolicy(min_replicas=0, max_replicas=6, scale_down_stabilization_seconds=300.0,
                        scale_to_zero_after_seconds=60.0)


def test_requests_held_for_a_service_at_zero_wake_the_replicas_their_slots_need():
    history = ScalingHistory(last_active=-10_000.0, observed_since=-10_000.0)
    assert autoscale(None, ReplicaState(0, 0), AT_ZERO, history, 0.0, False).replicas == 0
    one = autoscale(None, ReplicaState(0, 0), AT_ZERO, history, 0.0, False, held=2)
    assert one.replicas == 1 and one.held == 2
    assert one.reason == "2 request(s) held at the gateway and no replica: scaling up 0 → 1"
    # 20 held against 8 slots per replica at 80%: ceil(20 / 6.4) = 4; never beyond maxReplicas.
    burst = ReplicaState(0, 0, slots_per_replica=8)
    assert autoscale(None, burst, AT_ZERO, history, 0.0, False, held=20).replicas == 4
    assert autoscale(None, burst, AT_ZERO, history, 0.0, False, held=500).replicas == 6


def test_requests_held_while_a_replica_starts_keep_it_and_say_so():
    history = ScalingHistory(last_active=-10_000.0, observed_since=-10_000.0)
    decision = autoscale(None, ReplicaState(1, 0), AT_ZERO, history, 0.0, False, held=3)
    assert decision.replicas == 1 and not decision.changed
    assert "3 request(s) held at the gateway wait for it" in decision.reason
    assert decision.history.last_active == 0.0


def test_no_scale_to_zero_while_requests_are_held():
    idle = replace(load(0.0, 1)[0], running=0.0, waiting_now=0.0, mean_output_tokens_per_request=None)
    history = ScalingHistory(last_active=-1000.0, observed_since=-1000.0)
    assert autoscale(idle, ReplicaState(1, 1), AT_ZERO, history, 0.0, False).replicas == 0
    kept = autoscale(idle, ReplicaState(1, 1), AT_ZERO, history, 0.0, False, held=1)
    assert kept.replicas == 1 and kept.history.last_active == 0.0  # the idle clock starts again
    assert "(1 held at the gateway)" in kept.reason


def test_no_scale_down_while_requests_are_held():
    obs, _ = load(100.0, 3)
    history = ScalingHistory(capacity_per_replica=CAPACITY, observed_since=-1000.0)
    assert autoscale(obs, ReplicaState(3, 3), POLICY, history, 0.0, False).replicas == 2
    held = autoscale(obs, ReplicaState(3, 3), POLICY, history, 0.0, False, held=1)
    assert held.replicas == 3 and "requests are queued: holding" in held.reason


def test_held_requests_add_to_the_queue_the_replicas_are_sized_for():
    obs, _ = load(100.0, 3)  # 4 of 48 slots busy, capacity not measured yet
    history = ScalingHistory(observed_since=-1000.0)
    # 4 running + 60 held = 64 requests against 16 slots per replica at 80%: ceil(64 / 12.8) = 5.
    decision = autoscale(obs, ReplicaState(3, 3), POLICY, history, 0.0, False, held=60)
    assert decision.replicas == 5 and "64.0 requests running or queued (60 held at the gateway)" in decision.reason
    # With capacity known: 100 served + (0 queued + 60 held) x 100 tokens / 60 s = 200 tok/s of demand.
    measured = autoscale(obs, ReplicaState(3, 3), POLICY, ScalingHistory(capacity_per_replica=CAPACITY), 0.0,
                         False, held=60)
    assert measured.demand == pytest.approx(200.0)
    assert "queue of 0 and 60 held at the gateway" in measured.reason


def test_held_requests_cannot_be_negative():
    with pytest.raises(ValueError, match="held requests"):
        autoscale(None, ReplicaState(1, 1), POLICY, ScalingHistory(), 0.0, False, held=-1)
