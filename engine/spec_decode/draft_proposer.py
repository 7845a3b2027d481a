"""A draft model: a smaller model with the target's vocabulary proposes tokens by decoding greedily.

The draft keeps its own KV cache with the target's layout — the same number of blocks of the same
size, indexed by the same block tables — so it needs no block manager of its own: a slot holds the
target's KV of a token in the target's cache and the draft's KV of the same token in the draft's.
Two things keep the draft's cache in step with the target's:

- ``observe``: after every target forward, the draft runs the same batch (same tokens, positions,
  slots). Prompt chunks, recomputation after preemption and verified proposals all land in both
  caches, so a prefix-cache hit finds the draft's KV too. Slots of rejected proposals are rewritten
  when their position is computed again, as in the target's cache.
- ``propose``: k greedy decode steps over the requests that get proposals, writing the draft's KV
  of its own guesses into the slots the next step will verify them in. Those slots are reserved
  first (``reserve``: the KV cache manager's allocate_slots for 1 + k tokens, what the next step
  needs anyway); a request that cannot get them gets no proposals.

Greedy drafting makes the proposal distribution one-hot, which is what rejection_sampler.py assumes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

from kvpilot.engine.attention import AttentionBackend, AttentionMetadata
from kvpilot.engine.models import CausalLM
from kvpilot.engine.request import Request


class DraftModelProposer:
    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
        reserve: Callable[[Request, int], list[int] | None],
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.reserve = reserve  # (request, tokens after its computed ones) -> its block table, or None
        arch = model.arch
        shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(arch.num_layers)]

    @torch.inference_mode()
    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Run the target's step on the draft (its KV is what this is for; the output is dropped)."""
        self.model(input_ids, positions, self.kv_caches, metadata, self.backend)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        live: list[int] = []  # indices of requests still proposing
        tables: list[list[int]] = []
        for i, (request, count) in enumerate(zip(requests, num_tokens)):
            table = self.reserve(request, 1 + count)
            if table is not None:
                live.append(i)
                tables.append(table)
        if not live:
            return proposals
        # Each live request feeds its last token at position num_tokens - 1, then its own guesses.
        tokens = [requests[i].all_token_ids[-1] for i in live]
        positions = [requests[i].num_tokens - 1 for i in live]
        for step in range(max(num_tokens[i] for i in live)):
            guesses = self._decode(tokens, positions, tables)
            still: list[int] = []
            for row, i in enumerate(live):
                proposals[i].append(guesses[row])
                if len(proposals[i]) < num_tokens[i]:
                    still.append(row)
            live = [live[row] for row in still]
            tokens = [guesses[row] for row in still]
            positions = [positions[row] + 1 for row in still]
            tables = [tables[row] for row in still]
            if not live:
                break
        return proposals

    def _decode(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> list[int]:
        """One token per sequence at ``positions``; returns the draft's greedy next tokens."""
        num_seqs = len(tokens)
        device = self.device
        max_blocks = max(map(len, tables))
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int64)  # [num_seqs]
        slot_mapping = block_tables[torch.arange(num_seqs), positions_t // self.block_size].long() * self.block_size + (
            positions_t % self.block_size
        )  # [num_seqs]
        seq_lens = [p + 1 for p in positions]
        query_start_loc = list(accumulate([0] + [1] * num_seqs))
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            slot_mapping=slot_mapping.to(device),
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        hidden = self.model(input_ids, positions_t.to(device), self.kv_caches, metadata, self.backend)
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()  # [num_seqs]
