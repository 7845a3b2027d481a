"""A preempted request's wait to be scheduled again is its own metric, not an inter-token latency:
lowering max_num_seqs below the running batch preempts the excess at once, and counting their
waits as per-token latency made every later window's ITL P99 read the queue (the tuner then saw
an SLO that no setting meets). The same holds for a request's time per output token."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as names

ADMIN_TOKEN = "preemption-stall-admin-token"
TOKENS, REQUESTS = 200, 4  # long enough that all four run together before the limit drops


def counts(text: str) -> dict[str, float]:
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.endswith(("_count", "_sum"))}


def test_a_lowered_max_num_seqs_moves_the_preempted_waits_out_of_the_inter_token_latency(live_server_factory):
    live = live_server_factory(admin_token=ADMIN_TOKEN, engine={"max_num_seqs": REQUESTS})
    before = counts(httpx.get(f"{live.url}/metrics").text)

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
            requests = [asyncio.create_task(client.post(f"{live.url}/v1/completions", json={**body, "prompt": f"p {i}"}))
                        for i in range(REQUESTS)]
            deadline = time.monotonic() + 30
            while live.state.async_engine.stats().num_running < REQUESTS:
                assert time.monotonic() < deadline, live.state.async_engine.stats()
                await asyncio.sleep(0.005)
            lowered = await client.post(f"{live.admin_url}{names.ADMIN_SCHEDULER_PATH}", json={"max_num_seqs": 1},
                                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert lowered.status_code == 200, lowered.text
            return [(await task).json()["usage"]["completion_tokens"] for task in requests]

    assert asyncio.run(run()) == [TOKENS] * REQUESTS
    live.wait_idle()
    after = counts(httpx.get(f"{live.url}/metrics").text)
    itl = after[names.INTER_TOKEN_LATENCY + "_count"] - before.get(names.INTER_TOKEN_LATENCY + "_count", 0)
    stalls = after[names.PREEMPTION_STALL + "_count"] - before.get(names.PREEMPTION_STALL + "_count", 0)
    assert stalls >= REQUESTS - 1  # the three newest were preempted and waited their turn
    assert itl + stalls == REQUESTS * (TOKENS - 1)  # every gap after a first token counted once, in one of them

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    # Each request's TPOT is the mean of its own inter-token gaps, the stall left out: the three that
    # waited (199, 398 and 597 steps) would otherwise average 2.5x the gaps' mean.
    assert grew(names.TIME_PER_OUTPUT_TOKEN + "_count") == REQUESTS
    mean_tpot = grew(names.TIME_PER_OUTPUT_TOKEN + "_sum") / REQUESTS
    assert mean_tpot <= 1.5 * grew(names.INTER_TOKEN_LATENCY + "_sum") / itl
