"""Hostile and malformed HTTP requests against a real server: always a 4xx with an OpenAI-shaped
error naming the field, never a 5xx or a hang, and the engine keeps serving.

Three sources of inputs: a table of known-nasty requests (oversized, deeply nested, invalid UTF-8,
NaN, huge and negative numbers, unknown roles, empty messages, prompts past max_model_len),
hypothesis-generated bodies for both generation endpoints, and schemathesis over the server's own
OpenAPI schema (every endpoint, valid and invalid requests). The number of generated examples is
small for CI; KVPILOT_FUZZ_EXAMPLES raises it (the long form, e.g. 2000).
"""

from __future__ import annotations

import collections
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.server import protocol as p

pytestmark = pytest.mark.usefixtures("one_torch_thread")

API_KEY = "fuzz-key"
MAX_MODEL_LEN = 48
MAX_REQUEST_BYTES = 1 << 20
VOCAB_SIZE = 1536  # the tiny model's
EXAMPLES = int(os.environ.get("KVPILOT_FUZZ_EXAMPLES", "40"))
REQUEST_TIMEOUT_S = 60  # a hang fails the test instead of stalling it
FIELDS = frozenset(p.CompletionRequest.model_fields) | frozenset(p.ChatCompletionRequest.model_fields)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live(live_server_factory):
    """Auth on (every request passes the key check first), a short context, a 1 MiB body limit."""
    return live_server_factory(api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES,
                               engine={"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 16})


@pytest.fixture(scope="module")
def tally():
    """Inputs tried and their answers, by source; printed at the end (docs/reliability.md's figures)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    yield counts
    for source, statuses in counts.items():
        print(f"\nfuzz {source}: {sum(statuses.values())} requests, answers {dict(sorted(statuses.items()))}")


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, timeout=REQUEST_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def _param_root(param: str) -> str:
    return param.split("[")[0].split(".")[0]


def check_answer(response: httpx.Response, *, needs_param: bool) -> None:
    """No 5xx; a 4xx is OpenAI's error object, naming a request field when ``needs_param``;
    a 200 is a whole response or a whole stream."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["type"]
        if needs_param and response.status_code == 400:
            assert error["param"] is not None and _param_root(error["param"]) in FIELDS, error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event.removeprefix("data: ")), event
    else:
        assert response.json()["choices"]


def assert_still_serving(live, http) -> None:
    """The engine lives, answers a plain request, and holds no KV block once idle."""
    assert live.state.async_engine.dead_error is None
    response = http.post(COMPLETIONS, json={"prompt": "hello", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert live.wait_idle().kv_cache_usage == 0.0


# --- the table ------------------------------------------------------------------------------------

DEEP = 100_000
# (case, path, body: a JSON value or raw bytes, status, the param the error names (None: the whole body))
NASTY = [
    ("truncated JSON", COMPLETIONS, b'{"prompt": "hi"', 400, None),
    ("not JSON", COMPLETIONS, b"prompt=hi", 400, None),
    ("empty body", COMPLETIONS, b"", 400, None),
    ("null body", COMPLETIONS, b"null", 400, None),
    ("array body", CHAT, b"[]", 400, None),
    ("string body", COMPLETIONS, b'"hi"', 400, None),
    ("invalid UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe\xfa"}', 400, None),
    ("deeply nested JSON", COMPLETIONS, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, None),
    ("deeply nested objects", CHAT, b'{"messages": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", 400, None),
    ("body over the limit", COMPLETIONS, json.dumps({"prompt": "x" * (MAX_REQUEST_BYTES + 10)}).encode(), 413,
     None),
    ("NaN temperature", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("infinite top_p", COMPLETIONS, b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    ("minus infinity penalty", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
                                     b'"presence_penalty": -Infinity}', 400, "presence_penalty"),
    ("huge n", COMPLETIONS, {"prompt": "hi", "n": 10**30}, 400, "n"),
    ("zero n", COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
    ("huge max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    ("max_tokens past the context", COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("negative max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("huge logprobs", COMPLETIONS, {"prompt": "hi", "logprobs": 10**6}, 400, "logprobs"),
    ("negative logprobs", COMPLETIONS, {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("huge top_logprobs", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 10**9}, 400, "top_logprobs"),
    ("huge top_k", COMPLETIONS, {"prompt": "hi", "top_k": 10**30}, 400, "top_k"),
    ("negative top_k", COMPLETIONS, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("negative temperature", COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("temperature as text", COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("huge stop token id", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [10**30]}, 400, "stop_token_ids"),
    ("negative stop token id", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("empty stop string", COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("min_tokens over max_tokens", COMPLETIONS, {"prompt": "hi", "min_tokens": 30, "max_tokens": 2}, 400,
     "min_tokens"),
    ("negative token id in the prompt", COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
    ("token id past the vocabulary", COMPLETIONS, {"prompt": [VOCAB_SIZE]}, 400, "prompt"),
    ("huge token id", COMPLETIONS, {"prompt": [10**30]}, 400, "prompt"),
    ("empty token list", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("empty prompt in a batch", COMPLETIONS, {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("prompt over max_model_len", COMPLETIONS, {"prompt": "word " * 200}, 400, "prompt"),
    ("token prompt over max_model_len", COMPLETIONS, {"prompt": [5] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    ("no prompt", COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    ("prompt as an object", COMPLETIONS, {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("unknown model", COMPLETIONS, {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
    ("best_of above n", COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("logit_bias", COMPLETIONS, {"prompt": "hi", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("echo with logprobs", COMPLETIONS, {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("stream_options without stream", COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("no role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("messages as text", CHAT, {"messages": "hi"}, 400, "messages"),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                               "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ("content as a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat over max_model_len", CHAT, {"messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),
    ("zero max_completion_tokens", CHAT, {"messages": HELLO, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("tool without a function", CHAT, {"messages": HELLO, "tools": [{"type": "function"}]}, 400, "tools"),
    ("tool_choice naming no tool", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("tool schema that is not one", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": 5}}}], "tool_choice": "required"}, 400, "tools"),
]


@pytest.mark.parametrize("case,path,body,status,param", NASTY, ids=[c[0] for c in NASTY])
def test_a_nasty_request_gets_a_4xx_naming_the_field(live, http, tally, case, path, body, status, param):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    tally["table"][response.status_code] += 1
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    assert (error["param"] and _param_root(error["param"])) == param, error
    assert live.state.async_engine.dead_error is None


def test_wrong_content_type_is_a_4xx(http, tally):
    response = http.post(COMPLETIONS, content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
    tally["table"][response.status_code] += 1
    assert response.status_code == 400 and "Content-Type: application/json" in response.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_is_refused(http, tally):
    """No Content-Length to refuse it by: the server counts as it reads."""
    def chunks():
        for _ in range(MAX_REQUEST_BYTES // 4096 + 2):
            yield b" " * 4096

    response = http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    tally["table"][response.status_code] += 1
    assert response.status_code == 413 and "--max-request-bytes" in response.json()["error"]["message"]


def test_the_table_left_the_engine_serving(live, http):
    assert_still_serving(live, http)


# --- hypothesis ---------------------------------------------------------------------------------------

# Values of every JSON type, with the edges that break number handling: huge and negative integers,
# NaN and the infinities (Python's json writes and reads them), and empty and odd strings.
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.integers(-3, 60),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(-3, VOCAB_SIZE + 3), max_size=6), st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(-2, 2) | st.text(max_size=3), max_size=2),
)
COMPLETION_FIELDS = sorted(p.CompletionRequest.model_fields)
CHAT_FIELDS = sorted(p.ChatCompletionRequest.model_fields)
ROLES = ("system", "developer", "user", "assistant", "tool", "wizard", "", "USER")


@st.composite
def completion_bodies(draw) -> dict:
    body = {"prompt": draw(st.one_of(st.text(max_size=40), st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=60),
                                     ANY_VALUE)),
            "max_tokens": draw(st.integers(1, 8) | ANY_VALUE)}
    for name in draw(st.lists(st.sampled_from(COMPLETION_FIELDS), max_size=4, unique=True)):
        body[name] = draw(ANY_VALUE)
    return body


@st.composite
def chat_bodies(draw) -> dict:
    message = st.fixed_dictionaries({"role": st.sampled_from(ROLES)},
                                    optional={"content": st.text(max_size=40) | ANY_VALUE, "name": ANY_VALUE})
    body = {"messages": draw(st.lists(message, max_size=3) | ANY_VALUE),
            "max_tokens": draw(st.integers(1, 8) | ANY_VALUE)}
    for name in draw(st.lists(st.sampled_from(CHAT_FIELDS), max_size=4, unique=True)):
        body[name] = draw(ANY_VALUE)
    return body


SCHEMAS = st.sampled_from([{"type": "object"}, {"type": "objectx"}, {"type": "object", "properties": {"a": {
    "enum": ["x", "y"]}}, "required": ["a"]}, {"properties": 5}, {"type": "string"}, {"$ref": "#/nowhere"}]) | ANY_VALUE


@st.composite
def tool_bodies(draw) -> dict:
    """Chat bodies built around the tool fields: tools, tool_choice, parallel_tool_calls, and the
    messages that carry calls and results back."""
    names = st.sampled_from(["f", "get_weather", "", "has space", "x" * 65]) | ANY_VALUE
    function = st.fixed_dictionaries({}, optional={"name": names, "parameters": SCHEMAS, "description": ANY_VALUE,
                                                   "strict": ANY_VALUE})
    tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]) | ANY_VALUE},
                                 optional={"function": function | ANY_VALUE})
    choice = st.sampled_from(["none", "auto", "required", "any"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": names})}) | ANY_VALUE
    call = st.fixed_dictionaries({"id": st.text(max_size=4) | ANY_VALUE, "type": st.just("function"),
                                  "function": st.fixed_dictionaries({"name": names, "arguments": st.sampled_from(
                                      ['{"a": "x"}', "{", "[]", ""]) | ANY_VALUE})})
    message = st.fixed_dictionaries({"role": st.sampled_from(ROLES)}, optional={
        "content": st.text(max_size=20) | st.none(), "tool_calls": st.lists(call, max_size=2) | ANY_VALUE,
        "tool_call_id": st.text(max_size=4) | ANY_VALUE})
    body = {"messages": draw(st.lists(message, min_size=1, max_size=3)), "max_tokens": draw(st.integers(1, 6)),
            "tools": draw(st.lists(tool, max_size=3) | ANY_VALUE)}
    if draw(st.booleans()):
        body["tool_choice"] = draw(choice)
    if draw(st.booleans()):
        body["parallel_tool_calls"] = draw(st.booleans() | ANY_VALUE)
    return body


FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _post(http, path: str, body: dict) -> httpx.Response:
    content = json.dumps(body, allow_nan=True).encode()
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def _post_and_check(http, tally, path: str, body: dict) -> None:
    response = _post(http, path, body)
    tally["hypothesis"][response.status_code] += 1
    check_answer(response, needs_param=True)


@FUZZ_SETTINGS
@given(body=completion_bodies())
def test_generated_completion_bodies(http, tally, body):
    _post_and_check(http, tally, COMPLETIONS, body)


@FUZZ_SETTINGS
@given(body=chat_bodies())
def test_generated_chat_bodies(http, tally, body):
    _post_and_check(http, tally, CHAT, body)


@FUZZ_SETTINGS
@given(body=tool_bodies())
def test_generated_tool_bodies(http, tally, body):
    _post_and_check(http, tally, CHAT, body)


def test_generated_bodies_left_the_engine_serving(live, http):
    assert_still_serving(live, http)


# --- schemathesis ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_every_endpoint_of_the_openapi_schema(live, tally, mode):
    """Requests generated from the server's own OpenAPI schema, valid ones and ones that break it, for
    every operation: no 5xx, and every 4xx is OpenAI's error object."""
    import schemathesis
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_dict(live.app.openapi())
    headers = {"Authorization": f"Bearer {API_KEY}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics"}
    exercised = 0
    for operation in operations:
        strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

        @FUZZ_SETTINGS
        @given(case=strategy)
        def run(case):
            response = case.call(base_url=live.url, headers=headers, timeout=REQUEST_TIMEOUT_S)
            tally[f"schemathesis {mode}"][response.status_code] += 1
            assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text}"
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["message"] and error["type"], response.text

        try:
            run()
            exercised += 1
        except Unsatisfiable:
            continue  # an operation without inputs has no invalid request to make
    assert exercised >= 2
    assert live.state.async_engine.dead_error is None
