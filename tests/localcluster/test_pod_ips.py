"""Pod IPs: loopback addresses from the cluster's block, never two pods on one."""

from __future__ import annotations

from kvpilot.localcluster.kubelet import PodIPs


def test_allocation_is_round_robin_within_the_block_and_skips_addresses_in_use():
    ips = PodIPs(block=7)
    first, second = ips.allocate(), ips.allocate()
    assert (first, second) == ("127.0.7.1", "127.0.7.2")
    ips.release(first)
    assert ips.allocate() == "127.0.7.3"  # a released address is not reused at once
    for _ in range(251):
        ips.allocate()
    assert ips.allocate() == "127.0.8.1"  # the block spills into the next one


def test_the_last_block_wraps_around():
    ips = PodIPs(block=254)
    for _ in range(254):
        ips.allocate()
    assert ips.allocate() == "127.0.1.1"
