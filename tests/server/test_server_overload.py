"""Overload (429), an engine loop that dies (503), and the admin API switched off (404)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from .conftest import wait_until

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def small(live_server_factory):
    """One running sequence at a time, one waiting slot, no API key, no admin token."""
    return live_server_factory(max_waiting_requests=1, engine={"max_num_seqs": 1})


def test_full_waiting_queue_answers_429_then_recovers(small, step_gate):
    engine = small.state.async_engine
    gate = step_gate(small)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=small.url, timeout=60) as client:
            running = {"prompt": PROMPT, "max_tokens": 80, "ignore_eos": True, "stream": True}
            gate.close_after(2)  # the running request cannot finish and free its slot while the test looks
            async with client.stream("POST", "/v1/completions", json=running) as first:
                lines = first.aiter_lines()
                while not (await anext(lines)).startswith("data:"):
                    pass
                waiting = asyncio.create_task(
                    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
                )
                await asyncio.to_thread(wait_until, lambda: engine.num_waiting == 1, "the second request queued")
                # One more step: the engine thread takes the second request into its own waiting queue.
                gate.close_after(1)
                await asyncio.to_thread(gate.wait_held)
                assert engine.num_waiting == 1 and engine.stats().num_waiting == 1
                rejected = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
                assert rejected.status_code == 429
                assert int(rejected.headers["Retry-After"]) >= 1
                assert rejected.json()["error"]["type"] == "rate_limit_error"
                metrics = (await client.get("/metrics")).text
                assert re.search(r'kvpilot_requests_rejected_total\{[^}]*reason="queue_full"[^}]*\} 1\.0', metrics)
                gate.open()
                rest = [line async for line in lines if line.startswith("data:")]
                assert rest[-1] == "data: [DONE]"
            assert (await waiting).status_code == 200
            later = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
            assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] >= 1

    try:
        asyncio.run(scenario())
    finally:
        gate.open()
    assert httpx.get(f"{small.url}/health").status_code == 200
    assert small.wait_idle().kv_cache_usage == 0.0


def test_admin_api_off_without_token(small):
    response = httpx.get(f"{small.url}/admin/v1/scheduler", headers={"Authorization": "Bearer anything"})
    assert response.status_code == 404
    assert "--admin-token" in response.json()["error"]["message"]


def test_chat_without_template_is_a_clear_400(small, monkeypatch):
    monkeypatch.setattr(small.engine.tokenizer, "chat_template", None)
    response = httpx.post(f"{small.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400
    assert "chat template" in response.json()["error"]["message"]


def test_a_request_that_kills_the_engine_loop_gets_a_503_not_a_hang(live_server_factory, monkeypatch):
    doomed = live_server_factory()

    def broken_add(*args, **kwargs):
        raise AttributeError("a bug while adding the request")

    monkeypatch.setattr(doomed.engine, "add_request", broken_add)
    response = httpx.post(f"{doomed.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=30)
    assert response.status_code == 503 and "a bug while adding" in response.json()["error"]["message"]


def test_dead_engine_loop_turns_health_to_503(live_server_factory, monkeypatch):
    doomed = live_server_factory()

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(doomed.engine, "step", broken_step)
    response = httpx.post(f"{doomed.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=30)
    assert response.status_code == 503 and "device lost" in response.json()["error"]["message"]
    health = httpx.get(f"{doomed.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "engine_dead"
    again = httpx.post(f"{doomed.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert again.status_code == 503
    assert httpx.get(f"{doomed.url}/metrics").status_code == 200


def test_drain_aborts_requests_that_outlive_the_grace_period(live_server_factory, step_gate):
    live = live_server_factory(shutdown_grace_period=0.05)
    gate = step_gate(live)
    gate.close_after(2)  # held there, the request outlives any grace period
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data:"):
            pass
        drained = asyncio.run_coroutine_threadsafe(live.state.drain(), live.state.loop)
        rest = [line for line in lines if line.startswith("data:")]
    drained.result(timeout=60)
    gate.open()
    assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]  # cut off, and told so
    assert live.wait_idle().kv_cache_usage == 0.0
    assert httpx.get(f"{live.url}/health").json() == {"status": "draining"}
    refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
