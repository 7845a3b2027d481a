"""Leader election when the API server cannot be reached (its rules against a real one: tests/e2e)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kubernetes import client as k8s_client

from kvpilot.operator.kube import Kube
from kvpilot.operator.leader_election import LeaderElector, LeaseConfig


def _unreachable_kube() -> Kube:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections are refused
    configuration = k8s_client.Configuration(host=f"http://127.0.0.1:{port}")
    configuration.retries = 0
    return Kube(k8s_client.ApiClient(configuration))


def test_a_leader_that_cannot_renew_gives_up_within_the_renew_deadline():
    config = LeaseConfig("ns", "lease", "me", lease_seconds=3.0)  # renew every 1 s, give up after 2 s
    elector = LeaderElector(_unreachable_kube(), config)
    gave_up, stop = threading.Event(), threading.Event()
    started = time.monotonic()
    renewing = threading.Thread(target=elector.keep_renewing, args=(gave_up.set, stop), daemon=True)
    renewing.start()
    try:
        assert gave_up.wait(timeout=10.0)
        # Before a standby may take over (it waits out the whole lease after the last renewal it saw).
        assert config.renew_deadline_seconds <= time.monotonic() - started < config.lease_seconds + 0.5
    finally:
        stop.set()
        renewing.join(timeout=10.0)
    assert not renewing.is_alive()


def test_timings_follow_the_lease():
    config = LeaseConfig("ns", "lease", "me", lease_seconds=15.0)
    assert (config.renew_seconds, config.renew_deadline_seconds, config.retry_seconds) == (5.0, 10.0, 2.0)
    with pytest.raises(ValueError, match="at least 3 s"):
        LeaseConfig("ns", "lease", "me", lease_seconds=1.0)
