"""The picking policy: prefix affinity that every replica computes alike, bounded by load."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from kvpilot import gateway_contract as contract
from kvpilot.gateway.picker import Candidate, PickPolicy, load_bound, pick, rendezvous_rank

PODS = [f"ns/pod-{i}" for i in range(4)]


def _hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _idle(keys=PODS) -> list[Candidate]:
    return [Candidate(k, 0.0) for k in keys]


def test_no_candidates_no_pick():
    assert pick([], _hash("p"), b"r") is None


def test_a_prefix_always_goes_to_the_same_idle_pod_whatever_the_request():
    chosen = {pick(_idle(), _hash("system prompt A"), _hash(f"request {i}")).key for i in range(50)}
    assert len(chosen) == 1
    assert pick(_idle(), _hash("system prompt A"), b"x").reason == contract.REASON_PREFIX_AFFINITY


def test_the_choice_ignores_the_order_pods_are_listed_in():
    affinity = _hash("shared few-shot block")
    assert pick(_idle(), affinity, b"r").key == pick(list(reversed(_idle())), affinity, b"r").key


def test_different_prefixes_spread_over_the_pods():
    owners = Counter(pick(_idle(), _hash(f"prefix {i}"), b"r").key for i in range(400))
    assert set(owners) == set(PODS)
    assert min(owners.values()) > 400 / len(PODS) / 2  # no pod starved of prefixes


def test_removing_a_pod_moves_only_the_prefixes_it_owned():
    prefixes = [_hash(f"prefix {i}") for i in range(300)]
    before = {p: pick(_idle(), p, b"r").key for p in prefixes}
    after = {p: pick(_idle(PODS[:-1]), p, b"r").key for p in prefixes}
    moved = [p for p in prefixes if before[p] != after[p]]
    assert moved and all(before[p] == PODS[-1] for p in moved)


def test_an_overloaded_owner_spills_down_its_ranking_whatever_the_request():
    affinity = _hash("popular system prompt")
    ranking = rendezvous_rank(affinity, PODS)
    # Each pod of the ranking a little more loaded than the next: least-loaded would pick the last one.
    loads = {key: 11.0 - position for position, key in enumerate(ranking)}  # 11, 10, 9, 8
    loads[ranking[0]] = 30.0  # the owner, far over 1.5 x the mean (bound 21.75; the others have room)
    kv_full: set[str] = set()
    for spill_to in ranking[1:]:
        for i in range(20):
            candidates = [Candidate(k, v, 0.99 if k in kv_full else 0.1) for k, v in loads.items()]
            result = pick(candidates, affinity, _hash(f"request {i}"))
            assert result == type(result)(spill_to, contract.REASON_PREFIX_SPILL), (spill_to, kv_full)
        kv_full.add(spill_to)  # then that pod's KV cache fills up too: the next one in the ranking


def test_the_owner_keeps_its_prefix_while_within_its_share():
    affinity = _hash("popular system prompt")
    owner = rendezvous_rank(affinity, PODS)[0]
    loads = {k: 4.0 for k in PODS}
    loads[owner] = 5.0  # mean 4.25, bound 1.5 * 18 / 4 = 6.75: room for one more
    assert pick([Candidate(k, v) for k, v in loads.items()], affinity, b"r").key == owner


def test_a_stream_of_one_prefix_never_puts_more_than_the_bound_on_a_pod():
    """Every request shares one prefix and none finishes: the owner fills to its bound, then spills."""
    affinity = _hash("everyone's system prompt")
    policy = PickPolicy(load_factor=1.25)
    loads = dict.fromkeys(PODS, 0.0)
    for i in range(200):
        total = sum(loads.values())
        chosen = pick([Candidate(k, v) for k, v in loads.items()], affinity, _hash(str(i)), policy).key
        # Within the bound, or (when no pod is) the least loaded.
        assert loads[chosen] + 1 <= load_bound(total, len(PODS), policy.load_factor) \
            or loads[chosen] == min(loads.values())
        loads[chosen] += 1
    # No pod ends over 1.25 x the mean; the prefix's first pods are full, the last takes the rest.
    assert max(loads.values()) <= 1.25 * 200 / len(PODS) + 1
    assert loads[rendezvous_rank(affinity, PODS)[0]] == max(loads.values())


def test_a_new_prefix_goes_to_its_owner_only_at_or_below_the_mean():
    affinity = _hash("a system prompt nobody sent yet")
    owner = rendezvous_rank(affinity, PODS)[0]
    loads = dict.fromkeys(PODS, 4.0)
    loads[owner] = 5.0  # within 1.5 x the mean (a known prefix stays), above the mean (a new one moves)
    candidates = [Candidate(k, v) for k, v in loads.items()]
    assert pick(candidates, affinity, b"r").key == owner
    moved = pick(candidates, affinity, b"r", new_prefix=True)
    assert moved.key != owner and moved.reason == contract.REASON_LEAST_LOADED
    loads[owner] = 4.0  # at the mean
    assert pick([Candidate(k, v) for k, v in loads.items()], affinity, b"r", new_prefix=True).key == owner


def test_a_prefix_follows_the_pod_it_last_went_to_within_the_bound():
    affinity = _hash("a system prompt placed on a pod that is not its owner")
    ranking = rendezvous_rank(affinity, PODS)
    last = ranking[-1]
    loads = dict.fromkeys(PODS, 0.0)
    result = pick([Candidate(k, v) for k, v in loads.items()], affinity, b"r", last_pod=last)
    assert result.key == last and result.reason == contract.REASON_PREFIX_AFFINITY
    loads[last] = 10.0  # over its share: the prefix's own ranking takes over
    assert pick([Candidate(k, v) for k, v in loads.items()], affinity, b"r", last_pod=last).key == ranking[0]
    gone = [Candidate(k, 0.0) for k in PODS if k != last]  # the pod left: the ranking again
    assert pick(gone, affinity, b"r", last_pod=last).key == ranking[0]


def test_a_nearly_full_kv_cache_counts_as_over_its_share():
    affinity = _hash("prompt")
    owner, second = rendezvous_rank(affinity, PODS)[:2]
    candidates = [Candidate(k, 0.0, 0.99 if k == owner else 0.1) for k in PODS]
    assert pick(candidates, affinity, b"r").key == second


def test_without_a_prefix_the_least_loaded_pod_wins():
    candidates = [Candidate("ns/a", 3.0), Candidate("ns/b", 1.0), Candidate("ns/c", 2.0)]
    result = pick(candidates, None, b"r")
    assert result == type(result)("ns/b", contract.REASON_LEAST_LOADED)


def test_least_loaded_ties_break_by_kv_usage_then_spread_by_request():
    assert pick([Candidate("ns/a", 1.0, 0.9), Candidate("ns/b", 1.0, 0.2)], None, b"r").key == "ns/b"
    chosen = Counter(pick(_idle(), None, _hash(f"request {i}")).key for i in range(200))
    assert set(chosen) == set(PODS)


def test_load_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="load_factor must be at least 1"):
        PickPolicy(load_factor=0.9)
