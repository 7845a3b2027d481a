"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the context's tail.

A request that copies or edits text it has seen (rewriting a passage, code edits, quoting the
prompt) keeps producing n-grams that already occur in its context; the tokens after the earlier
occurrence are a good guess for what comes next, and guessing costs no model at all. The longest
tail (``prompt_lookup_max`` tokens) is tried first, down to ``prompt_lookup_min``; the most recent
match wins, since the text being copied is usually the nearest one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.request import Request


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Prompt lookup keeps no state between steps: the tokens are all it reads."""

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [self.lookup(request.all_token_ids, n) for request, n in zip(requests, num_tokens)]

    def lookup(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` proposed continuations of ``token_ids`` (none when no tail recurs)."""
        length = len(token_ids)
        if num_tokens < 1:
            return []
        last = token_ids[-1]
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            tail = list(token_ids[length - n :])
            # Candidate ends: earlier positions holding the tail's last token, newest first; the
            # match must end before the tail itself so at least one token follows it.
            end = length - 2
            while end >= n - 1:
                end = _rfind(token_ids, last, n - 1, end)
                if end < 0:
                    break
                start = end - n + 1
                if list(token_ids[start : end + 1]) == tail:
                    return list(token_ids[end + 1 : end + 1 + num_tokens])
                end -= 1
        return []


def _rfind(token_ids: Sequence[int], token: int, low: int, high: int) -> int:
    """The largest index in [low, high] holding ``token``, or -1."""
    for index in range(high, low - 1, -1):
        if token_ids[index] == token:
            return index
    return -1
