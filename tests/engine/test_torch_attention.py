"""The torch attention backend against dense attention over each sequence's full context."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.engine.attention import AttentionMetadata, get_attention_backend
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend, store_kv


def naive_attention(q, k, v, scale):
    """q: [q_len, H, D] at the last q_len positions of k/v: [seq_len, KVH, D]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def build_case(seq_specs, *, num_heads, num_kv_heads, head_dim, block_size, seed, pad_rows=0):
    """seq_specs: (cached_len, q_len) per sequence. Returns tensors for one step plus full K/V."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in seq_specs]
    num_blocks = sum(blocks_needed) + 3
    # Shuffled physical blocks: block tables are not contiguous or ordered.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    max_blocks = max(blocks_needed) + 1
    block_tables = torch.zeros(len(seq_specs), max_blocks, dtype=torch.int32)
    full_k, full_v, queries, keys, values, slots = [], [], [], [], [], []
    used = 0
    for i, (cached, q_len) in enumerate(seq_specs):
        table = perm[used : used + blocks_needed[i]]
        used += blocks_needed[i]
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        seq_len = cached + q_len
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        # The cached prefix is already in the cache; the new tokens arrive with the step.
        store_kv(k[:cached], v[:cached], kv_cache, seq_slots[:cached])
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen))
        keys.append(k[cached:])
        values.append(v[cached:])
        slots.append(seq_slots[cached:])
    query = torch.cat(queries + [torch.randn(pad_rows, num_heads, head_dim, generator=gen)])
    key = torch.cat(keys + [torch.randn(pad_rows, num_kv_heads, head_dim, generator=gen)])
    value = torch.cat(values + [torch.randn(pad_rows, num_kv_heads, head_dim, generator=gen)])
    slot_mapping = torch.cat(slots + [torch.full((pad_rows,), -1)]).long()
    q_lens = [q for _, q in seq_specs]
    seq_lens = [c + q for c, q in seq_specs]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return query, key, value, kv_cache, metadata, full_k, full_v, queries


CASES = {
    "decode_only": [(5, 1), (0, 1), (33, 1), (16, 1), (47, 1)],
    "prefill_only": [(0, 7), (0, 16), (0, 1)],
    "mixed": [(0, 9), (20, 1), (17, 5), (3, 1), (31, 18), (0, 1)],
    "chunk_on_prefix": [(32, 16), (15, 2)],
    # Enough decode rows of spread-out lengths to be split into several length groups.
    "many_decodes": [((i * 37) % 90, 1) for i in range(24)] + [(0, 5), (40, 3)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("decode_kernel", [True, False], ids=["c-kernel", "torch-only"])
def test_matches_dense_attention(case, num_heads, num_kv_heads, block_size, decode_kernel):
    head_dim = 8
    scale = head_dim**-0.5
    query, key, value, kv_cache, metadata, full_k, full_v, queries = build_case(
        CASES[case], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, seed=sorted(CASES).index(case) * 100 + num_heads * 10 + block_size,
    )
    out = TorchAttentionBackend(decode_kernel=decode_kernel).forward(query, key, value, kv_cache, metadata, scale)
    assert out.shape == query.shape
    starts = metadata.query_start_loc_cpu
    for i in range(len(CASES[case])):
        expected = naive_attention(queries[i], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_new_tokens_are_stored_and_padding_rows_skipped():
    block_size = 4
    query, key, value, kv_cache, metadata, full_k, full_v, _ = build_case(
        [(6, 3), (2, 1)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=block_size, seed=3, pad_rows=2
    )
    untouched = kv_cache.clone()
    out = get_attention_backend("torch").forward(query, key, value, kv_cache, metadata, 0.3)
    assert out.shape == query.shape
    flat_k = kv_cache[0].view(-1, 2, 8)
    real_slots = metadata.slot_mapping[metadata.slot_mapping >= 0]
    torch.testing.assert_close(flat_k[real_slots], key[: real_slots.shape[0]])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[real_slots] = True
    # Padding rows (slot -1) must not overwrite anything, in particular not the last slot.
    torch.testing.assert_close(flat_k[~written], untouched[0].view(-1, 2, 8)[~written])


def test_decode_rows_are_split_into_length_groups():
    from kvpilot.engine.attention.torch_backend import _build_plan

    *_, metadata, _, _, _ = build_case(
        CASES["many_decodes"], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=0
    )
    plan = _build_plan(metadata, block_size=4, dtype=torch.float32)
    assert len(plan.decode_groups) > 1
    assert sum(g.rows.numel() for g in plan.decode_groups) == 24
    assert len(plan.multi_token_seqs) == 2


@pytest.mark.parametrize("decode_kernel", [True, False], ids=["c-kernel", "torch-only"])
def test_bfloat16_close_to_float32(decode_kernel):
    query, key, value, kv_cache, metadata, *_ = build_case(
        CASES["mixed"], num_heads=8, num_kv_heads=2, head_dim=16, block_size=16, seed=11
    )
    backend = TorchAttentionBackend(decode_kernel=decode_kernel)
    ref = backend.forward(query, key, value, kv_cache.clone(), metadata, 0.25)
    out = backend.forward(
        query.bfloat16(), key.bfloat16(), value.bfloat16(), kv_cache.bfloat16(), metadata, 0.25
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_decode_rows_go_to_the_c_kernel_on_cpu():
    from kvpilot.engine.attention.torch_backend import _build_plan

    *_, metadata, _, _, _ = build_case(CASES["mixed"], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, seed=1)
    plan = _build_plan(metadata, block_size=4, dtype=torch.float32, use_kernel=True)
    seqs, rows = plan.kernel_decode
    # The decode sequences of "mixed" are 1, 3 and 5, at the rows where their one token sits.
    assert seqs.tolist() == [1, 3, 5]
    assert rows.tolist() == [metadata.query_start_loc_cpu[i] for i in (1, 3, 5)]
    assert plan.decode_groups == ()


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="torch, triton"):
        get_attention_backend("flash")
