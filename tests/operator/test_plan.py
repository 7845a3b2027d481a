"""One control interval, planned: from what was read to what to write, with no I/O."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.operator import spec
from kvpilot.operator.control_loop import wants_loop
from kvpilot.operator.engine_metrics import Observation, PodReport, ServiceMetrics
from kvpilot.operator.plan import Memory, Reading, count_new_oom_kills, plan, settle_seconds
from kvpilot.operator.spec import EngineSettings

INTERVAL = 30.0
SPEC = spec.parse_spec({
    "model": {"uri": "pvc://m"},
    "engine": {"maxNumSeqs": 16},
    "tuning": {"slo": {"itlP99Seconds": 0.1}, "maxNumSeqs": {"min": 1, "max": 64}},
})
AUTOSCALED = SPEC.model_copy(update={"autoscaling": spec.Autoscaling(min_replicas=1, max_replicas=3)})
IN_EFFECT = EngineSettings.of(SPEC.engine)


def observation(**fields) -> Observation:
    """A saturated window: 16 running of max_num_seqs 16, a queue, ITL well under the 100 ms SLO."""
    base = dict(
        window_seconds=INTERVAL, pods=2, output_tokens_per_second=600.0, prompt_tokens_per_second=900.0,
        requests_per_second=4.0, requests_finished=120.0, itl_samples=9000.0, ttft_p50=0.2, ttft_p99=0.5,
        itl_p50=0.04, itl_p99=0.05, e2e_p50=5.0, e2e_p99=9.0, queue_time_p99=0.3, mean_running_per_pod=16.0,
        running=32.0, waiting=10.0, waiting_now=10.0, kv_cache_usage=0.3, kv_cache_blocks=2000.0,
        preemptions_per_second=0.0, prefix_cache_hit_rate=None, mean_output_tokens_per_request=150.0,
        max_num_seqs=16, max_num_batched_tokens=2048, gpu_memory_utilization=0.9,
    )
    base.update(fields)
    return Observation(**base)


def reading(obs: Observation | None = None, *, reported=None, unreachable=(), pods=(), spec_=SPEC,
            in_effect=IN_EFFECT, ready=("a", "b")) -> Reading:
    reports = {pod: PodReport(pod, None) for pod in ready}
    reports.update({pod: PodReport(pod, None, "URLError: refused") for pod in unreachable})
    return Reading(name="llama", namespace="ml", spec=spec_, pods=list(pods),
                   ready={pod: f"http://10.0.0.{i}:8000" for i, pod in enumerate(ready)},
                   metrics=ServiceMetrics(obs if obs is not None else observation(), reports),
                   engine_max_num_seqs=reported if reported is not None else {pod: 16 for pod in ready},
                   in_effect=in_effect, now=1000.0)


def _plan(read: Reading, memory: Memory = Memory()):
    return plan(read, memory, interval=INTERVAL, scale_down_stabilization_seconds=300.0)


def test_a_new_max_num_seqs_goes_to_the_configmap_and_every_ready_engine():
    result = _plan(reading())
    assert result.decision.num_seqs_changed and result.new_settings.max_num_seqs > 16
    assert result.live == result.new_settings and result.push == ("a", "b")
    assert result.restart_windows_at == 1000.0 + settle_seconds(INTERVAL)
    assert [e.reason for e in result.events] == ["Tuned"] and "max_num_seqs 16 →" in result.events[0].message
    assert set(result.status) == {"metrics", "tuning"}
    assert result.memory.tuning == result.decision.history


def test_an_slo_no_setting_meets_is_a_warning_event_once_not_every_interval():
    # About 1.4 s an inter-token gap at any batch against a 0.1 s SLO: the tuner looks down to the
    # bound, finds it out of reach there too, says so once and keeps the best throughput it saw.
    memory, settings, events, decisions = Memory(), IN_EFFECT, [], []
    for step in range(6):
        batch = float(settings.max_num_seqs)
        obs = observation(itl_p99=1.4 + 0.005 * batch, mean_running_per_pod=batch, max_num_seqs=settings.max_num_seqs,
                          output_tokens_per_second=40.0 * batch)
        result = _plan(replace(reading(obs, in_effect=settings), now=1000.0 + INTERVAL * step), memory)
        memory, settings = result.memory, result.live
        events += [e for e in result.events if e.reason == "SLOUnreachable"]
        decisions.append(result.decision)
    assert len(events) == 1 and events[0].type == "Warning" and "no maxNumSeqs within 1..64" in events[0].message
    assert decisions[-1].slo_unreachable and settings.max_num_seqs == 16, [d.reason for d in decisions]


def test_without_a_change_only_engines_that_run_other_values_are_pushed():
    quiet = observation(itl_samples=10.0)  # too little traffic: the tuner holds
    result = _plan(reading(quiet, reported={"a": 16, "b": 4}))
    assert not result.decision.changed and result.new_settings is None
    assert result.push == ("b",) and result.live == IN_EFFECT and result.restart_windows_at is None
    assert result.events == ()


def test_a_memory_change_rolls_pods_through_the_configmap_not_the_admin_api():
    pod = {"metadata": {"name": "a", "uid": "u"},
           "status": {"containerStatuses": [{"name": "engine", "restartCount": 1,
                                             "lastState": {"terminated": {"reason": "OOMKilled"}}}]}}
    seen = _plan(reading(observation(itl_samples=10.0), pods=[pod])).memory
    pod["status"]["containerStatuses"][0]["restartCount"] = 2
    result = _plan(reading(observation(itl_samples=10.0), pods=[pod]), seen)
    assert result.decision.memory_changed and not result.decision.live_settings_changed
    assert result.new_settings.gpu_memory_utilization < 0.9
    assert result.push == () and result.restart_windows_at is None
    assert [e.reason for e in result.events] == ["TunedMemory"]


def test_a_memory_change_event_says_what_the_rollout_costs():
    def pod(name: str, started: str, ready: str, restarts: int) -> dict:
        return {"metadata": {"name": name, "uid": name},
                "status": {"startTime": started,
                           "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": ready}],
                           "containerStatuses": [{"name": "engine", "restartCount": restarts,
                                                  "lastState": {"terminated": {"reason": "OOMKilled"}}}]}}

    def event(spec_, restarts: int) -> str:
        # The older pod's Ready changed long after its start (a probe failed once): the newest one's start says.
        pods = [pod("old", "2026-12-06T10:00:00Z", "2026-12-06T11:00:31Z", 0),
                pod("new", "2026-12-06T10:05:00Z", "2026-12-06T10:05:12Z", restarts)]
        seen = _plan(reading(observation(itl_samples=10.0), pods=pods, spec_=spec_)).memory
        pods[1]["status"]["containerStatuses"][0]["restartCount"] = restarts + 1
        (tuned,) = _plan(reading(observation(itl_samples=10.0), pods=pods, spec_=spec_), seen).events
        assert tuned.reason == "TunedMemory"
        return tuned.message

    on_gpus = event(SPEC, 1)
    assert on_gpus.endswith("; restarting 2 pod(s) one at a time, each out of service until Ready "
                            "(the newest engine took 12 s from start to Ready)"), on_gpus
    on_cpus = event(SPEC.model_copy(update={"resources": spec.Resources(gpus=0, memory="8Gi")}), 1)
    assert "; replacing 2 pod(s) one at a time, each new one beside the old until Ready (the newest engine " \
           "took 12 s" in on_cpus, on_cpus


def test_the_autoscaler_asks_for_replicas_and_sees_the_new_settings():
    busy = observation(output_tokens_per_second=2000.0, waiting_now=200.0, pods=1)
    result = _plan(reading(busy, ready=("a",), spec_=AUTOSCALED))
    assert result.replicas is not None and result.replicas > 1
    assert "Scaled" in [e.reason for e in result.events] and set(result.status) == {"metrics", "tuning", "autoscaling"}
    assert result.memory.scaling == result.scale.history


def test_the_autoscaling_status_shows_the_inputs_of_the_sizing_rule():
    only_scaling = AUTOSCALED.model_copy(update={"tuning": None})
    saturated = observation(output_tokens_per_second=2000.0, waiting_now=200.0, pods=1)
    scaling = _plan(reading(saturated, ready=("a",), spec_=only_scaling)).status["autoscaling"]
    # 2000 tok/s served + a queue of 200 x 150 tokens drained over 60 s; the one saturated
    # replica's 2000 tok/s is its capacity; ceil(2500 / (2000 x 0.8)) = 2.
    assert scaling["demandTokensPerSecond"] == 2500.0 and scaling["capacityPerReplica"] == 2000.0
    assert scaling["desiredReplicas"] == 2


def test_requests_held_at_the_gateway_wake_a_service_at_zero_and_show_in_its_status():
    at_zero = SPEC.model_copy(update={"tuning": None, "replicas": 0,
                                      "autoscaling": spec.Autoscaling(min_replicas=0, max_replicas=3)})
    nothing_ready = replace(reading(spec_=at_zero, ready=()), metrics=ServiceMetrics(None, {}))
    assert _plan(nothing_ready).replicas is None  # no pod and nothing held: stays at zero
    result = _plan(replace(nothing_ready, held_at_gateway=30))
    # 30 held against the 16 slots per replica in effect at 80%: ceil(30 / 12.8) = 3.
    assert result.replicas == 3 and result.status["autoscaling"]["heldRequests"] == 30
    assert "30 request(s) held at the gateway" in result.status["autoscaling"]["reason"]
    assert _plan(reading(spec_=AUTOSCALED)).status["autoscaling"]["heldRequests"] == 0


def test_metrics_unavailable_is_posted_once_per_outage():
    first = _plan(reading(unreachable=("b",), ready=("a", "b")))
    assert [e.reason for e in first.events if e.type == "Warning"] == ["MetricsUnavailable"]
    again = _plan(reading(unreachable=("b",), ready=("a", "b")), first.memory)
    assert [e for e in again.events if e.reason == "MetricsUnavailable"] == []
    assert first.status["metrics"]["unscrapedPods"] == ["b"]


def test_a_service_that_only_autoscales_reports_no_tuning():
    only_scaling = AUTOSCALED.model_copy(update={"tuning": None})
    result = _plan(reading(spec_=only_scaling))
    assert result.decision is None and "tuning" not in result.status and result.new_settings is None


def test_oom_kills_count_only_new_restarts_with_oomkilled():
    def pod(uid: str, restarts: int, reason: str | None) -> dict:
        last = {"terminated": {"reason": reason, "exitCode": 137}} if reason else {}
        return {"metadata": {"name": f"p-{uid}", "uid": uid},
                "status": {"containerStatuses": [{"name": "engine", "restartCount": restarts, "lastState": last}]}}

    kills, seen = count_new_oom_kills([pod("a", 2, "OOMKilled"), pod("b", 0, None)], {})
    assert kills == 0  # the baseline
    kills, seen = count_new_oom_kills([pod("a", 3, "OOMKilled"), pod("b", 1, "Error")], seen)
    assert kills == 1
    assert count_new_oom_kills([pod("a", 3, "OOMKilled"), pod("b", 1, "Error")], seen)[0] == 0


def test_loop_runs_only_for_services_that_tune_or_scale():
    assert not wants_loop({})
    assert wants_loop({"tuning": {"slo": {"itlP99Seconds": 0.1}}})
    assert not wants_loop({"tuning": {"enabled": False}})
    assert wants_loop({"autoscaling": {"maxReplicas": 3}})


def test_the_window_after_a_change_starts_a_fifth_of_an_interval_later_within_bounds():
    assert settle_seconds(30.0) == 6.0
    assert settle_seconds(5.0) == 2.0
    assert settle_seconds(600.0) == 10.0


def test_the_tuner_is_told_whether_a_replica_can_relieve_the_queue():
    # A queue past the TTFT SLO is the autoscaler's to relieve while it can add a replica; with none to come
    # (no autoscaling, or at maxReplicas) the tuner judges a TPOT SLO at P95 instead.
    tpot = {"slo": {"tpotP99Seconds": 0.1, "ttftP99Seconds": 10.0}, "maxNumSeqs": {"min": 1, "max": 64}}
    queued = observation(ttft_p99=20.0, ttft_queue_share=0.9, tpot_samples=120.0, tpot_p99=0.095, tpot_p95=0.08)
    alone = SPEC.model_copy(update={"tuning": spec.Tuning.model_validate(tpot)})
    scaled = alone.model_copy(update={"autoscaling": spec.Autoscaling(min_replicas=1, max_replicas=3)})
    at_max = scaled.model_copy(update={"replicas": 3})
    reasons = {name: _plan(reading(queued, spec_=s)).decision.reason
               for name, s in (("alone", alone), ("scaled", scaled), ("at_max", at_max))}
    assert "judged at P95" in reasons["alone"] and "judged at P95" in reasons["at_max"], reasons
    assert "judged at P95" not in reasons["scaled"], reasons
