"""The gateway's HTTP behaviour, end to end over sockets: routing by model, streaming as it arrives,
disconnects, the retry rule, holding requests while a service has no Ready pod, and its metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx

from kvpilot import gateway_contract as contract
from kvpilot.gateway.picker import rendezvous_rank
from kvpilot.gateway.prefix import affinity_key

COMPLETION = {"prompt": "Hello there", "max_tokens": 4}


def _prompts_owned_by(pod: str, pods: list[str], count: int, model: str = "alpha") -> list[str]:
    """Prompts whose prefix ranks ``pod`` first among ``pods``: the picker tries it first when all are idle."""
    keys = [f"ns/{p}" for p in pods]
    owned = [f"prompt {i}" for i in range(10_000)
             if rendezvous_rank(affinity_key({"model": model, "prompt": f"prompt {i}"}, 256), keys)[0] == f"ns/{pod}"]
    return owned[:count]


def _post(harness, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{harness.url}/v1/completions", json={"model": model, **COMPLETION, **extra}, timeout=30)


def test_requests_go_to_the_service_serving_their_model(harness):
    h = harness(["a", "b"])
    h.set_routes({"alpha": (1, ["a"]), "beta": (1, ["b"])})
    assert _post(h, "alpha").json()["pod"] == "a"
    response = _post(h, "beta")
    assert response.json()["pod"] == "b" and response.headers[contract.POD_HEADER] == "ns/b"
    chat = httpx.post(f"{h.url}/v1/chat/completions", timeout=30,
                      json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["pod"] == "a"
    assert h.engines["a"].requests[-1]["messages"] == [{"role": "user", "content": "hi"}]
    assert h.metric_reaches(2, contract.REQUESTS, model="alpha", code="200")
    # Tool calling and structured outputs are the engine's: the body reaches it as the client sent it.
    tooled = {"model": "beta", "messages": [{"role": "user", "content": "weather?"}], "tool_choice": "required",
              "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
              "parallel_tool_calls": False, "response_format": {"type": "text"}}
    assert httpx.post(f"{h.url}/v1/chat/completions", json=tooled, timeout=30).status_code == 200
    assert h.engines["b"].requests[-1] == tooled


def test_models_lists_every_routable_name(harness):
    h = harness(["a"])
    h.set_routes({"alpha": (1, ["a"]), "cold": (0, [])})
    listing = httpx.get(f"{h.url}/v1/models", timeout=10).json()
    assert listing["object"] == "list"
    assert [(m["id"], m["object"], m["ready_replicas"]) for m in listing["data"]] == [("alpha", "model", 1),
                                                                                      ("cold", "model", 0)]


def test_an_unknown_model_is_an_openai_404_naming_the_available_ones(harness):
    h = harness(["a"])
    h.set_routes({"alpha": (1, ["a"]), "beta": (1, ["a"])})
    response = _post(h, "gamma")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gamma' does not exist" in error["message"] and "alpha, beta" in error["message"]
    assert h.metric_reaches(1, contract.REQUESTS, model="unknown", code="404")


def test_bad_bodies_are_openai_400s(harness):
    h = harness([])
    h.set_routes({})
    not_json = httpx.post(f"{h.url}/v1/completions", content=b"{", timeout=10)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    no_model = httpx.post(f"{h.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"


def test_a_stream_reaches_the_client_chunk_by_chunk_as_the_engine_sends_it(harness):
    h = harness(["a"])
    h.set_routes({"alpha": (1, ["a"])})
    engine = h.engines["a"]
    engine.behavior = "paced"
    with httpx.stream("POST", f"{h.url}/v1/completions", json={"model": "alpha", "prompt": "x", "stream": True},
                      timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = response.iter_raw()
        for i in range(3):
            engine.release()  # the engine sends chunk i only now: the client must see it before the next
            assert json.loads(next(chunks).decode().removeprefix("data: ").strip())["i"] == i
        engine.release(more=False)
        rest = b"".join(chunks)
    assert rest.endswith(b"data: [DONE]\n\n")


def test_a_client_that_disconnects_aborts_the_upstream_request(harness):
    h = harness(["a"])
    h.set_routes({"alpha": (1, ["a"])})
    engine = h.engines["a"]
    engine.behavior = "paced"
    with httpx.stream("POST", f"{h.url}/v1/completions", json={"model": "alpha", "prompt": "x", "stream": True},
                      timeout=30) as response:
        engine.release()
        next(response.iter_raw())
    # The client is gone; the engine's next write finds its connection closed.
    deadline = time.monotonic() + 60
    while not engine.aborted.wait(0.2) and time.monotonic() < deadline:
        engine.release()
    assert engine.aborted.is_set(), "the engine's request was not aborted"
    assert h.metric_reaches(1, contract.REQUESTS, model="alpha", code="499")
    assert h.metric_reaches(0, contract.IN_FLIGHT, model="alpha")


def test_a_429_is_retried_once_on_another_pod(harness):
    h = harness(["busy", "free"])
    h.set_routes({"alpha": (2, ["busy", "free"])})
    h.engines["busy"].behavior = 429
    for prompt in _prompts_owned_by("busy", ["busy", "free"], 3):  # the busy pod is tried first
        response = _post(h, "alpha", prompt=prompt)
        assert response.status_code == 200 and response.json()["pod"] == "free"
    assert len(h.engines["busy"].requests) == 3
    assert h.metric_reaches(3, contract.RETRIES, model="alpha", reason="status_429")
    assert h.metric_reaches(3, contract.ROUTING_DECISIONS, model="alpha", reason=contract.REASON_RETRY)


def test_with_every_pod_refusing_the_last_answer_reaches_the_client(harness):
    h = harness(["x", "y", "z"])
    h.set_routes({"alpha": (3, ["x", "y", "z"])})
    for engine in h.engines.values():
        engine.behavior = 503
    response = _post(h, "alpha")
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert sum(len(e.requests) for e in h.engines.values()) == 2  # one retry, never more


def test_a_lone_pod_answering_429_is_not_waited_on(harness):
    # Were the request held for another pod after the 429, it would end in the hold's 503 instead.
    h = harness(["busy"], hold_timeout_seconds=0.5)
    h.set_routes({"alpha": (1, ["busy"])})
    h.engines["busy"].behavior = 429
    response = _post(h, "alpha")
    assert response.status_code == 429 and response.headers["retry-after"] == "1"  # the pod's own answer
    assert len(h.engines["busy"].requests) == 1
    assert h.metric(contract.RETRIES, model="alpha", reason="status_429") == 0


def test_a_refused_connection_is_retried_on_another_pod(harness):
    h = harness(["good"])
    h.set_routes({"alpha": (2, ["dead:gone", "good"])})
    for prompt in _prompts_owned_by("dead:gone", ["dead:gone", "good"], 3):
        response = _post(h, "alpha", prompt=prompt)
        assert response.status_code == 200 and response.json()["pod"] == "good"
    assert h.metric_reaches(3, contract.RETRIES, model="alpha", reason="connect_error")


def test_a_stream_that_breaks_after_its_first_byte_is_not_retried(harness):
    h = harness(["broken", "spare"])
    h.set_routes({"alpha": (2, ["broken", "spare"])})
    h.engines["broken"].behavior = "break"
    (prompt,) = _prompts_owned_by("broken", ["broken", "spare"], 1)
    received = b""
    try:
        with httpx.stream("POST", f"{h.url}/v1/completions",
                          json={"model": "alpha", "prompt": prompt, "stream": True}, timeout=30) as response:
            for chunk in response.iter_raw():
                received += chunk
    except httpx.HTTPError:
        pass  # the truncated stream may surface as a protocol error
    assert b'"i": 0' in received and b"[DONE]" not in received
    assert h.engines["spare"].requests == []
    assert h.metric_reaches(1, contract.REQUESTS, model="alpha", code="502")


def _wait_held(h, model: str, count: int, woken: bool = False) -> None:
    """Waits until ``count`` requests for ``model`` are held (and, with ``woken``, its service was woken)."""
    deadline = time.monotonic() + 60
    while h.metric(contract.HELD_REQUESTS, model=model) != count or (woken and not h.wakes):
        assert time.monotonic() < deadline, f"never {count} held requests for {model}{' and a wake' * woken}"
        time.sleep(0.02)


def test_a_request_for_a_service_at_zero_is_held_until_a_pod_is_ready(harness):
    h = harness(["a"])
    h.set_routes({"alpha": (0, [])})
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("response", _post(h, "alpha")))
    thread.start()
    _wait_held(h, "alpha", 1, woken=True)
    assert h.wakes == ["alpha"]  # the gateway asked for a replica
    h.set_routes({"alpha": (1, ["a"])})  # the pod became Ready
    thread.join(60)
    assert result["response"].status_code == 200 and result["response"].json()["pod"] == "a"
    assert h.metric_reaches(0, contract.HELD_REQUESTS, model="alpha")


def test_held_requests_are_bounded_in_number(harness):
    h = harness(["a"], max_held_requests=1, retry_after_seconds=7)  # held for up to 300 s
    h.set_routes({"alpha": (1, [])})
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("response", _post(h, "alpha")))
    thread.start()
    _wait_held(h, "alpha", 1)
    refused = _post(h, "alpha")
    assert refused.status_code == 503 and "1 requests already wait" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "7" and refused.json()["error"]["code"] == "model_not_ready"
    h.set_routes({"alpha": (1, ["a"])})
    thread.join(60)
    assert result["response"].status_code == 200  # the held one was served once a pod was Ready


def test_held_requests_are_bounded_in_time(harness):
    h = harness([], hold_timeout_seconds=0.5, retry_after_seconds=7)
    h.set_routes({"alpha": (1, [])})
    response = _post(h, "alpha")
    assert response.status_code == 503 and "within 0.5 s" in response.json()["error"]["message"]
    assert response.headers["retry-after"] == "7" and response.json()["error"]["code"] == "model_not_ready"
    assert h.metric_reaches(0, contract.HELD_REQUESTS, model="alpha")


def test_requests_sharing_a_prefix_stick_to_one_pod(harness):
    h = harness(["p0", "p1", "p2"])
    h.set_routes({"alpha": (3, ["p0", "p1", "p2"])})
    system = "You answer questions about the kvpilot manual. " * 8
    pods = {_post(h, "alpha", prompt=system + f"question {i}").headers[contract.POD_HEADER] for i in range(8)}
    assert len(pods) == 1
    assert h.metric_reaches(8, contract.ROUTING_DECISIONS, model="alpha", reason=contract.REASON_PREFIX_AFFINITY)


def test_health_and_metrics(harness):
    h = harness([])
    assert httpx.get(f"{h.url}{contract.HEALTH_PATH}", timeout=10).status_code == 200
    h.table.synced = False
    assert httpx.get(f"{h.url}{contract.HEALTH_PATH}", timeout=10).status_code == 503
    text = httpx.get(f"{h.url}{contract.METRICS_PATH}", timeout=10).text
    assert f"# TYPE {contract.HELD_REQUESTS} gauge" in text
