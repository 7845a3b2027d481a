"""The OpenAI API through the official ``openai`` client against a real uvicorn serving a tiny model."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as names

from .conftest import wait_until

API_KEY = "test-key"
ADMIN_TOKEN = "admin-token"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def live(live_server_factory):
    return live_server_factory(api_key=API_KEY, admin_token=ADMIN_TOKEN, engine={"max_num_seqs": 8})


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def metric_values(text: str) -> dict[str, float]:
    """Sample name (plus its finish_reason, term or step_kind label when present) -> value."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            for label in (names.FINISH_REASON_LABEL, names.TERM_LABEL, names.STEP_KIND_LABEL):
                if label in sample.labels:
                    key += f"{{{sample.labels[label]}}}"
            values[key] = sample.value
    return values


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_usage_and_length(client, live):
    result = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = result.choices[0]
    assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 7
    prompt_ids = live.engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.total_tokens == len(prompt_ids) + 7
    assert result.usage.prompt_tokens_details.cached_tokens >= 0
    assert choice.text == live.engine.tokenizer.decode(
        live.engine.tokenizer.encode(choice.text, add_special_tokens=False)
    )


def test_repeated_prompt_reports_cached_tokens(client):
    long_prompt = "one two three four five six seven eight nine ten " * 6
    first = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    # Full blocks of the prompt come from the prefix cache the second time.
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_streamed_text_equals_full_text(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_chat_full(client):
    kwargs = dict(
        model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=16, temperature=0.8, seed=3
    )
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_prompt_uses_the_template(client, live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    result = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    rendered = live.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = live.engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert result.usage.prompt_tokens == len(expected)
    assert result.choices[0].finish_reason in ("stop", "length")


def test_n_choices_and_usage(client):
    result = client.completions.create(
        model="tiny", prompt=PROMPT, n=3, max_tokens=5, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 15
    streamed = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, n=3, max_tokens=5, temperature=1.0, seed=11, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    for choice in result.choices:
        text = "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == choice.index)
        assert text == choice.text


def test_several_prompts_and_echo(client):
    single = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0)
    batch = client.completions.create(model="tiny", prompt=["Hello there", PROMPT], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == single.choices[0].text
    assert batch.usage.prompt_tokens > single.usage.prompt_tokens
    echoed = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello there" + single.choices[0].text


def test_chat_content_parts_equal_plain_content(client):
    plain = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], max_tokens=4,
        temperature=0,
    )  # fmt: skip
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].text
    # A stop string that first occurs in the middle of the greedy text.
    start = next(i for i in range(3, len(base) - 3) if base.find(base[i : i + 3]) == i and base[i : i + 3].strip())
    stop = base[start : start + 3]
    result = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert result.choices[0].text == base[:start]
    assert result.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == base[:start]


def test_completion_logprobs(client):
    result = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == result.usage.completion_tokens
    assert "".join(logprobs.tokens) == result.choices[0].text
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert lp <= 0.0 and len(top) >= 2
        assert max(top.values()) == pytest.approx(lp)  # greedy picks the most likely token


def test_chat_logprobs(client):
    result = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_max_completion_tokens_wins(client):
    result = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=9, max_completion_tokens=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert result.usage.completion_tokens == 2


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert info.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 99}, "logprobs"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids[0]"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_invalid_parameters_are_400_naming_the_field(http, extra, param):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


def test_sampling_params_errors_name_the_field(http):
    # top_k < -1 passes the wire model and is refused by SamplingParams.
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "top_k": -5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_k"


def test_missing_required_field_and_bad_json(http):
    response = http.post("/v1/chat/completions", json={"model": "tiny"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_prompt_too_long_says_the_limits(client, live):
    limit = live.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * (limit - 10), max_tokens=20)
    assert str(limit) in info.value.message and "20" in info.value.message
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * (limit + 1), max_tokens=1)
    assert info.value.body["param"] == "prompt" and str(limit) in info.value.message


def test_token_outside_vocab_is_400(client, live):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[live.engine.arch.vocab_size + 5], max_tokens=1)
    assert info.value.body["param"] == "prompt"


def test_api_key_required(live):
    no_key = openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    response = httpx.get(f"{live.url}/v1/models")
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{live.url}/health").status_code == 200  # probes need no key


def test_metrics_follow_the_traffic(client, live, http):
    live.wait_idle()
    before = metric_values(http.get("/metrics").text)
    usages = []
    for max_tokens in (3, 5):
        result = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
        )
        usages.append(result.usage)
    streamed = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    usages.append(streamed[-1].usage)
    live.wait_idle()
    after = metric_values(http.get("/metrics").text)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta(names.PROMPT_TOKENS) == sum(u.prompt_tokens for u in usages)
    assert delta(names.GENERATION_TOKENS) == sum(u.completion_tokens for u in usages)
    assert delta(f"{names.REQUEST_SUCCESS}{{length}}") == 3
    assert delta(f"{names.TIME_TO_FIRST_TOKEN}_count") == 3
    assert delta(f"{names.E2E_REQUEST_LATENCY}_count") == 3
    assert delta(f"{names.REQUEST_QUEUE_TIME}_count") == 3
    # Every token after a request's first is one inter-token latency sample.
    assert delta(f"{names.INTER_TOKEN_LATENCY}_count") == sum(u.completion_tokens - 1 for u in usages)
    # One TPOT per request that produced two tokens or more: the mean of its inter-token gaps.
    assert delta(f"{names.TIME_PER_OUTPUT_TOKEN}_count") == sum(1 for u in usages if u.completion_tokens > 1)
    assert delta(f"{names.TIME_PER_OUTPUT_TOKEN}_sum") <= delta(f"{names.INTER_TOKEN_LATENCY}_sum") + 1e-9
    assert after[names.KV_CACHE_BLOCKS] == live.engine.num_kv_blocks
    assert after[names.KV_CACHE_USAGE] == 0.0 and after[names.REQUESTS_RUNNING] == 0
    assert after[names.MAX_NUM_SEQS] == 8
    assert after[names.MODEL_INFO] == 1
    assert delta(names.ENGINE_STEPS) >= max(u.completion_tokens for u in usages)
    # The cost curve's sums cover every step: each token after a request's first came from a decode row.
    cost = names.STEP_COST_SUMS
    assert delta(f"{cost}{{steps}}") == delta(names.ENGINE_STEPS)
    assert delta(f"{cost}{{rows}}") == sum(u.completion_tokens - 1 for u in usages)
    assert 0 < delta(f"{cost}{{prefill}}") <= sum(u.prompt_tokens for u in usages)
    assert delta(f"{cost}{{seconds}}") > 0 and delta(f"{cost}{{rows_rows}}") >= delta(f"{cost}{{rows}}")
    kinds = [delta(f"{names.STEP_DURATION}_count{{{kind}}}") for kind in names.STEP_KINDS]
    assert sum(kinds) == delta(names.ENGINE_STEPS) and all(kinds)


def test_health_and_metrics_content_type(http):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def test_stream_disconnect_frees_blocks(live, http, step_gate):
    before = live.wait_idle().generation_tokens_total
    aborted_before = metric_values(http.get("/metrics").text)[f"{names.REQUEST_SUCCESS}{{abort}}"]
    gate = step_gate(live)
    gate.close_after(8)  # the request cannot run on to max_tokens while the client is still there
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            gate.wait_held()
            assert live.state.async_engine.stats().kv_cache_usage > 0
    # Leaving the block closed the connection mid-generation: the server aborts the request without
    # waiting for the engine, which is still held.
    wait_until(lambda: live.state.async_engine.num_in_flight == 0, "the server noticing the disconnect")
    gate.open()
    stats = live.wait_idle()
    assert stats.kv_cache_usage == 0.0
    assert stats.generation_tokens_total - before < 400  # did not run on to max_tokens
    aborted_after = metric_values(http.get("/metrics").text)[f"{names.REQUEST_SUCCESS}{{abort}}"]
    assert aborted_after == aborted_before + 1


def test_non_streaming_disconnect_aborts(live, step_gate):
    before = live.wait_idle().generation_tokens_total
    gate = step_gate(live)
    gate.close_after(2)  # a prefill and a decode step, then the engine waits for the test
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    url = httpx.URL(live.url)
    with socket.create_connection((url.host, url.port)) as sock:
        sock.sendall(head + body)
        gate.wait_held()
        assert live.state.async_engine.stats().generation_tokens_total > before  # generation runs
    wait_until(lambda: live.state.async_engine.num_in_flight == 0, "the server noticing the disconnect")
    gate.open()
    stats = live.wait_idle()
    assert stats.kv_cache_usage == 0.0
    assert stats.generation_tokens_total - before < 480


def test_admin_api_answers_only_on_its_own_port(live, http):
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    on_api_port = http.get("/admin/v1/scheduler", headers=admin)
    assert on_api_port.status_code == 404 and "--admin-port" in on_api_port.json()["error"]["message"]
    assert http.post("/admin/v1/scheduler", json={"max_num_seqs": 2}, headers=admin).status_code == 404
    for path in ("/v1/models", "/metrics", "/health"):
        assert httpx.get(f"{live.admin_url}{path}", headers=http.headers).status_code == 404, path


def _steps_of(live, http, body: dict) -> tuple[int, int]:
    """(engine steps, sequences summed over those steps) that serving ``body`` alone took."""
    before = live.wait_idle()
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    after = live.wait_idle()
    return after.steps_total - before.steps_total, after.step_running_seqs_total - before.step_running_seqs_total


def test_admin_changes_limits_live(live, http):
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    admin_http = httpx.Client(base_url=live.admin_url, timeout=60)
    assert admin_http.get("/admin/v1/scheduler", headers=admin).json() == {
        "max_num_seqs": 8, "max_num_batched_tokens": live.engine.resolved.max_num_batched_tokens,
        "num_speculative_tokens": None,
    }  # fmt: skip
    assert admin_http.post("/admin/v1/scheduler", json={"max_num_seqs": 2}, headers={"Authorization": "Bearer no"}
                           ).status_code == 401  # fmt: skip
    # The API key is not the admin token.
    assert admin_http.post("/admin/v1/scheduler", json={"max_num_seqs": 2}, headers=http.headers).status_code == 401
    response = admin_http.post("/admin/v1/scheduler", json={"max_num_seqs": 0}, headers=admin)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_num_seqs"
    try:
        response = admin_http.post("/admin/v1/scheduler", json={"max_num_seqs": 1}, headers=admin)
        assert response.json()["max_num_seqs"] == 1
        assert metric_values(http.get("/metrics").text)[names.MAX_NUM_SEQS] == 1
        # The scheduler follows: the three sequences of one request (n=3) are there together, and each step
        # runs one of them, by the engine's own count of steps and of sequences in them.
        steps, sequence_steps = _steps_of(live, http, {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "n": 3})
        assert steps == sequence_steps >= 3 * 6
    finally:
        admin_http.post("/admin/v1/scheduler", json={"max_num_seqs": 8}, headers=admin)
        admin_http.close()
    steps, sequence_steps = _steps_of(live, http, {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "n": 3})
    assert sequence_steps > steps  # back at 8, they run side by side
    assert metric_values(http.get("/metrics").text)[names.MAX_NUM_SEQS] == 8


def test_admin_changes_max_num_batched_tokens_live(live, http):
    admin = httpx.Client(base_url=live.admin_url, timeout=60, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    default = admin.get("/admin/v1/scheduler").json()["max_num_batched_tokens"]
    # Every running sequence needs one token per step: a budget below max_num_seqs (8) is refused, unchanged.
    response = admin.post("/admin/v1/scheduler", json={"max_num_batched_tokens": 4})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "max_num_batched_tokens" and "max_num_seqs" in response.text
    assert admin.get("/admin/v1/scheduler").json()["max_num_batched_tokens"] == default
    try:
        response = admin.post("/admin/v1/scheduler", json={"max_num_batched_tokens": 16})
        assert response.status_code == 200, response.text
        assert response.json()["max_num_batched_tokens"] == 16 and response.json()["max_num_seqs"] == 8
        assert admin.get("/admin/v1/scheduler").json()["max_num_batched_tokens"] == 16
        assert metric_values(http.get("/metrics").text)[names.MAX_NUM_BATCHED_TOKENS] == 16
        # The scheduler follows: a prompt no request sent before (no prefix-cache hit) prefills 16 tokens a step.
        steps_before = live.wait_idle().steps_total
        prompt = " ".join(f"budget{i}" for i in range(30))
        result = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
        prompt_tokens = result["usage"]["prompt_tokens"]
        assert prompt_tokens > 32 and result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert live.wait_idle().steps_total - steps_before == -(-prompt_tokens // 16)
    finally:
        admin.post("/admin/v1/scheduler", json={"max_num_batched_tokens": default})
        admin.close()
    assert metric_values(http.get("/metrics").text)[names.MAX_NUM_BATCHED_TOKENS] == default


def test_admin_update_with_nothing_to_change_is_400(live):
    url, admin = f"{live.admin_url}/admin/v1/scheduler", {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    before = httpx.get(url, headers=admin).json()
    for body in ({}, {"max_num_seqs": None, "max_num_batched_tokens": None}):
        response = httpx.post(url, json=body, headers=admin)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert all(field in error["message"] for field in ("max_num_seqs", "max_num_batched_tokens",
                                                           "num_speculative_tokens")), error
    no_body = httpx.post(url, headers=admin)
    assert no_body.status_code == 400 and "JSON object" in no_body.json()["error"]["message"]
    assert httpx.get(url, headers=admin).json() == before
