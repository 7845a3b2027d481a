"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kvpilot.engine.structured_outputs import StructuredOutputsParams

# Below this a temperature means greedy: dividing logits by it would only overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs carries (vLLM's names and meanings)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only the tokens, text and logprobs new since the request's previous output
    FINAL_ONLY = 2  # one output, once the request has finished


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)  # a single string is accepted
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per token, plus the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # What the output must match (a JSON schema, a regex, ...: engine/structured_outputs.py); a dict
    # of StructuredOutputsParams' fields is taken too.
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature, "a number >= 0 (0 means greedy)", lambda v: v >= 0)
        _check_number("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 or -1 to disable it; got {self.top_k!r}")
        _check_number("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
        _check_number("presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_number("frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_number("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)", lambda v: v > 0)
        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop[{i}] must be a non-empty string; got {stop!r}")
        for i, token_id in enumerate(self.stop_token_ids):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids[{i}] must be a non-negative integer token id; got {token_id!r}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]; got {self.logprobs}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind; got {self.output_kind!r}")


def _check_int(name: str, value: object, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {bound}; got {value!r}")


def _check_number(name: str, value: object, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
