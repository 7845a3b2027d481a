"""Pure: the part of a request that prefix affinity follows, hashed.

The gateway has no tokenizer, so the prefix is the first ``chars`` characters
of the prompt as the engine would see it begin: a completion's prompt, or a
chat's messages in order (role, then content). With the default of 256
characters (about 60 tokens, several KV blocks) requests that share a system
prompt share a key, while unrelated prompts rarely do.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any


def prompt_prefix(body: dict[str, Any], chars: int) -> str | None:
    """The first ``chars`` characters of the request's prompt; None when it has no text prompt."""
    if "messages" in body:
        parts: list[str] = []
        size = 0
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                return None
            text = f"{message.get('role', '')}\n{_content_text(message.get('content'))}\n"
            parts.append(text)
            size += len(text)
            if size >= chars:
                break
        joined = "".join(parts)
        return joined[:chars] or None
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if not prompt:
            return None
        first = prompt[0]
        if isinstance(first, int):  # token ids: as many ids as characters would be many blocks
            return ",".join(str(t) for t in prompt[:chars])
        prompt = first
    if not isinstance(prompt, str):
        return None
    return prompt[:chars] or None


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def affinity_key(body: dict[str, Any], chars: int) -> bytes | None:
    """The hash prefix affinity follows; None when the request has nothing to follow (or ``chars`` is 0)."""
    if chars <= 0:
        return None
    prefix = prompt_prefix(body, chars)
    if prefix is None:
        return None
    model = str(body.get("model", ""))
    return hashlib.blake2b(f"{model}\0{prefix}".encode(), digest_size=16).digest()


class RecentPrefixes:
    """For each affinity key this gateway routed lately, the pod it last went to; the least recent
    forgotten past ``capacity``. Each gateway replica keeps its own: a hint for the picker
    (picker.pick's ``last_pod`` and ``new_prefix``), never needed for a correct answer."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._pods: OrderedDict[bytes, str] = OrderedDict()

    def last_pod(self, key: bytes) -> str | None:
        return self._pods.get(key)

    def record(self, key: bytes, pod: str) -> None:
        self._pods[key] = pod
        self._pods.move_to_end(key)
        while len(self._pods) > self.capacity:
            self._pods.popitem(last=False)
