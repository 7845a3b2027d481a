"""The engine's side of speculative decoding: which sequences get proposals each step, how many,
and the acceptance counts /metrics reports.

The rule (docs/speculative.md): after a step, every sequence that sampled and is still running gets
up to ``num_speculative_tokens`` proposals for the next step, unless

- more than ``disable_by_batch_size`` sequences are running: a large batch already keeps the
  matmuls busy, so k extra rows per sequence cost nearly k times the work (speculation is off for
  the whole step, and back on by itself when the batch shrinks);
- the sequence uses repetition/presence/frequency penalties, asks for logprobs, or has not reached
  min_tokens: its distribution at a proposed position would depend on the proposals before it;
- it is within one token of max_tokens or max_model_len (proposals are capped to what can still
  be emitted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.request import Request
from kvpilot.engine.spec_decode.config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig


class Proposer(Protocol):
    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Called after every target forward with what it ran (a draft model runs it too)."""
        ...

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Up to num_tokens[i] proposed next tokens for each request (possibly none)."""
        ...


@dataclass(frozen=True)
class SpecDecodeStats:
    """Counters since start, named as vLLM's spec-decode metrics."""

    num_drafts: int = 0  # sequence-steps that verified at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_pos: tuple[int, ...] = ()  # accepted proposals by position (0 = first proposal)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verifying step of a sequence: the accepted proposals plus the one sampled."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class NoSpeculation:
    """The speculator of an engine started without speculative decoding: it never proposes, so every
    step verifies nothing and the engine's step needs no special case for it."""

    enabled = False
    num_speculative_tokens = 0

    def set_num_speculative_tokens(self, value: int) -> None:
        raise ValueError(
            "num_speculative_tokens: this engine runs without speculative decoding; start it with "
            "speculative_config (kvpilot serve --speculative-config '{\"method\": \"ngram\", ...}')"
        )

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        pass

    def propose(self, requests: Sequence[Request], num_running: int) -> None:
        pass

    def record(self, num_drafts: Sequence[int], token_ids: Sequence[Sequence[int]]) -> None:
        pass

    def stats(self) -> None:
        return None


class Speculator:
    enabled = True

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.num_speculative_tokens = config.num_speculative_tokens
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._accepted_per_pos = [0] * MAX_NUM_SPECULATIVE_TOKENS
        self._num_positions = config.num_speculative_tokens  # the largest k used so far

    def set_num_speculative_tokens(self, value: int) -> None:
        """Change k live (0 pauses speculation); the next proposals obey it."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens: must be an integer from 0 (off) to {MAX_NUM_SPECULATIVE_TOKENS}, "
                f"got {value!r}"
            )
        self.num_speculative_tokens = value
        self._num_positions = max(self._num_positions, value)

    def is_active(self, num_running: int) -> bool:
        return self.num_speculative_tokens > 0 and num_running <= self.config.disable_by_batch_size

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        self.proposer.observe(input_ids, positions, metadata)

    def propose(self, requests: Sequence[Request], num_running: int) -> None:
        """Set the proposals of ``requests`` (sequences that just sampled and keep running)."""
        if not self.is_active(num_running):
            return
        chosen: list[Request] = []
        counts: list[int] = []
        for request in requests:
            count = self._num_to_propose(request)
            if count > 0:
                chosen.append(request)
                counts.append(count)
        if chosen:
            for request, proposal in zip(chosen, self.proposer.propose(chosen, counts)):
                request.spec_token_ids = proposal

    def record(self, num_drafts: Sequence[int], token_ids: Sequence[Sequence[int]]) -> None:
        """Count one step's verification: proposals per sequence and the tokens it emitted."""
        for drafted, emitted in zip(num_drafts, token_ids):
            if drafted == 0:
                continue
            accepted = len(emitted) - 1
            self._num_drafts += 1
            self._num_draft_tokens += drafted
            self._num_accepted_tokens += accepted
            for position in range(accepted):
                self._accepted_per_pos[position] += 1

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            num_drafts=self._num_drafts,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=self._num_accepted_tokens,
            accepted_per_pos=tuple(self._accepted_per_pos[: self._num_positions]),
        )

    def _num_to_propose(self, request: Request) -> int:
        params = request.params
        if params.has_penalties or params.logprobs is not None or request.sampling_input.matcher is not None:
            return 0  # (a constrained row: its proposals would have to be checked against the grammar)
        num_output = len(request.output_token_ids)
        if num_output < params.min_tokens:
            return 0
        count = min(self.num_speculative_tokens, self.max_model_len - request.num_tokens)
        if params.max_tokens is not None:
            count = min(count, params.max_tokens - num_output - 1)
        return max(count, 0)
