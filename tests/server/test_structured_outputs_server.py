"""Structured outputs over the OpenAI API, through the official client: OpenAI's response_format
(json_object, json_schema, ``chat.completions.parse`` with a pydantic model) and vLLM's
structured_outputs extra field, on SmolLM2 (a trained model: its answers are checked against the
schema) and on the tiny model (the errors)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
                   "capital": {"type": "boolean"}, "continent": {"enum": ["Europe", "Asia", "Africa", "America",
                                                                          "Oceania"]}},
    "required": ["city", "country", "capital", "continent"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Berlin", "Sydney", "Cairo", "Madrid", "Delhi", "Toronto"]
QUESTIONS = ["Describe {} as JSON.", "Give {} as a JSON object.", "Which country is {} in? Answer in JSON.",
             "Is {} a capital? Reply with JSON.", "Tell me about {} in JSON."]


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    # Bounded, or greedy SmolLM2 in bfloat16 (dtype auto on AVX-512 BF16) explains past max_tokens.
    reason: str = Field(max_length=120)


@pytest.fixture(scope="module")
def smollm2(smollm2_server):
    return openai.AsyncOpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0)


def test_fifty_answers_under_a_json_schema_all_parse_and_validate(smollm2):
    async def ask(question: str) -> str:
        reply = await smollm2.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
        return reply.choices[0].message.content

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(ask(q.format(c)) for q in QUESTIONS for c in CITIES))

    answers = asyncio.run(all_of_them())
    assert len(answers) == 50
    for text in answers:
        jsonschema.validate(json.loads(text), CITY)


def test_the_clients_parse_helper_and_vllms_field(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0)
    parsed = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Is Paris in France? Answer and say why."}],
        response_format=Answer, temperature=0, max_tokens=80)
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    choice = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                       temperature=0, extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
    assert choice.choices[0].text in ("Paris", "Lyon") and choice.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=100)
    text = anything.choices[0].message.content
    assert text.lstrip().startswith("{")
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "objectx"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema: required"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(live_server_factory, extra, param, message):
    live = live_server_factory()
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)
    body = info.value.body
    assert (body.get("param") or "").startswith(param), body
    assert message in body["message"], body
    assert live.wait_idle().num_running == 0
