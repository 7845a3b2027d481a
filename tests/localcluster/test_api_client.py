"""The kubelet stand-in's API client turns an API server that does not answer into an ApiError, which
the pod workers treat as a failed call to retry (their pods keep running through a restart)."""

from __future__ import annotations

import pytest

from kvpilot.localcluster import processes
from kvpilot.localcluster.api import ApiError, KubeApi
from kvpilot.localcluster.pki import ensure_pki


def test_an_api_server_that_does_not_answer_is_an_api_error_without_a_status(tmp_path):
    ensure_pki(tmp_path)
    api = KubeApi(f"https://127.0.0.1:{processes.free_port()}", tmp_path)  # nothing listens there
    with pytest.raises(ApiError, match=r"PATCH /api/v1/namespaces/ns/pods/p/status: no answer: ") as caught:
        api.merge_patch("/api/v1/namespaces/ns/pods/p/status", {"status": {}}, timeout=2)
    assert caught.value.status is None
