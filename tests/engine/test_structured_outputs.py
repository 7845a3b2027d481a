"""Structured outputs in the engine, on a generated tiny model (random weights, so only the mask
makes its output well-formed): every kind of constraint, bad constraints refused before they are
queued, and batching, preemption and speculative decoding leaving both the constrained and the
unconstrained rows right."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.request import InvalidRequestError
from kvpilot.engine.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
PROMPTS = ["Hello there", "Describe the sky in one word", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20)


def generate(llm, constraint: dict, prompts=PROMPTS, **params) -> list[str]:
    sampling = SamplingParams(temperature=params.pop("temperature", 0.0), max_tokens=params.pop("max_tokens", 96),
                              structured_outputs=constraint, **params)
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def test_json_schema_outputs_parse_and_validate(llm):
    for seed in range(4):
        for text in generate(llm, {"json": SCHEMA, "disable_any_whitespace": True}, temperature=1.0, seed=seed):
            jsonschema.validate(json.loads(text), SCHEMA)


def test_properties_come_out_in_the_schemas_order(llm):
    # SCHEMA lists ok, color, size: not sorted, and a reversed schema gives the reversed order.
    reordered = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    for schema, order in ((SCHEMA, ["ok", "color", "size"]), (reordered, ["size", "color", "ok"])):
        for text in generate(llm, {"json": schema, "disable_any_whitespace": True}):
            assert list(json.loads(text)) == order, text


def test_a_schema_as_json_text_and_any_json_object(llm):
    for text in generate(llm, {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}):
        jsonschema.validate(json.loads(text), SCHEMA)
    # Any object: a random model rambles inside its strings, so only the start and finished ones are checked.
    sampling = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json_object": True})
    for output in (o.outputs[0] for o in llm.generate(PROMPTS, sampling, use_tqdm=False)):
        assert output.text.lstrip().startswith("{"), output.text
        if output.finish_reason == "stop":
            assert isinstance(json.loads(output.text), dict)


def test_regex_choice_and_grammar(llm):
    assert all(re.fullmatch(r"[0-9]{3}-[a-c]{2}", t) for t in generate(llm, {"regex": r"[0-9]{3}-[a-c]{2}"}))
    choices = generate(llm, {"choice": ["yes", "no", "maybe so"]}, temperature=1.0, seed=3)
    assert all(t in ("yes", "no", "maybe so") for t in choices), choices
    lark = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{2,5}/'
    assert all(re.fullmatch(r"(hi|hello) [a-z]{2,5}", t) for t in generate(llm, {"grammar": lark}))
    gbnf = 'root ::= "x" [0-9] [0-9]'
    assert all(re.fullmatch(r"x[0-9]{2}", t) for t in generate(llm, {"grammar": gbnf}))


def test_a_constrained_request_leaves_an_unconstrained_one_in_its_batch_alone(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], plain, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"regex": "[a-z ]{1,40}"})
    together = llm.generate([PROMPTS[0], PROMPTS[1]], [plain, constrained], use_tqdm=False)
    assert together[0].outputs[0].token_ids == alone
    assert re.fullmatch("[a-z ]{1,40}", together[1].outputs[0].text)


def test_preemption_and_speculative_decoding_keep_the_output_valid(tiny_model_dir):
    # 4 KV blocks of 16 tokens for six requests: they preempt each other and are recomputed.
    small = LLM(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=128, block_size=16,
                kv_cache_memory=4 * 16 * 2 * 2 * 4 * 32 * 4, max_num_seqs=6,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    texts = generate(small, {"json": SCHEMA, "disable_any_whitespace": True}, prompts=PROMPTS * 2, max_tokens=60)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert small.llm_engine.stats().spec_decode.num_drafts == 0  # constrained rows get no proposals


@pytest.mark.parametrize("constraint,field,message", [
    ({"json": {"type": "objectx"}}, "structured_outputs.json", "objectx"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"regex": "[a-"}, "structured_outputs.regex", ""),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar", ""),
])
def test_a_bad_constraint_is_refused_before_it_is_queued(llm, constraint, field, message):
    with pytest.raises(InvalidRequestError, match=rf"^{re.escape(field)}: .*{re.escape(message)}"):
        llm.llm_engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=constraint))
    assert not llm.llm_engine.has_unfinished_requests()


def test_exactly_one_kind_of_constraint():
    with pytest.raises(ValueError, match="give exactly one of json, regex, choice, grammar, json_object; got json, regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="got none"):
        SamplingParams(structured_outputs={})
    with pytest.raises(ValueError, match="unknown field.*guided_json"):
        SamplingParams(structured_outputs={"guided_json": SCHEMA})
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice="yes")


def test_llm_chat_renders_the_template_and_takes_a_constraint(llm):
    conversation = [{"role": "user", "content": "Pick a colour."}]
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": ["red", "green"]})
    (one,) = llm.chat(conversation, params, use_tqdm=False)
    assert one.outputs[0].text in ("red", "green")
    template = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert one.prompt == template
    both = llm.chat([conversation, conversation + [{"role": "assistant", "content": "red"},
                                                   {"role": "user", "content": "Another?"}]], params, use_tqdm=False)
    assert [o.outputs[0].text in ("red", "green") for o in both] == [True, True]
    own = llm.chat(conversation, params, use_tqdm=False, chat_template="{{ messages[0]['content'] }} ->")
    assert own[0].prompt == "Pick a colour. ->"
    tools = [{"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}]
    offered = llm.chat(conversation, params, use_tqdm=False, tools=tools,
                       chat_template="{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0]['content'] }}")
    assert offered[0].prompt == "paint;Pick a colour."


@pytest.mark.slow
def test_constraints_need_no_cxx_compiler(tiny_model_dir, tmp_path):
    """The image has no C++ compiler: masking must not go through torch.compile (llguidance's own
    apply_token_bitmask_inplace does, and killed the engine loop in the image)."""
    script = tmp_path / "constrained.py"
    script.write_text(
        "import sys\n"
        "from kvpilot.engine import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir)!r}, dtype='float32', device='cpu', max_model_len=128, "
        "kv_cache_memory=4 << 20)\n"
        "params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={'choice': ['yes', 'no']})\n"
        "print(llm.generate(['Hello'], params, use_tqdm=False)[0].outputs[0].text)\n"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("CXX", "CC")}
    env["PATH"] = str(tmp_path)  # no g++, no gcc: only the interpreter, named by its full path
    run = subprocess.run([sys.executable, "-P", str(script)], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] in ("yes", "no")
