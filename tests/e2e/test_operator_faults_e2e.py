"""Operator faults on the local control plane: the operator SIGKILLed at random points of a reconcile,
children deleted and edited by hand. Every time the service converges to its spec, with one child
of each kind and its state (the engines' admin token, the tuning ConfigMap) kept.

One operator replica without leader election, so a killed pod is replaced at once; its engine is a
real `kvpilot serve` on the tiny model. CI kills it 3 times; KVPILOT_FAULT_KILLS=20 for the long form.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
import yaml

from kvpilot.localcluster.testing import wait_until
from kvpilot.operator import builders, crd
from kvpilot.kube_contract import pod_ready

pytestmark = pytest.mark.e2e

NS = "kvpilot-faults"
RELEASE = "flt"
NAME = "steady"
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
KILLS = int(os.environ.get("KVPILOT_FAULT_KILLS", "3"))
CONVERGE_S = 240  # an engine restart loads torch and the model on 2 shared cores

@pytest.fixture(scope="module")
def steady(cluster, kube, converged, tiny_model_dir):
    cluster.kubectl("create", "namespace", NS)
    cluster.helm(
        "install", RELEASE, str(crd.REPO_ROOT / "charts" / "kvpilot"), "--namespace", NS,
        "--set", "rbac.scope=namespaced", "--set", "leaderElection.enabled=false",
        "--set", "engine.bindPodIP=true", "--set", "bindPodIP=true",
        "--set", "engine.shutdownGraceSeconds=2", "--set", "engine.drainSeconds=1",
        "--set", "engine.startupSeconds=600", "--set", "resyncSeconds=5",
        "--set", "healthPort=18511", "--set", "metricsPort=18512",
    )
    manifest = yaml.safe_load((crd.REPO_ROOT / "examples" / "local-cpu.yaml").read_text())
    manifest["metadata"] = {"name": NAME, "namespace": NS}
    manifest["spec"]["model"]["uri"] = f"file://{Path(tiny_model_dir).resolve()}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    converged(NS, NAME, "--max-num-seqs", "16", CONVERGE_S)
    yield
    cluster.kubectl("delete", "kvis", NAME, "-n", NS, "--wait=true", "--timeout=60s", check=False)
    cluster.helm("uninstall", RELEASE, "--namespace", NS, "--wait", check=False)
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _max_num_seqs(pod_or_template: dict) -> str:
    args = pod_or_template["spec"]["containers"][0]["args"]
    return args[args.index("--max-num-seqs") + 1]


def _operator_pod(kube) -> str:
    def running():
        pods = [p for p in kube.list("v1", "Pod", NS, label_selector=OPERATOR_SELECTOR)
                if not p["metadata"].get("deletionTimestamp") and pod_ready(p)]
        return pods[0]["metadata"]["name"] if len(pods) == 1 else None

    return wait_until(running, 120, "one ready operator pod", interval=0.5)


def test_the_operator_killed_at_random_points_of_a_reconcile_converges_every_time(
    cluster, kube, children_once, converged, steady, capsys
):
    rng = random.Random(0)
    before = children_once(NS, NAME)
    token = before["Secret"]["data"]
    tuning = before["ConfigMap"]["data"]
    times = []
    for kill in range(KILLS):
        value = str(17 + kill)
        victim = _operator_pod(kube)
        cluster.kubectl("patch", "kvis", NAME, "-n", NS, "--type", "merge",
                        "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": int(value)}}}))
        time.sleep(rng.uniform(0.0, 2.0))  # somewhere in the reconcile the edit started
        cluster.kubectl("delete", "pod", victim, "-n", NS, "--grace-period=0", "--force")
        start = time.monotonic()
        children = converged(NS, NAME, "--max-num-seqs", value, CONVERGE_S)
        times.append(time.monotonic() - start)
        assert _operator_pod(kube) != victim
        assert children["Secret"]["data"] == token  # the engines' admin token is never regenerated
        assert json.loads(children["ConfigMap"]["data"]["tuning.json"]) == {"maxNumSeqs": int(value)}
        assert set(children["ConfigMap"]["data"]) == set(tuning)
    with capsys.disabled():
        print(f"\nfaults: {KILLS} SIGKILLs of the operator mid-reconcile, converged after "
              f"{', '.join(f'{t:.0f}' for t in times)} s")


def test_children_deleted_or_edited_by_hand_are_restored(cluster, kube, children_once, converged, steady):
    children = children_once(NS, NAME)
    value = _max_num_seqs(children["Deployment"]["spec"]["template"])
    cluster.kubectl("delete", "service", NAME, "-n", NS)
    cluster.kubectl("scale", "deployment", NAME, "-n", NS, "--replicas=3")  # drift from spec.replicas
    cluster.kubectl("label", "configmap", builders.tuning_configmap_name(NAME), "-n", NS,
                    f"{builders.INSTANCE_LABEL}=someone-else", "--overwrite")  # drift in a label it owns
    restored = converged(NS, NAME, "--max-num-seqs", value, CONVERGE_S)
    assert restored["Service"]["metadata"]["uid"] != children["Service"]["metadata"]["uid"]
    assert restored["Deployment"]["spec"]["replicas"] == 1
    assert restored["ConfigMap"]["metadata"]["labels"][builders.INSTANCE_LABEL] == NAME
