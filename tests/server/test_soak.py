"""Engine soak: many requests through a real server while faults are injected, with invariants checked
after every phase.

The mix: streaming and not, n from 1 to 3, stop strings, prompts sharing prefixes (prefix caching),
a KV cache too small for the batch (preemption), clients that disconnect at random points,
server-side aborts of random in-flight requests, and max_num_seqs changed live through the admin
API throughout. After each phase, with the server idle: every sequence the engine admitted ended
exactly once by the server's own count (kvpilot_request_success_total: stop, length or abort), and
that count agrees with the clients' outcomes (answered in full, refused with 429, aborted by the
injected fault, or dropped by the client); no choice is answered twice, no 5xx other than the
injected aborts, no request left in the engine, every KV block back in the free queue with the
prefix cache's table consistent, and the process's RSS growth bounded. CI runs the short form;
KVPILOT_SOAK_REQUESTS=10000 runs the long one.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import resource

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as names

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ADMIN_TOKEN = "soak-admin-token"
REQUESTS = int(os.environ.get("KVPILOT_SOAK_REQUESTS", "240"))
PHASES = 4
CONCURRENCY = 16
MAX_NUM_SEQS = 8
# 8 blocks of 16 tokens (16 KiB each for the tiny model): 8 sequences of up to 64 tokens need 32.
KV_CACHE_BYTES = 8 * 16 * 1024
MAX_MODEL_LEN = 96
RSS_GROWTH_LIMIT_MIB = 64
PROMPTS = ["The quick brown fox", "The quick brown fox jumps over", "Once upon a time there was",
           "Once upon a time there was a small", "A B C D E F G H I J K L M N O P", "hello", "1 2 3 4 5 6 7 8 9"]
STOPS = ["the", "a", "\n", "o", "e"]


@pytest.fixture(scope="module")
def live(live_server_factory):
    return live_server_factory(admin_token=ADMIN_TOKEN, max_waiting_requests=32,
                               engine={"max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                                       "kv_cache_memory": KV_CACHE_BYTES})


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _request(rng: random.Random) -> tuple[str, dict]:
    body: dict = {"max_tokens": rng.randint(1, 48), "n": rng.choice([1, 1, 1, 2, 3]), "stream": rng.random() < 0.5,
                  "temperature": rng.choice([0.0, 0.8]), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": rng.choice(PROMPTS)}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}


class Admissions:
    """Requests and sequences the engine admitted: wraps its add_request (called on the engine thread)."""

    def __init__(self, add_request) -> None:
        self._add_request = add_request
        self.requests = self.sequences = 0

    def add_request(self, request_id, prompt_token_ids, params, **kwargs):
        self._add_request(request_id, prompt_token_ids, params, **kwargs)
        self.requests += 1
        self.sequences += params.n


def _ended_sequences(live) -> collections.Counter:
    """finish_reason -> sequences the server counted as ended, from its /metrics."""
    ended: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(httpx.get(f"{live.url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == names.REQUEST_SUCCESS:
                ended[sample.labels[names.FINISH_REASON_LABEL]] += sample.value
    return ended


def _check_choices(choices: dict[int, int], n: int) -> None:
    """Each of the n choices finished exactly once."""
    assert sorted(choices) == list(range(n)) and all(count == 1 for count in choices.values()), (choices, n)


async def _send(client: httpx.AsyncClient, path: str, body: dict) -> str:
    """The request's outcome: ok, refused (429) or aborted (the injected server-side abort)."""
    if not body["stream"]:
        response = await client.post(path, json=body)
        if response.status_code == 429:
            return "refused"
        if response.status_code == 503 and response.json()["error"]["code"] == "aborted":
            return "aborted"
        assert response.status_code == 200, f"{response.status_code}: {response.text[:300]}"
        _check_choices(collections.Counter(c["index"] for c in response.json()["choices"]), body["n"])
        return "ok"
    finished: collections.Counter = collections.Counter()
    done = 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code == 429:
            return "refused"
        assert response.status_code == 200, response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                assert "aborted" in event["error"]["message"], event
                return "aborted"
            for choice in event["choices"]:
                if choice.get("finish_reason"):
                    finished[choice["index"]] += 1
    assert done == 1, f"{done} [DONE] events"
    _check_choices(finished, body["n"])
    return "ok"


async def _phase(live, rng: random.Random, count: int) -> tuple[collections.Counter, collections.Counter]:
    """Runs ``count`` requests; returns the outcomes (requests, and the faults injected) and the choices
    (sequences) the requests of each outcome asked for."""
    outcomes: collections.Counter = collections.Counter()
    choices: collections.Counter = collections.Counter()
    limit = asyncio.Semaphore(CONCURRENCY)
    stop = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> None:
        path, body = _request(rng)
        async with limit:
            task = asyncio.ensure_future(_send(client, path, body))
            outcome = None
            if rng.random() < 0.1:  # the client goes away at a random point
                await asyncio.wait([task], timeout=rng.uniform(0.0, 0.3))
                if not task.done():
                    task.cancel()
                    outcome = "disconnected"
            outcome = outcome or await task
            outcomes[outcome] += 1
            choices[outcome] += body["n"]

    async def abort_some() -> None:
        # Server-side aborts on the server's own loop, as a shutdown or an engine error would do them.
        engine = live.state.async_engine
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0.05, 0.3))
            in_flight = list(engine._streams)  # a snapshot; the loop thread owns the dict
            if in_flight:
                live.state.loop.call_soon_threadsafe(engine.abort, rng.choice(in_flight))
                outcomes["abort injected"] += 1

    async def retune(admin: httpx.AsyncClient) -> None:
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            response = await admin.post("/admin/v1/scheduler", json={"max_num_seqs": rng.randint(1, MAX_NUM_SEQS)})
            assert response.status_code == 200, response.text
            outcomes["max_num_seqs change"] += 1

    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=live.url, timeout=120) as client, \
            httpx.AsyncClient(base_url=live.admin_url, timeout=30, headers=headers) as admin:
        faults = [asyncio.ensure_future(abort_some()), asyncio.ensure_future(retune(admin))]
        try:
            await asyncio.gather(*(one(client) for _ in range(count)))
        finally:
            stop.set()
            await asyncio.gather(*faults)
        await admin.post("/admin/v1/scheduler", json={"max_num_seqs": MAX_NUM_SEQS})
    return outcomes, choices


def _assert_every_block_back(live) -> None:
    """Idle: no sequence holds a block, every block is in the free queue once, the prefix cache's
    table names only blocks that hold its hash."""
    manager = live.engine.kv_cache_manager
    pool = manager.pool
    assert manager.owned_blocks() == {}
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    queued = [block.block_id for block in pool.free_queue]
    assert sorted(queued) == list(range(pool.num_blocks)) and pool.num_free_blocks == pool.num_blocks
    assert all(block.block_hash == block_hash for block_hash, block in pool.cached.items())


@pytest.mark.slow
def test_soak_keeps_every_invariant_phase_after_phase(live, capsys, monkeypatch):
    rng = random.Random(0)
    totals: collections.Counter = collections.Counter()
    preemptions_before = live.state.async_engine.stats().preemptions_total
    admitted = Admissions(live.engine.add_request)
    monkeypatch.setattr(live.engine, "add_request", admitted.add_request)
    rss_after_first = None
    for phase in range(PHASES):
        ended_before, admitted_before = _ended_sequences(live), (admitted.requests, admitted.sequences)
        outcomes, choices = asyncio.run(_phase(live, rng, REQUESTS // PHASES))
        totals.update(outcomes)
        stats = live.wait_idle(timeout=60)
        assert live.state.async_engine.num_in_flight == 0 and stats.num_running == stats.num_waiting == 0
        assert live.state.async_engine.dead_error is None
        _assert_every_block_back(live)

        # None lost, none counted twice, by the server's own books: every sequence the engine admitted
        # ended exactly once, by stop, length or abort.
        ended = _ended_sequences(live) - ended_before
        requests, sequences = admitted.requests - admitted_before[0], admitted.sequences - admitted_before[1]
        assert sum(ended.values()) == sequences, (phase, dict(ended), sequences)
        # And the books agree with the clients': a request answered in full or aborted was admitted, one
        # refused was not; a client that went away may have left before the engine took its request.
        answered = outcomes["ok"] + outcomes["aborted"]
        assert answered <= requests <= answered + outcomes["disconnected"], (phase, outcomes, requests)
        assert choices["ok"] + choices["aborted"] <= sequences <= (
            choices["ok"] + choices["aborted"] + choices["disconnected"]), (phase, choices, sequences)
        assert ended["stop"] + ended["length"] >= choices["ok"], (phase, dict(ended), choices)
        if rss_after_first is None:
            rss_after_first = _rss_mib()
    growth = _rss_mib() - rss_after_first
    preemptions = live.state.async_engine.stats().preemptions_total - preemptions_before
    with capsys.disabled():
        print(f"\nsoak: {REQUESTS} requests in {PHASES} phases: {dict(sorted(totals.items()))}, "
              f"{preemptions} preemptions ({stats.num_kv_blocks} KV blocks), RSS growth after phase 1: {growth:.1f} MiB")
    assert totals["ok"] > REQUESTS // 2 and totals["disconnected"] and totals["aborted"] and preemptions > 0
    assert growth < RSS_GROWTH_LIMIT_MIB
