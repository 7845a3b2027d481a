"""Admission by predicted wait (--max-waiting-seconds): the start rate on synthetic step streams, and
the server turning a request away when the queue ahead of it would outlast the limit."""

from __future__ import annotations

import asyncio
import math
import re

import httpx
import pytest

from kvpilot.engine.server.admission import StartRate

from .conftest import wait_until

PROMPT = "Once upon a time"


def _steps(rate: StartRate, seconds: float, step_s: float, queued: int, starts_per_second: float) -> None:
    """``seconds`` of steps of ``step_s``, each finding ``queued`` waiting and starting them at the
    given pace (a start whenever the accumulated fraction reaches one, as slots free up)."""
    owed = 0.0
    for _ in range(round(seconds / step_s)):
        owed += starts_per_second * step_s
        started = int(owed)
        owed -= started
        rate.observe(step_s, queued, started)


def test_the_rate_is_starts_per_second_of_steps_with_a_queue():
    rate = StartRate(horizon_s=10.0, min_busy_s=1.0)
    _steps(rate, 0.5, 0.05, queued=20, starts_per_second=8.0)
    assert rate.per_second is None and rate.predicted_wait(20) is None  # half a second: too little to say
    _steps(rate, 20.0, 0.05, queued=20, starts_per_second=8.0)
    assert rate.per_second == pytest.approx(8.0, rel=0.05)
    assert rate.predicted_wait(40) == pytest.approx(5.0, rel=0.05)
    assert rate.predicted_wait(0) == 0.0  # nobody ahead: no wait, however slow the queue was


def test_steps_with_nobody_waiting_leave_the_rate_alone():
    rate = StartRate(horizon_s=10.0, min_busy_s=1.0)
    _steps(rate, 20.0, 0.05, queued=20, starts_per_second=4.0)
    before = rate.per_second
    _steps(rate, 60.0, 0.05, queued=0, starts_per_second=0.0)  # an idle minute: no evidence, no decay
    assert rate.per_second == before


def test_the_rate_follows_a_change_of_traffic_within_a_few_horizons():
    rate = StartRate(horizon_s=10.0, min_busy_s=1.0)
    _steps(rate, 60.0, 0.05, queued=30, starts_per_second=8.0)  # short chats
    _steps(rate, 10.0, 0.05, queued=30, starts_per_second=1.0)  # long prompts: 8x slower to start
    assert 2.5 < rate.per_second < 4.0  # the old pace still weighs e^-1
    _steps(rate, 40.0, 0.05, queued=30, starts_per_second=1.0)
    assert rate.per_second == pytest.approx(1.0, rel=0.1)


def test_a_queue_that_starts_nothing_predicts_an_unbounded_wait():
    rate = StartRate(horizon_s=10.0, min_busy_s=1.0)
    _steps(rate, 5.0, 0.05, queued=3, starts_per_second=0.0)
    assert rate.predicted_wait(1) == math.inf


def test_starts_are_counted_at_most_once_per_waiting_request():
    rate = StartRate(horizon_s=10.0, min_busy_s=0.0)
    rate.observe(1.0, queued=2, started=5)  # preempted requests rejoining can make the difference odd
    rate.observe(1.0, queued=2, started=-3)
    assert 0.0 < rate.per_second <= 1.0


def test_the_server_turns_away_a_request_whose_predicted_wait_is_over_the_limit(live_server_factory, step_gate):
    live = live_server_factory(max_waiting_seconds=2.0, engine={"max_num_seqs": 1})
    engine = live.state.async_engine
    gate = step_gate(live)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            running = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True}
            gate.close_after(2)  # the running request holds the only slot while the test looks
            async with client.stream("POST", "/v1/completions", json=running) as first:
                lines = first.aiter_lines()
                while not (await anext(lines)).startswith("data:"):
                    pass
                # As measured on a busy engine: one waiting request starts every 1.5 s.
                engine._start_rate = StartRate(min_busy_s=0.0)
                engine._start_rate.observe(3.0, queued=4, started=2)
                body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
                waiting = asyncio.create_task(client.post("/v1/completions", json=body))  # 1.5 s ahead of the next
                await asyncio.to_thread(wait_until, lambda: engine.num_waiting == 1, "the second request queued")
                second = asyncio.create_task(client.post("/v1/completions", json=body))  # would wait 1.5 s: in
                await asyncio.to_thread(wait_until, lambda: engine.num_waiting == 2, "the third request queued")
                rejected = await client.post("/v1/completions", json=body, timeout=10)  # 2 ahead: 3 s > 2 s
                assert rejected.status_code == 429
                assert int(rejected.headers["Retry-After"]) >= 1
                error = rejected.json()["error"]
                assert error["type"] == "rate_limit_error" and "--max-waiting-seconds 2" in error["message"]
                assert "2 waiting" in error["message"]
                metrics = (await client.get("/metrics")).text
                assert re.search(r'kvpilot_requests_rejected_total\{[^}]*reason="queue_wait"[^}]*\} 1\.0', metrics)
                gate.open()
                assert [line async for line in lines if line.startswith("data:")][-1] == "data: [DONE]"
            assert (await waiting).status_code == 200 and (await second).status_code == 200

    try:
        asyncio.run(scenario())
    finally:
        gate.open()
    assert live.wait_idle().kv_cache_usage == 0.0


def test_the_engine_thread_measures_how_fast_its_queue_starts(live_server_factory):
    live = live_server_factory(max_waiting_seconds=60.0, engine={"max_num_seqs": 1})
    engine = live.state.async_engine
    engine._start_rate = StartRate(min_busy_s=0.0)
    before = engine.stats()
    max_tokens = 12

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
            responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))
        return [r.status_code for r in responses]

    assert asyncio.run(burst()) == [200] * 6
    after = live.wait_idle()
    step_s = (after.step_seconds_total - before.step_seconds_total) / (after.steps_total - before.steps_total)
    # One slot: a waiting request starts each time the running one has taken its max_tokens steps.
    expected = 1.0 / (max_tokens * step_s)
    assert expected / 2.5 < engine._start_rate.per_second < expected * 2.5
