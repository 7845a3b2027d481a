"""The triton attention backend against the torch backend, through the engine's AttentionMetadata."""

from __future__ import annotations

import torch

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend


def _metadata(q_lens, seq_lens, block_tables, slot_mapping, device) -> AttentionMetadata:
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=slot_mapping.to(device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
    )


def test_store_then_attend_matches_torch_backend(dtype, device, assert_close):
    """Two steps: a prompt + a chunk on a cached prefix, then a decode step with a padded token."""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 2, 32, 8, 12
    block_tables = torch.tensor([[7, 2, 0, 0], [4, 9, 1, 11]], dtype=torch.int32)

    def slots(seq, positions):
        return [int(block_tables[seq, p // block_size]) * block_size + p % block_size for p in positions]

    # Step 1: seq 0 prompt of 10 tokens; seq 1 has 9 cached tokens and prefills 14 more.
    # Step 2: both decode one token, plus one padding token (slot -1) as CUDA-graph replay adds.
    steps = [
        ([10, 14], [10, 23], slots(0, range(10)) + slots(1, range(9, 23))),
        ([1, 1, 1], [11, 24, 0], slots(0, [10]) + slots(1, [23]) + [-1]),
    ]
    caches = {}
    for name in ("torch", "triton"):
        cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        caches[name] = cache
    caches["triton"].copy_(caches["torch"])
    for q_lens, seq_lens, slot_list in steps:
        num_tokens = len(slot_list)
        tables = block_tables if len(q_lens) == 2 else torch.cat([block_tables, torch.zeros(1, 4, dtype=torch.int32)])
        metadata = _metadata(q_lens, seq_lens, tables, torch.tensor(slot_list, dtype=torch.int64), device)
        q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        outs = {}
        for name in ("torch", "triton"):
            backend = get_attention_backend(name)
            outs[name] = backend.forward(q, k, v, caches[name], metadata, head_dim ** -0.5)
        assert get_attention_backend("triton").name == "triton"
        real = sum(q_lens[:2])  # the padding row's output is unspecified for the torch backend
        assert_close(outs["triton"][:real], outs["torch"][:real])
        assert torch.equal(caches["triton"], caches["torch"])
