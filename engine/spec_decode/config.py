"""``speculative_config``: vLLM's keys, validated once into a frozen dataclass.

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4})`` and
``kvpilot serve --speculative-config '{"method": "ngram", ...}'`` both end here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvpilot.engine_contract import MAX_NUM_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

# The engine speculates in a step only while at most this many sequences run (see docs/speculative.md):
# on a CPU a decode step over a large batch is bound by compute, not by reading the weights, so
# verifying k extra tokens per sequence costs nearly k times the work and saves little.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2


class SpeculativeConfigError(ValueError):
    """A speculative_config value is invalid; the message names the key and what to change."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int  # proposals per sequence per step (k); live-tunable on the engine
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX  # ngram: longest tail matched
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN  # ngram: shortest tail matched
    model: str | None = None  # draft_model: the draft's folder or .gguf file
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE  # speculate only up to this many running

    def __post_init__(self) -> None:
        _check_choice("method", self.method, SPECULATIVE_METHODS)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_NUM_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, None)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, None)
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, None)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise SpeculativeConfigError(
                    "speculative_config.model: method draft_model needs the draft model's path "
                    "(a smaller model with the target's vocabulary)"
                )
        elif self.model is not None:
            raise SpeculativeConfigError(
                f"speculative_config.model applies only to method draft_model, not {self.method}; remove it"
            )

    @classmethod
    def from_dict(cls, value: Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The config of a ``speculative_config`` mapping (None: no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise SpeculativeConfigError(
                "speculative_config: expected a mapping like "
                f"{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, "
                f"got {type(value).__name__}"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
            )
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise SpeculativeConfigError(f"speculative_config.{required}: this key is required")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpeculativeConfigError(f"speculative_config.{key}: must be one of {', '.join(choices)}; got {value!r}")


def _check_int(key: str, value: object, minimum: int, maximum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
        maximum is not None and value > maximum
    ):
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise SpeculativeConfigError(f"speculative_config.{key}: must be an integer {bound}, got {value!r}")
