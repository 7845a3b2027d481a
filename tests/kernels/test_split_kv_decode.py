"""Split-KV (flash-decoding): split attention vs the reference, the merge kernel, the split choice."""

from __future__ import annotations

import os

import pytest
import torch

import kvpilot.kernels.split_kv_decode as split_kv
from kvpilot.kernels.paged_attention import paged_attention, paged_attention_reference
from kvpilot.kernels.split_kv_decode import (
    MAX_SPLITS,
    choose_num_splits,
    merge_splits,
    merge_splits_reference,
)

ON_CUDA = os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cuda"

# (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits). Short contexts next to
# long ones leave some splits empty, which the merge must ignore.
CASES = [
    ([1] * 4, [32768, 9000, 17, 1], 32, 8, 128, 16, 16),
    ([1] * 2, [20000, 31000], 32, 8, 128, 16, 32),
    ([1, 1, 1], [5000, 1, 4100], 32, 4, 64, 64, 7),
    ([1, 300], [8000, 4000], 32, 8, 128, 16, 4),  # split also works with a prefill chunk in the batch
] if ON_CUDA else [
    ([1, 1, 1, 1], [1, 5, 70, 33], 8, 2, 32, 8, 3),
    ([1, 1], [100, 64], 4, 4, 16, 16, 2),
    ([1, 1], [129, 40], 8, 1, 64, 32, 8),
    ([1, 6], [50, 23], 4, 2, 16, 8, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"splits{c[6]}-ctx{max(c[1])}")
def test_split_attention_matches_reference(case, dtype, make_batch, assert_close):
    q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits = case
    batch = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype)
    out = paged_attention(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, scale=batch.scale,
                          num_splits=num_splits)
    expected = paged_attention_reference(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                         batch.query_start_loc, batch.scale)
    assert_close(out, expected)


@pytest.mark.parametrize("num_splits,head_dim", [(1, 16), (3, 24), (8, 64)])
def test_merge_kernel_matches_reference(num_splits, head_dim, device):
    gen = torch.Generator().manual_seed(num_splits)
    head_dim_pad = 1 << (head_dim - 1).bit_length()
    num_tokens, num_heads = 5, 3
    partial_out = torch.randn(num_tokens, num_heads, num_splits, head_dim_pad, generator=gen)
    partial_lse = torch.randn(num_tokens, num_heads, num_splits, generator=gen) * 4
    partial_lse[0, :, 0] = float("-inf")  # an empty split
    partial_lse[1, 1, :] = float("-inf")  # a row with no key at all: merges to zeros
    partial_out, partial_lse = partial_out.to(device), partial_lse.to(device)
    out = torch.empty(num_tokens, num_heads, head_dim, device=device)
    merge_splits(partial_out, partial_lse, out)
    expected = merge_splits_reference(partial_out, partial_lse, head_dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, 1], torch.zeros(head_dim, device=device))


def test_split_choice_by_shape(monkeypatch):
    monkeypatch.setattr(split_kv, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # Few sequences, long contexts: split up to the cap.
    assert choose_num_splits(1, 8, 1, 32768, cuda) == MAX_SPLITS
    # Splits shrink as the batch fills the GPU, and vanish once it is full.
    assert 1 < choose_num_splits(8, 8, 1, 32768, cuda) < MAX_SPLITS
    assert choose_num_splits(128, 8, 1, 32768, cuda) == 1
    # Short contexts are not worth a merge; prefill batches and the CPU never split.
    assert choose_num_splits(1, 8, 1, 300, cuda) == 1
    assert choose_num_splits(1, 8, 5, 32768, cuda) == 1
    assert choose_num_splits(1, 8, 1, 32768, torch.device("cpu")) == 1
