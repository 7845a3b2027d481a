"""What the engine hands back for a request: the same shape as vLLM's outputs.

What an output holds depends on the request's ``SamplingParams.output_kind``: everything so far
(CUMULATIVE), only what is new since the request's previous output (DELTA), or everything, once,
when the request has finished (FINAL_ONLY).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.engine.lora import LoRARequest


@dataclass
class CompletionOutput:
    """One of a request's ``n`` generated sequences: all of it so far, or what is new (DELTA)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort"; None while still generating
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Append a later delta of the same sequence to this one."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs.extend(later.logprobs)
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason


@dataclass
class RequestMetrics:
    """time.monotonic() timestamps of a request's life; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # over its sequences: a token after one ends a stall, not a decode step


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    lora_request: LoRARequest | None = None  # the adapter it ran with (None: the model alone)

    def add(self, later: RequestOutput) -> None:
        """Append a later delta output of the same request to this one (DELTA outputs that a slow
        reader takes together); a sequence new in ``later`` joins the list."""
        by_index = {completion.index: completion for completion in self.outputs}
        for completion in later.outputs:
            if completion.index in by_index:
                by_index[completion.index].add(completion)
            else:
                self.outputs.append(completion)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
