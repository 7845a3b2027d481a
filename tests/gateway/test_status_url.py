"""With a gateway, every InferenceService's status.url is the gateway's (the operator's KVPILOT_GATEWAY_URL)."""

from __future__ import annotations

from kvpilot.operator import builders, spec, status
from kvpilot.operator.settings import OperatorSettings

SPEC = spec.parse_spec({"model": {"uri": "pvc://models/llama"}, "replicas": 1})
READY = {"metadata": {"generation": 1},
         "status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1}}


def test_the_gateway_url_is_read_from_the_environment_without_a_trailing_slash():
    assert OperatorSettings.from_env({"KVPILOT_GATEWAY_URL": "http://127.0.0.1:8000/"}).gateway_url == \
        "http://127.0.0.1:8000"
    assert OperatorSettings.from_env({}).gateway_url is None


def test_status_url_is_the_gateways_when_one_runs():
    assert builders.status_url("llama", "ml", "http://gw.kvpilot-system.svc.cluster.local:80") == \
        "http://gw.kvpilot-system.svc.cluster.local:80/v1"
    assert builders.status_url("llama", "ml", None) == "http://llama.ml.svc.cluster.local:8000/v1"
    result = status.compute_status(
        name="llama", namespace="ml", generation=1, spec=SPEC, settings=spec.EngineSettings.of(SPEC.engine),
        deployment=READY, pods=[], events=[], previous_conditions=[], now="2026-01-01T00:00:00Z",
        url=builders.status_url("llama", "ml", "http://127.0.0.1:8000"))
    assert result["url"] == "http://127.0.0.1:8000/v1"
    ready = next(c for c in result["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "1/1 replicas ready at http://127.0.0.1:8000/v1"
