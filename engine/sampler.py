"""Turn one step's logits into next tokens: penalties, min_tokens, greedy or random sampling.

Random draws use the exponential race (``argmax(p / q)`` with ``q ~ Exp(1)`` per token), which
picks token i with probability p_i. Every seeded request draws its own ``q`` from its own
generator, one full vocabulary row per step, so the tokens it samples do not depend on what else
is in the batch. Requests without a seed share one batched draw from torch's default generator.

Logprobs are the model's own distribution (log-softmax of the raw logits), as in vLLM V1.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.structured_outputs import mask_disallowed

# Smallest exponential draw allowed: exponential_() can return 0, and 0/0 would be NaN.
_MIN_EXPONENTIAL = 1e-20


@dataclass
class SamplingInput:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # on the logits' device; seeded when params.seed is set
    matcher: Any = None  # an llguidance.LLMatcher when the output is constrained (structured outputs)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # For requests with params.logprobs = k: the top-k token -> logprob plus the sampled token's.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def sample(self, logits: torch.Tensor, inputs: Sequence[SamplingInput], grammar_mask: Future | None = None
               ) -> SamplerOutput:
        """logits: [num_requests, vocab_size] float32, one row per input, in order. ``grammar_mask``:
        the constrained rows' token bitmask, started before the forward (structured_outputs.start_bitmask)."""
        if logits.shape[0] != len(inputs):
            raise ValueError(f"got {logits.shape[0]} rows of logits for {len(inputs)} sampling inputs")
        processed = self._apply_min_tokens(logits, inputs)
        processed = _apply_penalties(processed, inputs)
        processed = mask_disallowed(processed, [inp.matcher for inp in inputs], grammar_mask)
        token_ids = processed.argmax(dim=-1)  # [num_requests]; right for greedy rows
        random_rows = [i for i, inp in enumerate(inputs) if not inp.params.is_greedy]
        if random_rows:
            token_ids[random_rows] = _sample_random(processed[random_rows], [inputs[i] for i in random_rows])
        sampled = token_ids.tolist()
        return SamplerOutput(token_ids=sampled, logprobs=_logprobs(logits, inputs, sampled))

    def _apply_min_tokens(self, logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> torch.Tensor:
        """Forbid EOS and stop_token_ids for requests that have not produced min_tokens yet."""
        vocab = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for i, inp in enumerate(inputs):
            params = inp.params
            if len(inp.output_token_ids) >= params.min_tokens:
                continue
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(self.eos_token_ids)
            banned_ids = [t for t in banned if t < vocab]
            rows.extend([i] * len(banned_ids))
            cols.extend(banned_ids)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = -float("inf")
        return logits


def _apply_penalties(logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens; presence/frequency over output tokens."""
    rows = [i for i, inp in enumerate(inputs) if inp.params.has_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    device, vocab = logits.device, logits.shape[1]
    chosen = [inputs[i] for i in rows]
    # One spare column absorbs the padding of ragged id lists; it is dropped afterwards.
    output_counts = _token_counts([inp.output_token_ids for inp in chosen], vocab, device)  # [r, vocab]
    prompt_seen = _token_counts([inp.prompt_token_ids for inp in chosen], vocab, device) > 0
    sub = logits[rows]  # [r, vocab]

    repetition = torch.tensor([inp.params.repetition_penalty for inp in chosen], device=device)[:, None]
    seen = prompt_seen | (output_counts > 0)
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)

    frequency = torch.tensor([inp.params.frequency_penalty for inp in chosen], device=device)[:, None]
    presence = torch.tensor([inp.params.presence_penalty for inp in chosen], device=device)[:, None]
    sub = sub - frequency * output_counts - presence * (output_counts > 0).float()
    logits[rows] = sub
    return logits


def _token_counts(id_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    longest = max((len(ids) for ids in id_lists), default=0)
    padded = torch.full((len(id_lists), max(longest, 1)), vocab, dtype=torch.int64)
    for row, ids in enumerate(id_lists):
        if ids:
            padded[row, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64).clamp_(max=vocab)
    counts = torch.zeros(len(id_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _sample_random(logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> torch.Tensor:
    """logits: [r, vocab] of non-greedy requests -> sampled token ids [r]."""
    return sample_from_probs(random_probs(logits, [inp.params for inp in inputs]), inputs)


def random_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [r, vocab] -> the distribution [r, vocab] a random row samples from: temperature,
    then top-k / top-p, then min-p (penalties and min_tokens are applied to the logits before)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temperature
    if any(p.uses_top_k or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, -float("inf"))
    return logits.softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, inputs: Sequence[SamplingInput]) -> torch.Tensor:
    """probs: [r, vocab], one row per input (rows need not sum to 1) -> token ids [r], each drawn with
    its row's probabilities, from the input's own generator when it has one."""
    device = probs.device
    q = torch.empty_like(probs)
    unseeded = [i for i, inp in enumerate(inputs) if inp.generator is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_()
    for i, inp in enumerate(inputs):
        if inp.generator is not None:
            q[i].exponential_(generator=inp.generator)
    return (probs / q.clamp_min_(_MIN_EXPONENTIAL)).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Keep each row's top_k tokens and its smallest set whose probability reaches top_p."""
    device, vocab = logits.device, logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [r, vocab]
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([p.top_k if p.uses_top_k else vocab for p in params], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, -float("inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Probability mass strictly before each token; the first token always survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, -float("inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(
    logits: torch.Tensor, inputs: Sequence[SamplingInput], sampled: list[int]
) -> list[dict[int, float] | None]:
    result: list[dict[int, float] | None] = [None] * len(inputs)
    rows = [i for i, inp in enumerate(inputs) if inp.params.logprobs is not None]
    if not rows:
        return result
    logprobs = logits[rows].float().log_softmax(dim=-1)  # [r, vocab]
    most = max(inputs[i].params.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (None, None)
    sampled_ids = torch.tensor([sampled[i] for i in rows], device=logits.device)
    chosen = logprobs[torch.arange(len(rows), device=logits.device), sampled_ids].tolist()
    top_values_list = top_values.tolist() if top_values is not None else None
    top_ids_list = top_ids.tolist() if top_ids is not None else None
    for r, i in enumerate(rows):
        k = inputs[i].params.logprobs or 0
        entry: dict[int, float] = {}
        if k and top_ids_list is not None and top_values_list is not None:
            entry = dict(zip(top_ids_list[r][:k], top_values_list[r][:k], strict=True))
        entry[sampled[i]] = chosen[r]
        result[i] = entry
    return result
