"""Structured outputs: a request's tokens constrained to a JSON schema, any JSON object, a regex, a
choice among strings or a Lark grammar, with llguidance (what vLLM and SGLang use by default).

Per request, ``SamplingParams.structured_outputs`` (vLLM's ``StructuredOutputsParams`` names)
says what the output must match; ``GrammarCompiler.matcher`` compiles it once, before anything is
queued (a bad schema, regex or grammar is an ``InvalidRequestError`` naming the field), into one
``llguidance.LLMatcher`` per sequence. The matcher is per-row state the sampler reads: before each
sample it fills the row's bitmask of allowed tokens and the sampler masks the others out; after it
the engine feeds it the token. A preempted sequence keeps its tokens (only its KV cache is
recomputed), so its matcher stays where it was; speculative decoding proposes nothing for
constrained rows. Rows without a constraint pay nothing: no bitmask is built for a batch without
constrained rows.

Compiling a schema is bounded by llguidance's parser limits (its defaults): a grammar beyond them
is refused as invalid rather than stalling the engine.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.request import InvalidRequestError
from kvpilot.kernels import cpu_fused_ops

FIELDS = ("json", "regex", "choice", "grammar", "json_object")
JSON_WHITESPACE = r"[\n\t ]{0,8}"  # what may separate JSON tokens


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What one request's output must match: exactly one of the fields (vLLM's names)."""

    json: str | dict | None = None  # a JSON schema (an object, or its JSON text)
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect), or GBNF (llama.cpp's, with ::=)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without the whitespace between tokens a model may ramble in

    def __post_init__(self) -> None:
        given = [name for name in FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(FIELDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema: an object or its JSON text")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.choice is not None and (isinstance(self.choice, str) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty Lark or GBNF grammar")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")

    @property
    def field(self) -> str:
        return next(name for name in FIELDS if getattr(self, name) not in (None, False))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        unknown = set(data) - set(FIELDS) - {"disable_any_whitespace"}
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(FIELDS)}, disable_any_whitespace")
        return cls(**data)

    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar (its JSON form); ValueError for a schema that is not JSON."""
        import llguidance

        matcher = llguidance.LLMatcher
        # Between JSON tokens: none, or a bounded run (unbounded, a small model can fill its whole
        # budget with newlines and never close the object).
        options = {"whitespace_flexible": False} if self.disable_any_whitespace else \
            {"whitespace_pattern": JSON_WHITESPACE}
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not valid JSON: {exc}") from None
            return matcher.grammar_from_json_schema(schema, defaults=options)
        if self.json_object:
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if self.regex is not None:
            return matcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return matcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

        try:
            grammar = any_to_lark(self.grammar)  # GBNF (::=) becomes Lark; Lark stays as it is
        except GbnfToLarkError as exc:
            raise ValueError(f"not a valid GBNF grammar: {exc}") from None
        return matcher.grammar_from_lark(grammar)


class GrammarCompiler:
    """Turns a request's StructuredOutputsParams into matchers, over the model's tokenizer (its
    llguidance view is built on first use: about a second for a 49k vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size

    @functools.cached_property
    def _lltokenizer(self):
        try:
            import llguidance.hf
        except ImportError:
            raise InvalidRequestError("structured outputs need the llguidance package: "
                                      "pip install 'kvpilot[engine]' (or pip install llguidance)") from None
        return llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size)

    def check(self, params: StructuredOutputsParams) -> str:
        """The constraint's grammar, compiled and checked against the vocabulary; InvalidRequestError
        naming the field when it cannot be. The server calls it off the engine's thread, before it
        queues the request, so the engine's own call finds it cached."""
        import llguidance

        field = f"structured_outputs.{params.field}"
        try:
            grammar = _grammar_text(params)
        except ValueError as exc:
            raise InvalidRequestError(f"{field}: {exc}") from None
        error = _validation_error(grammar, self._lltokenizer)
        if error:
            raise InvalidRequestError(f"{field}: {error}")
        return grammar

    def matchers(self, params: StructuredOutputsParams, count: int) -> list[Any]:
        """``count`` fresh matchers (one per sequence of a request); InvalidRequestError naming the
        field when the constraint cannot be compiled."""
        import llguidance

        field = f"structured_outputs.{params.field}"
        grammar = self.check(params)
        matchers = [llguidance.LLMatcher(self._lltokenizer, grammar) for _ in range(count)]
        if matchers[0].is_error():
            raise InvalidRequestError(f"{field}: {matchers[0].get_error()}")
        return matchers


@functools.lru_cache(maxsize=256)
def _validation_error(grammar: str, lltokenizer: Any) -> str:
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)


@functools.lru_cache(maxsize=256)
def _grammar_text_cached(key: str) -> str:
    return StructuredOutputsParams.from_dict(json.loads(key)).grammar_text()


def _grammar_text(params: StructuredOutputsParams) -> str:
    """The grammar, compiled once per distinct constraint (clients repeat their schemas)."""
    value = getattr(params, params.field)
    key = {params.field: list(value) if params.field == "choice" else value}
    if params.disable_any_whitespace:
        key["disable_any_whitespace"] = True
    # Not sorted: a schema's property order is the order the output writes them in.
    return _grammar_text_cached(json.dumps(key))


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def start_bitmask(matchers: Sequence[Any | None], vocab_size: int) -> Future | None:
    """Start filling the token bitmask of the rows with a matcher on llguidance's own threads (they
    hold no GIL), so it overlaps the step's forward; ``mask_disallowed`` waits for it. None when no
    row has a matcher."""
    rows = _constrained_rows(matchers)
    return None if not rows else _mask_thread().submit(_fill_bitmask, matchers, rows, vocab_size)


def mask_disallowed(logits: torch.Tensor, matchers: Sequence[Any | None], started: Future | None = None
                    ) -> torch.Tensor:
    """``logits`` ([rows, vocab]) with every token its row's matcher disallows at -inf; rows
    without a matcher unchanged. Returns ``logits`` itself when no row has one. ``started``: the
    same rows' bitmask from ``start_bitmask``, filled while the forward ran."""
    if started is None:
        rows = _constrained_rows(matchers)
        if not rows:
            return logits
        bitmask, rows = _fill_bitmask(matchers, rows, logits.shape[1])
    else:
        bitmask, rows = started.result()
    masked = logits[rows]  # a copy: the sampler's logprobs read the model's own logits
    if cpu_fused_ops.usable(masked):
        cpu_fused_ops.apply_token_bitmask_(masked, bitmask)
    else:
        masked = cpu_fused_ops.apply_token_bitmask_reference(masked, bitmask.to(logits.device))
    if len(rows) == logits.shape[0]:
        return masked
    return logits.index_copy(0, torch.tensor(rows, device=logits.device), masked)


def _constrained_rows(matchers: Sequence[Any | None]) -> list[int]:
    return [i for i, matcher in enumerate(matchers) if matcher is not None]


def _fill_bitmask(matchers: Sequence[Any | None], rows: list[int], vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """([len(rows), words] int32 where bit t of word w allows token 32 * w + t for the matcher of row
    rows[i] in row i, rows)."""
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    # All rows in one call into llguidance's own threads: about 0.5 ms a row one by one. Its
    # low-level call, not llguidance.torch's wrapper: importing that module imports torch.compile's
    # machinery (its apply kernel is compiled), 0.6-2.4 s that landed on the first constrained request.
    _executor().unsafe_compute_mask_ptr([(matchers[row], slot) for slot, row in enumerate(rows)],
                                        bitmask.data_ptr(), words * 4, len(rows))
    return bitmask, rows


@functools.cache
def _mask_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpilot-grammar-mask")

