"""A draft model through the CRD, end to end, on the local control plane.

The chart runs the operator (namespaced RBAC, its own namespace and ports); one InferenceService
serves a generated tiny model from a file:/// URI with `method: draft_model` and a draft at
another file:/// URI (a second copy of the same generated model: the same vocabulary, and a draft
that agrees with the target, so accepted proposals show that the draft's KV stayed in step). It
becomes Ready, its pod mounts both models, answers a completion, and its /metrics counts proposals.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as contract
from kvpilot.engine.model_files import make_model
from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders, crd

pytestmark = pytest.mark.e2e

NS = "kvpilot-spec-e2e"
RELEASE = "spd"
NAME = "drafted"
OPERATOR_HEALTH_PORT = 18541  # pods share the host's network: clear of the other e2e modules' ports
ENGINE_READY_S = 240  # the engine imports torch and loads two models on 2 shared cores
NUM_SPECULATIVE_TOKENS = 3


@pytest.fixture(scope="module")
def operator(chart_operator):
    chart_operator(NS, RELEASE, OPERATOR_HEALTH_PORT, "resyncSeconds=5")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    """The draft: the tests' tiny model generated again (same seed) into a folder of its own."""
    return make_model(tmp_path_factory.mktemp("draft") / "tiny-draft", preset="tiny", arch="llama", seed=0)


@pytest.fixture(scope="module")
def drafted(cluster, kube, operator, tiny_model_dir, draft_dir) -> dict:
    """The InferenceService, Ready; returns its engine pod."""
    manifest = yaml.safe_load((crd.REPO_ROOT / "examples" / "local-cpu.yaml").read_text())
    manifest["metadata"] = {"name": NAME, "namespace": NS}
    manifest["spec"]["model"]["uri"] = f"file://{Path(tiny_model_dir).resolve()}"
    manifest["spec"]["engine"]["speculative"] = {
        "method": "draft_model", "model": {"uri": f"file://{draft_dir.resolve()}"},
        "numSpeculativeTokens": NUM_SPECULATIVE_TOKENS,
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    def ready():
        kvis = kube.get_inference_service(NS, NAME)
        status = (kvis or {}).get("status") or {}
        pods = [p for p in kube.list("v1", "Pod", NS, label_selector=builders.selector_string(NAME))
                if not p["metadata"].get("deletionTimestamp")]
        return pods[0] if status.get("phase") == "Ready" and len(pods) == 1 else None

    try:
        return wait_until(ready, ENGINE_READY_S, f"{NAME} to be Ready", interval=0.5)
    except AssertionError as exc:
        status = cluster.kubectl("get", "kvis,pods", "-n", NS, "-o", "yaml", check=False).stdout[-6000:]
        raise AssertionError(f"{exc}\n{status}") from None


def _samples(text: str) -> dict[str, float]:
    """Sample name -> value, of the samples that are one per engine (no label but model_name)."""
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if set(sample.labels) <= {contract.MODEL_NAME_LABEL}}


def test_the_pod_mounts_the_draft_beside_the_target(drafted, tiny_model_dir, draft_dir):
    (container,) = drafted["spec"]["containers"]
    volumes = {v["name"]: v for v in drafted["spec"]["volumes"]}
    assert volumes[builders.MODEL_VOLUME]["hostPath"]["path"] == str(Path(tiny_model_dir).resolve())
    assert volumes[builders.DRAFT_MODEL_VOLUME]["hostPath"]["path"] == str(draft_dir.resolve())
    config = json.loads(container["args"][container["args"].index("--speculative-config") + 1])
    assert config == {"method": "draft_model", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                      "model": builders.DRAFT_MODEL_ROOT}


def test_it_answers_and_its_metrics_count_accepted_proposals(drafted):
    base = f"http://{drafted['status']['podIP']}:{contract.ENGINE_PORT}"
    body = {"model": NAME, "prompt": "one two three four five six seven eight", "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 24
    values = _samples(httpx.get(f"{base}/metrics", timeout=30).text)
    assert values[contract.SPEC_DECODE_NUM_SPECULATIVE_TOKENS] == NUM_SPECULATIVE_TOKENS
    assert values[contract.SPEC_DECODE_NUM_DRAFTS] > 0
    assert values[contract.SPEC_DECODE_NUM_DRAFT_TOKENS] > 0
    assert values[contract.SPEC_DECODE_NUM_ACCEPTED_TOKENS] > 0
