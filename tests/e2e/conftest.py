"""What every end-to-end module shares: the session's local cluster and a Kube client on it."""

from __future__ import annotations

import pytest

from kvpilot.operator.kube import Kube


@pytest.fixture(scope="module")
def cluster(local_cluster):
    return local_cluster


@pytest.fixture(scope="module")
def kube(cluster) -> Kube:
    return Kube(cluster.api_client())
