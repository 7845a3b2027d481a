"""Leader election's rules against a real API server: one holder, takeover only after expiry or release,
and of two replicas racing for an expired Lease exactly one wins.

Each replica gets its own clock, advanced by hand, so expiry takes no waiting.
"""

from __future__ import annotations

import pytest

from kvpilot.operator.kube import Kube
from kvpilot.operator.leader_election import API_VERSION, LeaderElector, LeaseConfig

pytestmark = pytest.mark.e2e

NS = "kvpilot-lease-e2e"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def kube(local_cluster) -> Kube:
    local_cluster.kubectl("create", "namespace", NS)
    yield Kube(local_cluster.api_client())
    local_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _replica(kube: Kube, lease: str, identity: str) -> tuple[LeaderElector, Clock]:
    clock = Clock()
    return LeaderElector(kube, LeaseConfig(NS, lease, identity, lease_seconds=15.0), clock=clock), clock


def _holder(kube: Kube, lease: str) -> str:
    return kube.get(API_VERSION, "Lease", NS, lease)["spec"]["holderIdentity"]


def test_one_holder_and_a_takeover_only_after_the_lease_expires(kube):
    a, _ = _replica(kube, "expiry", "a")
    b, b_clock = _replica(kube, "expiry", "b")
    assert a.try_acquire_or_renew() and _holder(kube, "expiry") == "a"
    assert not b.try_acquire_or_renew()  # a's lease is live
    b_clock.now += 14.0
    assert a.try_acquire_or_renew()  # renewed: b starts counting again
    assert not b.try_acquire_or_renew()
    b_clock.now += 14.0
    assert not b.try_acquire_or_renew()  # 14 s since the renewal b saw: not yet expired
    b_clock.now += 1.0
    assert b.try_acquire_or_renew() and _holder(kube, "expiry") == "b"  # a stopped renewing 15 s ago
    lease = kube.get(API_VERSION, "Lease", NS, "expiry")["spec"]
    assert lease["leaseTransitions"] == 1 and lease["leaseDurationSeconds"] == 15
    assert not a.try_acquire_or_renew()  # the old holder does not get it back


def test_a_released_lease_is_taken_at_once(kube):
    a, _ = _replica(kube, "release", "a")
    b, _ = _replica(kube, "release", "b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    a.release()
    assert b.try_acquire_or_renew() and _holder(kube, "release") == "b"
    a.release()  # no longer a's: nothing happens
    assert _holder(kube, "release") == "b"


class StaleReads(Kube):
    """Returns one earlier read of the Lease, as if this replica read it just before the other wrote."""

    def __init__(self, kube: Kube, stale: dict) -> None:
        super().__init__(kube._api)
        self.stale = stale

    def get(self, api_version, kind, namespace, name):
        return self.stale if kind == "Lease" else super().get(api_version, kind, namespace, name)


def test_of_two_replicas_racing_for_an_expired_lease_exactly_one_wins(kube):
    a, _ = _replica(kube, "race", "a")
    assert a.try_acquire_or_renew()
    b, b_clock = _replica(kube, "race", "b")
    c, c_clock = _replica(kube, "race", "c")
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()
    b_clock.now += 16.0
    c_clock.now += 16.0
    seen_by_both = kube.get(API_VERSION, "Lease", NS, "race")
    assert b.try_acquire_or_renew()
    c.kube = StaleReads(kube, seen_by_both)
    assert not c.try_acquire_or_renew()  # its write carries the resourceVersion b's write replaced
    assert _holder(kube, "race") == "b"
