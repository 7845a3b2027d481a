"""What every end-to-end module shares: the session's local cluster, a Kube client on it, and the
check that the operator made each child of a service at most once."""

from __future__ import annotations

import pytest

from kvpilot.operator import builders
from kvpilot.operator.kube import Kube


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster


@pytest.fixture(scope="module")
def kube(cluster) -> Kube:
    return Kube(cluster.api_client())


@pytest.fixture(scope="module")
def children_once(kube):
    """``check(namespace, name)``: the service's Deployment, Service, tuning ConfigMap and admin Secret
    (among the objects labeled for it, not being deleted) each there at most once; returns them by kind."""
    def check(namespace: str, name: str) -> dict[str, dict]:
        children = (("apps/v1", "Deployment", name), ("v1", "Service", name),
                    ("v1", "ConfigMap", builders.tuning_configmap_name(name)),
                    ("v1", "Secret", builders.admin_secret_name(name)))
        found = {}
        for api_version, kind, child in children:
            objects = [o for o in kube.list(api_version, kind, namespace,
                                            label_selector=f"{builders.INSTANCE_LABEL}={name}")
                       if not o["metadata"].get("deletionTimestamp")]
            assert [o["metadata"]["name"] for o in objects] in ([], [child]), f"duplicate {kind}: {objects}"
            if objects:
                found[kind] = objects[0]
        return found

    return check
