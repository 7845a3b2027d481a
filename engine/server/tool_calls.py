"""Tool calling on the chat API: the constraint ``tool_choice`` puts on the output, and the
parsers that find the calls in a model's text (``kvpilot serve --tool-call-parser``).

``tool_choice`` decides how calls come out of the model:

Both constraints write compact JSON (as OpenAI's arguments are): with whitespace allowed between
tokens a small model pads and repeats until its token budget runs out.

- ``"required"``: the output is constrained to a JSON array of one or more calls
  (``[{"name": ..., "arguments": {...}}]``, one item when ``parallel_tool_calls`` is false),
  each ``arguments`` matching its tool's ``parameters`` schema, so even a small model returns a
  valid call; it is read back with the ``json`` parser.
- a named function: the output is constrained to that function's arguments object.
- ``"auto"``: the model writes what it wants and the server's parser finds the calls in it:
  ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format of most
  open models' templates) or ``json`` (the whole answer is one call object or an array of them).
- ``"none"``: the tools reach the chat template, nothing is parsed.

A parser reads a growing text: ``parse(text, final)`` returns the plain content so far and the
calls so far, the last one's arguments possibly still growing. Each result extends the one before
(content and arguments only grow), so the stream sends differences: a call's id and name when it
appears, then pieces of its arguments, as OpenAI streams them.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.structured_outputs import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a tool without `parameters` takes any arguments object


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object; may still grow while ``complete`` is false
    complete: bool = True


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser(abc.ABC):
    """Finds tool calls in a model's text."""

    name: str

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls in ``text``. While not ``final``, text that may still turn out to
        be a call is held back from the content."""


class NamedFunctionParser(ToolCallParser):
    """tool_choice naming a function: the whole (constrained) output is that call's arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        arguments = text.strip()
        return Parsed("", [ToolCall(self.function, arguments, final)] if arguments or final else [])


class JsonParser(ToolCallParser):
    """The whole answer is one call (``{"name": ..., "arguments": {...}}``) or an array of them;
    ``parameters`` is accepted for ``arguments`` (Llama 3's spelling). Anything else is content."""

    name = "json"

    def parse(self, text: str, final: bool) -> Parsed:
        start = _skip_whitespace(text, 0)
        if start == len(text):
            return Parsed(text if final else "")
        if text[start] not in "{[":
            return Parsed(text)
        calls, end = _scan_calls(text, start)
        if final and (end is None or text[end:].strip() or not _all_valid(calls)):
            return Parsed(text)  # not (only) calls after all: the model answered in JSON
        return Parsed("", calls)


class HermesParser(ToolCallParser):
    """Calls in ``<tool_call>...</tool_call>`` tags (Hermes, Qwen2.5, SmolLM3, the example template
    in examples/chat-templates/). The content is the text before the first tag."""

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.open_tag)
        if first < 0:
            held = 0 if final else _partial_suffix(text, self.open_tag)
            return Parsed(text[: len(text) - held])
        content, calls, position = text[:first], [], first
        while position >= 0:
            body_start = position + len(self.open_tag)
            close = text.find(self.close_tag, body_start)
            body_end = close if close >= 0 else len(text)
            call_start = _skip_whitespace(text, body_start)
            found = _scan_calls(text[:body_end], call_start)[0] if text.startswith("{", call_start) else []
            if not found and (final or close >= 0):
                found = [ToolCall("", "", False)]  # a closed tag without a call object in it
            calls.extend(found)
            position = text.find(self.open_tag, close) if close >= 0 else -1
        if final and not _all_valid(calls):
            return Parsed(text)
        return Parsed(content, calls)


PARSERS: dict[str, type[ToolCallParser]] = {parser.name: parser for parser in (HermesParser, JsonParser)}


def constraint(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
               parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """The output constraint of ``tool_choice`` over ``tools`` (OpenAI's function definitions):
    a JSON schema for ``required`` and a named function, none for ``auto`` and ``none``."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        (function,) = [tool["function"] for tool in tools if tool["function"]["name"] == name]
        return StructuredOutputsParams(json=function.get("parameters") or ANY_OBJECT, disable_any_whitespace=True)
    if tool_choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def parser_for(tool_choice: str | dict[str, Any], auto_parser: str | None) -> ToolCallParser | None:
    """The parser that reads the calls back: None for ``none`` (nothing to find)."""
    if isinstance(tool_choice, dict):
        return NamedFunctionParser(tool_choice["function"]["name"])
    if tool_choice == "required":
        return JsonParser()
    if tool_choice == "auto":
        assert auto_parser is not None, "the server refuses auto without --tool-call-parser"
        return PARSERS[auto_parser]()
    return None


# ---- a small scanner for JSON that may still be growing ----------------------------------------


def _scan_calls(text: str, start: int) -> tuple[list[ToolCall], int | None]:
    """The calls in the object or array at ``start`` and the index after it (None while open)."""
    if text[start] == "{":
        call, end = _scan_call(text, start)
        return ([call] if call is not None else []), end
    calls, position = [], start + 1
    while True:
        position = _skip_whitespace(text, position)
        if position == len(text):
            return calls, None
        if text[position] == "]":
            return calls, position + 1
        if text[position] == ",":
            position += 1
            continue
        if text[position] != "{":
            calls.append(ToolCall("", "", False))  # not a call object: invalid when final
            return calls, None
        call, end = _scan_call(text, position)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls, None
        position = end


def _scan_call(text: str, start: int) -> tuple[ToolCall | None, int | None]:
    """One ``{"name": ..., "arguments": ...}`` object at ``start``: the call once its name is
    known (arguments as far as they go), and the index after the object (None while open)."""
    name: str | None = None
    arguments, arguments_done = "", False
    position = start + 1
    while True:
        position = _skip_whitespace(text, position)
        if position == len(text):
            break
        if text[position] == "}":
            if name is None:
                return ToolCall("", "", False), position + 1
            if arguments.startswith('"'):  # arguments sent as a JSON string holding the object
                decoded = _loads(arguments)
                arguments = decoded if isinstance(decoded, str) else arguments
            return ToolCall(name, arguments, arguments_done), position + 1
        if text[position] == ",":
            position += 1
            continue
        key_end = _value_end(text, position) if text[position] == '"' else None
        key = _loads(text[position:key_end]) if key_end is not None else None
        if not isinstance(key, str):
            break
        colon = _skip_whitespace(text, key_end)
        if colon == len(text) or text[colon] != ":":
            break
        value_start = _skip_whitespace(text, colon + 1)
        value_end = _value_end(text, value_start)
        if value_end == value_start:
            break  # no value where one must be
        if key == "name":
            if value_end is None:
                break
            value = _loads(text[value_start:value_end])
            name = value if isinstance(value, str) else ""
        elif key in ("arguments", "parameters"):
            arguments = text[value_start:value_end if value_end is not None else len(text)].rstrip()
            arguments_done = value_end is not None
            if value_end is None:
                break
        elif value_end is None:
            break
        position = value_end
    # Arguments stream only once the name is known and only while they are an object.
    growing = name is not None and arguments.startswith("{")
    return (ToolCall(name, arguments if growing else "", False) if name is not None else None), None


def _value_end(text: str, start: int) -> int | None:
    """The index after the JSON value at ``start``, or None if it is not complete in ``text``."""
    if start >= len(text):
        return None
    opener = text[start]
    if opener == '"':
        position = start + 1
        while position < len(text):
            if text[position] == "\\":
                position += 2
            elif text[position] == '"':
                return position + 1
            else:
                position += 1
        return None
    if opener in "{[":
        depth, position = 0, start
        while position < len(text):
            char = text[position]
            if char == '"':
                end = _value_end(text, position)
                if end is None:
                    return None
                position = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return position + 1
            position += 1
        return None
    position = start  # a number, true, false or null: it ends where a delimiter starts
    while position < len(text) and text[position] not in ",}] \n\t\r":
        position += 1
    return position if position < len(text) else None


def _loads(text: str) -> Any:
    """The JSON value in ``text``, or None when it is not valid JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \n\t\r":
        position += 1
    return position


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that ``tag`` starts with (it may become the tag)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _all_valid(calls: list[ToolCall]) -> bool:
    """Every call complete, named, with a JSON object for arguments."""
    for call in calls:
        if not (call.complete and call.name):
            return False
        try:
            if not isinstance(json.loads(call.arguments), dict):
                return False
        except json.JSONDecodeError:
            return False
    return bool(calls)
