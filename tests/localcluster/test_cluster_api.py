"""The API side of the local cluster: GPU nodes, CRD validation, scheduling, garbage collection."""

from __future__ import annotations

import json
import uuid

import pytest

from kvpilot.localcluster.testing import wait_until

pytestmark = pytest.mark.e2e

CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.test.kvpilot.io}
spec:
  group: test.kvpilot.io
  names: {kind: Widget, plural: widgets, singular: widget}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            x-kubernetes-validations:
            - rule: "self.minReplicas <= self.maxReplicas"
              message: "minReplicas must not exceed maxReplicas"
            properties:
              minReplicas: {type: integer}
              maxReplicas: {type: integer}
"""


def _json(result) -> dict:
    return json.loads(result.stdout)


def test_up_was_quick_and_versions_are_real(local_cluster):
    print(f"local cluster up in {local_cluster.up_seconds:.1f}s")
    version = _json(local_cluster.kubectl("version", "-o", "json"))
    assert version["clientVersion"]["gitVersion"].startswith("v1.37.")
    assert version["serverVersion"]["gitVersion"].startswith("v1.37.")
    assert local_cluster.helm("version", "--short").stdout.startswith("v3.")


def test_nodes_show_gpu_capacity_and_stay_ready(local_cluster):
    nodes = _json(local_cluster.kubectl("get", "nodes", "-o", "json"))["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(local_cluster.nodes)
    for node in nodes:
        assert node["status"]["capacity"][local_cluster.gpu_resource] == "4"
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True"
        assert not node["spec"].get("taints")
    leases = _json(local_cluster.kubectl("get", "leases", "-n", "kube-node-lease", "-o", "json"))["items"]
    assert {lease["metadata"]["name"] for lease in leases} >= set(local_cluster.nodes)
    table = local_cluster.kubectl("get", "nodes").stdout
    assert "Ready" in table and "kvpilot-gpu-0" in table


def test_crd_cel_rule_rejects_invalid_object_with_its_message(local_cluster):
    local_cluster.kubectl("apply", "-f", "-", input=CRD)
    local_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/widgets.test.kvpilot.io", "--timeout=30s"
    )
    try:
        good = (
            "apiVersion: test.kvpilot.io/v1\nkind: Widget\nmetadata: {name: ok}\n"
            "spec: {minReplicas: 1, maxReplicas: 2}\n"
        )
        local_cluster.kubectl("apply", "-f", "-", input=good)
        bad = good.replace("name: ok", "name: bad").replace("minReplicas: 1", "minReplicas: 3")
        result = local_cluster.kubectl("apply", "-f", "-", input=bad, check=False)
        assert result.returncode != 0
        assert "minReplicas must not exceed maxReplicas" in result.stderr
    finally:
        local_cluster.kubectl("delete", "crd", "widgets.test.kvpilot.io", "--wait=false")


def test_pod_asking_for_too_many_gpus_stays_pending_with_the_schedulers_reason(local_cluster):
    name = f"too-greedy-{uuid.uuid4().hex[:6]}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "ignored",
                    "command": ["sleep", "60"],
                    "resources": {"limits": {local_cluster.gpu_resource: "5"}},
                }
            ]
        },
    }
    local_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:

        def unschedulable():
            status = _json(local_cluster.kubectl("get", "pod", name, "-o", "json"))["status"]
            return next(
                (
                    c
                    for c in status.get("conditions", [])
                    if c["type"] == "PodScheduled" and c["status"] == "False"
                ),
                None,
            )

        condition = wait_until(unschedulable, 30, "the scheduler to mark the pod unschedulable")
        assert condition["reason"] == "Unschedulable"
        assert f"Insufficient {local_cluster.gpu_resource}" in condition["message"]
        assert _json(local_cluster.kubectl("get", "pod", name, "-o", "json"))["status"]["phase"] == "Pending"
    finally:
        local_cluster.kubectl("delete", "pod", name, "--wait=false")


def test_owner_reference_cascade_deletes_children(local_cluster):
    parent = f"parent-{uuid.uuid4().hex[:6]}"
    local_cluster.kubectl("create", "configmap", parent, "--from-literal=a=b")
    uid = _json(local_cluster.kubectl("get", "configmap", parent, "-o", "json"))["metadata"]["uid"]
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{parent}-child",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": parent, "uid": uid}],
        },
        "data": {"x": "y"},
    }
    local_cluster.kubectl("apply", "-f", "-", input=json.dumps(child))
    local_cluster.kubectl("delete", "configmap", parent)

    def child_gone():
        result = local_cluster.kubectl("get", "configmap", f"{parent}-child", check=False)
        return result.returncode != 0 and "NotFound" in result.stderr

    wait_until(child_gone, 60, "the garbage collector to delete the child")
