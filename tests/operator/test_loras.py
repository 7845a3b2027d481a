"""LoRA adapters in the operator: the reconcile keeps each Ready pod's adapters equal to spec.loras
and says so in status.loras, Events and the AdaptersReady condition (against FakeKube and a
recording engine client; tests/operator/test_engine_client.py syncs a real engine)."""

from __future__ import annotations

from kvpilot import kube_contract
from kvpilot.operator import builders, reconcile, status
from kvpilot.operator.settings import OperatorSettings

from .fake_kube import FakeKube

NAMESPACE, NAME = "ml", "llama"
SPEC = {"model": {"uri": "pvc://m", "servedName": "llama3"}, "replicas": 2,
        "loras": [{"name": "sql", "uri": "pvc://adapters/sql"}, {"name": "chat", "uri": "pvc://adapters/chat"}]}


class Engines:
    """Answers sync_loras with ``failures`` (pod -> adapter -> message) and records each call."""

    def __init__(self) -> None:
        self.failures: dict[str, dict[str, str]] = {}
        self.without_lora: set[str] = set()  # pods of the template before spec.loras: they answer nothing
        self.calls: list[tuple[dict[str, str], dict[str, str], str | None]] = []

    def sync_loras(self, engines, desired, token):
        self.calls.append((dict(engines), dict(desired), token))
        return {pod: {} if pod in self.without_lora else {name: self.failures.get(pod, {}).get(name) for name in desired}
                for pod in engines}


def _setup(spec: dict = SPEC) -> tuple[FakeKube, dict]:
    kube = FakeKube()
    body = kube.put({"apiVersion": kube_contract.API_VERSION, "kind": kube_contract.KIND,
                     "metadata": {"name": NAME, "namespace": NAMESPACE, "generation": 1}, "spec": spec})
    for index, ready in enumerate((True, True, False)):
        kube.put({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": f"{NAME}-{index}", "namespace": NAMESPACE, "labels": builders.labels(NAME)},
                  "status": {"podIP": f"10.0.0.{index}",
                             "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})
    return kube, body


def _condition(kube: FakeKube, kind: str) -> dict | None:
    conditions = kube.get_inference_service(NAMESPACE, NAME)["status"]["conditions"]
    return next((c for c in conditions if c["type"] == kind), None)


def test_each_ready_pod_gets_the_adapters_and_a_failure_is_named_while_the_model_serves():
    kube, body = _setup()
    engines = Engines()
    engines.failures = {f"{NAME}-1": {"sql": "HTTP 400: r=64 is above max_lora_rank=16"}}
    outcome = reconcile.reconcile(kube, body, OperatorSettings(), engines)

    (targets, desired, token), = engines.calls
    assert targets == {f"{NAME}-0": "http://10.0.0.0:8001", f"{NAME}-1": "http://10.0.0.1:8001"}  # Ready pods only
    assert desired == builders.lora_paths(reconcile.parse_spec(SPEC))
    assert token == builders.admin_token(kube.object("Secret", NAMESPACE, builders.admin_secret_name(NAME)))
    loras = kube.get_inference_service(NAMESPACE, NAME)["status"]["loras"]
    assert [(e["name"], e["loadedPods"]) for e in loras] == [("sql", 1), ("chat", 2)]
    assert loras[0]["pods"][1] == {"pod": f"{NAME}-1", "state": "Failed",
                                   "message": "HTTP 400: r=64 is above max_lora_rank=16"}
    assert (status.LORA_FAILED, f"LoRA adapter sql failed to load on pod {NAME}-1: HTTP 400: r=64 is above "
            "max_lora_rank=16") in outcome.warnings
    assert sum("LoRA adapter" in action for action in outcome.actions) == 3
    adapters = _condition(kube, "AdaptersReady")
    assert adapters["status"] == "False" and adapters["reason"] == status.LORA_FAILED and "sql" in adapters["message"]
    assert _condition(kube, "Degraded")["status"] == "False"  # the base model is fine

    again = reconcile.reconcile(kube, kube.get_inference_service(NAMESPACE, NAME), OperatorSettings(), engines)
    assert again.warnings == [] and not any("LoRA" in a for a in again.actions)  # nothing new to announce

    engines.failures = {}
    fixed = reconcile.reconcile(kube, kube.get_inference_service(NAMESPACE, NAME), OperatorSettings(), engines)
    assert fixed.actions == [f"LoRA adapter sql loaded on pod {NAME}-1"]
    assert _condition(kube, "AdaptersReady")["status"] == "True"


def test_a_pod_started_before_lora_was_on_is_left_out_while_it_is_replaced():
    kube, body = _setup()
    engines = Engines()
    engines.without_lora = {f"{NAME}-0"}
    outcome = reconcile.reconcile(kube, body, OperatorSettings(), engines)
    loras = kube.get_inference_service(NAMESPACE, NAME)["status"]["loras"]
    assert [[p["pod"] for p in entry["pods"]] for entry in loras] == [[f"{NAME}-1"], [f"{NAME}-1"]]
    assert outcome.warnings == []


def test_without_adapters_the_status_forgets_them():
    kube, body = _setup()
    engines = Engines()
    reconcile.reconcile(kube, body, OperatorSettings(), engines)
    service = kube.get_inference_service(NAMESPACE, NAME)
    service["spec"] = {key: value for key, value in SPEC.items() if key != "loras"}
    kube.put(service)
    reconcile.reconcile(kube, kube.get_inference_service(NAMESPACE, NAME), OperatorSettings(), engines)
    assert "loras" not in kube.get_inference_service(NAMESPACE, NAME)["status"]
    assert _condition(kube, "AdaptersReady") is None
    assert len(engines.calls) == 1


def test_an_adapter_named_like_the_defaulted_served_name_is_an_invalid_spec():
    kube, body = _setup({"model": {"uri": "pvc://m"}, "loras": [{"name": NAME, "uri": "pvc://adapters/x"}]})
    outcome = reconcile.reconcile(kube, body, OperatorSettings(), Engines())
    (reason, message), = outcome.warnings
    assert reason == status.INVALID_SPEC and "adapter 'llama' has the base model's name" in message
    assert kube.object("Deployment", NAMESPACE, NAME) is None
