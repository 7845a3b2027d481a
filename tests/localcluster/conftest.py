"""The local cluster's own tests share the e2e suites' cluster (one start per session).

``local_cluster`` (a kvpilot.localcluster.testing.ClusterHandle) gives:
``kubeconfig`` (path), ``env`` (for subprocesses: KUBECONFIG, kubectl and helm on
PATH), ``kubectl(*args)`` / ``helm(*args)`` (raise with output on failure unless
``check=False``), ``api_client()`` (a kubernetes.client.ApiClient), ``server``,
``bin_dir``, ``state_dir``, ``nodes`` and ``gpu_resource``. Pods run as local
processes on 127.0.1.N (see kvpilot/localcluster/podenv.py for what they get).
The binaries must be built first (`kvpilot local-cluster build`, which
scripts/setup.sh runs); without them the fixture fails and says so.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def local_cluster():
    from kvpilot.localcluster import testing

    handle = testing.acquire()
    yield handle
    leftovers = testing.release()
    assert not leftovers, f"processes left behind after teardown: {leftovers}"
