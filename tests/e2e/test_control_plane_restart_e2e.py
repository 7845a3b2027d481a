"""Control-plane faults on the local cluster: the kube-apiserver, etcd, and both, stopped and started
again (same ports, same data: `LocalCluster.restart_component`'s way) in the middle of a rollout.

The chart runs the operator as users install it (one replica holding its leader-election Lease); one
InferenceService on the tiny model, on the CPU (no GPU, so its rollouts surge: the old pod serves
until the new one is Ready), has tuning on and a tuned state in its ConfigMap (maxNumSeqs 24, the
spec says 16). Each round edits spec.engine.extraArgs, which rolls the Deployment without touching
the tuned settings, waits until the new pod is starting, and takes the component(s) down for a few
seconds, during which the old pod must keep serving requests. Afterwards the service must converge to its
spec: Ready at its generation, one Deployment / Service / tuning ConfigMap / admin Secret, the
Deployment on the new template with its one pod Ready, and the tuning state unchanged: the ConfigMap's
data, the admin token, status.engine and the new engine's own maxNumSeqs (read from its tuning file).

CI runs 3 rounds (API server, etcd, both), each down 3 s; KVPILOT_CP_RESTARTS=N runs N rounds in that
cycle, KVPILOT_CP_DOWN_SECONDS=S keeps the components down S seconds.
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvpilot.localcluster import components
from kvpilot.localcluster.cluster import Health
from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders
from kvpilot.kube_contract import pod_ready, pod_url
from kvpilot.operator.spec import EngineSettings, parse_spec

from .service_reads import engine_arg, engine_max_num_seqs, engine_pods, service_status

pytestmark = pytest.mark.e2e

NS = "kvpilot-cp-restart"
RELEASE = "cpr"
NAME = "rolling"
OPERATOR_HEALTH_PORT = 18531  # clear of the other e2e modules' operator ports
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
FAULTS = (("kube-apiserver",), ("etcd",), ("etcd", "kube-apiserver"))
ROUNDS = int(os.environ.get("KVPILOT_CP_RESTARTS", str(len(FAULTS))))
# Seconds from the stop signal until the start begins (the stop is part of it); longer outages test
# the operator past its retries and its Lease (KVPILOT_CP_DOWN_SECONDS=70).
DOWN_S = float(os.environ.get("KVPILOT_CP_DOWN_SECONDS", "3"))
SPEC_MAX_NUM_SEQS = 16
TUNED_MAX_NUM_SEQS = 24  # the tuner's stored value: the upper bound, so with no SLO pressure it holds
CONVERGE_S = 240  # an engine start loads torch and the model on 2 shared cores

def _kv_cache_args(mib: int) -> list[str]:
    return ["--device", "cpu", "--kv-cache-memory", f"{mib}MiB"]


@pytest.fixture(scope="module")
def tuned(cluster, kube, chart_operator, converged, tiny_model_dir):
    """The operator installed, the service serving, and a tuned state stored as the tuner stores it."""
    chart_operator(NS, RELEASE, OPERATOR_HEALTH_PORT)
    manifest = {
        "apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"uri": f"file://{Path(tiny_model_dir).resolve()}"},
            "resources": {"gpus": 0},
            "engine": {"maxNumSeqs": SPEC_MAX_NUM_SEQS, "maxModelLen": 512, "extraArgs": _kv_cache_args(64)},
            # A loose SLO and maxNumSeqs at its upper bound: the tuner holds what is stored.
            "tuning": {"slo": {"itlP99Seconds": 30.0},
                       "maxNumSeqs": {"min": SPEC_MAX_NUM_SEQS, "max": TUNED_MAX_NUM_SEQS},
                       "gpuMemoryUtilization": {"min": 0.9, "max": 0.9}},
        },
    }  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    converged(NS, NAME, "--kv-cache-memory", "64MiB", CONVERGE_S)
    spec = parse_spec(manifest["spec"])
    tuned_settings = EngineSettings.of(spec.engine).model_copy(update={"max_num_seqs": TUNED_MAX_NUM_SEQS})
    kube.apply(builders.build_tuning_configmap(NAME, NS, spec, tuned_settings),
               owner=kube.get_inference_service(NS, NAME))  # fmt: skip
    wait_until(lambda: service_status(kube, NS, NAME).get("engine", {}).get("maxNumSeqs") == TUNED_MAX_NUM_SEQS, 60,
               "status.engine to show the tuned maxNumSeqs")  # fmt: skip


def _kv_cache_mib(pod_or_template: dict) -> int:
    return int(engine_arg(pod_or_template, "--kv-cache-memory").removesuffix("MiB"))


def _operator_restarts(kube) -> int:
    pods = kube.list("v1", "Pod", NS, label_selector=OPERATOR_SELECTOR)
    return sum(s["restartCount"] for p in pods for s in (p.get("status") or {}).get("containerStatuses") or [])


def _complete(client: httpx.Client, base: str, model: str) -> int:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    return client.post(f"{base}/v1/completions", json=body).status_code


@contextmanager
def _stopped(cluster, names: tuple[str, ...]):
    """The components stopped (last started first) while the block runs, then started again in start
    order; whatever happens in the block, the cluster is whole afterwards."""
    in_order = sorted(names, key=components.ORDER.index)
    try:
        for name in reversed(in_order):
            cluster.cluster.stop_component(name)
        yield
    finally:
        for name in in_order:
            if name not in {s.name for s in cluster.cluster.status() if s.health is Health.RUNNING}:
                cluster.cluster.start_component(name)


def test_a_rollout_converges_through_api_server_and_etcd_restarts(
    cluster, kube, children_once, converged, tuned, capsys
):
    rng = random.Random(0)
    before = children_once(NS, NAME)
    token, tuning = before["Secret"]["data"], before["ConfigMap"]["data"]
    uids = {kind: child["metadata"]["uid"] for kind, child in before.items()}
    rows = []
    for round_ in range(ROUNDS):
        fault = FAULTS[round_ % len(FAULTS)]
        mib = 65 + round_
        restarts_before = _operator_restarts(kube)
        old_pod = engine_pods(kube, NS, NAME)[0]
        old_url = pod_url(old_pod['status']['podIP'])
        with httpx.Client(timeout=60) as client:
            model = client.get(f"{old_url}/v1/models").json()["data"][0]["id"]
            cluster.kubectl("patch", "kvis", NAME, "-n", NS, "--type", "merge",
                            "-p", json.dumps({"spec": {"engine": {"extraArgs": _kv_cache_args(mib)}}}))
            # The rollout has begun: the operator rendered the new template and its pod is starting.
            wait_until(lambda: any(_kv_cache_mib(p) == mib for p in engine_pods(kube, NS, NAME)), 60, "the new pod")
            time.sleep(rng.uniform(0.0, 1.0))
            assert not any(pod_ready(p) for p in engine_pods(kube, NS, NAME) if _kv_cache_mib(p) == mib), \
                "rollout already done"
            stopped_at = time.monotonic()
            with _stopped(cluster, fault):
                served = [_complete(client, old_url, model) for _ in range(3)]  # the data plane goes on
                time.sleep(max(0.0, DOWN_S - (time.monotonic() - stopped_at)))
            back_at = time.monotonic()
        children = converged(NS, NAME, "--kv-cache-memory", f"{mib}MiB", CONVERGE_S)
        converged_at = time.monotonic()

        assert served == [200, 200, 200], f"the old pod stopped serving while {' and '.join(fault)} was down"
        assert {kind: child["metadata"]["uid"] for kind, child in children.items()} == uids  # none recreated
        assert children["Secret"]["data"] == token  # the engines' admin token is never regenerated
        assert children["ConfigMap"]["data"] == tuning  # the tuned state, not the spec's 16
        assert service_status(kube, NS, NAME)["engine"]["maxNumSeqs"] == TUNED_MAX_NUM_SEQS
        assert engine_max_num_seqs(engine_pods(kube, NS, NAME)[0]) == TUNED_MAX_NUM_SEQS  # read at start from the file
        rows.append((" + ".join(fault), back_at - stopped_at, converged_at - back_at,
                     _operator_restarts(kube) - restarts_before))

    with capsys.disabled():
        print(f"\ncontrol-plane restarts mid-rollout ({ROUNDS}):")
        for fault, down, after, restarts in rows:
            print(f"  {fault}: down {down:.1f} s, converged {after:.1f} s later, operator restarts {restarts}")
