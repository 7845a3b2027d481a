"""The operator's writes without an API server: ``reconcile`` and the control loop's write step, against
tests/operator/fake_kube.py (tests/e2e runs the same against a real one)."""

from __future__ import annotations

import copy
import json

import pytest

from kvpilot import kube_contract
from kvpilot.operator import builders, control_loop, reconcile, spec, status, tuning_configmap
from kvpilot.operator.control_loop import ControlLoop
from kvpilot.operator.kube import KubeError
from kvpilot.operator.plan import Event, Memory, Plan
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import EngineSettings

from .fake_kube import FakeKube, merge_patch

NAMESPACE, NAME = "ml", "llama"
TUNED = {"model": {"uri": "pvc://m"}, "engine": {"maxNumSeqs": 32}, "replicas": 2,
         "tuning": {"slo": {"itlP99Seconds": 0.1}, "maxNumSeqs": {"min": 8, "max": 128}}}
SETTINGS = OperatorSettings()


def _service(kube: FakeKube, spec_: dict) -> dict:
    return kube.put({"apiVersion": kube_contract.API_VERSION, "kind": kube_contract.KIND,
                     "metadata": {"name": NAME, "namespace": NAMESPACE, "generation": 1}, "spec": spec_})


def _owned_by_the_service(obj: dict) -> bool:
    return [ref["name"] for ref in obj["metadata"].get("ownerReferences", [])] == [NAME]


# --- reconcile ---------------------------------------------------------------------------------


def test_reconcile_creates_every_child_owned_by_the_service_then_writes_nothing_more():
    kube = FakeKube()
    body = _service(kube, TUNED)
    outcome = reconcile.reconcile(kube, body, SETTINGS)
    children = [("Secret", builders.admin_secret_name(NAME)), ("ConfigMap", builders.tuning_configmap_name(NAME)),
                ("Service", NAME), ("Deployment", NAME), ("PodDisruptionBudget", NAME)]
    assert outcome.actions == [
        f"Created Secret {builders.admin_secret_name(NAME)} (engine admin token)",
        *(f"Created {kind} {name}" for kind, name in children[1:]),
    ]
    for kind, name in children:
        obj = kube.object(kind, NAMESPACE, name)
        assert obj is not None and _owned_by_the_service(obj), kind
    assert builders.admin_token(kube.object("Secret", NAMESPACE, builders.admin_secret_name(NAME)))
    assert kube.object(kube_contract.KIND, NAMESPACE, NAME)["status"] == merge_patch({}, outcome.status)
    assert outcome.status["observedGeneration"] == 1

    writes = len(kube.writes)
    again = reconcile.reconcile(kube, kube.get_inference_service(NAMESPACE, NAME), SETTINGS)
    assert again.actions == [] and again.warnings == []
    assert len(kube.writes) == writes  # converged: no apply changed anything, the status was the same


def test_reconcile_keeps_the_tuners_settings_and_renders_them():
    kube = FakeKube()
    body = _service(kube, TUNED)
    parsed = spec.parse_spec(TUNED)
    seed = EngineSettings.of(parsed.engine)
    # The control loop's write (its own test is below).
    kube.apply(builders.build_tuning_configmap(NAME, NAMESPACE, parsed, seed.replace(max_num_seqs=96)), owner=body)
    outcome = reconcile.reconcile(kube, body, SETTINGS)
    assert "ConfigMap" not in " ".join(outcome.actions)  # neither reseeded nor touched
    data = kube.object("ConfigMap", NAMESPACE, builders.tuning_configmap_name(NAME))["data"]
    assert json.loads(data[tuning_configmap.TUNING_FILE_KEY])["maxNumSeqs"] == 96
    assert tuning_configmap.settings_in_effect(parsed, data).max_num_seqs == 96
    assert outcome.status["engine"]["maxNumSeqs"] == 96


def test_a_configmap_written_meanwhile_is_read_again_not_overwritten():
    kube = FakeKube()
    body = _service(kube, TUNED)
    parsed = spec.parse_spec(TUNED)
    seed = EngineSettings.of(parsed.engine)
    apply = kube.apply
    apply(builders.build_tuning_configmap(NAME, NAMESPACE, parsed, seed), owner=body)
    tuned = builders.build_tuning_configmap(NAME, NAMESPACE, parsed, seed.replace(max_num_seqs=64))

    def tuner_writes_first(manifest, *, owner=None):
        if manifest["kind"] == "ConfigMap" and not getattr(tuner_writes_first, "done", False):
            tuner_writes_first.done = True  # the tuner's write lands between the reconcile's read and its write
            apply(tuned, owner=body)
        return apply(manifest, owner=owner)

    kube.apply = tuner_writes_first
    reconcile.reconcile(kube, body, SETTINGS)
    data = kube.object("ConfigMap", NAMESPACE, builders.tuning_configmap_name(NAME))["data"]
    assert tuning_configmap.settings_in_effect(parsed, data).max_num_seqs == 64


def test_an_invalid_spec_is_reported_and_nothing_is_created():
    kube = FakeKube()
    body = _service(kube, {"model": {"uri": "pvc://m"}, "replicas": -1})
    outcome = reconcile.reconcile(kube, body, SETTINGS)
    assert [reason for reason, _ in outcome.warnings] == [status.INVALID_SPEC]
    assert "replicas" in outcome.warnings[0][1]
    assert kube.writes == [("status", kube_contract.KIND, NAME)]
    assert kube.object(kube_contract.KIND, NAMESPACE, NAME)["status"] == merge_patch({}, outcome.status)


def test_going_down_to_one_replica_deletes_the_disruption_budget():
    kube = FakeKube()
    reconcile.reconcile(kube, _service(kube, TUNED), SETTINGS)
    assert kube.object("PodDisruptionBudget", NAMESPACE, NAME) is not None
    outcome = reconcile.reconcile(kube, _service(kube, {**TUNED, "replicas": 1}), SETTINGS)
    assert f"Deleted PodDisruptionBudget {NAME} (one replica needs none)" in outcome.actions
    assert kube.object("PodDisruptionBudget", NAMESPACE, NAME) is None
    assert kube.object("Deployment", NAMESPACE, NAME)["spec"]["replicas"] == 1


# --- the control loop's write step -------------------------------------------------------------


class RecordingEngines:
    """Stands in for EngineClient: records what was pushed; ``refuse`` maps a pod to its error."""

    def __init__(self, refuse: dict[str, str] | None = None) -> None:
        self.refuse = refuse or {}
        self.pushed: list[tuple[dict, EngineSettings, str | None]] = []

    def scrape(self, engines):
        return {pod: ConnectionRefusedError("not scraped in this test") for pod in engines}

    def set_scheduler_limits(self, engines, settings, token):
        self.pushed.append((dict(engines), settings, token))
        return {pod: error for pod, error in self.refuse.items() if pod in engines}


def _pod(name: str, ip: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": builders.selector_labels(NAME)},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture
def served():
    """A reconciled tuned service with two Ready engine pods: (kube, its body as read back)."""
    kube = FakeKube()
    reconcile.reconcile(kube, _service(kube, {**TUNED, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}),
                        SETTINGS)
    kube.put(_pod("llama-a", "10.0.0.1"))
    kube.put(_pod("llama-b", "10.0.0.2"))
    return kube, kube.get_inference_service(NAMESPACE, NAME)


def _tick_with(monkeypatch, kube, body, engines, planned: Plan):
    """One control interval whose plan is ``planned``: what the loop then writes is under test."""
    monkeypatch.setattr(control_loop, "plan", lambda reading, memory, **_: planned)
    return ControlLoop(kube, engines, SETTINGS).tick(body, now=1000.0)


def test_a_tuning_decision_is_written_to_the_configmap_pushed_to_every_engine_and_reported(monkeypatch, served):
    kube, body = served
    engines = RecordingEngines()
    new = EngineSettings.of(spec.parse_spec(TUNED).engine).replace(max_num_seqs=48)
    tuned = Event("Normal", "Tuned", "max_num_seqs 32 → 48")
    planned = Plan(memory=Memory(), status={"tuning": {"maxNumSeqs": 48}}, live=new, events=(tuned,),
                   new_settings=new, push=("llama-a", "llama-b"), replicas=3)
    result = _tick_with(monkeypatch, kube, body, engines, planned)

    data = kube.object("ConfigMap", NAMESPACE, builders.tuning_configmap_name(NAME))["data"]
    assert json.loads(data[tuning_configmap.TUNING_FILE_KEY])["maxNumSeqs"] == 48
    token = builders.admin_token(kube.object("Secret", NAMESPACE, builders.admin_secret_name(NAME)))
    ((targets, settings, sent_token),) = engines.pushed
    assert set(targets) == {"llama-a", "llama-b"} and "10.0.0.1" in targets["llama-a"]
    assert settings == new and sent_token == token
    service = kube.object(kube_contract.KIND, NAMESPACE, NAME)
    assert service["spec"]["replicas"] == 3  # through the scale subresource
    assert service["status"]["tuning"] == {"maxNumSeqs": 48}
    assert result.events == (tuned,)
    # A reconcile of what the loop wrote renders it into the pod template and reports it.
    outcome = reconcile.reconcile(kube, kube.get_inference_service(NAMESPACE, NAME), SETTINGS)
    assert outcome.status["engine"]["maxNumSeqs"] == 48


def test_an_engine_that_refuses_the_push_becomes_a_warning_event(monkeypatch, served):
    kube, body = served
    engines = RecordingEngines(refuse={"llama-b": "HTTP 503"})
    live = EngineSettings.of(spec.parse_spec(TUNED).engine)
    planned = Plan(memory=Memory(), status={}, live=live, push=("llama-b",))
    writes = len(kube.writes)
    result = _tick_with(monkeypatch, kube, body, engines, planned)
    (event,) = result.events
    assert (event.type, event.reason) == ("Warning", "TuningNotApplied")
    assert "llama-b" in event.message and "HTTP 503" in event.message and "32" in event.message
    # Nothing new to persist and no scaling: the ConfigMap and replicas are left alone.
    assert [w for w in kube.writes[writes:] if w[0] != "status"] == []


def test_a_failed_interval_is_logged_and_the_loop_goes_on(monkeypatch, served):
    kube, body = served
    calls = []

    def failing_tick(current, now=None):
        calls.append(current)
        if len(calls) == 1:
            raise KubeError(500, "GET", "/api", "the API server hiccuped")
        return Plan(memory=Memory(), status={}, live=EngineSettings(max_num_seqs=8),
                    events=(Event("Normal", "Scaled", "2 → 3"),))

    class TwoIntervals:
        def __init__(self):
            self.waits = 0

        def __bool__(self):
            return self.waits >= 2

        def wait(self, timeout=None):
            self.waits += 1

    loop = ControlLoop(kube, RecordingEngines(), SETTINGS)
    monkeypatch.setattr(loop, "tick", failing_tick)
    posted = []
    loop.run(lambda: copy.deepcopy(body), TwoIntervals(), lambda b, e: posted.append((b["metadata"]["name"], e)))
    assert len(calls) == 2 and posted == [(NAME, Event("Normal", "Scaled", "2 → 3"))]
