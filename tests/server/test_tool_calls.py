"""The tool-call parsers and tool_choice's constraint (engine/server/tool_calls.py), as pure
functions: what they find in a finished text, and that reading the text as it grows (every prefix,
as a stream sees it) only ever extends content and arguments and ends where the finished parse does."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvpilot import engine_contract
from kvpilot.engine.server import tool_calls
from kvpilot.engine.server.tool_calls import HermesParser, JsonParser, NamedFunctionParser, ToolCall

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def calls(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def test_hermes_finds_each_tagged_call_and_the_content_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"arguments": {"city": "Rome, \\"Italy\\""}, "name": "get_weather"}</tool_call>')
    parsed = HermesParser().parse(text, final=True)
    assert parsed.content == "Let me check.\n"
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": 'Rome, "Italy"'})]


def test_hermes_without_a_call_is_all_content_and_a_broken_call_falls_back_to_content():
    assert HermesParser().parse("Paris is in France.", final=True) == tool_calls.Parsed("Paris is in France.")
    broken = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert HermesParser().parse(broken, final=True) == tool_calls.Parsed(broken)
    no_object = "<tool_call>get_weather(Paris)</tool_call>"
    assert HermesParser().parse(no_object, final=True) == tool_calls.Parsed(no_object)


def test_hermes_accepts_parameters_and_arguments_given_as_a_json_string():
    text = '<tool_call>{"name": "get_weather", "parameters": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert calls(HermesParser().parse(text, final=True)) == [("get_weather", {"city": "Oslo"})]


def test_json_reads_one_call_or_a_list_and_leaves_other_json_as_content():
    one = '{"name": "get_time", "arguments": {}}'
    assert calls(JsonParser().parse(one, final=True)) == [("get_time", {})]
    two = ' [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Lima"}}]'
    assert calls(JsonParser().parse(two, final=True)) == [("get_time", {}), ("get_weather", {"city": "Lima"})]
    for answer in ('{"answer": "yes"}', "Plain words.", '{"name": "get_time", "arguments": {}} and more', "[1, 2]"):
        assert JsonParser().parse(answer, final=True) == tool_calls.Parsed(answer), answer


@pytest.mark.parametrize("parser,text", [
    (HermesParser(), 'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "São {Paulo}"}}\n'
                     '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": ["UTC", 1]}}</tool_call>'),
    (HermesParser(), "No call here, just <tool text and <tool_"),
    (JsonParser(), '[{"name": "get_weather", "arguments": {"city": "Lima\\n"}}, {"name": "get_time", "arguments": '
                   '{"x": [true, null, 1.5]}}]'),
    (JsonParser(), '{"city": "not a call"}'),
    (NamedFunctionParser("get_weather"), '{ "city" : "Paris" }'),
])
def test_a_growing_text_only_extends_what_was_already_read(parser, text):
    final = parser.parse(text, final=True)
    content, arguments = "", {}
    for end in range(len(text) + 1):
        parsed = parser.parse(text[:end], final=end == len(text))
        assert parsed.content.startswith(content), (text[:end], parsed.content, content)
        content = parsed.content
        named = [call for call in parsed.calls if call.name]
        assert len(named) >= len(arguments)
        for index, call in enumerate(named):
            assert call.arguments.startswith(arguments.get(index, "")), (text[:end], call)
            arguments[index] = call.arguments
    assert content == final.content
    assert [arguments[i] for i in range(len(arguments))] == [call.arguments for call in final.calls]


def test_arguments_grow_only_after_the_name_is_known():
    partial = HermesParser().parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', final=False)
    assert partial.calls == [ToolCall("get_weather", '{"city": "Pa', complete=False)]
    before_name = HermesParser().parse('<tool_call>{"arguments": {"city": "Pa', final=False)
    assert before_name.calls == []


def test_required_constrains_to_a_list_of_calls_matching_each_tools_schema():
    constraint = tool_calls.constraint([WEATHER, TIME], "required", parallel_tool_calls=True)
    schema = constraint.json
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_calls.constraint([WEATHER, TIME], "required", parallel_tool_calls=False).json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, single)


def test_a_named_function_constrains_to_its_arguments_and_auto_and_none_constrain_nothing():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_calls.constraint([WEATHER, TIME], named, True).json == WEATHER["function"]["parameters"]
    assert tool_calls.constraint([TIME], {"type": "function", "function": {"name": "get_time"}}, True).json == \
        {"type": "object"}
    assert tool_calls.constraint([WEATHER], "auto", True) is None
    assert tool_calls.constraint([WEATHER], "none", True) is None
    assert tool_calls.parser_for("none", "hermes") is None
    assert isinstance(tool_calls.parser_for("auto", "json"), JsonParser)


def test_the_flags_choices_are_the_parsers():
    assert engine_contract.TOOL_CALL_PARSERS == tuple(tool_calls.PARSERS)
