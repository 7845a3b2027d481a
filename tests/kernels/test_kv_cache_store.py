"""KV-cache store kernel vs its torch reference: scattered slots, padded (-1) tokens, strided inputs."""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels.kv_cache_store import kv_cache_store, kv_cache_store_reference

ON_CUDA = os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cuda"

# (num_tokens, num_kv_heads, head_dim, block_size, num_blocks)
CASES = ([(512, 8, 128, 16, 300), (77, 2, 64, 128, 5), (300, 4, 128, 8, 60)] if ON_CUDA
         else [(11, 2, 16, 8, 6), (7, 3, 32, 16, 2), (5, 1, 24, 8, 3)])


@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim,block_size,num_blocks", CASES)
def test_matches_reference_and_skips_padding(num_tokens, num_kv_heads, head_dim, block_size, num_blocks,
                                             dtype, device):
    gen = torch.Generator().manual_seed(num_tokens)
    # key/value are views into one fused projection output, as in the model: rows strided.
    kv_width = num_kv_heads * head_dim
    fused = torch.randn(num_tokens, 3 * kv_width, generator=gen).to(dtype).to(device)
    key = fused[:, kv_width:2 * kv_width].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, 2 * kv_width:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.3] = -1  # padded tokens
    slot_mapping = slots.to(device)
    before = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)

    actual = before.clone()
    kv_cache_store(key, value, actual, slot_mapping)
    expected = before.clone()
    kv_cache_store_reference(key, value, expected, slot_mapping)

    assert torch.equal(actual, expected)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slot_mapping[slot_mapping >= 0]] = True
    untouched = actual.view(2, -1, num_kv_heads, head_dim)[:, ~written]
    assert torch.equal(untouched, before.view(2, -1, num_kv_heads, head_dim)[:, ~written])


def test_int32_slot_mapping_and_empty_batch(device):
    kv_cache = torch.zeros(2, 2, 8, 1, 16, device=device)
    key = torch.ones(2, 1, 16, device=device)
    kv_cache_store(key, 2 * key, kv_cache, torch.tensor([9, -1], dtype=torch.int32, device=device))
    assert torch.equal(kv_cache[0, 1, 1], key[0]) and torch.equal(kv_cache[1, 1, 1], 2 * key[0])
    assert int((kv_cache != 0).sum()) == 2 * 16
    kv_cache_store(key[:0], key[:0], kv_cache, torch.zeros(0, dtype=torch.int64, device=device))


def test_rejects_mismatched_shapes(device):
    kv_cache = torch.zeros(2, 2, 8, 2, 16, device=device)
    key = torch.ones(3, 2, 16, device=device)
    slots = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="heads/head_dim"):
        kv_cache_store(key[:, :1], key[:, :1], kv_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_cache_store(key, key, kv_cache, slots[:2])
    with pytest.raises(ValueError, match="key and value"):
        kv_cache_store(key, key[:2], kv_cache, slots)
