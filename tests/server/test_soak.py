"""Engine soak: many requests through a real server while faults are injected, with invariants checked
after every phase.

The mix: streaming and not, n from 1 to 3, stop strings, prompts sharing prefixes (prefix caching),
a KV cache too small for the batch (preemption), clients that disconnect at random points,
server-side aborts of random in-flight requests, and max_num_seqs changed live through the admin
API throughout. After each phase, with the server idle: every request sent has exactly one outcome
(answered in full, refused with 429, aborted by the injected fault, or dropped by its client), no
choice is answered twice, no 5xx other than the injected aborts, no request left in the engine,
every KV block back in the free queue with the prefix cache's table consistent, and the process's
RSS growth bounded. CI runs the short form; KVPILOT_SOAK_REQUESTS=10000 runs the long one.
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


async def _phase(live, rng: random.Random, count: int) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    limit = asyncio.Semaphore(CONCURRENCY)
    stop = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> None:
        path, body = _request(rng)
        async with limit:
            task = asyncio.ensure_future(_send(client, path, body))
            if rng.random() < 0.1:  # the client goes away at a random point
                await asyncio.wait([task], timeout=rng.uniform(0.0, 0.3))
                if not task.done():
                    task.cancel()
                    outcomes["disconnected"] += 1
                    return
            outcomes[await task] += 1

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
    return outcomes


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


def test_soak_keeps_every_invariant_phase_after_phase(live, capsys):
    rng = random.Random(0)
    totals: collections.Counter = collections.Counter()
    preemptions_before = live.state.async_engine.stats().preemptions_total
    rss_after_first = None
    for phase in range(PHASES):
        outcomes = asyncio.run(_phase(live, rng, REQUESTS // PHASES))
        totals.update(outcomes)
        sent = REQUESTS // PHASES
        answered = sum(outcomes[k] for k in ("ok", "refused", "aborted", "disconnected"))
        assert answered == sent, (phase, outcomes)  # none lost, none counted twice
        stats = live.wait_idle(timeout=60)
        assert live.state.async_engine.num_in_flight == 0 and stats.num_running == stats.num_waiting == 0
        assert live.state.async_engine.dead_error is None
        _assert_every_block_back(live)
        if rss_after_first is None:
            rss_after_first = _rss_mib()
    growth = _rss_mib() - rss_after_first
    preemptions = live.state.async_engine.stats().preemptions_total - preemptions_before
    with capsys.disabled():
        print(f"\nsoak: {REQUESTS} requests in {PHASES} phases: {dict(sorted(totals.items()))}, "
              f"{preemptions} preemptions ({stats.num_kv_blocks} KV blocks), RSS growth after phase 1: {growth:.1f} MiB")
    assert totals["ok"] > REQUESTS // 2 and totals["disconnected"] and totals["aborted"] and preemptions > 0
    assert growth < RSS_GROWTH_LIMIT_MIB
