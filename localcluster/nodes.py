"""The fake GPU nodes: their Node objects, and the heartbeats that keep them Ready.

The node lifecycle controller marks a node NotReady (and taints it) when
neither its Lease in kube-node-lease nor its Ready condition's heartbeat has
moved within the grace period (50s), so both are renewed every few seconds.
"""

from __future__ import annotations

import datetime
import os

from kvpilot.localcluster.api import KubeApi

NODE_NAMES = ("kvpilot-gpu-0", "kvpilot-gpu-1")
GPU_RESOURCE = "nvidia.com/gpu"
CAPACITY = {
    "cpu": "16",
    "memory": "64Gi",
    "pods": "110",
    "ephemeral-storage": "100Gi",
    GPU_RESOURCE: "4",
}
HEARTBEAT_S = 10.0
LEASE_DURATION_S = 40


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """Leases carry MicroTime."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_conditions(since: str) -> list[dict]:
    """Healthy conditions; ``since`` (when the kubelet started) is their last transition."""
    now = now_rfc3339()
    healthy = [
        ("MemoryPressure", "KubeletHasSufficientMemory"),
        ("DiskPressure", "KubeletHasNoDiskPressure"),
        ("PIDPressure", "KubeletHasSufficientPID"),
    ]
    conditions = [
        {"type": t, "status": "False", "reason": r, "message": "kvpilot local kubelet",
         "lastHeartbeatTime": now, "lastTransitionTime": since}
        for t, r in healthy
    ]  # fmt: skip
    conditions.append(
        {"type": "Ready", "status": "True", "reason": "KubeletReady",
         "message": "kvpilot local kubelet is posting ready status",
         "lastHeartbeatTime": now, "lastTransitionTime": since}
    )  # fmt: skip
    return conditions


def node_status(kubelet_port: int, since: str) -> dict:
    return {
        "capacity": dict(CAPACITY),
        "allocatable": dict(CAPACITY),
        "conditions": node_conditions(since),
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": "localhost"},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "kubeletVersion": "v1.37.2-kvpilot-local",
            "kubeProxyVersion": "",
            "containerRuntimeVersion": "kvpilot-local://processes",
            "kernelVersion": os.uname().release,
            "osImage": "host processes (kvpilot local-cluster)",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
    }


def node_manifest(name: str, kubelet_port: int, since: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.present": "true",
                "kvpilot.io/local-cluster": "true",
            },
        },
        "spec": {},
        "status": node_status(kubelet_port, since),
    }


def register_nodes(api: KubeApi, kubelet_port: int, since: str) -> None:
    """Creates the nodes (or takes over existing ones) and their status."""
    for name in NODE_NAMES:
        existing = api.get(f"/api/v1/nodes/{name}", ok_missing=True)
        if existing is None:
            api.request("POST", "/api/v1/nodes", node_manifest(name, kubelet_port, since))
        # Create may drop status on some versions; setting it explicitly is idempotent.
        api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": node_status(kubelet_port, since)})


def heartbeat(api: KubeApi, since: str) -> None:
    """Renews each node's Lease and its conditions' heartbeat times."""
    for name in NODE_NAMES:
        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": now_micro()}
        if api.get(lease_path, ok_missing=True) is None:
            api.request(
                "POST",
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": name, "namespace": "kube-node-lease"}, "spec": spec},
            )  # fmt: skip
        else:
            api.merge_patch(lease_path, {"spec": spec})
        api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": {"conditions": node_conditions(since)}})
