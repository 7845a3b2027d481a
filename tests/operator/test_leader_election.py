"""Leader election when the API server cannot be reached (its rules against a real one: tests/e2e)."""

from __future__ import annotations

import socket
import threading

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


class ManualClock:
    """The elector's clock, set by the test; every read is counted, so the test knows when the watchdog
    has looked at the time it set (it reads the clock once per check)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            self.reads += 1
            self._changed.notify_all()
            return self.now

    def set_and_wait_for_reads(self, now: float, reads: int) -> None:
        """Sets the time, then waits until it has been read ``reads`` more times."""
        with self._changed:
            self.now = now
            target = self.reads + reads
            assert self._changed.wait_for(lambda: self.reads >= target, timeout=30.0), "the clock is not read"


def test_a_leader_that_cannot_renew_gives_up_within_the_renew_deadline():
    config = LeaseConfig("ns", "lease", "me", lease_seconds=3.0)  # renew every 1 s, give up after 2 s
    # Before a standby may take over: it waits out the whole lease after the last renewal it saw.
    assert config.renew_deadline_seconds < config.lease_seconds
    clock = ManualClock()
    elector = LeaderElector(_unreachable_kube(), config, clock=clock)
    gave_up, stop = threading.Event(), threading.Event()
    renewing = threading.Thread(target=elector.keep_renewing, args=(gave_up.set, stop), daemon=True)
    renewing.start()
    try:
        clock.set_and_wait_for_reads(0.0, reads=1)  # the last renewal is "now", 0
        # Two reads: the first check at this time is over once the second one reads the clock.
        clock.set_and_wait_for_reads(config.renew_deadline_seconds - 0.1, reads=2)
        assert not gave_up.is_set(), "gave up before the renew deadline"
        clock.set_and_wait_for_reads(config.renew_deadline_seconds, reads=0)
        assert gave_up.wait(timeout=30.0), "still leading past the renew deadline without a renewal"
    finally:
        stop.set()
        renewing.join(timeout=10.0)
    assert not renewing.is_alive()


def test_timings_follow_the_lease():
    config = LeaseConfig("ns", "lease", "me", lease_seconds=15.0)
    assert (config.renew_seconds, config.renew_deadline_seconds, config.retry_seconds) == (5.0, 10.0, 2.0)
    with pytest.raises(ValueError, match="at least 3 s"):
        LeaseConfig("ns", "lease", "me", lease_seconds=1.0)
