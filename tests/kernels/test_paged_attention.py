"""Paged attention kernel vs its torch reference: mixed prefill/decode batches, GQA, odd shapes."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvpilot.kernels.paged_attention import (
    AttentionLaunchConfig,
    paged_attention,
    paged_attention_reference,
)

ON_CUDA = os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cuda"

# (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size): each sequence's queries are the
# last q_len of its seq_len positions, so q_len < seq_len is a chunk on top of a cached prefix.
SMALL_CASES = [
    ([1, 7, 1, 19, 3], [13, 7, 40, 45, 3], 4, 4, 32, 8),  # GQA 1, prompt + chunks + decodes
    ([5, 1, 12], [30, 17, 12], 4, 2, 16, 16),  # GQA 2
    ([1, 1, 9, 2], [70, 1, 40, 33], 8, 2, 64, 32),  # GQA 4, a one-token context
    ([16, 1], [50, 9], 8, 1, 32, 8),  # GQA 8 (multi-query)
    ([4, 1, 6], [21, 33, 6], 6, 2, 32, 16),  # GQA 3: group not a power of two
    ([3, 1], [11, 26], 4, 4, 24, 8),  # head_dim 24: padded to 32 inside the kernel
    ([2, 1], [130, 5], 4, 2, 16, 128),  # block_size 128
    ([2, 1], [9, 14], 4, 2, 8, 8),  # head_dim 8: padded to the 16 lanes a tile needs
]
LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)
REAL_CASES = [
    ([1] * 24 + [300, 64, 1000], [2048] * 8 + [517] * 8 + [4001] * 8 + [300, 900, 3000], 32, 8, 128, 16),
    ([1] * 32, [4096 + 13 * i for i in range(32)], 32, 8, 128, 16),
    ([777, 1, 129], [777, 2000, 5000], 32, 32, 128, 32),
    ([1, 200, 1], [1500, 1700, 3], 16, 8, 64, 8),
    ([1, 100, 1], [3000, 2100, 30], 32, 4, 128, 128),
]
CASES = REAL_CASES if ON_CUDA else SMALL_CASES


def _run(batch, **kwargs) -> torch.Tensor:
    return paged_attention(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                           max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, scale=batch.scale,
                           **kwargs)


def _reference(batch) -> torch.Tensor:
    return paged_attention_reference(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens,
                                     batch.query_start_loc, batch.scale)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[2]}kv{c[3]}d{c[4]}bs{c[5]}n{len(c[0])}")
def test_matches_reference(case, dtype, make_batch, assert_close):
    q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size = case
    batch = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype)
    assert_close(_run(batch), _reference(batch))


@pytest.mark.parametrize("seed", range(8 if ON_CUDA else 4))
def test_randomized_batches(seed, dtype, make_batch, assert_close):
    rng = random.Random(seed)
    ratio = rng.choice([1, 2, 4, 8])
    num_kv_heads = rng.choice([1, 2, 8] if ON_CUDA else [1, 2])
    head_dim = rng.choice([64, 128] if ON_CUDA else [16, 32, 64])
    block_size = rng.choice([8, 16, 32, 64, 128] if ON_CUDA else [8, 16, 32])
    max_prefix, max_new = (3000, 600) if ON_CUDA else (40, 20)
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 24 if ON_CUDA else 5)):
        q_len = 1 if rng.random() < 0.5 else rng.randint(1, max_new)
        q_lens.append(q_len)
        seq_lens.append(q_len + rng.randint(0, max_prefix))
    batch = make_batch(q_lens, seq_lens, num_heads=num_kv_heads * ratio, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed)
    assert_close(_run(batch), _reference(batch))


@pytest.mark.parametrize("config", [AttentionLaunchConfig(block_m=64, tile_n=16, num_warps=4, num_stages=1),
                                    AttentionLaunchConfig(block_m=16, tile_n=64, num_warps=2, num_stages=1)],
                         ids=["tall-tiles", "wide-tiles"])
def test_launch_configs_agree(config, make_batch, assert_close):
    """Tile shape changes how queries and keys are grouped, never the result."""
    batch = make_batch([9, 1, 30], [25, 41, 30], num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                       dtype=torch.float32)
    assert_close(_run(batch, config=config), _reference(batch))


def test_non_contiguous_query_and_preallocated_out(make_batch, assert_close):
    """q may be a view into the fused QKV projection output: rows strided, head_dim contiguous."""
    batch = make_batch([3, 1], [20, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
    num_tokens = batch.query.shape[0]
    qkv = torch.randn(num_tokens, (4 + 2 * 2) * 16, device=batch.query.device)
    qkv[:, : 4 * 16] = batch.query.reshape(num_tokens, -1)
    batch.query = qkv[:, : 4 * 16].view(num_tokens, 4, 16)
    assert not batch.query.is_contiguous()
    out = torch.full_like(batch.query.contiguous(), float("nan"))
    result = _run(batch, out=out)
    assert result is out
    assert_close(out, _reference(batch))


def test_padding_sequences_yield_zeros(make_batch, assert_close):
    """CUDA-graph padding: extra one-token sequences with seq_len 0 see no key and output zeros."""
    batch = make_batch([2, 1], [17, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
    device = batch.query.device
    pad = 3
    batch.query = torch.cat([batch.query, torch.randn(pad, 4, 16, device=device)])
    batch.seq_lens = torch.cat([batch.seq_lens, torch.zeros(pad, dtype=torch.int32, device=device)])
    last = int(batch.query_start_loc[-1])
    batch.query_start_loc = torch.cat([batch.query_start_loc,
                                       torch.arange(last + 1, last + pad + 1, dtype=torch.int32, device=device)])
    batch.block_tables = torch.cat([batch.block_tables,
                                    torch.zeros(pad, batch.block_tables.shape[1], dtype=torch.int32, device=device)])
    out = _run(batch)
    assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
    assert_close(out, _reference(batch))


def test_rejects_bad_inputs(make_batch):
    batch = make_batch([2], [5], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="share one of"):
        paged_attention(batch.query.half(), batch.kv_cache, batch.block_tables, batch.seq_lens,
                        batch.query_start_loc, max_query_len=2, max_seq_len=5, scale=1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(batch.query[:, :3], batch.kv_cache, batch.block_tables, batch.seq_lens,
                        batch.query_start_loc, max_query_len=2, max_seq_len=5, scale=1.0)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        paged_attention(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens.long(),
                        batch.query_start_loc, max_query_len=2, max_seq_len=5, scale=1.0)
    with pytest.raises(ValueError, match="block_m"):
        paged_attention(batch.query, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                        max_query_len=2, max_seq_len=5, scale=1.0,
                        config=AttentionLaunchConfig(block_m=24, tile_n=16, num_warps=4, num_stages=1))
