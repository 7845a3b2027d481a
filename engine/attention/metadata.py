"""The per-step description of a flat, variable-length batch that attention needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and where its KV lives.

    Sequence i's new tokens are the last ``q_len_i`` positions of its context: query j
    (0-based among its new tokens) sits at position ``seq_len_i - q_len_i + j`` and attends
    causally to keys ``0 .. that position``. That one rule covers prefill, chunked prefill on
    top of a cached prefix, and decode (``q_len_i == 1``).
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32; seq i's rows: query_start_loc[i]:query_start_loc[i+1]
    seq_lens: torch.Tensor  # [num_seqs] int32; context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32; unused entries are 0, never read
    slot_mapping: torch.Tensor  # [num_tokens] int64; K/V destination of each new token, -1 = padding
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU code paths never synchronise with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
