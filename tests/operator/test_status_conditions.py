"""Status computation: conditions and reasons a user can act on, from realistic pod states, and the
control loop's reports (metrics, tuning, autoscaling)."""

from __future__ import annotations

from kvpilot.operator import spec, status
from kvpilot.operator.engine_metrics import MetricsCollector
from kvpilot.operator.spec import EngineSettings
from kvpilot.operator.tuner import Change, Decision, TuningHistory

NOW = "2026-01-01T00:00:00Z"
SPEC = spec.parse_spec({"model": {"uri": "pvc://models/llama"}, "replicas": 2, "resources": {"gpus": 4}})
SETTINGS = spec.EngineSettings.of(SPEC.engine)


def _deployment(replicas=2, ready=2, updated=2, generation=1, observed=1):
    return {"metadata": {"generation": generation},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                       "observedGeneration": observed}}


def _pod(name, *, ready=False, conditions=(), containers=(), init_containers=(), phase="Pending"):
    conds = list(conditions)
    if ready:
        conds.append({"type": "Ready", "status": "True"})
    return {"metadata": {"name": name}, "status": {"phase": phase, "conditions": conds,
                                                    "containerStatuses": list(containers),
                                                    "initContainerStatuses": list(init_containers)}}


def _compute(deployment, pods=(), events=(), previous=(), spec_=SPEC):
    return status.compute_status(name="llama", namespace="ml", generation=3, spec=spec_, settings=SETTINGS,
                                 deployment=deployment, pods=list(pods), events=list(events),
                                 previous_conditions=list(previous), now=NOW)


def _cond(result, kind):
    return next(c for c in result["conditions"] if c["type"] == kind)


def test_all_ready():
    result = _compute(_deployment(), [_pod("a", ready=True), _pod("b", ready=True)])
    assert result["phase"] == "Ready"
    assert _cond(result, "Ready")["status"] == "True"
    assert _cond(result, "Progressing")["status"] == "False"
    assert _cond(result, "Degraded")["status"] == "False"
    assert result["url"] == "http://llama.ml.svc.cluster.local:8000/v1"
    assert result["replicas"] == 2 and result["readyReplicas"] == 2
    assert result["selector"] == "app.kubernetes.io/component=engine,app.kubernetes.io/instance=llama,app.kubernetes.io/name=kvpilot"
    assert result["engine"]["maxNumSeqs"] == 64 and result["observedGeneration"] == 3


def test_no_deployment_yet_is_pending():
    result = _compute(None)
    assert result["phase"] == "Pending" and _cond(result, "Progressing")["reason"] == "Creating"


def test_gpu_shortage_names_the_gpus():
    message = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are available."
    pending = _pod("b", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": message}])
    result = _compute(_deployment(ready=1), [_pod("a", ready=True), pending])
    degraded = _cond(result, "Degraded")
    assert result["phase"] == "Degraded"
    assert degraded["status"] == "True" and degraded["reason"] == "InsufficientGPU"
    assert "no node has 4 free nvidia.com/gpu" in degraded["message"]
    assert "spec.resources.gpus" in degraded["message"]
    assert _cond(result, "Ready")["status"] == "False"


def test_missing_claim_is_a_model_volume_problem():
    message = 'persistentvolumeclaim "models" not found. preemption: 0/2 nodes are available'
    pending = _pod("a", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": message}])
    degraded = _cond(_compute(_deployment(ready=0), [pending]), "Degraded")
    assert degraded["reason"] == "ModelVolumeMissing" and "'models'" in degraded["message"]


def test_failed_mount_event_of_the_model_volume():
    pod = _pod("a", conditions=[{"type": "PodScheduled", "status": "True"}])
    event = {"involvedObject": {"name": "a"}, "reason": "FailedMount",
             "message": 'MountVolume.SetUp failed for volume "model" : hostPath type check failed: /data is not a directory'}
    degraded = _cond(_compute(_deployment(ready=0), [pod], [event]), "Degraded")
    assert degraded["reason"] == "ModelVolumeMissing" and "hostPath type check failed" in degraded["message"]


def test_image_pull_failure():
    container = {"name": "engine", "image": "nope:1", "restartCount": 0,
                 "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}
    degraded = _cond(_compute(_deployment(ready=0), [_pod("a", containers=[container])]), "Degraded")
    assert degraded["reason"] == "ImagePullFailed" and "nope:1" in degraded["message"]
    assert "spec.image" in degraded["message"]


def test_crash_loop_reports_exit_code_and_logs_command():
    container = {"name": "engine", "restartCount": 3,
                 "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                 "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "ConfigError: block_size"}}}
    degraded = _cond(_compute(_deployment(ready=0), [_pod("a", containers=[container], phase="Running")]), "Degraded")
    assert degraded["reason"] == "CrashLoop"
    assert "restarted 3 times" in degraded["message"] and "exit code 1 (Error)" in degraded["message"]
    assert "kubectl logs a --previous" in degraded["message"]


def test_failing_download_init_container():
    init = {"name": "download-model", "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1}}}
    degraded = _cond(_compute(_deployment(ready=0), [_pod("a", init_containers=[init])]), "Degraded")
    assert degraded["reason"] == "ModelDownloadFailed" and "-c download-model" in degraded["message"]


def test_most_urgent_problem_wins_and_others_are_counted():
    crash = {"name": "engine", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
             "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}
    result = _compute(_deployment(ready=0), [_pod("a", containers=[crash]), _pod("b", conditions=[unschedulable])])
    degraded = _cond(result, "Degraded")
    assert degraded["reason"] == "InsufficientGPU" and "(1 more pods have problems)" in degraded["message"]


def test_rollout_in_progress():
    result = _compute(_deployment(replicas=2, ready=1, updated=1, generation=4, observed=4),
                      [_pod("a", ready=True), _pod("b")])
    assert result["phase"] == "Progressing"
    assert _cond(result, "Progressing")["reason"] == "RollingOut"


def test_scaled_to_zero_is_stopped():
    zero = spec.parse_spec({"model": {"uri": "pvc://m"}, "replicas": 0})
    result = _compute(_deployment(replicas=0, ready=0, updated=0), spec_=zero)
    assert result["phase"] == "Stopped" and _cond(result, "Ready")["reason"] == "ScaledToZero"


def test_transition_time_kept_while_status_holds():
    first = _compute(_deployment(), [_pod("a", ready=True), _pod("b", ready=True)])
    old = [dict(c, lastTransitionTime="2025-12-31T00:00:00Z") for c in first["conditions"]]
    again = _compute(_deployment(), [_pod("a", ready=True), _pod("b", ready=True)], previous=old)
    assert _cond(again, "Ready")["lastTransitionTime"] == "2025-12-31T00:00:00Z"
    flipped = _compute(_deployment(ready=1), [_pod("a", ready=True), _pod("b")], previous=old)
    assert _cond(flipped, "Ready")["lastTransitionTime"] == NOW


def test_rollout_past_its_deadline_is_degraded_even_without_pod_clues():
    deployment = _deployment(ready=1)
    deployment["status"]["conditions"] = [{"type": "Progressing", "status": "False",
                                           "reason": "ProgressDeadlineExceeded",
                                           "message": 'ReplicaSet "llama-5d" has timed out progressing.'}]
    degraded = _cond(_compute(deployment, [_pod("a", ready=True), _pod("b", phase="Running")]), "Degraded")
    assert degraded["reason"] == "RolloutStuck" and "timed out progressing" in degraded["message"]


def test_engine_status_is_the_settings_with_unset_fields_removed_by_the_merge_patch():
    result = _compute(_deployment(), [_pod("a", ready=True), _pod("b", ready=True)])
    assert result["engine"] == {"maxNumSeqs": 64, "maxNumBatchedTokens": None, "gpuMemoryUtilization": 0.9}
    assert EngineSettings.model_validate(result["engine"]) == SETTINGS


def test_tuning_status_lists_changes_with_the_values_after_each():
    history = TuningHistory(changes=(
        Change(100.0, "maxNumSeqs", 8, 16, "grow"),
        Change(130.0, "gpuMemoryUtilization", 0.9, 0.92, "preempting"),
        Change(160.0, "maxNumSeqs", 16, 24, "grow again"),
    ))
    decision = Decision(EngineSettings(max_num_seqs=24, gpu_memory_utilization=0.92), "grow again", history,
                        EngineSettings(max_num_seqs=16, gpu_memory_utilization=0.92))
    report = status.tuning_status(decision, 160.0)
    spec.TuningStatus.model_validate(report)
    assert report["lastDecision"] == "maxNumSeqs 16 → 24"
    assert [(h["maxNumSeqs"], h["gpuMemoryUtilization"]) for h in report["history"]] == [
        (16, 0.9), (16, 0.92), (24, 0.92)]
    assert report["history"][0]["time"] == "1970-01-01T00:01:40Z"


def test_metrics_status_uses_the_crd_field_names_and_reports_dead_pods():
    collector = MetricsCollector(window_seconds=30.0)
    scraped = collector.ingest({"a": ConnectionError("refused")}, 0.0)
    report = status.metrics_status(scraped, 0.0)
    assert report["unscrapedPods"] == ["a"] and report["scrapedPods"] == 0
    spec.MetricsStatus.model_validate(report)
