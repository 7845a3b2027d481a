"""One sequence the scheduler runs: its tokens, how many of them are in the KV cache, its state.

A user request with ``n > 1`` becomes ``n`` of these (see llm_engine.py); the
scheduler, KV cache manager and model runner only ever see sequences.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.engine.lora.adapter import LoRAAdapter


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says what to change."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV freed, to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self in _FINISHED else None


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


class Request:
    """A sequence whose ``num_computed_tokens`` catch up to ``num_tokens`` (prompt + output).

    There is no prefill or decode phase: a step computes some of the missing
    tokens; when it computes the last one, the model samples the next token.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "params",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "sampling_input",
        "stop_reason",
        "spec_token_ids",
        "lora",
        "lora_slot",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        arrival_time: float,
        sampling_input: Any = None,
        lora: LoRAAdapter | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.num_preemptions = 0  # times its KV was freed and it went back to waiting (either cause)
        # Chained hashes of this sequence's full blocks, filled by the KV cache
        # manager; tokens never change, so they survive preemption.
        self.block_hashes: list[int] = []
        self.sampling_input = sampling_input  # the sampler's per-sequence input, set by the engine
        self.stop_reason: str | int | None = None
        # Proposed next tokens (speculative decoding), not yet verified: the scheduler computes them
        # like any other token and the target model accepts a prefix of them; never in all_token_ids.
        self.spec_token_ids: list[int] = []
        self.lora = lora  # the adapter it runs with, or None for the base model
        self.lora_slot: int | None = None  # the slot its adapter sits in while it runs (engine/lora/manager.py)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model: the seed of its prefix-cache hashes, so blocks
        computed with one adapter are never reused by another or by the base model."""
        return 0 if self.lora is None else self.lora.request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
