"""The reconcile's decisions that need no API server: when to write status, when to raise an Event."""

from __future__ import annotations

from kvpilot.operator import reconcile
from kvpilot.operator.kube import resource_path


class RecordingKube:
    """Stands in for Kube where only the status write matters."""

    def __init__(self):
        self.patches = []

    def patch_status(self, namespace, name, status):
        self.patches.append((namespace, name, status))


BODY = {"metadata": {"name": "llama", "namespace": "ml"}}


def test_status_is_written_only_when_it_changes():
    kube = RecordingKube()
    new = {"phase": "Ready", "engine": {"maxNumSeqs": 8, "maxNumBatchedTokens": None}, "url": None}
    reconcile._write_status(kube, {**BODY, "status": {"phase": "Ready", "engine": {"maxNumSeqs": 8},
                                                      "metrics": {"itlP99Seconds": 0.05}}}, new)
    assert kube.patches == []  # None fields are absent, the tuner's metrics are not ours to compare
    reconcile._write_status(kube, {**BODY, "status": {"phase": "Progressing"}}, new)
    assert kube.patches == [("ml", "llama", new)]
    reconcile._write_status(kube, {**BODY, "status": {"phase": "Ready", "engine": {"maxNumSeqs": 8}, "url": "x"}}, new)
    assert len(kube.patches) == 2  # a field to remove is a change


def _degraded(status, reason):
    return {"conditions": [{"type": "Degraded", "status": status, "reason": reason, "message": reason}]}


def test_an_event_only_when_a_problem_appears_or_changes():
    fresh = _degraded("True", "InsufficientGPU")
    assert reconcile._new_problems({**BODY, "status": _degraded("False", "AsExpected")}, fresh) == \
        [("InsufficientGPU", "InsufficientGPU")]
    assert reconcile._new_problems({**BODY, "status": fresh}, fresh) == []
    assert reconcile._new_problems({**BODY, "status": _degraded("True", "CrashLoop")}, fresh) != []
    assert reconcile._new_problems({**BODY}, _degraded("False", "AsExpected")) == []


def test_resource_paths():
    assert resource_path("v1", "ConfigMap", "ml", "a-tuning") == "/api/v1/namespaces/ml/configmaps/a-tuning"
    assert resource_path("apps/v1", "Deployment", "ml") == "/apis/apps/v1/namespaces/ml/deployments"
    assert resource_path("kvpilot.io/v1alpha1", "InferenceService", "ml", "a", "status") == \
        "/apis/kvpilot.io/v1alpha1/namespaces/ml/inferenceservices/a/status"
