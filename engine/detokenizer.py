"""Incremental detokenization with stop strings, correct across multi-byte characters.

Each new token is decoded inside a small window of the tokens before it (starting with the
prompt's tail, so tokenizers that drop a leading space at the start of a text still render it).
Text is committed only when the window's decoding does not end in U+FFFD, i.e. once a UTF-8
character split across byte tokens is complete; one still incomplete when the output ends is
never shown (as in vLLM). Two short decodes per token keep the cost flat
however long the output grows.

Stop strings are searched for in the committed text as it grows (once ``min_tokens`` tokens are
out, as in vLLM); ``pop_delta`` holds back a
tail that could still turn into a stop string, so a stream never shows text that a stop later
removes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.engine.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output, for context-dependent decoders (e.g. SentencePiece).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # The Rust tokenizer directly: transformers' decode adds per-call overhead we pay per token.
        self._decode_fn = backend.decode if backend is not None else tokenizer.decode
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = tuple(params.stop)
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_output_tokens = 0
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: already-committed context
        self._read_offset = len(self._ids)  # tokens before this are committed text
        self._text = ""
        self._emitted = 0  # characters of _text handed out by pop_delta
        self._stop_string: str | None = None

    @property
    def text(self) -> str:
        """Output text so far (without a matched stop string unless include_stop_str_in_output)."""
        return self._text

    @property
    def emitted_text(self) -> str:
        """The text ``pop_delta`` has handed out so far."""
        return self._text[: self._emitted]

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, once one has matched."""
        return self._stop_string

    def append(self, token_id: int) -> str | None:
        """Add one output token; return the stop string it completed, if any."""
        if self._stop_string is not None:
            raise RuntimeError("output already ended at a stop string; no more tokens can be appended")
        self._ids.append(token_id)
        self._num_output_tokens += 1
        return self._decode_window()

    def pop_delta(self, finished: bool) -> str:
        """Text added since the last call.

        Until ``finished``, holds back any tail that might still become a stop string.
        """
        end = len(self._text)
        if not finished and self._stop_string is None and not self._include_stop:
            end -= self._possible_stop_prefix_len()
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

    def _decode_window(self) -> str | None:
        committed = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if window.endswith(_REPLACEMENT_CHAR):
            return None  # a multi-byte character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._commit(window[len(committed) :])

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self._skip_special_tokens)

    def _commit(self, delta: str) -> str | None:
        if not delta:
            return None
        # A stop string may straddle the old text and the delta.
        search_from = max(0, len(self._text) - self._longest_stop + 1)
        self._text += delta
        if self._num_output_tokens < self._min_tokens:
            return None  # as in vLLM, stop strings count only once min_tokens are out
        match_at, matched = -1, None
        for stop in self._stops:
            at = self._text.find(stop, search_from)
            if at != -1 and (match_at == -1 or at < match_at):
                match_at, matched = at, stop
        if matched is None:
            return None
        self._stop_string = matched
        self._text = self._text[: match_at + len(matched) if self._include_stop else match_at]
        return matched

    def _possible_stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = min(self._longest_stop - 1, len(self._text) - self._emitted)
        for length in range(longest, 0, -1):
            tail = self._text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
