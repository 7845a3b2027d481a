"""The gateway in front of a service whose engines require an API key (spec.apiKeySecretRef): the client's
key goes through to the engine untouched, and the engine's 401 comes back to the client as it is, never
retried on another pod and never turned into a gateway error."""

from __future__ import annotations

import json

import httpx

from kvpilot import gateway_contract as contract

KEY = "client-key-6c1f0e9a7b2d"
COMPLETION = {"model": "alpha", "prompt": "Hello there", "max_tokens": 4}


def _keyed(harness):
    h = harness(["a", "b"])
    for engine in h.engines.values():
        engine.api_key = KEY
    h.set_routes({"alpha": (2, ["a", "b"])})
    return h


def test_the_clients_key_reaches_the_engine_and_its_answer_the_client(harness):
    h = _keyed(harness)
    key = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{h.url}/v1/completions", json=COMPLETION, headers=key, timeout=30)
    assert response.status_code == 200, response.text
    pod = response.json()["pod"]
    assert h.engines[pod].authorizations == [f"Bearer {KEY}"] and h.engines[pod].requests[-1] == COMPLETION
    chat = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{h.url}/v1/chat/completions", json=chat, headers=key, timeout=30) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[0].removeprefix("data: "))["i"] == 0
    assert h.metric_reaches(2, contract.REQUESTS, model="alpha", code="200")


def test_a_missing_or_wrong_key_gets_the_engines_401_once(harness):
    h = _keyed(harness)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{h.url}/v1/completions", json=COMPLETION, headers=headers, timeout=30)
        assert response.status_code == 401, response.text
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert response.json()["error"]["type"] == "authentication_error"
    # Each went to one pod: another pod would refuse the same key.
    sent = [auth for engine in h.engines.values() for auth in engine.authorizations]
    assert sorted(sent, key=str) == sorted([None, "Bearer wrong"], key=str)
    assert all(not engine.requests for engine in h.engines.values())  # no body read without the key
    assert h.metric_reaches(2, contract.REQUESTS, model="alpha", code="401")
    assert h.metric(contract.RETRIES, model="alpha", reason="status_401") == 0

