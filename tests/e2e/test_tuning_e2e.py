"""Live tuning and autoscaling end to end, on the local control plane.

The chart runs the operator (namespaced RBAC, its own namespace and ports); one
InferenceService with tuning and autoscaling enabled serves a generated tiny model from
real `kvpilot serve` processes. Under load from client threads: the tuner raises
maxNumSeqs live (same pod, no restart; the engine, the ConfigMap and the status agree; an
Event says why), the autoscaler adds a replica, a pod whose /metrics stops answering is
reported while tuning goes on, and the extra replica goes away once the load drops,
without a failed request. The tests run in file order and share the service.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from kvpilot.kube_contract import pod_ready
from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders, crd

from .service_reads import engine_max_num_seqs, engine_pods, service_events, service_status

pytestmark = pytest.mark.e2e

NS = "kvpilot-tuning-e2e"
RELEASE = "kvt"
NAME = "tuned"
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
OPERATOR_HEALTH_PORT = 18551  # pods share the host's network: clear of the other e2e modules' ports
ENGINE_READY_S = 240
SCALE_DOWN_WINDOW_S = 20


def _wait(cluster, kube, predicate, timeout: float, what: str):
    try:
        return wait_until(predicate, timeout, what, interval=0.5)
    except AssertionError as exc:
        logs = [cluster.pod_log(NS, p["metadata"]["name"], "operator")[-5000:]
                for p in kube.list("v1", "Pod", NS, label_selector=OPERATOR_SELECTOR)]
        table = cluster.kubectl("get", "kvis,pods", "-n", NS, "-o", "wide", check=False).stdout
        decisions = {k: (service_status(kube, NS, NAME).get(k) or {}).get("reason") for k in ("tuning", "autoscaling")}
        raise AssertionError(f"{exc}\n{table}\nlast decisions: {decisions}\n--- operator log tail:\n"
                             + "\n".join(logs)) from None


@pytest.fixture(scope="module")
def operator(cluster, kube):
    cluster.kubectl("create", "namespace", NS)
    cluster.helm(
        "install", RELEASE, str(crd.REPO_ROOT / "charts" / "kvpilot"), "--namespace", NS,
        "--set", "rbac.scope=namespaced",
        "--set", "engine.bindPodIP=true",
        "--set", "engine.shutdownGraceSeconds=5",
        "--set", "engine.drainSeconds=2",
        "--set", "engine.startupSeconds=600",
        # status.engine must follow the tuning ConfigMap through its change event, not a resync.
        "--set", "resyncSeconds=3600",
        "--set", f"healthPort={OPERATOR_HEALTH_PORT}",
        "--set", f"metricsPort={OPERATOR_HEALTH_PORT + 1}",
        "--set-json", "extraEnv=" + json.dumps(
            [{"name": "KVPILOT_SCALE_DOWN_STABILIZATION_SECONDS", "value": str(SCALE_DOWN_WINDOW_S)}]),
    )

    def running():
        pods = [p for p in kube.list("v1", "Pod", NS, label_selector=OPERATOR_SELECTOR)
                if not p["metadata"].get("deletionTimestamp")]
        return len(pods) == 1 and pod_ready(pods[0])

    _wait(cluster, kube, running, 90, "the operator pod to run")
    yield
    cluster.helm("uninstall", RELEASE, "--namespace", NS, "--wait", check=False)
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


@pytest.fixture(scope="module")
def service(cluster, kube, operator, tiny_model_dir):
    manifest = {
        "apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"uri": f"file://{Path(tiny_model_dir).resolve()}"},
            "resources": {"gpus": 1},
            "engine": {"maxNumSeqs": 2, "maxModelLen": 512,
                       "extraArgs": ["--device", "cpu", "--kv-cache-memory", "64MiB"]},
            # A loose SLO: the tiny model meets it at any batch, so the tuner grows under a queue.
            "tuning": {"intervalSeconds": 5, "slo": {"itlP99Seconds": 30.0}, "maxNumSeqs": {"min": 1, "max": 16}},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 2},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    _wait(cluster, kube, lambda: service_status(kube, NS, NAME).get("readyReplicas") == 1, ENGINE_READY_S,
          "the first engine pod")
    return manifest


@pytest.fixture(scope="module")
def load(engine_load, service):
    body = {"model": NAME, "prompt": "tune me please", "max_tokens": 48, "ignore_eos": True}
    with engine_load(NS, NAME, 24, lambda _: body) as running:
        yield running


def test_max_num_seqs_grows_live_under_load(cluster, kube, load):
    (before,) = [p for p in engine_pods(kube, NS, NAME) if pod_ready(p)]
    _wait(cluster, kube, lambda: (service_status(kube, NS, NAME).get("engine") or {}).get("maxNumSeqs", 2) > 2, 180,
          "the tuner to raise maxNumSeqs")
    tuned = service_status(kube, NS, NAME)["engine"]["maxNumSeqs"]

    after = kube.get("v1", "Pod", NS, before["metadata"]["name"])
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert all(c.get("restartCount", 0) == 0 for c in after["status"]["containerStatuses"])
    _wait(cluster, kube,
          lambda: engine_max_num_seqs(after) == service_status(kube, NS, NAME)["engine"]["maxNumSeqs"], 30,
          "the engine to run the tuned maxNumSeqs")
    configmap = kube.get("v1", "ConfigMap", NS, builders.tuning_configmap_name(NAME))
    assert json.loads(configmap["data"]["tuning.json"])["maxNumSeqs"] >= tuned

    status = service_status(kube, NS, NAME)
    assert "max_num_seqs 2 →" in service_events(cluster, NS, NAME, "Tuned")
    assert status["tuning"]["reason"] and status["tuning"]["history"]
    assert status["metrics"]["outputTokensPerSecond"] > 0 and status["metrics"]["scrapedPods"] >= 1
    row = next(r for r in cluster.kubectl("get", "kvis", "-n", NS).stdout.splitlines() if r.startswith(NAME))
    assert row.split()[3] == str(status["engine"]["maxNumSeqs"])


def test_autoscaler_adds_a_replica_under_load(cluster, kube, load):
    _wait(cluster, kube, lambda: service_status(kube, NS, NAME).get("readyReplicas") == 2, ENGINE_READY_S + 120,
          "a second replica under load")
    assert kube.get_inference_service(NS, NAME)["spec"]["replicas"] == 2
    assert "scaling up 1 → 2" in service_events(cluster, NS, NAME, "Scaled")
    # The new pod started with the tuned value from the ConfigMap, no push needed.
    tuned = service_status(kube, NS, NAME)["engine"]["maxNumSeqs"]
    _wait(cluster, kube, lambda: all(engine_max_num_seqs(p) == service_status(kube, NS, NAME)["engine"]["maxNumSeqs"]
                                     for p in engine_pods(kube, NS, NAME) if pod_ready(p)), 60,
          f"both engines to run maxNumSeqs {tuned}")


def _engine_pid(pod_ip: str) -> int:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and pod_ip.encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no engine process listens on {pod_ip}")


def test_a_pod_that_stops_answering_metrics_is_reported_and_tuning_goes_on(cluster, kube, load):
    pods = sorted((p for p in engine_pods(kube, NS, NAME) if pod_ready(p)), key=lambda p: p["metadata"]["name"])
    assert len(pods) == 2
    frozen = pods[0]
    tuned_at = service_status(kube, NS, NAME)["tuning"]["time"]
    pid = _engine_pid(frozen["status"]["podIP"])
    os.kill(pid, signal.SIGSTOP)
    try:
        def reported():
            metrics = service_status(kube, NS, NAME).get("metrics") or {}
            return frozen["metadata"]["name"] in metrics.get("unscrapedPods", []) or \
                frozen["metadata"]["name"] in service_events(cluster, NS, NAME, "MetricsUnavailable")

        _wait(cluster, kube, reported, 40, "the unresponsive pod in status or Events")
        _wait(cluster, kube, lambda: service_status(kube, NS, NAME)["tuning"]["time"] != tuned_at, 30,
              "tuning to go on")
    finally:
        os.kill(pid, signal.SIGCONT)
    _wait(cluster, kube, lambda: len([p for p in engine_pods(kube, NS, NAME) if pod_ready(p)]) == 2, 120,
          "the pod to be Ready again")


def test_autoscaler_removes_the_replica_after_the_load_drops_without_failing_requests(cluster, kube, load):
    failures_before = len(load.failures)
    # One client with a pause: a trickle far below one replica's capacity however fast the machine
    # (back-to-back requests from one client can keep a tiny-model replica near its measured capacity).
    load.resize(1, pause=0.5)
    _wait(cluster, kube, lambda: kube.get_inference_service(NS, NAME)["spec"]["replicas"] == 1,
          SCALE_DOWN_WINDOW_S + 120, "the autoscaler to scale down")
    _wait(cluster, kube, lambda: len(engine_pods(kube, NS, NAME)) == 1, 120, "the extra pod to go")
    time.sleep(3)
    assert "scaling down 2 → 1" in service_events(cluster, NS, NAME, "Scaled")
    assert load.failures[failures_before:] == []
    assert load.ok > 0


def test_a_ttft_slo_broken_by_queueing_adds_a_replica_not_a_larger_batch(cluster, kube, load):
    assert kube.get_inference_service(NS, NAME)["spec"]["replicas"] == 1
    tuned = service_status(kube, NS, NAME)["engine"]["maxNumSeqs"]
    # Only a TTFT SLO, far below what requests queueing for one replica's batch wait.
    cluster.kubectl("patch", "kvis", NAME, "-n", NS, "--type", "merge", "-p", json.dumps(
        {"spec": {"tuning": {"slo": {"itlP99Seconds": None, "ttftP99Seconds": 0.1}}}}))
    load.resize(24)
    engine_values, reasons = [], []

    def scaled_out_while_the_tuner_held():
        status = service_status(kube, NS, NAME)
        engine_values.append(status["engine"]["maxNumSeqs"])
        reasons.append(status["tuning"]["reason"])
        return kube.get_inference_service(NS, NAME)["spec"]["replicas"] == 2 and \
            any("queueing, which more replicas cure" in r for r in reasons)

    _wait(cluster, kube, scaled_out_while_the_tuner_held, 180, "a replica added for the TTFT, the batch held")
    assert max(engine_values) <= tuned, engine_values  # the old tuner grew the batch for a TTFT-only SLO
    scaled = [m for m in service_events(cluster, NS, NAME, "Scaled").splitlines()
              if "scaling up 1 → 2" in m and "TTFT P99" in m]
    assert scaled and "of it queueing, with ITL within its SLO: one more replica" in scaled[-1], scaled
