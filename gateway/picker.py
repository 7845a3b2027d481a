"""Pure: which engine pod takes a request, by prefix affinity with bounded load.

Requests that share a prompt prefix (one system prompt, one few-shot block)
should land where that prefix already sits in the prefix cache. The prefix's
hash ranks the pods by rendezvous hashing (highest ``hash(prefix, pod)`` first),
so every gateway replica ranks them alike with no shared state, and a pod
coming or going moves only the prefixes it owned.

Affinity alone would pile a popular prefix onto one pod. So the load is bounded
as in "consistent hashing with bounded loads" (Mirrokni, Thorup, Zadimoghaddam):
a pod takes the request only while its load stays within ``load_factor`` times
the mean (counting the new request); otherwise the next pod in the prefix's
ranking does, so an overflowing prefix spills to the same second pod each time
and warms a second cache rather than all of them. Requests with no prefix to
follow go to the least loaded pod, ties broken by the request's own hash so
that gateway replicas do not all pick the same pod.

A prefix this gateway has not routed lately is cached nowhere: its owner saves
it nothing now, and a burst of such requests (a cold start, new system prompts
arriving together) piled onto owners is where the longest waits for a first
token come from. So a new prefix goes to its owner only while the owner is at
most at the mean load, otherwise to the least loaded pod; and a prefix routed
lately follows the pod it last went to (which holds it now), then its ranking.
The gateway remembers those pods (``prefix.RecentPrefixes``): a hint only, so a
gateway that forgot, or another gateway replica, still routes correctly.

Load is in requests: what this gateway has in flight to the pod plus what the
engine last reported beyond that (``engine_load.py``).
A pod whose KV cache is nearly full counts as over its share too: a new
request there would preempt a running one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot import gateway_contract as contract


@dataclass(frozen=True)
class Candidate:
    key: str  # NAMESPACE/POD
    load: float  # requests on it now
    kv_cache_usage: float | None = None  # fraction of its KV blocks in use, as last scraped


@dataclass(frozen=True)
class PickPolicy:
    load_factor: float = 1.5  # a pod may carry this many times the mean load before its prefixes spill
    # (1.25, the paper's, spilled a fifth of the decisions with 2 replicas: docs/gateway.md, Benchmark)
    kv_cache_full: float = 0.95  # a pod this full would preempt for a new request: its prefixes spill too

    def __post_init__(self) -> None:
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be at least 1 (a pod's share of the mean load), got {self.load_factor}")
        if not 0.0 < self.kv_cache_full <= 1.0:
            raise ValueError(f"kv_cache_full must be a fraction in (0, 1], got {self.kv_cache_full}")

    def has_room(self, candidate: Candidate, bound: float) -> bool:
        full = candidate.kv_cache_usage is not None and candidate.kv_cache_usage >= self.kv_cache_full
        return candidate.load + 1 <= bound and not full


@dataclass(frozen=True)
class Pick:
    key: str
    reason: str  # one of gateway_contract.REASON_*


def rendezvous_rank(affinity: bytes, keys: Sequence[str]) -> list[str]:
    """``keys`` ordered by their rendezvous weight for ``affinity``, highest first."""
    def weight(key: str) -> bytes:
        return hashlib.blake2b(affinity + b"\0" + key.encode(), digest_size=8).digest()

    return sorted(keys, key=weight, reverse=True)


def load_bound(total_load: float, pods: int, load_factor: float) -> float:
    """Most load one pod may reach with the new request: load_factor x the mean counting that request, and
    at least 1. (The paper rounds up; at a few requests per pod that lets one pod take them all while
    another idles, and each request's wait costs more than a prefix-cache miss saves.)"""
    return max(1.0, load_factor * (total_load + 1) / pods)


def pick(candidates: Sequence[Candidate], affinity: bytes | None, request_hash: bytes,
         policy: PickPolicy = PickPolicy(), *, last_pod: str | None = None, new_prefix: bool = False) -> Pick | None:
    """The pod for one request, or None when there is none. ``affinity`` is the prompt prefix's hash;
    ``last_pod`` the pod this gateway last sent that prefix to, ``new_prefix`` True when it sent it
    nowhere lately."""
    if not candidates:
        return None
    by_key = {c.key: c for c in candidates}
    if affinity is not None:
        total = sum(c.load for c in candidates)
        # A new prefix: its owner only while at most at the mean; else the usual bound.
        bound = total / len(candidates) + 1 if new_prefix else load_bound(total, len(candidates), policy.load_factor)
        ranking = rendezvous_rank(affinity, list(by_key))
        if last_pod in by_key:
            ranking.remove(last_pod)
            ranking.insert(0, last_pod)
        for position, key in enumerate(ranking[:1] if new_prefix else ranking):
            if policy.has_room(by_key[key], bound):
                return Pick(key, contract.REASON_PREFIX_AFFINITY if position == 0 else contract.REASON_PREFIX_SPILL)
    # Least loaded, then least KV in use; among equals, the request's own rendezvous choice.
    ties = rendezvous_rank(request_hash, list(by_key))
    least = min(ties, key=lambda key: (by_key[key].load, by_key[key].kv_cache_usage or 0.0))  # first of equals
    reason = contract.REASON_PREFIX_SPILL if affinity is not None and not new_prefix else contract.REASON_LEAST_LOADED
    return Pick(least, reason)
