"""The tuning loop's pure helpers: OOM accounting and the status it writes."""

from __future__ import annotations

from kvpilot.operator import spec as specs
from kvpilot.operator.metrics import MetricsCollector
from kvpilot.operator.tuner import Change, Decision, EngineParams, TuningHistory
from kvpilot.operator.tuning import count_new_oom_kills, metrics_status, settle_seconds, tuning_status, wants_loop


def pod(uid: str, restarts: int, reason: str | None) -> dict:
    last = {"terminated": {"reason": reason, "exitCode": 137}} if reason else {}
    return {
        "metadata": {"name": f"p-{uid}", "uid": uid},
        "status": {"containerStatuses": [{"name": "engine", "restartCount": restarts, "lastState": last}]},
    }


def test_oom_kills_count_only_new_restarts_with_oomkilled():
    seen: dict[str, int] = {}
    assert count_new_oom_kills([pod("a", 2, "OOMKilled"), pod("b", 0, None)], seen) == 0  # baseline
    assert count_new_oom_kills([pod("a", 3, "OOMKilled"), pod("b", 1, "Error")], seen) == 1
    assert count_new_oom_kills([pod("a", 3, "OOMKilled"), pod("b", 1, "Error")], seen) == 0


def test_tuning_status_lists_changes_with_the_values_after_each():
    history = TuningHistory(changes=(
        Change(100.0, "maxNumSeqs", 8, 16, "grow"),
        Change(130.0, "gpuMemoryUtilization", 0.9, 0.92, "preempting"),
        Change(160.0, "maxNumSeqs", 16, 24, "grow again"),
    ))
    decision = Decision(EngineParams(24, 0.92), "grow again", history, EngineParams(16, 0.92))
    status = tuning_status(decision, 160.0)
    specs.TuningStatus.model_validate(status)
    assert status["lastDecision"] == "maxNumSeqs 16 → 24"
    assert [(h["maxNumSeqs"], h["gpuMemoryUtilization"]) for h in status["history"]] == [
        (16, 0.9), (16, 0.92), (24, 0.92)]
    assert status["history"][0]["time"] == "1970-01-01T00:01:40Z"


def test_metrics_status_uses_the_crd_field_names_and_reports_dead_pods():
    collector = MetricsCollector(window_seconds=30.0)
    scraped = collector.ingest({"a": ConnectionError("refused")}, 0.0)
    status = metrics_status(scraped, 0.0)
    assert status["unscrapedPods"] == ["a"] and status["scrapedPods"] == 0
    specs.MetricsStatus.model_validate(status)


def test_loop_runs_only_for_services_that_tune_or_scale():
    assert not wants_loop({})
    assert wants_loop({"tuning": {"slo": {"itlP99Seconds": 0.1}}})
    assert not wants_loop({"tuning": {"enabled": False}})
    assert wants_loop({"autoscaling": {"maxReplicas": 3}})


def test_the_window_after_a_change_starts_a_fifth_of_an_interval_later_within_bounds():
    assert settle_seconds(30.0) == 6.0
    assert settle_seconds(5.0) == 2.0
    assert settle_seconds(600.0) == 10.0
