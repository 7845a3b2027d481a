"""Which proposed tokens the target model accepts, so that its output distribution is unchanged.

Every proposer here is deterministic (prompt lookup; a draft model decoding greedily): its
distribution q at a position puts all mass on the proposed token d. The rule of speculative
sampling (Leviathan et al., Chen et al.) with that q reads: accept d with probability
min(1, p(d) / q(d)) = p(d), where p is the target's distribution at that position (after
temperature, top-k, top-p, min-p: what the plain sampler would draw from); on the first
rejection draw from the residual max(p - q, 0) renormalised, which is p with d removed, and stop;
when every proposal is accepted, draw one bonus token from p at the position after the last.
Summing over accept and reject, each emitted token is distributed exactly as p, so sampling
with proposals is sampling from the target. Greedy rows are the limit: accept while d is the
target's argmax, then emit the argmax — token for token what decoding without proposals emits.

Random draws come from a seeded request's own generator (so its output is reproducible for a
given configuration), else from torch's default generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from kvpilot.engine.sampler import SamplingInput, random_probs, sample_from_probs


def rejection_sample(
    logits: torch.Tensor, drafts: Sequence[Sequence[int]], inputs: Sequence[SamplingInput]
) -> list[list[int]]:
    """Each request's emitted tokens: its accepted proposals, then one sampled token.

    logits: [sum(len(d) + 1 for d in drafts), vocab] float32, the target's rows of each request in
    order: row j of request i is the distribution of the token after its j-th proposal (row 0: after
    its last verified token). Penalties and min_tokens must not apply to these requests (the engine
    proposes nothing for them); logprobs are not computed here.
    """
    num_rows = sum(len(d) + 1 for d in drafts)
    if logits.shape[0] != num_rows or len(drafts) != len(inputs):
        raise ValueError(
            f"got {logits.shape[0]} rows of logits and {len(inputs)} sampling inputs for {len(drafts)} "
            f"requests with {num_rows} rows"
        )
    device = logits.device
    starts = [0, *accumulate(len(d) + 1 for d in drafts)]  # each request's first row

    emitted: list[list[int]] = [[] for _ in drafts]
    greedy = [i for i, inp in enumerate(inputs) if inp.params.is_greedy]
    if greedy:
        argmax = logits.argmax(dim=-1).tolist()  # [num_rows]
        for i in greedy:
            emitted[i] = _accept_greedy(drafts[i], argmax[starts[i] : starts[i] + len(drafts[i]) + 1])

    randoms = [i for i, inp in enumerate(inputs) if not inp.params.is_greedy]
    if not randoms:
        return emitted
    rows = [starts[i] + j for i in randoms for j in range(len(drafts[i]) + 1)]
    params = [inputs[i].params for i in randoms for _ in range(len(drafts[i]) + 1)]
    probs = random_probs(logits[rows], params)  # [r, vocab], r = the random requests' rows
    draft_rows: list[int] = []  # rows of probs that judge a proposal, and the proposals
    draft_tokens: list[int] = []
    local = 0
    for i in randoms:
        draft_rows.extend(range(local, local + len(drafts[i])))
        draft_tokens.extend(drafts[i])
        local += len(drafts[i]) + 1
    accept_p = probs[draft_rows, draft_tokens].tolist() if draft_rows else []  # p(d) per proposal

    final_rows: list[int] = []  # per random request: the row its last token is drawn from
    rejected: list[int | None] = []  # the proposal removed from that row, if it was rejected there
    local = 0
    cursor = 0
    for i in randoms:
        draft = drafts[i]
        uniforms = _uniforms(len(draft), inputs[i].generator, device)
        accepted = 0
        while accepted < len(draft) and uniforms[accepted] < accept_p[cursor + accepted]:
            accepted += 1
        emitted[i] = list(draft[:accepted])
        final_rows.append(local + accepted)
        rejected.append(draft[accepted] if accepted < len(draft) else None)
        cursor += len(draft)
        local += len(draft) + 1
    final = probs[final_rows]  # [len(randoms), vocab]
    for k, token in enumerate(rejected):
        if token is not None:
            final[k, token] = 0.0  # the residual max(p - onehot(d), 0); the draw renormalises it
    tokens = sample_from_probs(final, [inputs[i] for i in randoms]).tolist()
    for i, token in zip(randoms, tokens):
        emitted[i].append(token)
    return emitted


def _accept_greedy(draft: Sequence[int], argmax: list[int]) -> list[int]:
    """argmax: the target's choice at each of len(draft) + 1 rows."""
    out = []
    for proposed, target in zip(draft, argmax):
        out.append(target)
        if proposed != target:
            return out
    out.append(argmax[len(draft)])
    return out


def _uniforms(count: int, generator: torch.Generator | None, device: torch.device) -> list[float]:
    if count == 0:
        return []
    return torch.rand(count, generator=generator, device=device).tolist()
